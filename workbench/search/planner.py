"""The planner: every parallel layout of a job over N GPUs (FSDP x TP x PP x EP, schedule,
microbatches), each with its fastest checkpointing policy under the GPU's memory, ranked by
estimated tokens/s per GPU. EP (routed experts over `ep` of the fsdp x tp ranks, as
torchtitan borrows them) is tried on MoE models only.

Entry points: `plan(options) -> Plan`; what to plan (`PlanOptions`), the enumeration and the
analytic lower bound that prunes before tracing (`layouts(options, workload) -> (candidates,
pruned)`, `Candidate`, `ParamCounts`, `lower_bound_bytes`) live in `workbench.search.layouts`
and are re-exported here.

Layouts that cannot fit even without activations (parameter shards, optimizer state,
gradients and, under PP with FSDP, the stage's unsharded parameters and gradients, as
`cost.stages` holds them) are pruned before anything is traced. Stage graphs that are alike
(same fsdp, tp, ep, microbatch, layer count and first/last role) are traced once and shared by
every layout that holds such a stage.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from workbench.capture.degrees import Degrees
from workbench.capture.expert_parallel import routing_note
from workbench.capture.graph import JointGraph
from workbench.capture.kernels import KERNEL_TARGETS
from workbench.capture.models import Workload, load_workload
from workbench.capture.models.deepseek_v3 import MoE
from workbench.capture.parallel import Parallel
from workbench.capture.stages import StageLayout, n_layers, trace_stages
from workbench.capture.trace import trace
from workbench.capture.tracing import collector_paused
from workbench.cost.calibrate import time_basis
from workbench.cost.estimate import Estimator
from workbench.cost.profiles import get_profile
from workbench.cost.stages import PipelineModel, StageCache
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError, check_type
from workbench.search.layouts import (
    MICROBATCH_MULTIPLES,
    OPTIMIZER,
    PLAN_SCHEDULES,
    Candidate,
    ParamCounts,
    PlanOptions,
    Pruned,
    ep_degrees,
    layouts,
    lower_bound_bytes,
)
from workbench.search.stages import solve_stages

__all__ = [
    "MICROBATCH_MULTIPLES",
    "PLAN_SCHEDULES",
    "Candidate",
    "ParamCounts",
    "Plan",
    "PlanOptions",
    "PlannedConfig",
    "Progress",
    "Pruned",
    "default_jobs",
    "ep_degrees",
    "layouts",
    "lower_bound_bytes",
    "plan",
]

GIB = 2**30
# Each stage's choices, least recompute first (`solve_stages` walks down them).
LADDER = ("none", "default", "full")


@dataclass
class PlannedConfig:
    """A layout's best policy under the memory and its figures (one stage when pp is 1)."""

    candidate: Candidate
    policies: list[Policy]
    stage_peaks: list[int]
    step_seconds: float
    tokens_per_second_per_gpu: float
    feasible: bool

    @property
    def peak_bytes(self) -> int:
        return max(self.stage_peaks)

    def policy_summary(self) -> str:
        """`default` when one policy, else runs of stages: `s0-2 none, s3 full`."""
        names = [p.preset if not (p.selectors or p.overrides) else "custom" for p in self.policies]
        if len(set(names)) == 1:
            return names[0]
        runs: list[tuple[int, int, str]] = []
        for s, name in enumerate(names):
            if runs and runs[-1][2] == name:
                runs[-1] = (runs[-1][0], s, name)
            else:
                runs.append((s, s, name))
        return ", ".join(f"s{a}" + (f"-{b}" if b > a else "") + f" {n}" for a, b, n in runs)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.candidate.to_json(),
            "peak_bytes": self.peak_bytes,
            "stage_peaks": self.stage_peaks,
            "est_step_seconds": self.step_seconds,
            "est_tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "feasible": self.feasible,
            "policy_summary": self.policy_summary(),
            "policy": [p.to_json() for p in self.policies],
        }


@dataclass
class Plan:
    """Layouts ranked best first (those that fit, fastest first; then the rest, lowest
    peak first), the pruned ones, and where the time went."""

    options: PlanOptions
    configs: list[PlannedConfig]
    pruned: list[Pruned]
    seconds: float
    trace_seconds: float
    """Summed over the worker processes (each traces its own groups)."""
    traces: int
    traces_reused: int
    jobs: int
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.options.model,
            "gpus": self.options.gpus,
            "gpu": self.options.gpu,
            "memory_bytes": self.options.budget_bytes,
            "seq": self.options.seq,
            "global_batch": self.options.batch,
            # what every layout's step time and tokens/s per GPU, hence the ranking, rest on
            "time_basis": time_basis([get_profile(self.options.gpu)])[self.options.gpu],
            "configs": [c.to_json() for c in self.configs],
            "pruned": [p.to_json() for p in self.pruned],
            "traces": self.traces,
            "traces_reused": self.traces_reused,
            "trace_seconds": round(self.trace_seconds, 3),
            "seconds": round(self.seconds, 3),
            "jobs": self.jobs,
            "notes": self.notes,
        }


