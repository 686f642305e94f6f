"""Reference models and the `Workload` (model + example batch + loss) that tracing consumes.

Entry point: `load_workload(spec, layers=, seq=, batch=, dtype=, device=)`, where `spec` is
a registered name (`llama3-debug`, `llama3-8b`, `dsv3-debug`, `dsv3-16b`, ...),
`package.module:callable`, `torchtitan:FAMILY/FLAVOR` (torchtitan's own models,
`workbench.capture.models.torchtitan`) or `hf:NAME` (small Hugging Face transformers models,
`workbench.capture.models.hf`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from workbench.capture.fits import check_build_fits
from workbench.capture.models.deepseek_v3 import DSV3_FLAVORS, DeepSeekV3
from workbench.capture.models.hf import PREFIX as HF_PREFIX
from workbench.capture.models.hf import load_hf
from workbench.capture.models.llama3 import LLAMA3_FLAVORS, Llama3
from workbench.capture.models.torchtitan import PREFIX as TORCHTITAN_PREFIX
from workbench.capture.models.torchtitan import load_torchtitan
from workbench.capture.workload import (
    MAX_LAYERS,
    LossFn,
    Workload,
    token_cross_entropy,
    token_workload,
)
from workbench.errors import WorkbenchError, describe

__all__ = [
    "DTYPES",
    "LossFn",
    "Workload",
    "is_user_factory",
    "load_workload",
    "model_names",
    "parse_dtype",
    "token_cross_entropy",
]


@dataclass(frozen=True)
class Shape:
    """Step shape of a reference model: batch and sequence length."""

    batch: int
    seq: int


REFERENCE_MODELS: dict[str, tuple[Callable[..., nn.Module], Any, Shape]] = {
    "llama3-debug": (Llama3, LLAMA3_FLAVORS["debugmodel"], Shape(batch=2, seq=128)),
    "llama3-1b": (Llama3, LLAMA3_FLAVORS["1B"], Shape(batch=2, seq=2048)),
    "llama3-3b": (Llama3, LLAMA3_FLAVORS["3B"], Shape(batch=1, seq=8192)),
    "llama3-8b": (Llama3, LLAMA3_FLAVORS["8B"], Shape(batch=1, seq=8192)),
    "llama3-70b": (Llama3, LLAMA3_FLAVORS["70B"], Shape(batch=1, seq=8192)),
    "llama3-405b": (Llama3, LLAMA3_FLAVORS["405B"], Shape(batch=1, seq=8192)),
    "dsv3-debug": (DeepSeekV3, DSV3_FLAVORS["debugmodel"], Shape(batch=2, seq=128)),
    # torchtitan's deepseek_v3_16b training shape (local batch 4, seq 4096); GQA, not MLA
    "dsv3-16b": (DeepSeekV3, DSV3_FLAVORS["16B"], Shape(batch=4, seq=4096)),
}

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_names() -> list[str]:
    return sorted(REFERENCE_MODELS)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise WorkbenchError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def is_user_factory(spec: str) -> bool:
    """`package.module:callable` (built by the user's code, so never on meta by us)."""
    return ":" in spec and not spec.startswith((TORCHTITAN_PREFIX, HF_PREFIX))


# Far above any real model, far below what would build for minutes or overflow int64 sizes.
MAX_DIM = 2**31 - 1
MAX_TOKENS = 2**40


def _check_size(what: str, value: int | None, limit: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkbenchError(f"{what} must be a positive integer, got {value!r}")
    if value > limit:
        raise WorkbenchError(f"{what} must be at most {limit}, got {value}")


def load_workload(
    spec: str,
    *,
    layers: int | None = None,
    seq: int | None = None,
    batch: int | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Workload:
    """Build a reference model (or call a user factory) with its example batch.

    `device="meta"` builds without memory, for fake-mode tracing of big shapes.
    """
    for what, value, limit in (
        ("layers", layers, MAX_LAYERS),
        ("seq", seq, MAX_DIM),
        ("batch", batch, MAX_DIM),
    ):
        _check_size(what, value, limit)
    if seq is not None and batch is not None and seq * batch > MAX_TOKENS:
        raise WorkbenchError(f"batch × seq must be at most {MAX_TOKENS} tokens, got {batch * seq}")
    torch_dtype = parse_dtype(dtype)
    if spec.startswith(TORCHTITAN_PREFIX):
        return load_torchtitan(  # type: ignore[no-any-return]
            spec, layers=layers, seq=seq, batch=batch, dtype=torch_dtype, device=device, seed=seed
        )
    if spec.startswith(HF_PREFIX):
        return load_hf(
            spec, layers=layers, seq=seq, batch=batch, dtype=torch_dtype, device=device, seed=seed
        )
    if ":" in spec:
        return _load_user_workload(spec, layers=layers, seq=seq, batch=batch, dtype=torch_dtype)
    if spec not in REFERENCE_MODELS:
        raise WorkbenchError(
            f"unknown model {spec!r}; choose one of {', '.join(model_names())} "
            "or give a factory as package.module:callable"
        )
    cls, config, shape = REFERENCE_MODELS[spec]
    if layers is not None:
        if hasattr(config, "n_dense_layers") and layers <= config.n_dense_layers:
            config = replace(config, n_layers=layers, n_dense_layers=min(1, layers - 1))
        else:
            config = replace(config, n_layers=layers)
    shape = Shape(batch=batch or shape.batch, seq=seq or shape.seq)
    if str(device) != "meta":
        _check_fits(spec, cls, config, shape, torch_dtype, torch.device(device))
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = cls(config, shape.seq)
    finally:
        torch.set_default_dtype(previous)
    return token_workload(
        model,
        config.vocab_size,
        batch=shape.batch,
        seq=shape.seq,
        device=device,
        seed=seed,
        name=spec,
        config={
            "layers": config.n_layers,
            "seq": shape.seq,
            "batch": shape.batch,
            "dtype": str(torch_dtype).removeprefix("torch."),
        },
    )


def _check_fits(
    spec: str,
    cls: Callable[..., nn.Module],
    config: Any,
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Build the reference model on meta, then `check_build_fits`."""
    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            meta = cls(config, shape.seq)
        finally:
            torch.set_default_dtype(previous)
    check_build_fits(spec, meta, device, token_bytes=shape.batch * (shape.seq + 1) * 8)


def _load_user_workload(
    spec: str,
    *,
    layers: int | None,
    seq: int | None,
    batch: int | None,
    dtype: torch.dtype = torch.float32,
) -> Workload:
    """`package.module:callable` returning a Workload, (model, batch) or (model, batch, loss).
    The size flags given go to the factory's arguments of those names; a dtype other than
    float32 goes to its `dtype` argument, or (without one) the factory is called under that
    default dtype and its parameters must come out in it."""
    factory = _import_factory(spec)
    overrides = {"layers": layers, "seq": seq, "batch": batch}
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    try:
        params: Any = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        params = given
    unsupported = [k for k in given if k not in params]
    if unsupported:
        raise WorkbenchError(
            f"model factory {spec!r} takes no {', '.join(unsupported)} argument; "
            f"it accepts: {', '.join(params) or 'nothing'}"
        )
    if dtype != torch.float32 and "dtype" in params:
        given["dtype"] = dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        result = factory(**given)
    except (Exception, SystemExit) as err:  # user code: its error, named, in one line
        raise WorkbenchError(f"model factory {spec!r} failed: {describe(err)}") from None
    finally:
        torch.set_default_dtype(previous)
    workload = _as_workload(spec, result)
    if dtype != torch.float32:
        _check_factory_dtype(spec, workload, dtype)
    return workload


def _import_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise WorkbenchError(
            f"model spec {spec!r} must be package.module:callable, e.g. mypkg.models:build"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise WorkbenchError(f"cannot load model factory {spec!r}: {err}") from None
    except (Exception, SystemExit) as err:  # the module's own code failed on import
        raise WorkbenchError(
            f"cannot load model factory {spec!r}: importing {module_name!r} failed: {describe(err)}"
        ) from None
    if not callable(factory):
        raise WorkbenchError(
            f"model factory {spec!r} is a {type(factory).__name__}, not a callable returning "
            "a Workload, (model, batch) or (model, batch, loss_fn)"
        )
    return factory  # type: ignore[no-any-return]


def _as_workload(spec: str, result: Any) -> Workload:
    if isinstance(result, Workload):
        return result
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise WorkbenchError(
            f"model factory {spec!r} must return a Workload, (model, batch) or "
            f"(model, batch, loss_fn); got {type(result).__name__}"
        )
    model, batch_, *loss = result
    inputs, target = batch_ if isinstance(batch_, tuple) and len(batch_) == 2 else (batch_, None)
    return Workload(model, inputs, target, loss[0] if loss else None, name=spec)


def _check_factory_dtype(spec: str, workload: Workload, dtype: torch.dtype) -> None:
    """--dtype applies to a factory or is refused: never silently ignored."""
    others = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for p in workload.model.parameters()
            if p.is_floating_point() and p.dtype != dtype
        }
    )
    if others:
        raise WorkbenchError(
            f"--dtype {str(dtype).removeprefix('torch.')}: model factory {spec!r} built "
            f"{', '.join(others)} parameters; give it a dtype argument (it receives --dtype) "
            "or build the model in the default dtype"
        )
    workload.config.setdefault("dtype", str(dtype).removeprefix("torch."))
