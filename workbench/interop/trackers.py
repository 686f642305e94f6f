"""An eager step measured by torch's own memory trackers, and its allocations replayed through
the workbench's caching-allocator model for the reserved figure.

Entry points: `track_step(run, model, ...) -> (outputs, TrackedStep)` (torch's `MemTracker`, or
`FSDPMemTracker` for an FSDP2 model), `TrackedStep` (peak, categories and module at the peak,
per-module peaks, the allocation sequence) and `replay_events(events, config)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from workbench.cost.allocator import AllocatorConfig, AllocatorReplay, Block, CachingAllocator

__all__ = ["TOTAL", "TrackedStep", "module_path", "replay_events", "track_step"]

TOTAL = "Total"  # torch's trackers' key for the sum of their categories
# torch's `checkpoint_wrapper` puts the wrapped block one level down under this name
_WRAPPED = "_checkpoint_wrapped_module"


def module_path(fqn: str) -> str:
    """A tracker's module name as the workbench writes module paths: without the root's class
    name that torch's `ModTracker` puts first, nor the checkpoint wrapper's level; the root
    itself is "" and code outside every module (the loss) is "loss".

    >>> module_path("Llama3.layers.0._checkpoint_wrapped_module.attention.wq")
    'layers.0.attention.wq'
    >>> module_path("Llama3"), module_path("Global")
    ('', 'loss')
    """
    if fqn == "Global":
        return "loss"
    parts = [p for p in fqn.split(".")[1:] if p != _WRAPPED]
    return ".".join(parts)


@dataclass
class TrackedStep:
    """One step as torch's tracker saw it. Bytes are storages as the tracker counts them (the
    tensors' sizes; no allocator rounding on the CPU tensors a fake run uses).

    `events` is the allocation sequence the tracker counted, in order: `(storage, +bytes,
    stream)` when a storage is counted, `(storage, -bytes, stream)` when it dies, a resize
    being a free and an allocation; `storage` is a number standing for one storage while it
    lives, `stream` the number of the stream current when the event happened (0: the default
    stream), which `streams` names: FSDP2 allocates its all-gather buffers on its
    `all_gather_copy_in` stream and its reduced gradients on its `reduce_scatter` stream."""

    tracker: str
    peak_bytes: int
    peak_breakdown: dict[str, int]
    peak_module: str
    peak_phase: str
    module_peaks: dict[str, dict[str, int]]
    events: list[tuple[int, int, int]] = field(repr=False)
    streams: list[str] = field(default_factory=lambda: ["default"])

    def replay(self, config: AllocatorConfig | None = None) -> AllocatorReplay:
        """The caching allocator's figures for this step's allocations (`replay_events`)."""
        return replay_events(self.events, config)

    def named_streams(self, replay: AllocatorReplay) -> dict[str, int]:
        """A replay of this step's events: what each stream's pools reserved, by name."""
        return {self.streams[n]: size for n, size in sorted(replay.reserved_by_stream.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "tracker": self.tracker,
            "peak_bytes": self.peak_bytes,
            "peak_breakdown": self.peak_breakdown,
            "peak_module": self.peak_module,
            "peak_phase": self.peak_phase,
            "module_peaks": self.module_peaks,
        }


def replay_events(
    events: Sequence[tuple[int, int, int]], config: AllocatorConfig | None = None
) -> AllocatorReplay:
    """Run a tracked allocation sequence through `CachingAllocator`: each allocation a
    `malloc` on its stream, each free a `free` of that storage's block (back to the pool of
    the stream it was allocated on, whichever stream frees it). Storages counted before the
    step (parameters, optimizer state, inputs) come first in the sequence, as they were
    allocated before it. The reserved timeline has one entry per event."""
    allocator = CachingAllocator(config)
    blocks: dict[int, Block] = {}
    timeline: list[int] = []
    peak = 0
    for key, size, stream in events:
        if size > 0:
            blocks[key] = allocator.malloc(size, stream)
            peak = max(peak, allocator.allocated_bytes)
        elif key in blocks:
            allocator.free(blocks.pop(key))
        timeline.append(allocator.reserved_bytes)
    return AllocatorReplay(
        reserved_peak_bytes=allocator.reserved_bytes,
        allocated_peak_bytes=peak,
        segments=allocator.segments,
        reserved_timeline=timeline,
        reserved_by_stream=dict(allocator.reserved_by_stream),
    )


@contextlib.contextmanager
def _shapes_untracked(recorder: Any) -> Iterator[None]:
    """DTensor's sharding propagation runs ops on tensors of the *global* shape to read the
    output's metadata; inside a tracker's mode those count as allocations, which no device
    makes (a full-vocabulary fp32 logits tensor per propagation under TP). While it runs, the
    recorder lets ops through uncounted."""
    propagator = ShardingPropagator._propagate_tensor_meta_non_cached

    def uncounted(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.propagating += 1
        try:
            return propagator(self, *args, **kwargs)
        finally:
            recorder.propagating -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = uncounted  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagator  # type: ignore[method-assign]


class _Recording:
    """Mixed into torch's trackers: the two of their methods every count and every peak goes
    through (`_update_snap`, `_update_peak_stats`) also write the allocation sequence and the
    modules running when the peak rose. The trackers' own figures are left as they are."""

    # Higher-order ops (torchtitan's flex_attention) pass through the tracker, which runs them
    # as any op and counts their outputs; without this torch refuses them in its modes.
    supports_higher_order_operators = True

    _curr_mem_snap: dict[torch.device, dict[str, int]]
    _peak_mem: dict[torch.device, int]
    _mod_tracker: Any

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.propagating:  # DTensor reading shapes (`_shapes_untracked`): nothing allocated
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

    def _start_recording(self) -> None:
        self.propagating = 0
        self.events: list[tuple[int, int, int]] = []
        self.peak_parents: set[str] = {"Global"}
        self.peak_in_backward = False
        # each stream met, numbered in order; 0 the default stream (the CPU's current one now:
        # fake tensors live on the CPU, whose stand-in streams FSDP2 enters as it would CUDA's)
        self.streams: dict[Any, int] = {torch.cpu.current_stream(): 0}

    def _stream(self, device: torch.device) -> int:
        """The number of the stream current on `device` (0 on a device without streams)."""
        if device.type == "cuda":
            current: Any = torch.cuda.current_stream(device)
            if current == torch.cuda.default_stream(device):
                return 0
        elif device.type == "cpu":
            current = torch.cpu.current_stream()
        else:
            return 0
        number = self.streams.get(current)
        if number is None:  # a stream met for the first time: the next number
            number = self.streams[current] = len(set(self.streams.values()))
        return number

    def _update_snap(
        self,
        u_type: _UpdateType,
        winfo: Any,
        old_mem_consumed: int | None = None,
        old_reftype: Any = None,
    ) -> None:
        key, stream = id(winfo), self._stream(winfo.device)
        if u_type == _UpdateType.ADD:
            self.events.append((key, winfo.mem_consumed, stream))
        elif u_type == _UpdateType.DEL:
            self.events.append((key, -winfo.mem_consumed, stream))
        elif u_type == _UpdateType.SIZE:
            if old_mem_consumed:
                self.events.append((key, -old_mem_consumed, stream))
            if winfo.mem_consumed:
                self.events.append((key, winfo.mem_consumed, stream))
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)  # type: ignore[misc]

    def _update_peak_stats(self, peak_state: Any) -> None:
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)  # type: ignore[misc]
        if self._peak_mem != before:
            self.peak_parents = set(self._mod_tracker.parents)
            self.peak_in_backward = bool(self._mod_tracker.is_bw)