class _Traces:
    """Stage graphs by what makes them alike: fsdp, tp, ep, the stage's microbatch, layer
    count (and how many are dense) and first/last role. Graphs are shared, not copied:
    estimates never change a graph. `traced` counts every graph traced (the cache may have
    been cleared since)."""

    def __init__(self, options: PlanOptions) -> None:
        self.options = options
        self.graphs: dict[tuple[Any, ...], JointGraph] = {}
        # traced 3-layer templates by role: a stage of any layer count is stamped from one
        self.templates: dict[Any, Any] = {}
        self.workloads: dict[int, Workload] = {}
        self.seconds = 0.0
        self.reused = 0
        self.traced = 0
        # the planned GPU's kernels (`workbench.capture.kernels`); another profile: the default
        self.kernels = options.gpu if options.gpu in KERNEL_TARGETS else None

    def workload(self, batch: int) -> Workload:
        if batch not in self.workloads:
            self.workloads[batch] = load_workload(
                self.options.model,
                layers=self.options.layers,
                seq=self.options.seq,
                batch=batch,
                device="meta",
            )
        return self.workloads[batch]

    def get(self, key: tuple[Any, ...], build: Callable[[], JointGraph]) -> JointGraph:
        if key in self.graphs:
            self.reused += 1
            return self.graphs[key]
        start = time.perf_counter()
        self.graphs[key] = build()
        self.traced += 1
        self.seconds += time.perf_counter() - start
        return self.graphs[key]

    def stage_graphs(self, candidate: Candidate, layout: StageLayout) -> list[JointGraph]:
        workload = self.workload(candidate.local_batch)
        parallel = candidate.parallel()
        graphs = []
        for stage, layers in enumerate(layout.layers):
            key = (
                _sharding(candidate),
                candidate.microbatch_size,
                len(layers),
                _dense_layers(workload, layers),
                stage == 0,
                stage == layout.n_stages - 1,
            )

            def build(stage: int = stage) -> JointGraph:
                pipeline = candidate.pipeline()
                graphs = trace_stages(
                    workload,
                    "fake",
                    parallel,
                    pipeline,
                    [stage],
                    templates=self.templates,
                    kernels=self.kernels,
                )
                return graphs[0]

            graphs.append(self.get(key, build))
        return graphs

    def whole(self, candidate: Candidate) -> JointGraph:
        workload = self.workload(candidate.local_batch)
        key = (_sharding(candidate), candidate.local_batch, "whole")
        return self.get(
            key, lambda: trace(workload, "fake", candidate.parallel(), kernels=self.kernels)
        )


def _dense_layers(workload: Workload, layers: tuple[int, ...]) -> int:
    """How many of a stage's layers have no MoE: DeepSeek-V3's dense first layers make a
    stage of as many layers another graph (an MoE model's dense ones come first)."""
    blocks: Any = getattr(workload.model, "layers", {})

    def moe(block: Any) -> bool:  # the reference's MoE feed-forward; torchtitan's `moe` module
        return isinstance(getattr(block, "feed_forward", None), MoE) or bool(
            getattr(block, "moe_enabled", False)
        )

    return sum(not moe(blocks[str(i)]) for i in layers)


def _sharding(candidate: Candidate) -> Degrees:
    """What a rank's graph is sharded by: the layout's degrees but pp (a stage's graph is
    the same in any pipeline depth)."""
    return replace(candidate.degrees, pp=1)


def _group(candidate: Candidate) -> tuple[Degrees, int]:
    return (_sharding(candidate), candidate.microbatch_size)


