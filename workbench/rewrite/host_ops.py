"""The host "device" of CPU offload: the workbench's own copy ops on the CPU (their buffers
counted), torch's `ao::` ops elsewhere. Importing this module registers the `workbench::` ops.

Entry points: `ops_for(device) -> Ops`, `host_usage()`, `host_buffer_pool(device)`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx


@dataclass
class HostUsage:
    """Host bytes the workbench's offload ops hold while `host_usage()` is active."""

    live_bytes: int = 0
    peak_bytes: int = 0
    copies: int = 0


_USAGE: list[HostUsage] = []


@contextlib.contextmanager
def host_usage() -> Iterator[HostUsage]:
    """Count the host buffers `workbench::offload` allocates and `workbench::wait_tensor`
    frees while the block runs (the CPU stand-in for pinned host memory)."""
    usage = HostUsage()
    _USAGE.append(usage)
    try:
        yield usage
    finally:
        _USAGE.remove(usage)


# Host buffers `workbench::offload` made and no wait has freed yet: data pointer -> bytes.
_HOST_BUFFERS: dict[int, int] = {}


def _account(pointer: int, nbytes: int) -> None:
    """Record a host buffer made (nbytes > 0) or freed (nbytes < 0)."""
    if nbytes > 0:
        _HOST_BUFFERS[pointer] = nbytes
    else:
        _HOST_BUFFERS.pop(pointer, None)
    for usage in _USAGE:
        usage.live_bytes += nbytes
        usage.peak_bytes = max(usage.peak_bytes, usage.live_bytes)
        usage.copies += nbytes > 0


@torch.library.custom_op("workbench::offload", mutates_args=())
def _offload(tensor: torch.Tensor) -> torch.Tensor:
    """Copy to a fresh host buffer (its own storage); the device original is freed by the
    `wait_tensor` that takes it as `keepalive`."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    host.copy_(tensor)
    _account(host.untyped_storage().data_ptr(), host.untyped_storage().nbytes())
    return host


@_offload.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


@torch.library.custom_op("workbench::reload", mutates_args=())
def _reload(
    tensor: torch.Tensor, device: torch.device, size: list[int], stride: list[int]
) -> torch.Tensor:
    """Copy a host buffer back to `device` with the original's layout."""
    result = torch.empty_strided(size, stride, dtype=tensor.dtype, device=device)
    result.copy_(tensor)
    return result


@_reload.register_fake
def _(tensor: torch.Tensor, device: torch.device, size: list[int], stride: list[int]) -> Any:
    return torch.empty_strided(size, stride, dtype=tensor.dtype, device=device)


# `wait_tensor` returns its input (an alias, which custom_op forbids): defined by schema,
# as torch's `ao::wait_tensor`, whose arguments it takes.
_LIB = torch.library.Library("workbench", "FRAGMENT")
_LIB.define(
    "wait_tensor(Tensor(a) tensor, Tensor? keepalive=None, Tensor? last_use_of_storage=None) "
    "-> Tensor(a)"
)


def _wait_tensor(
    tensor: torch.Tensor,
    keepalive: torch.Tensor | None = None,
    last_use_of_storage: torch.Tensor | None = None,
) -> torch.Tensor:
    """The copy into `tensor` is complete (CPU copies are synchronous): free the storage of
    its source `keepalive`, the device original after an offload, the host buffer after a
    reload."""
    if keepalive is not None:
        storage = keepalive.untyped_storage()
        if storage.data_ptr() in _HOST_BUFFERS:
            _account(storage.data_ptr(), -storage.nbytes())
        if storage.nbytes() > 0:
            storage.resize_(0)
    return tensor


_LIB.impl("wait_tensor", _wait_tensor, "CompositeExplicitAutograd")


@torch.library.register_fake("workbench::wait_tensor")
def _(tensor: Any, keepalive: Any = None, last_use_of_storage: Any = None) -> Any:
    return tensor


fx.node.has_side_effect(torch.ops.workbench.wait_tensor.default)


class Ops(NamedTuple):
    """The three ops of one device kind: copy out, copy back, wait (and free the source)."""

    offload: Any
    reload: Any
    wait: Any


def ops_for(device: torch.device) -> Ops:
    """The workbench's ops on the CPU; torch's `ao` ops (streams, pinned memory) on an
    accelerator."""
    if device.type in ("cpu", "meta"):
        w = torch.ops.workbench
        return Ops(w.offload.default, w.reload.default, w.wait_tensor.default)
    importlib.import_module("torch._functorch._activation_offloading.offload_ops")  # ao::

    return Ops(
        torch.ops.ao.offload.default, torch.ops.ao.reload.default, torch.ops.ao.wait_tensor.default
    )


def host_buffer_pool(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Where a step runs repeatedly: on an accelerator, torch's pool of pinned host buffers
    (without it every `ao::offload` pins a fresh buffer, a few ms each, and the first steps
    would time the allocator; graph trainer keeps it open for the whole run). Nothing on
    the CPU, whose ops allocate plain buffers."""
    if device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    ao = importlib.import_module("torch._functorch._activation_offloading.offload_ops")
    return ao.pinned_memory_pool()  # type: ignore[no-any-return]