class _MemRecorder(_Recording, MemTracker):
    def __init__(self) -> None:
        super().__init__()
        self._start_recording()


class _FSDPRecorder(_Recording, FSDPMemTracker):
    def __init__(self, mod: nn.Module, optm: torch.optim.Optimizer | None = None) -> None:
        super().__init__(mod, optm)
        self._start_recording()


def _stream_names(model: nn.Module, numbers: dict[Any, int]) -> list[str]:
    """Each stream number's name: `default` for 0, FSDP2's streams by their names in its
    communication context (`all_gather_copy_in`, `reduce_scatter`, ...), `stream N` else."""
    names = ["default", *(f"stream {n}" for n in range(1, len(set(numbers.values()))))]
    if isinstance(model, FSDPModule):
        context = model._get_fsdp_state()._comm_ctx
        for attr, value in vars(context).items():
            if attr.endswith("_stream") and value in numbers:
                names[numbers[value]] = attr.removesuffix("_stream")
    return names


def _innermost(parents: set[str]) -> str:
    """The deepest module of those running (torch's `ModTracker.parents`); "Global" alone is
    code outside every module."""
    inside = [p for p in parents if p != "Global"]
    if not inside:
        return "Global"
    return max(inside, key=lambda p: (p.count("."), p))


def _named(snapshot: dict[Any, int]) -> dict[str, int]:
    """A tracker snapshot of one device with its categories as torch names them."""
    return {getattr(k, "value", str(k)): int(v) for k, v in snapshot.items() if k != TOTAL}