def _plan_whole(candidate: Candidate, graph: JointGraph, options: PlanOptions) -> PlannedConfig:
    """Without PP: the fastest preset that fits, else the lowest peak."""
    estimator = Estimator(graph, profiles=[options.gpu], optimizer=OPTIMIZER)
    name = get_profile(options.gpu).name
    tried = [(Policy(p), estimator.estimate(Policy(p))) for p in LADDER]
    fits = [(p, e) for p, e in tried if e.peak_bytes <= options.budget_bytes]
    policy, est = (
        min(fits, key=lambda pe: pe[1].step_seconds[name])
        if fits
        else min(tried, key=lambda pe: pe[1].peak_bytes)
    )
    # torchtitan's count, as `PipelineEstimate`'s: a rank's tokens over the tp ranks sharing them
    rate = est.tokens_per_second[name] / candidate.degrees.non_data_parallel_size
    return PlannedConfig(
        candidate, [policy], [est.peak_bytes], est.step_seconds[name], rate, bool(fits)
    )


def _plan_pipeline(
    candidate: Candidate,
    graphs: list[JointGraph],
    layout: StageLayout,
    options: PlanOptions,
    cache: StageCache,
) -> PlannedConfig:
    model = PipelineModel(graphs, layout, profile=options.gpu, optimizer=OPTIMIZER, cache=cache)
    ladders = [[Policy(p) for p in LADDER]] * layout.n_stages
    found = solve_stages(model, options.budget_bytes, per_stage=True, ladders=ladders)
    return PlannedConfig(
        candidate,
        list(found.policies),
        [row.peak_bytes for row in found.estimate.schedule.stages],
        found.estimate.schedule.step_seconds,
        found.estimate.tokens_per_second_per_gpu,
        found.feasible,
    )


# Called after each layout: (layouts done, layouts in all, that layout's figures).
Progress = Callable[[int, int, "PlannedConfig"], None]


@dataclass
class _GroupResult:
    """One group's layouts evaluated (in the group's order) and its tracing figures."""

    configs: list[PlannedConfig]
    trace_seconds: float
    traced: int
    reused: int


def _plan_group(
    options: PlanOptions,
    total: int,
    candidates: list[Candidate],
    progress: Callable[[PlannedConfig], None] | None = None,
) -> _GroupResult:
    """Evaluate layouts sharing fsdp, tp, ep and the microbatch size (so their stage graphs
    and templates), then drop the graphs: a worker process's unit of work."""
    traces, cache = _Traces(options), StageCache()
    configs = []
    # The group's graphs live until it ends: full collections would walk them again and
    # again (a tenth of a plan's time); what they leave is collected after the group.
    with collector_paused():
        for candidate in candidates:
            if candidate.schedule is None:
                configs.append(_plan_whole(candidate, traces.whole(candidate), options))
            else:
                layout = candidate.pipeline().layout(total)
                graphs = traces.stage_graphs(candidate, layout)
                configs.append(_plan_pipeline(candidate, graphs, layout, options, cache))
            if progress is not None:
                progress(configs[-1])
    return _GroupResult(configs, traces.seconds, traces.traced, traces.reused)


def _worker_start() -> None:
    """A worker traces on one thread (the CPUs are shared among the workers) and, once the
    pool has its last answer and lets it go, exits at once: tearing down its interpreter
    object by object (graphs, fake tensors) took tens of seconds, and the pool waits."""
    torch.set_num_threads(1)
    atexit.register(os._exit, 0)


def default_jobs() -> int:
    """One worker per CPU this process may run on (`plan --jobs`'s default)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _work(group: list[Candidate]) -> int:
    """A group's rough cost, to hand out the largest first: its schedule actions (the
    simulation walks them for every trial) and its stage graphs."""
    return sum(c.microbatches * c.degrees.pp + c.degrees.pp for c in group)


def _start_pool(jobs: int) -> ProcessPoolExecutor | None:
    """`jobs` spawned workers (a forked torch may hold locks of threads that did not
    follow), started now: they import torch while this process enumerates the layouts."""
    if jobs == 1:
        return None
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_start)
    for _ in range(jobs):
        pool.submit(int)
    return pool


def _evaluate(
    options: PlanOptions,
    total: int,
    groups: list[list[Candidate]],
    progress: Progress | None,
    pool: ProcessPoolExecutor | None,
) -> list[_GroupResult]:
    """Each group's result, in `groups`' order: in this process without a pool or for one
    group, else in the pool's workers, the largest groups first."""
    count = sum(map(len, groups))
    done = 0

    def report(config: PlannedConfig) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, count, config)

    if pool is None or len(groups) == 1:
        return [_plan_group(options, total, g, report) for g in groups]
    results: list[_GroupResult | None] = [None] * len(groups)
    try:
        order = sorted(range(len(groups)), key=lambda k: -_work(groups[k]))
        futures = {pool.submit(_plan_group, options, total, groups[k]): k for k in order}
        for future in as_completed(futures):
            result = results[futures[future]] = future.result()
            for config in result.configs:
                report(config)
    except BrokenProcessPool:
        raise WorkbenchError(
            f"a worker process of plan (jobs={options.jobs}) stopped before answering: "
            "workers import the calling script again, so a script must call plan under "
            "`if __name__ == '__main__':`; or plan with jobs=1 (one process)"
        ) from None
    return [r for r in results if r is not None]


