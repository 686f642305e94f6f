"""RMSNorm as a GPU runs it, traced on a CPU.

`torch.rms_norm` (`aten/src/ATen/native/layer_norm.cpp`, `rms_norm_symint`) calls
`aten._fused_rms_norm` unless the input is channels-last or complex or the weight's dtype
differs from the input's. On CUDA that op is one kernel whose autograd saves the input and
an fp32 `rstd` of shape `[..., 1]` and whose backward is `aten._fused_rms_norm_backward`;
on a CPU build it is only a composite (an fp32 upcast, pow, mean, rsqrt, two muls, a
downcast), so a CPU trace saves other tensors than the GPU's. Seen on an H200 (torch
2.11): `make_fx` of Llama3's step holds `_fused_rms_norm` and its backward for every norm.

While a step is traced for a GPU, `fused_rms_norm(input, shape, weight, eps)` traces the
fused op through a stand-in custom op (`workbench::fused_rms_norm`: its fake kernel gives
the CUDA kernel's outputs; its autograd calls `aten._fused_rms_norm_backward`, whose meta
function runs on CPU fake tensors), and `restore_fused_rms_norm(gm)` then names the nodes
`aten._fused_rms_norm.default`, so the graph is the GPU's op for op.

Entry points: `fuses(input, weight)` (torch's rule), `fused_rms_norm`,
`restore_fused_rms_norm(gm)`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["FUSED_RMS_NORM", "fused_rms_norm", "fuses", "restore_fused_rms_norm"]

FUSED_RMS_NORM = "aten._fused_rms_norm.default"


def fuses(input: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether CUDA's `rms_norm` runs the fused kernel for these arguments."""
    if input.is_complex():
        return False
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(input.dim())
    if last is not None and input.is_contiguous(memory_format=last) and not input.is_contiguous():
        return False  # channels-last (`suggest_memory_format`) falls back to the composite
    return weight is None or weight.dtype == input.dtype


def _rstd_shape(input: torch.Tensor, normalized: Sequence[int]) -> list[int]:
    return [*input.shape[: input.dim() - len(normalized)], *([1] * len(normalized))]


@torch.library.custom_op("workbench::fused_rms_norm", mutates_args=())
def _fused_rms_norm(
    input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A real run (a CPU's) computes what the fused kernel does: fp32 statistics."""
    dims = list(range(input.dim() - len(normalized_shape), input.dim()))
    upcast = input.float()
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    rstd = torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True) + eps)
    out = upcast * rstd
    out = out * weight if weight is not None else out
    return out.to(input.dtype), rstd


@_fused_rms_norm.register_fake
def _(
    input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = input.new_empty(_rstd_shape(input, normalized_shape), dtype=torch.float32)
    return torch.empty_like(input, memory_format=torch.contiguous_format), rstd


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    input, normalized_shape, weight, _ = inputs
    ctx.normalized_shape = normalized_shape
    ctx.mask = [input.requires_grad, weight is not None and weight.requires_grad]
    ctx.save_for_backward(input, output[1], weight)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zeros made for rstd's gradient: CUDA makes none


def _backward(ctx: Any, grad: torch.Tensor, _rstd_grad: Any) -> tuple[Any, ...]:
    input, rstd, weight = ctx.saved_tensors
    grad_input, grad_weight = torch.ops.aten._fused_rms_norm_backward.default(
        grad, input, ctx.normalized_shape, rstd, weight, ctx.mask
    )
    return grad_input, None, grad_weight if ctx.mask[1] else None, None


_fused_rms_norm.register_autograd(_backward, setup_context=_setup)


@functools.cache
def _shard_as_aten() -> None:
    """DTensor (TP's sequence-parallel norms) shards the stand-in as it shards
    `aten._fused_rms_norm`: with torch's own rule for that op (registered at the first trace,
    so importing the workbench registers nothing)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops._math_ops import rms_norm_single_dim_strategy
    from torch.distributed.tensor._ops.single_dim_strategy import register_single_dim_strategy

    register_single_dim_strategy(
        torch.ops.workbench.fused_rms_norm.default, schema_info=RuntimeSchemaInfo(1)
    )(rms_norm_single_dim_strategy)


def fused_rms_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """`torch.rms_norm` as CUDA runs it when `fuses` holds (traced as the stand-in op)."""
    _shard_as_aten()
    return _fused_rms_norm(input, list(normalized_shape), weight, eps)[0]


def restore_fused_rms_norm(gm: fx.GraphModule) -> int:
    """Make the stand-in's nodes the GPU's op (same schema, same outputs), named as FX
    names that op's nodes (`_fused_rms_norm`, `_fused_rms_norm_1`, ...); how many."""
    stand_in = torch.ops.workbench.fused_rms_norm.default
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is stand_in]
    for node in nodes:
        node.target = torch.ops.aten._fused_rms_norm.default
        node._rename("_fused_rms_norm")
    if nodes:
        gm.recompile()
    return len(nodes)
