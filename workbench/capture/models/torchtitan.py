"""torchtitan's own decoder models as workloads: `torchtitan:FAMILY/FLAVOR` (torchtitan 0.3.0).

Entry point: `load_torchtitan(spec, layers=, seq=, batch=, dtype=, device=, seed=)`, which
`workbench.capture.models.load_workload` calls for specs starting with `torchtitan:`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import logging
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from workbench.errors import WorkbenchError

__all__ = [
    "FLEX_NOTE",
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
    "titan_kernels",
    "torchtitan_log",
]

PREFIX = "torchtitan:"
INSTALL_HINT = "pip install -e '.[torchtitan]'"
SDPA_NOTE = (
    "attention: torchtitan's ScaledDotProductAttention replaces FlexAttention in every layer "
    "(flex attention has no CPU backward, and this graph carries the CPU's kernels); "
    "is_causal SDPA, no document masking"
)
FLEX_NOTE = (
    "attention: torchtitan's FlexAttention as shipped, traced as the flex_attention op a GPU "
    "runs (torch.compile and flex's CPU-backward refusal left out), with a block-causal mask "
    "of one document per sequence (its packed-document mask when nothing is packed)"
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
    return sorted(
        m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg and _has_registry(m)
    )


def _has_registry(info: pkgutil.ModuleInfo) -> bool:
    """A family's package defines `model_registry`; a shared one (`common`) does not. Its
    source is read, not imported: importing every family takes seconds."""
    init = Path(getattr(info.module_finder, "path", "")) / info.name / "__init__.py"
    try:
        return "model_registry" in init.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


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


def _model_config(
    family: str, flavor: str, layers: int | None, seq: int, flex: bool
) -> tuple[Any, list[str]]:
    """The flavor's decoder config as `adapt_config` leaves it, and its notes."""
    check_flavor(family, flavor)
    config = copy.deepcopy(_family(family).model_registry(flavor).model)
    notes = adapt_config(config, f"torchtitan:{family}/{flavor}", layers, seq, flex)
    return config, notes


def adapt_config(config: Any, spec: str, layers: int | None, seq: int, flex: bool) -> list[str]:
    """What the workbench changes in a decoder config, in place: `layers` blocks, SDPA inner
    attention unless `flex` (a graph for a GPU keeps FlexAttention: `titan_kernels`), RoPE
    caches sized to the traced sequence (as torchtitan's trainer sizes them to
    `training.seq_len`), no vision encoder (a text-only step). Returns the notes saying what
    differs from the model as shipped."""
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
    notes = []
    if not flex and _use_sdpa(config):
        notes.append(SDPA_NOTE)
    _size_rope(config, seq, family_flavor)
    if getattr(config, "vision_encoder", None) is not None:
        config.vision_encoder = None
        notes.append(VISION_NOTE)
    return notes


def _size_rope(config: Any, seq: int, family_flavor: str) -> None:
    """RoPE caches cut to `seq`; a longer `seq` than the flavor's RoPE length is refused
    naming the limit (positions past it have no rotation: a shape error deep in the
    trace)."""
    for block in config.layers:
        rope = getattr(getattr(block, "attention", None), "rope", None)
        limit = getattr(rope, "max_seq_len", None)
        if isinstance(limit, int) and seq > limit:
            raise WorkbenchError(
                f"--seq {seq}: torchtitan:{family_flavor}'s RoPE covers {limit} positions; "
                f"give --seq {limit} or less"
            )
        if rope is not None and isinstance(limit, int) and limit > seq:
            block.attention.rope = dataclasses.replace(rope, max_seq_len=seq)


def _use_sdpa(config: Any) -> bool:
    """SDPA in place of every FlexAttention; whether there was one."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    replaced = False
    for block in config.layers:
        attention: Any = getattr(block, "attention", None)  # absent in linear-attention blocks
        if isinstance(getattr(attention, "inner_attention", None), FlexAttention.Config):
            attention.inner_attention = ScaledDotProductAttention.Config()
            replaced = True
    return replaced


def _flex_block_size(model: nn.Module) -> int | tuple[int, int]:
    config = getattr(getattr(model, "config", None), "first_attention", None)
    inner = getattr(config, "inner_attention", None)
    return getattr(inner, "block_size", 128)


@contextlib.contextmanager
def titan_kernels(
    model: nn.Module, batch: int, seq: int, kernels: str, shard: Any = None
) -> Iterator[Any]:
    """torchtitan's FlexAttention while `model` is traced for `kernels`: for a GPU, the
    `flex_attention` op (`workbench.capture.flex`) with a block-causal mask of `batch` x `seq`
    (its tensors named as graph inputs; `shard`: torchtitan's `cp_shard` for a context-parallel
    rank, which keeps the rank's queries); for the CPU, SDPA in its place, as a real run on
    this CPU has it. Yields `workbench.capture.kernels.ModelKernels`; the model is restored
    after."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    from workbench.capture.flex import (
        block_mask_names,
        block_mask_sparsity,
        causal_block_mask,
        flex_attention_op,
    )
    from workbench.capture.kernels import ModelKernels, gpu_arch

    holders = [
        m for m in model.modules() if isinstance(getattr(m, "inner_attention", None), FlexAttention)
    ]
    if not holders:
        yield ModelKernels()
        return
    if gpu_arch(kernels) is None:
        flex = [(m, m.inner_attention) for m in holders]
        for holder, _ in flex:
            holder.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
        try:
            yield ModelKernels(notes=(SDPA_NOTE,))
        finally:
            for holder, inner in flex:
                holder.inner_attention = inner
        return
    mask = causal_block_mask(batch, seq, _flex_block_size(model))
    if shard is not None:  # the balancer reads the sequence off a batch of its shape
        _, mask = shard((torch.zeros(batch, seq, dtype=torch.long),), mask)
    compiled = FlexAttention.__dict__["_compiled_flex_attn"]
    inners: list[Any] = [m.inner_attention for m in holders]
    own = [inner.__dict__.get("forward") for inner in inners]  # graph trainer annotates them
    for inner in inners:
        inner.forward = _with_mask(inner.forward, mask)
    FlexAttention._compiled_flex_attn = staticmethod(flex_attention_op)  # type: ignore[assignment]
    try:
        hint = {"sparsity_hint": block_mask_sparsity(mask)}
        custom = {"flex_attention": hint, "flex_attention_backward": hint}
        yield ModelKernels(names=block_mask_names(mask), custom=custom, notes=(FLEX_NOTE,))
    finally:
        FlexAttention._compiled_flex_attn = compiled
        for inner, forward in zip(inners, own, strict=True):
            if forward is None:
                del inner.forward
            else:
                inner.forward = forward


def _with_mask(forward: Any, mask: Any) -> Any:
    """`forward` given `mask` where its caller passes no attention mask (a step traced
    without torchtitan's dataloader, which builds one per batch)."""

    def masked(*args: Any, attention_masks: Any = None, **kwargs: Any) -> Any:
        return forward(*args, attention_masks=attention_masks or mask, **kwargs)

    return masked


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
    # flex attention runs on no CPU: a model built to run here takes SDPA, one built on meta
    # (traced for a GPU) keeps flex and switches at trace time (`titan_kernels`)
    flex = str(device) == "meta"
    config, notes = _model_config(family, flavor, layers, seq, flex)
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
            "attention": "flex" if flex else "sdpa",
        },
    )
    workload.notes.extend(notes)
    workload.kernel_context = functools.partial(titan_kernels, model, batch, seq)
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
