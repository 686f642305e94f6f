"""torchtitan's own decoder models as workloads: `torchtitan:FAMILY/FLAVOR` (torchtitan 0.3.0).

Entry point: `load_torchtitan(spec, layers=, seq=, batch=, dtype=, device=, seed=)`, which
`workbench.capture.models.load_workload` calls for specs starting with `torchtitan:`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import logging
import pkgutil
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

from workbench.errors import WorkbenchError

__all__ = [
    "PREFIX",
    "REFUSED",
    "SDPA_NOTE",
    "VISION_NOTE",
    "adapt_config",
    "check_flavor",
    "families",
    "flavors",
    "load_torchtitan",
    "parse_spec",
    "torchtitan_log",
]

PREFIX = "torchtitan:"
INSTALL_HINT = "pip install -e '.[torchtitan]'"
SDPA_NOTE = (
    "attention: torchtitan's ScaledDotProductAttention replaces FlexAttention in every layer "
    "(flex attention has no CPU backward and its block mask cannot be built on meta); "
    "is_causal SDPA, no document masking"
)


# torchtitan 0.3.0 families that cannot be traced on a CPU, and why (checked before import).
REFUSED: dict[str, str] = {
    "flux": "an image diffusion model (latents and text encodings, not token ids; its "
    "package also imports `datasets`, a training-only requirement): only token decoders "
    "can be traced here",
    "qwen3_5": "its linear-attention layers (Gated DeltaNet) run flash-linear-attention's "
    "Triton GPU kernels (the `fla` package), which have no CPU path",
    "gpt_oss": "its attention sinks rescale by the attention's log-sum-exp, which only its "
    "varlen (CUDA flash) and flex attention give, and neither has a CPU backward; SDPA "
    "gives none, so the sinks would get no gradient",
}
# Notes on what the workbench leaves out of a family's model, and why.
VISION_NOTE = (
    "vision encoder left out: the traced step is text-only (token ids, no pixels), so its "
    "parameters would get no gradient"
)


def _torchtitan_models() -> ModuleType:
    try:
        return importlib.import_module("torchtitan.models")
    except ImportError as err:
        raise WorkbenchError(f"torchtitan models need torchtitan ({err}): {INSTALL_HINT}") from None


def families() -> list[str]:
    """Model families of the installed torchtitan (its `torchtitan/models/*` packages)."""
    package = _torchtitan_models()
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg)


def _family(name: str) -> ModuleType:
    known = families()
    if name not in known:
        raise WorkbenchError(
            f"unknown torchtitan model family {name!r}; choose one of {', '.join(known)}"
        )
    if name in REFUSED:
        raise WorkbenchError(f"torchtitan:{name} cannot be traced here: {REFUSED[name]}")
    try:
        module = importlib.import_module(f"torchtitan.models.{name}")
    except ImportError as err:
        raise WorkbenchError(
            f"cannot import torchtitan.models.{name} ({err}): install the missing package "
            f"or {INSTALL_HINT}"
        ) from None
    if not hasattr(module, "model_registry"):
        raise WorkbenchError(f"torchtitan.models.{name} has no model_registry")
    return module


def flavors(family: str) -> list[str]:
    """Flavors of one family: the keys of its `*_configs` registry dict."""
    module = _family(family)
    registries = [
        value
        for key, value in vars(module).items()
        if key.endswith("_configs") and isinstance(value, dict)
    ]
    return [flavor for registry in registries for flavor in registry]


def parse_spec(spec: str) -> tuple[str, str]:
    family, slash, flavor = spec.removeprefix(PREFIX).partition("/")
    if not slash or not family or not flavor:
        raise WorkbenchError(
            f"torchtitan model {spec!r} must be torchtitan:FAMILY/FLAVOR, "
            "e.g. torchtitan:llama3/debugmodel"
        )
    return family, flavor


def check_flavor(family: str, flavor: str) -> None:
    known = flavors(family)
    if flavor not in known:
        raise WorkbenchError(
            f"unknown torchtitan {family} flavor {flavor!r}; choose one of {', '.join(known)}"
        )


def _model_config(family: str, flavor: str, layers: int | None, seq: int) -> tuple[Any, list[str]]:
    """The flavor's decoder config as `adapt_config` leaves it, and its notes."""
    check_flavor(family, flavor)
    config = copy.deepcopy(_family(family).model_registry(flavor).model)
    notes = adapt_config(config, f"torchtitan:{family}/{flavor}", layers, seq)
    return config, notes


