"""Fake kernels for ops whose meta registration refuses what their real kernels run.

`aten._grouped_mm` (the grouped GEMM of MoE experts: transformers' default experts kernel,
torchtitan's) runs in float32 on the CPU and through CUDA's fallback, but torch 2.13's meta
function checks the inputs against the Hopper fast path and accepts bfloat16 only, so a
float32 MoE step cannot be traced with the kernel it runs. While a step is traced,
`traceable_kernels()` gives the op a fake kernel that takes any floating dtype both inputs
share, with the output shape torch's meta function computes
(`_create_grouped_mm_output_tensor`).

Entry point: `traceable_kernels()` (a context manager around make_fx).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._library import simple_registry
from torch._library.fake_impl import Kernel

__all__ = ["traceable_kernels"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _fake_grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Any:
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    torch._check(
        mat_a.dtype == mat_b.dtype and mat_a.dtype in _FLOATS,
        lambda: (
            f"_grouped_mm needs two inputs of one floating dtype, got {mat_a.dtype} and "
            f"{mat_b.dtype}"
        ),
    )
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "2D or 3D inputs")
    torch._check(bias is None, lambda: "_grouped_mm takes no bias yet")
    if mat_a.dim() == 2 or mat_b.dim() == 2:
        torch._check(offs is not None, lambda: "_grouped_mm needs offs for 2D inputs")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


@contextlib.contextmanager
def traceable_kernels() -> Iterator[None]:
    """The fake kernels above, registered while the block runs (fake tensor mode asks a
    registered fake kernel before the op's meta function)."""
    entry = simple_registry.singleton.find("aten::_grouped_mm").fake_impl
    if entry.kernel is not None:  # someone else's: leave it
        yield
        return
    # held by the fake-impl registry only (no Meta registration, unlike `register_fake`):
    # meta tensors outside a fake mode keep torch's own check
    kernel = Kernel(_fake_grouped_mm, "workbench.capture.fake_kernels")
    entry.kernels.append(kernel)
    try:
        yield
    finally:
        entry.kernels.remove(kernel)
