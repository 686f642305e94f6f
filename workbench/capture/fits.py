"""What fits in memory now: the free bytes of a device, and a model build's parameters,
gradients and token ids against them (refused before a build that would swap or die).

Entry points: `available_bytes(device)` and `check_build_fits(spec, meta, device)`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from workbench.errors import WorkbenchError

__all__ = ["available_bytes", "check_build_fits"]


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can use now: free GPU memory, or the OS's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_build_fits(
    spec: str, meta: nn.Module, device: torch.device, token_bytes: int = 0
) -> None:
    """Refuse a real build whose parameters, gradients, buffers and token ids alone exceed
    free memory (activations are checked against an estimate before a graph runs); `meta`
    is the model built on the meta device."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise WorkbenchError("device 'cuda' requested but no CUDA GPU is available; use cpu")
    needed = (
        2 * sum(p.numel() * p.element_size() for p in meta.parameters())
        + sum(b.numel() * b.element_size() for b in meta.buffers())
        + token_bytes
    )
    free = available_bytes(device)
    if needed > free:
        raise WorkbenchError(
            f"{spec} needs at least {needed / 2**30:.1f} GiB on {device} for parameters, "
            f"gradients and token ids alone, but {free / 2**30:.1f} GiB is free: trace it with "
            "--mode fake (no memory), or fewer --layers, --batch or --seq"
        )