def adapt_config(config: Any, spec: str, layers: int | None, seq: int) -> list[str]:
    """What the workbench changes in a decoder config, in place: `layers` blocks, SDPA inner
    attention, RoPE caches sized to the traced sequence (as torchtitan's trainer sizes them
    to `training.seq_len`), no vision encoder (a text-only step). Returns the notes saying
    what differs from the model as shipped."""
    family_flavor = spec.removeprefix(PREFIX)
    blocks = getattr(config, "layers", None)
    if not isinstance(blocks, list) or not hasattr(config, "vocab_size"):
        raise WorkbenchError(
            f"torchtitan:{family_flavor} is not a token decoder (no layers list and "
            "vocab_size): only language models can be traced here"
        )
    if layers is not None:
        if layers > len(blocks):
            raise WorkbenchError(
                f"torchtitan:{family_flavor} has {len(blocks)} layers; --layers must be at "
                f"most {len(blocks)}"
            )
        config.layers = blocks[:layers]
    _use_sdpa(config)
    _size_rope(config, seq)
    notes = [SDPA_NOTE]
    if getattr(config, "vision_encoder", None) is not None:
        config.vision_encoder = None
        notes.append(VISION_NOTE)
    return notes


def _size_rope(config: Any, seq: int) -> None:
    for block in config.layers:
        rope = getattr(getattr(block, "attention", None), "rope", None)
        if rope is not None and getattr(rope, "max_seq_len", 0) > seq:
            block.attention.rope = dataclasses.replace(rope, max_seq_len=seq)


def _use_sdpa(config: Any) -> None:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for block in config.layers:
        attention: Any = getattr(block, "attention", None)  # absent in linear-attention blocks
        if isinstance(getattr(attention, "inner_attention", None), FlexAttention.Config):
            attention.inner_attention = ScaledDotProductAttention.Config()


def _build(config: Any, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = config.build()
            if str(device) != "meta":
                model.init_states()
    finally:
        torch.set_default_dtype(previous)
    return model  # type: ignore[no-any-return]


def _default_shape(flavor: str) -> tuple[int, int]:
    """(batch, seq): small for debug flavors, one long sequence for real ones."""
    return (2, 128) if "debug" in flavor else (1, 8192)


def load_torchtitan(
    spec: str,
    *,
    layers: int | None,
    seq: int | None,
    batch: int | None,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
) -> Any:
    """A `Workload` of torchtitan's model `spec`; `device="meta"` for fake-mode tracing."""
    from workbench.capture.fits import check_build_fits
    from workbench.capture.workload import token_workload

    family, flavor = parse_spec(spec)
    default_batch, default_seq = _default_shape(flavor)
    batch, seq = batch or default_batch, seq or default_seq
    config, notes = _model_config(family, flavor, layers, seq)
    if str(device) != "meta":
        meta = _build(config, dtype, "meta")
        check_build_fits(spec, meta, torch.device(device))
    torch.manual_seed(seed)
    model = _build(config, dtype, device)
    workload = token_workload(
        model,
        config.vocab_size,
        batch=batch,
        seq=seq,
        device=device,
        seed=seed,
        name=spec,
        config={
            "layers": len(config.layers),
            "seq": seq,
            "batch": batch,
            "dtype": str(dtype).removeprefix("torch."),
            "attention": "sdpa",
        },
    )
    workload.notes.extend(notes)
    _use_graph_trainer_backend()
    return workload


def _use_graph_trainer_backend() -> None:
    """torchtitan's SPMD backend as graph trainer runs it (`partial_dtensor`, its
    `to_graph_trainer_config`): the default `spmd_types` type-checks muse_glimmer against a
    device mesh that a single-device step has none of. Process-wide, as torchtitan sets it."""
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend("partial_dtensor")


@contextlib.contextmanager
def torchtitan_log(level: int, handler: logging.Handler | None = None) -> Iterator[None]:
    """torchtitan logs through the root logger: `level` there (and `handler` added) while
    the block runs."""
    logger = logging.getLogger()
    previous = logger.level
    logger.setLevel(level)
    if handler is not None:
        logger.addHandler(handler)
    try:
        yield
    finally:
        logger.setLevel(previous)
        if handler is not None:
            logger.removeHandler(handler)