def _module_peaks(tracker: MemTracker) -> dict[str, dict[str, int]]:
    """Per module the tracker followed: its peak (all devices summed) in forward and in
    backward, by the states torch names `Peak-Forward`/`Peak-Backward` (FSDP2: per unit)."""
    peaks: dict[str, dict[str, int]] = {}
    for stats in tracker.memory_tracking.values():
        row: dict[str, int] = {}
        for state, snapshots in stats.snapshots.items():
            value = getattr(state, "value", str(state)).lower().replace(" ", "-")
            if value not in ("peak-forward", "peak-backward"):
                continue
            phase = value.removeprefix("peak-")
            best = max((sum(d[TOTAL] for d in s.values()) for s in snapshots), default=0)
            row[phase] = max(row.get(phase, 0), best)
        if row:
            peaks[module_path(stats.mod_fqn)] = row
    return peaks


def track_step(
    run: Callable[[], Any],
    model: nn.Module,
    *,
    held: Sequence[torch.Tensor] = (),
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[Any, TrackedStep]:
    """Run `run()` once under torch's tracker for `model`: `FSDPMemTracker` when `model` is
    an FSDP2 module (its sharded and unsharded parameters, gradients and collective buffers as
    categories of their own), else `MemTracker`. `held`: tensors that exist before the step
    (inputs, target), counted from the start; `optimizer`: its state, counted likewise. In fake
    mode, call this inside the fake mode the tensors belong to. Returns what `run` returned and
    the `TrackedStep`."""
    tracker: MemTracker
    if isinstance(model, FSDPModule):
        tracker, name = _FSDPRecorder(model, optimizer), "FSDPMemTracker"
        tracker.track_inputs(tuple(held))
    else:
        tracker, name = _MemRecorder(), "MemTracker"
        tracker.track_external(model, *held)
        if optimizer is not None:
            tracker.track_external(optimizer)
    with tracker, _shapes_untracked(tracker):
        outputs = run()
    recorder: Any = tracker
    peaks = tracker.get_tracker_snapshot("peak")
    total = sum(d.get(TOTAL, 0) for d in peaks.values())
    breakdown: dict[str, int] = {}
    for device_snapshot in peaks.values():
        for category, size in _named(device_snapshot).items():
            breakdown[category] = breakdown.get(category, 0) + size
    step = TrackedStep(
        tracker=name,
        peak_bytes=int(total),
        peak_breakdown=breakdown,
        peak_module=module_path(_innermost(recorder.peak_parents)),
        peak_phase="backward" if recorder.peak_in_backward else "forward",
        module_peaks=_module_peaks(tracker),
        events=recorder.events,
        streams=_stream_names(model, recorder.streams),
    )
    return outputs, step
