"""Memory snapshots for tests, recorded on the CPU in the format torch's CUDA caching allocator
writes (`torch.cuda.memory._snapshot()`; torch/csrc/cuda/Module.cpp names its keys).

`record_snapshot(gm, inputs)` runs a graph module for real under a dispatch mode that sees
each op's fresh output storages (an `alloc` with the Python frames of that moment, innermost
first, as torch's CapturedTraceback lists them: `<eval_with_key>.N` at the node's line), and
each storage's death (`free_requested` + `free_completed`), placing blocks with the
workbench's model of the caching allocator (`segment_alloc` when it makes a segment). The
inputs exist before recording starts, as a model's parameters do before
`_record_memory_history`: they are blocks of the final segments without events or frames.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from workbench.cost.allocator import Block, CachingAllocator
from workbench.cost.measure import Recording

BASE = 0x7F10_0000_0000
HERE = __file__


def _frames() -> list[dict[str, Any]]:
    """The Python stack now, innermost first, without this file's frames."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename != HERE:
            frames.append(
                {"filename": code.co_filename, "line": frame.f_lineno, "name": code.co_name}
            )
        frame = frame.f_back
    return frames


class _Recorder(TorchDispatchMode):
    def __init__(self, strip_every: int) -> None:
        super().__init__()
        self.allocator = CachingAllocator()
        self.trace: list[dict[str, Any]] = []
        # data_ptr -> (weak ref, block, address, bytes, frames); inputs have no block
        self.live: dict[int, tuple[StorageWeakRef, Block | None, int, int, list[Any]]] = {}
        self.strip_every = strip_every
        self.made = 0

    def hold(self, tensors: list[Any]) -> None:
        """Storages that exist before recording (the graph's inputs)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in self.live:
                    block = self.allocator.malloc(storage.nbytes())
                    self.live[storage.data_ptr()] = (
                        StorageWeakRef(storage),
                        block,
                        BASE + block.addr,
                        storage.nbytes(),
                        [],
                    )

    def poll(self) -> None:
        frames = _frames()
        for key in [k for k, v in self.live.items() if v[0].expired()]:
            _, block, addr, nbytes, _ = self.live.pop(key)
            assert block is not None
            self.allocator.free(block)
            for action in ("free_requested", "free_completed"):
                self.trace.append(_event(action, addr, nbytes, frames))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.poll()
        out = func(*args, **(kwargs or {}))
        frames = _frames()
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if not storage.nbytes() or storage.data_ptr() in self.live:
                continue
            self.made += 1
            kept = [] if self.strip_every and self.made % self.strip_every == 0 else frames
            mapped = len(self.allocator.mapped)
            block = self.allocator.malloc(storage.nbytes())
            for addr, size, _ in self.allocator.mapped[mapped:]:
                self.trace.append(_event("segment_alloc", BASE + addr, size, kept))
            self.trace.append(_event("alloc", BASE + block.addr, storage.nbytes(), kept))
            self.live[storage.data_ptr()] = (
                StorageWeakRef(storage),
                block,
                BASE + block.addr,
                storage.nbytes(),
                kept,
            )
        return out

    def segments(self) -> list[dict[str, Any]]:
        blocks = [(v[1], v[3], v[4]) for v in self.live.values()]
        blocks += [(b, 0, None) for b in self.allocator.cached_blocks()]
        blocks.sort(key=lambda b: b[0].addr)
        segments = []
        for addr, size, small in self.allocator.mapped:
            inside = [b for b in blocks if addr <= b[0].addr < addr + size]
            assert sum(b[0].size for b in inside) == size
            segments.append(
                {
                    "device": 0,
                    "address": BASE + addr,
                    "total_size": size,
                    "allocated_size": sum(b[0].size for b in inside if b[2] is not None),
                    "active_size": sum(b[0].size for b in inside if b[2] is not None),
                    "requested_size": sum(b[1] for b in inside),
                    "stream": 0,
                    "segment_type": "small" if small else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": [
                        {
                            "address": BASE + b.addr,
                            "size": b.size,
                            "requested_size": n,
                            "state": "inactive" if f is None else "active_allocated",
                            "frames": f or [],
                        }
                        for b, n, f in inside
                    ],
                }
            )
        return segments


def _event(action: str, addr: int, size: int, frames: list[Any]) -> dict[str, Any]:
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": 0,
        "time_us": 0,
        "frames": frames,
    }


def record_run(
    run: Callable[[], Any], held: Sequence[Any], strip_every: int = 0
) -> tuple[dict[str, Any], Any]:
    """Call `run()` recording; `held`: the tensors that exist before it (inputs,
    parameters). The snapshot dict and what `run` returned (held, as a caller holds it when
    the snapshot is taken). `strip_every=k` records every k-th allocation without frames (as
    one made while recording kept no context)."""
    recorder = _Recorder(strip_every)
    recorder.hold(list(held))
    with recorder:
        outputs = run()
    recorder.poll()
    return {
        "segments": recorder.segments(),
        "device_traces": [recorder.trace],
        "allocator_settings": {"expandable_segments": False},
        "external_annotations": [],
    }, outputs


def record_snapshot(
    gm: fx.GraphModule, inputs: list[Any], strip_every: int = 0
) -> tuple[dict[str, Any], list[Any]]:
    """`gm(*inputs)` under no_grad, recorded (`record_run`)."""

    def run() -> list[Any]:
        with torch.no_grad():
            return list(gm(*inputs))

    return record_run(run, inputs, strip_every)


def cpu_recording(run: Callable[[], Any], held: Sequence[Any]) -> Recording:
    """What `bench_gpu` takes from `record_cuda_step`, recorded on the CPU: the snapshot,
    its peaks as the snapshot counts them, and an empty Chrome trace."""
    snapshot, _ = record_run(run, held)
    return Recording(snapshot, b'{"traceEvents": []}', 0, 0)