def plan(options: PlanOptions, progress: Progress | None = None) -> Plan:
    """Enumerate, prune, trace what is left (alike stages once), solve each layout's
    policies under the memory, rank. Groups of layouts sharing stage graphs run in
    `options.jobs` worker processes. Refuses when nothing is left to trace, or nothing fits."""
    check_type("options", options, PlanOptions, "a PlanOptions(model=..., gpus=...)")
    start = time.perf_counter()
    pool = _start_pool(options.jobs)
    try:
        return _plan(options, progress, start, pool)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


MAX_COUNTS_SHOWN = 4  # GPU counts an error suggests in place of --gpus


def _no_layout(options: PlanOptions, workload: Workload, pruned: list[Pruned]) -> WorkbenchError:
    """Why nothing is left to trace: the memory (the lowest bound) when a layout was pruned
    for it; else no layout splits the model over these GPUs, with the nearest counts (up to
    twice --gpus) that have one."""
    bounds = [p.lower_bound_bytes for p in pruned if p.lower_bound_bytes is not None]
    if bounds:
        return WorkbenchError(
            f"no layout of {options.model} on {options.gpus} GPUs fits "
            f"{options.budget_bytes / GIB:.3g} GiB: parameters, optimizer state and gradients "
            f"alone need at least {min(bounds) / GIB:.3g} GiB per GPU; give more --gpus or "
            "--memory-gib"
        )
    near = sorted(range(1, 2 * options.gpus + 1), key=lambda n: (abs(n - options.gpus), n))
    valid: list[int] = []
    for gpus in near[1:]:
        if layouts(replace(options, gpus=gpus), workload)[0]:
            valid.append(gpus)
            if len(valid) == MAX_COUNTS_SHOWN:
                break
    counts = ", ".join(map(str, sorted(valid))) or "none up to twice as many"
    reasons = "; ".join(dict.fromkeys(p.reason for p in pruned))
    return WorkbenchError(
        f"--gpus {options.gpus}: no layout splits {options.model} over {options.gpus} GPUs "
        f"({reasons}); choose --gpus among {counts}"
    )


def _plan(
    options: PlanOptions,
    progress: Progress | None,
    start: float,
    pool: ProcessPoolExecutor | None,
) -> Plan:
    workload = _Traces(options).workload(1)
    candidates, pruned = layouts(options, workload)
    budget_gib = options.budget_bytes / GIB
    if not candidates:
        raise _no_layout(options, workload, pruned)
    # Alike stages share fsdp, tp, ep and the microbatch size: evaluated group by group, a
    # group's graphs are dropped when it ends (a 70B plan holds hundreds otherwise).
    groups: dict[tuple[Degrees, int], list[Candidate]] = {}
    for candidate in sorted(candidates, key=_group):
        groups.setdefault(_group(candidate), []).append(candidate)
    results = _evaluate(options, n_layers(workload), list(groups.values()), progress, pool)
    configs = [c for r in results for c in r.configs]
    if not any(c.feasible for c in configs):
        best = min(configs, key=lambda c: c.peak_bytes)
        raise WorkbenchError(
            f"no layout of {options.model} on {options.gpus} GPUs fits {budget_gib:.3g} GiB; "
            f"the lowest peak is {best.peak_bytes / GIB:.3g} GiB ({best.candidate.describe()}, "
            f"{best.policy_summary()}); give more --gpus or --memory-gib"
        )
    configs.sort(key=lambda c: (not c.feasible, -c.tokens_per_second_per_gpu, c.peak_bytes))
    notes = []
    if any(c.candidate.degrees.ep > 1 for c in configs):  # the EP rank graphs' note, once
        notes.append(routing_note("one per MoE layer", Parallel().ep_imbalance))
    return Plan(
        options,
        configs,
        pruned,
        time.perf_counter() - start,
        sum(r.trace_seconds for r in results),
        sum(r.traced for r in results),
        sum(r.reused for r in results),
        1 if pool is None or len(groups) == 1 else options.jobs,
        notes,
    )
