"""Measurement: run a step for real; its peak memory and step time, and its loss and
gradients against eager's, bit for bit.

Entry points: `measure_graph(graph, gm)`, `measure_step(name, step, held, tokens)`,
`measure_run(...)` (any callable), `measured_counterpart` (the estimate of what a measured
peak counts), `bitwise_mismatches`, `check_fits` and `record_cuda_step` (one step on a GPU
with torch's memory history and profiler on: a memory snapshot and a Chrome trace).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from workbench.capture.fits import available_bytes
from workbench.capture.graph import JointGraph
from workbench.capture.workload import Workload, eager_step
from workbench.cost.calibrate import measured_basis
from workbench.cost.estimate import Estimate
from workbench.cost.profiles import allocation_granularity, round_up
from workbench.errors import WorkbenchError, describe
from workbench.rewrite.host_ops import host_buffer_pool


@dataclass
class Measurement:
    """One way of running the step. `peak_bytes` = what the inputs hold (`held_bytes`) plus
    the most the step allocated on top; `step_seconds` is the median of `all_seconds`."""

    name: str
    device: str
    peak_bytes: int
    held_bytes: int
    step_seconds: float
    all_seconds: list[float]
    tokens: int
    outputs: list[torch.Tensor] = field(repr=False, default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "held_bytes": self.held_bytes,
            "step_seconds": self.step_seconds,
            "all_seconds": self.all_seconds,
            "tokens_per_second": self.tokens_per_second,
            "time_basis": measured_basis(self.device, len(self.all_seconds)),
        }


def device_of(tensors: Iterable[Any]) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def held_bytes(tensors: Iterable[Any], granularity: int = 1) -> int:
    """Bytes of the distinct storages behind `tensors` (views and slices counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = round_up(storage.nbytes(), granularity)
    return sum(seen.values())


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Kineto writes profiler start/stop lines to file descriptor 2 whatever its log level;
    errors still arrive as Python exceptions."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak(run: Callable[[], Any]) -> tuple[int, Any]:
    """Most bytes the CPU allocator held at once during `run`, above what it held before,
    from the profiler's allocation events."""
    with (
        _native_stderr_silenced(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        result = run()
    events: list[Any] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            events.append(event)
        stack.extend(event.children)
    events.sort(key=lambda e: e.start_time_ns)
    live = peak = 0
    for event in events:
        live += event.typed[1].alloc_size
        peak = max(peak, live)
    return peak, result


def _cuda_peak(run: Callable[[], Any], device: torch.device) -> tuple[int, Any]:
    """What the run adds to the device's allocated peak. cuBLAS's workspaces are given back
    first, so the run takes them again as a job's first step does: the estimate counts them
    (`workbench.cost.workspaces`)."""
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, result


def measure_run(
    name: str,
    run: Callable[[], list[torch.Tensor]],
    inputs: Sequence[Any],
    tokens: int,
    warmup: int,
    repeats: int,
) -> Measurement:
    """Warm up, time `repeats` runs (median), then one more run for the memory peak. On a
    GPU the runs share torch's pinned host buffers, as a training loop with offload does."""
    if repeats < 1 or warmup < 0:
        raise WorkbenchError(f"repeats must be ≥ 1 and warmup ≥ 0, got {repeats} and {warmup}")
    device = device_of(inputs)
    with _fails_in_one_line(name), host_buffer_pool(device):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            gc.collect()
            sync()
            start = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - start)
        gc.collect()
        extra, outputs = _cuda_peak(run, device) if device.type == "cuda" else _cpu_peak(run)
        held = held_bytes(inputs, allocation_granularity(device))
        return Measurement(
            name=name,
            device=str(device),
            peak_bytes=held + extra,
            held_bytes=held,
            step_seconds=statistics.median(times),
            all_seconds=times,
            tokens=tokens,
            outputs=list(outputs),
        )


# What a measured graph peak counts, by device type: the graph step holds no optimizer state;
# on the CPU the offloaded host copies come from the same allocator the profiler reads.
PEAK_COUNTS = {
    "cpu": "graph step without optimizer state; device + host copies, which share the CPU's "
    "allocator",
    "cuda": "graph step without optimizer state; device memory only, host copies apart",
}


def measured_counterpart(est: Estimate, device: torch.device | str) -> tuple[int, str]:
    """The estimated peak of what a measurement on `device` counts, and those words
    (`PEAK_COUNTS`): on the CPU the most device + host bytes live at one step, on a GPU the
    device peak. `est` must be of an estimator without optimizer state, as a graph run holds
    none."""
    kind = torch.device(device).type
    if kind == "cpu" and est.host_timeline:
        both = max(d + h for d, h in zip(est.totals(), est.host_timeline, strict=True))
        return both, PEAK_COUNTS["cpu"]
    return est.peak_bytes, PEAK_COUNTS.get(kind, PEAK_COUNTS["cuda"])


@contextlib.contextmanager
def _fails_in_one_line(what: str) -> Iterator[None]:
    """Real data can fail where fake tensors passed (fake kernels skip some dtype checks; out
    of memory): one line naming what ran instead of torch's traceback."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise WorkbenchError(f"{what} failed when run for real: {describe(err)}") from None


fails_in_one_line = _fails_in_one_line  # for `workbench.cost.reference`


def measure_step(
    name: str,
    step: Callable[[], list[torch.Tensor]],
    held: Sequence[Any],
    tokens: int,
    *,
    warmup: int = 1,
    repeats: int = 5,
) -> Measurement:
    """Any train step as a closure (e.g. a partitioned forward + backward); `held`: the
    tensors it reads that exist before it runs (parameters, buffers, inputs)."""
    return measure_run(name, step, held, tokens, warmup, repeats)


def measure_graph(
    graph: JointGraph,
    gm: fx.GraphModule | None = None,
    inputs: Sequence[Any] | None = None,
    *,
    name: str = "graph",
    warmup: int = 1,
    repeats: int = 5,
) -> Measurement:
    """Run `gm` (default: the joint graph itself) under no_grad on the graph's real inputs."""
    args = list(inputs) if inputs is not None else graph.example_inputs
    if args is None:
        raise WorkbenchError(
            f"graph of {graph.model_name!r} was traced in fake mode and holds no tensors: "
            "trace with mode='real' to measure it"
        )
    module = graph.gm if gm is None else gm

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return list(module(*args))

    return measure_run(name, run, args, graph.tokens, warmup, repeats)


def bitwise_mismatches(
    graph: JointGraph, gm: fx.GraphModule, workload: Workload, seed: int = 0
) -> list[str]:
    """Outputs (`loss`, then parameter names) where running `gm` under no_grad differs bitwise
    from a plain eager step. Both start from the same generator state (the caller's is restored
    after): random ops such as dropout then draw the same numbers, since the graph runs them
    as eager does (random ops are always saved, never replayed by remat)."""
    inputs = graph.example_inputs
    assert inputs is not None
    device = device_of(inputs)
    devices = [device] if device.type == "cuda" else []

    def seeded(run: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return run()

    def run_graph() -> list[torch.Tensor]:
        with torch.no_grad():
            return list(gm(*inputs))

    kinds = [spec.kind for spec in graph.inputs]
    before = [
        t.clone() if isinstance(t, torch.Tensor) and kind == "param" else None
        for t, kind in zip(inputs, kinds, strict=False)
    ]
    with _fails_in_one_line(f"the graph of {graph.model_name!r}"):
        traced = seeded(run_graph)
    _refuse_written_inputs(graph, inputs, before)
    with _fails_in_one_line(f"the eager step of {graph.model_name!r}"):
        eager = seeded(lambda: eager_step(workload))
    names = ["loss", *graph.param_names]
    return [n for n, a, b in zip(names, traced, eager, strict=True) if not bitwise_equal(a, b)]


def _refuse_written_inputs(
    graph: JointGraph, inputs: Sequence[Any], before: Sequence[torch.Tensor | None]
) -> None:
    """A step that writes into its parameters leaves the eager run other starting values
    than the graph had: the comparison would blame the policy for the model's write.
    (Buffers such as running statistics are meant to change.)"""
    written = [
        spec.fqn or spec.placeholder
        for spec, now, then in zip(graph.inputs, inputs, before, strict=False)
        if spec.kind == "param" and then is not None and not bitwise_equal(now, then)
    ]
    if written:
        raise WorkbenchError(
            f"{graph.model_name!r} writes into {', '.join(written[:3])} during the step (an "
            "in-place update in forward or backward): the graph and the eager step would start "
            "from different values, so a bitwise comparison cannot judge the policy; move the "
            "update out of the step"
        )


refuse_written_inputs = _refuse_written_inputs  # for `workbench.cost.reference`


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: NaN equals an identical NaN, 0.0 differs from -0.0
    (`torch.equal` compares values, so a NaN loss would never be equal to itself).

    >>> nan = torch.tensor([float("nan"), 0.0])
    >>> bitwise_equal(nan, nan.clone()), bitwise_equal(nan, torch.tensor([float("nan"), -0.0]))
    (True, False)
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_fits(estimated_peak: int, held: int, device: torch.device, what: str) -> None:
    """Refuse a run whose estimated peak exceeds what the device has free (beyond the inputs
    it already holds), instead of swapping or dying out of memory."""
    needed = estimated_peak - held
    free = available_bytes(device)
    if needed > 0.9 * free:
        raise WorkbenchError(
            f"{what} is estimated to need {estimated_peak / 2**30:.2f} GiB at its peak "
            f"({needed / 2**30:.2f} GiB beyond its inputs) but {device} has "
            f"{free / 2**30:.2f} GiB free: use a smaller --batch/--seq/--layers, a policy "
            "that recomputes more, or `estimate` with --mode fake"
        )


# Trace events a recorded step keeps (torch keeps the newest): a few KB each in the snapshot.
MAX_TRACE_ENTRIES = 1_000_000


@dataclass
class Recording:
    """One step run on a GPU with torch's memory history on: its snapshot (what
    `torch.cuda.memory._snapshot()` returns), and the peaks torch counted for that run; then
    one more run under `torch.profiler`: its Chrome trace (what `--calibrate` reads)."""

    snapshot: dict[str, Any]
    chrome_trace: bytes
    max_allocated: int
    max_reserved: int


def record_cuda_step(run: Callable[[], Any], held: Sequence[Any]) -> Recording:
    """Run `run` once on the device of `held` (the tensors it reads, which exist before it)
    recording allocations with their Python frames (`_record_memory_history`), then once
    under the profiler (CPU and CUDA activities, shapes recorded)."""
    device = device_of(held)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(
        "all", context="all", stacks="python", max_entries=MAX_TRACE_ENTRIES, clear_history=True
    )
    try:
        outputs = run()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(None)
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    del outputs
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with _native_stderr_silenced(), profile(activities=activities, record_shapes=True) as prof:
        run()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as trace:
            chrome_trace = trace.read()
    return Recording(snapshot, chrome_trace, allocated, reserved)
