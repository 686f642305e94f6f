"""Measurement: run a rematerialized graph or an eager baseline for real; peak memory, step time.

Entry points: `measure_graph(graph, gm)`, `measure_eager(workload)`, `measure_policy(workload,
policy)` (trace, remat, refuse what cannot fit, run) and `bitwise_mismatches` (against eager).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from workbench.eager import apply_eager_sac, apply_eager_sac_to, eager_step
from workbench.errors import WorkbenchError, describe
from workbench.estimate import Estimate, Estimator, estimate_remat
from workbench.graph import JointGraph
from workbench.models import Workload, available_bytes
from workbench.offload import host_buffer_pool
from workbench.policy import Policy
from workbench.profiles import allocation_granularity, round_up
from workbench.remat import remat
from workbench.trace import trace


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
        }


def _device_of(tensors: Iterable[Any]) -> torch.device:
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
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, result


def _measure(
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
    device = _device_of(inputs)
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


@contextlib.contextmanager
def _fails_in_one_line(what: str) -> Iterator[None]:
    """Real data can fail where fake tensors passed (fake kernels skip some dtype checks; out
    of memory): one line naming what ran instead of torch's traceback."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise WorkbenchError(f"{what} failed when run for real: {describe(err)}") from None


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
    return _measure(name, step, held, tokens, warmup, repeats)


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

    return _measure(name, run, args, graph.tokens, warmup, repeats)


def measure_eager(
    workload: Workload,
    policy: Policy | None = None,
    *,
    layers_attr: str = "layers",
    regions: Sequence[str] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    graph: JointGraph | None = None,
) -> Measurement:
    """An eager train step: no AC (`policy=None`), or eager SAC with the exported policy_fn
    wrapped around every block (on a copy of the model), or around each submodule matching
    `regions` (`apply_eager_sac_to`, e.g. `["layers.*.attention", "layers.*.feed_forward"]`).
    `graph`: the workload's traced graph, for the export (`eager.load_policy_fn`)."""
    if policy is None:
        target, name = workload, "no AC"
    else:
        copied = copy.deepcopy(workload.model)
        # eager SAC cannot offload: it runs the policy with its offloads saved
        preset = f"{policy.preset}, offload saved" if policy.offloads else policy.preset
        if regions is None:
            model = apply_eager_sac(copied, policy, layers_attr, graph=graph)
            name = f"eager SAC ({preset})"
        else:
            model = apply_eager_sac_to(copied, policy, regions, graph=graph)
            name = f"eager SAC ({preset}; {', '.join(regions)})"
        target = Workload(model, workload.inputs, workload.target, workload.loss_fn, workload.name)
    held = [*target.model.parameters(), *target.model.buffers(), *target.inputs, target.target]
    return _measure(name, lambda: eager_step(target), held, workload.tokens, warmup, repeats)


@dataclass
class PolicyMeasurement:
    """Graph SAC measured beside its estimate, with the bitwise check against eager."""

    graph_sac: Measurement
    estimate: Estimate
    bitwise_equal: bool
    mismatched: list[str]
    baselines: list[Measurement] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.graph_sac.peak_bytes,
            "estimated_peak_bytes": self.estimate.peak_bytes,
            "step_seconds": self.graph_sac.step_seconds,
            "tokens_per_second": self.graph_sac.tokens_per_second,
            "bitwise_equal": self.bitwise_equal,
            "mismatched": self.mismatched,
            "device": self.graph_sac.device,
            "baselines": [b.to_json() for b in self.baselines],
        }


def bitwise_mismatches(
    graph: JointGraph, gm: fx.GraphModule, workload: Workload, seed: int = 0
) -> list[str]:
    """Outputs (`loss`, then parameter names) where running `gm` under no_grad differs bitwise
    from a plain eager step. Both start from the same generator state (the caller's is restored
    after): random ops such as dropout then draw the same numbers, since the graph runs them
    as eager does (random ops are always saved, never replayed by remat)."""
    inputs = graph.example_inputs
    assert inputs is not None
    device = _device_of(inputs)
    devices = [device] if device.type == "cuda" else []

    def seeded(run: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return run()

    def run_graph() -> list[torch.Tensor]:
        with torch.no_grad():
            return list(gm(*inputs))

    with _fails_in_one_line(f"the graph of {graph.model_name!r}"):
        traced = seeded(run_graph)
    with _fails_in_one_line(f"the eager step of {graph.model_name!r}"):
        eager = seeded(lambda: eager_step(workload))
    names = ["loss", *graph.param_names]
    return [n for n, a, b in zip(names, traced, eager, strict=True) if not bitwise_equal(a, b)]


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


def measure_policy(
    workload: Workload,
    policy: Policy,
    *,
    baselines: bool = False,
    warmup: int = 1,
    repeats: int = 5,
    graph: JointGraph | None = None,
    estimator: Estimator | None = None,
) -> PolicyMeasurement:
    """Trace, remat with torch's pass, estimate, refuse what cannot fit, run, and compare
    loss and gradients bitwise with a plain eager step. `graph` and `estimator`: already
    built ones of this workload, so they are not built again."""
    graph = graph if graph is not None else trace(workload, mode="real")
    assert graph.example_inputs is not None
    device = _device_of(graph.example_inputs)
    result = remat(graph, policy)
    # a graph run holds no optimizer state: compare it with the graph's own bytes
    if estimator is None or estimator.optimizer_bytes:
        estimator = Estimator(graph, profiles=(), optimizer="none")
    granularity = allocation_granularity(device)
    est = estimate_remat(graph, result, estimator, granularity)
    eager_peak = estimator.estimate(Policy("none"), granularity).peak_bytes  # the comparison
    check_fits(
        max(est.peak_bytes, eager_peak), held_bytes(graph.example_inputs), device, workload.name
    )
    measured = measure_graph(
        graph, result.gm, name=f"graph SAC ({policy.preset})", warmup=warmup, repeats=repeats
    )
    mismatched = bitwise_mismatches(graph, result.gm, workload)
    others = []
    if baselines:
        others = [
            measure_eager(workload, None, warmup=warmup, repeats=repeats),
            measure_eager(workload, policy, warmup=warmup, repeats=repeats, graph=graph),
        ]
    return PolicyMeasurement(measured, est, not mismatched, mismatched, others)
