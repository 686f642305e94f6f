"""Published runs beside the workbench's estimates: each row of `interop.published` traced as
rank 0 of its job on fake tensors and estimated for its preset, as `estimate` does it.

Entry points: `validate(runs, layers=None, seq=None, progress=None) -> list[RowResult]` and
`RowResult.to_json()`. Rows differing only in policy share one trace.

What a row compares: torchtitan logs the caching allocator's reserved peak, so a row's
difference is the estimate's reserved peak (`Estimate.reserved_peak_bytes`, in the run's
allocator setting) minus the published figure. What a rank holds outside the allocator (the
CUDA context, NCCL's buffers) is reported beside it, not added: torchtitan's figure does not
count it. A pipelined row has no reserved model over its schedule: its allocated peak is
compared, and the row says so (`compared`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.stages import Pipeline, n_layers, trace_stages
from workbench.capture.trace import trace
from workbench.cost.allocator import AllocatorConfig
from workbench.cost.estimate import Estimator
from workbench.cost.stages import PipelineEstimate, PipelineModel
from workbench.interop.eager_runs import AcKind, BaselineOptions, estimate_baselines
from workbench.interop.published import PublishedRun

__all__ = ["RowResult", "estimate_run", "validate"]

Progress = Callable[[str], None]
TOP_SAVED_OPS = 5  # ops listed in a row's saved-at-peak itemisation


@dataclass
class RowResult:
    """One published run's estimate, the figure it sits beside and how long it took."""

    run: PublishedRun
    allocated_bytes: int
    reserved_bytes: int | None
    """The caching allocator model's reserved peak; None for a pipeline (not modelled)."""
    outside_bytes: dict[str, int]
    """Held outside the allocator (`DeviceProfile.outside_allocator_bytes`): not in the
    published figure."""
    breakdown: dict[str, int]
    """What the allocated peak holds: the estimate's categories, or for a pipeline the peak
    rank's resident bytes, its in-flight microbatches and the rest."""
    peak_at: str
    saved_at_peak_by_op: dict[str, int] = field(default_factory=dict)
    trace_seconds: float = 0.0
    """This row's tracing (0 when it shares an earlier row's trace)."""
    estimate_seconds: float = 0.0
    trace_reused: bool = False
    layers: int | None = None
    seq: int | None = None
    estimated_by: str = "graph"
    """What the figures are of: `graph` (the preset on the workbench's graph) or `eager` (the
    run's AC as eager runs it, under torch's trackers: the row ran eagerly)."""
    graph: dict[str, Any] | None = None
    """For an eager-estimated row, the graph preset's figures beside it."""
    reserved_by_stream: dict[str, int] = field(default_factory=dict)
    """For an eager-estimated row, what each stream's pools reserved (FSDP2 allocates on its
    all-gather copy-in and reduce-scatter streams, whose cached blocks the default stream
    cannot reuse); empty for a graph's estimate, one stream."""

    @property
    def compared(self) -> Literal["reserved", "allocated"]:
        return "allocated" if self.reserved_bytes is None else "reserved"

    @property
    def estimate_bytes(self) -> int:
        """The figure set beside the published one."""
        return self.allocated_bytes if self.reserved_bytes is None else self.reserved_bytes

    @property
    def comparable(self) -> bool:
        """False when --layers or --seq changed the run: then there is no difference."""
        return self.layers is None and self.seq is None

    @property
    def difference_bytes(self) -> int | None:
        """Estimate minus published (positive: the estimate is higher)."""
        return self.estimate_bytes - self.run.published_bytes if self.comparable else None

    @property
    def difference_pct(self) -> float | None:
        diff = self.difference_bytes
        return None if diff is None else round(100 * diff / self.run.published_bytes, 2)

    @property
    def seconds(self) -> float:
        return round(self.trace_seconds + self.estimate_seconds, 3)

    def to_json(self) -> dict[str, Any]:
        run = self.run
        return {
            "id": run.id,
            "title": run.title,
            "policy": run.policy,
            "profile": run.profile,
            "allocated_peak_bytes": self.allocated_bytes,
            "reserved_peak_bytes": self.reserved_bytes,
            "outside_allocator_bytes": self.outside_bytes,
            "published_bytes": run.published_bytes,
            "published_gib": run.published_gib,
            "published_quantity": run.quantity,
            "compared": self.compared,
            "comparable": self.comparable,
            "difference_bytes": self.difference_bytes,
            "difference_pct": self.difference_pct,
            "peak_at": self.peak_at,
            "ran": run.ran,
            "estimated_by": self.estimated_by,
            "graph_estimate": self.graph,
            "reserved_by_stream": self.reserved_by_stream,
            "breakdown": self.breakdown,
            "saved_at_peak_by_op": self.saved_at_peak_by_op,
            "differences": list(run.differences),
            "layers": self.layers,
            "seq": self.seq,
            "command": run.estimate_command(self.layers, self.seq),
            "trace_seconds": round(self.trace_seconds, 3),
            "estimate_seconds": round(self.estimate_seconds, 3),
            "trace_reused": self.trace_reused,
            "seconds": self.seconds,
            "source": run.source,
            "config": run.to_json(),
        }


def _parallel(run: PublishedRun) -> Parallel | None:
    return Parallel.of(run.degrees) if run.degrees.sharded else None


def _pipeline(run: PublishedRun) -> Pipeline:
    return Pipeline(
        pp=run.degrees.pp, schedule=run.pp_schedule or "1F1B", microbatches=run.microbatches
    )


def _workload(run: PublishedRun, layers: int | None, seq: int | None) -> Any:
    return load_workload(
        run.model, layers=layers, seq=seq or run.seq, batch=run.local_batch, device="meta"
    )


def trace_run(
    run: PublishedRun, layers: int | None, seq: int | None, kernels: str | None = None
) -> Any:
    """The row's graph (one rank) or, pipelined, its stage graphs and layout: what
    `estimate` traces for the row's flags (`PublishedRun.estimate_argv`). `kernels` defaults
    to the row's GPU's, as `estimate --profile` traces them ("cpu": a graph this CPU runs)."""
    workload = _workload(run, layers, seq)
    kernels = kernels or run.profile
    if run.degrees.pp == 1:
        return trace(workload, "fake", _parallel(run), kernels=kernels)
    pipeline = _pipeline(run)
    layout = pipeline.layout(n_layers(workload))
    graphs = trace_stages(workload, "fake", _parallel(run), pipeline, kernels=kernels)
    return PipelineModel(graphs, layout, run.profile, run.optimizer)


def _by_op(rows: list[dict[str, Any]]) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for row in rows:
        totals[str(row["op"])] += int(row["bytes"])
    return dict(totals.most_common(TOP_SAVED_OPS))


def row_estimator(run: PublishedRun, graph: JointGraph) -> Estimator:
    """The Estimator of a row's graph as the row ran: its GPU's profile, its optimizer, its
    allocator setting and what its backward did with its inputs."""
    return Estimator(
        graph,
        [run.profile],
        run.optimizer,
        allocator=AllocatorConfig(expandable_segments=run.expandable_segments),
        backward_inputs=run.backward_inputs,
    )


def _graph_row(run: PublishedRun, graph: JointGraph, estimators: dict[Any, Estimator]) -> RowResult:
    key = (run.profile, run.expandable_segments, run.backward_inputs)
    if key not in estimators:
        estimators[key] = row_estimator(run, graph)
    est = estimators[key].estimate(run.workbench_policy)
    return RowResult(
        run=run,
        allocated_bytes=est.peak_bytes,
        reserved_bytes=est.reserved_peak_bytes,
        outside_bytes=est.outside_allocator_bytes[run.profile],
        breakdown=dict(est.peak_breakdown),
        peak_at=est.peak_node,
        saved_at_peak_by_op=_by_op(est.saved_at_peak),
    )


def _pipeline_row(run: PublishedRun, model: PipelineModel) -> RowResult:
    est: PipelineEstimate = model.estimate(run.workbench_policy)
    rank = max(est.schedule.ranks, key=lambda r: r.peak_bytes)
    stages = {s.stage: s for s in est.schedule.stages}
    costs = {c.stage: c for c in est.costs}
    resident = sum(costs[s].resident_bytes for s in rank.stages)
    inflight = sum(
        stages[s].inflight_microbatches * costs[s].phases["F"].residue_bytes for s in rank.stages
    )
    first = min(rank.stages)
    return RowResult(
        run=run,
        allocated_bytes=est.peak_bytes,
        reserved_bytes=None,
        outside_bytes=est.estimates[first].outside_allocator_bytes[run.profile],
        breakdown={
            "resident_bytes": resident,
            "inflight_activation_bytes": inflight,
            "gradients_and_transient_bytes": rank.peak_bytes - resident - inflight,
        },
        peak_at=f"rank {rank.rank} (stages {', '.join(map(str, rank.stages))}) at "
        f"{rank.peak_action}, {rank.inflight_microbatches} microbatches in flight",
    )


# A published AC run and the eager baseline that runs it (`workbench.interop.eager_runs`).
_EAGER_KINDS: dict[str, AcKind] = {"none": "none", "eager": "sac", "full": "full"}


def eager_kind(run: PublishedRun) -> AcKind | None:
    """The eager baseline standing for a row that ran eagerly; None where there is none (a
    graph run, a preset with no eager counterpart, or a job the baselines cannot run: a
    pipeline, expert or context parallelism, a torchtitan model's graph trainer ranks)."""
    kind = _EAGER_KINDS.get(run.policy)
    if run.ran != "eager" or kind is None or run.model.startswith("torchtitan:"):
        return None
    degrees = run.degrees
    return kind if degrees.pp == degrees.ep == degrees.cp == 1 else None


def _eager_row(
    run: PublishedRun, graph_row: RowResult, layers: int | None, seq: int | None
) -> RowResult:
    """The row's AC run as eager runs it (its eager baseline), the graph's figures beside."""
    kind = eager_kind(run)
    assert kind is not None
    workload = _workload(run, layers, seq)
    options = BaselineOptions(
        parallel=_parallel(run),
        kernels=run.profile,
        optimizer=run.optimizer,
        allocator=AllocatorConfig(expandable_segments=run.expandable_segments),
        kinds=(kind,),
    )
    [baseline] = estimate_baselines(workload, options)
    tracked = baseline.tracked
    return RowResult(
        run=run,
        allocated_bytes=baseline.peak_bytes,
        reserved_bytes=baseline.reserved_peak_bytes,
        outside_bytes=graph_row.outside_bytes,
        breakdown=dict(tracked.peak_breakdown),
        peak_at=f"{tracked.peak_module} ({tracked.peak_phase})",
        estimated_by="eager",
        graph={
            "policy": run.policy,
            "allocated_peak_bytes": graph_row.allocated_bytes,
            "reserved_peak_bytes": graph_row.reserved_bytes,
            "peak_at": graph_row.peak_at,
        },
        reserved_by_stream=baseline.reserved_by_stream,
    )


def estimate_run(
    run: PublishedRun,
    traced: Any,
    estimators: dict[Any, Estimator] | None = None,
    layers: int | None = None,
    seq: int | None = None,
) -> RowResult:
    """One row's figures from its traced graph (`PipelineModel` for a pipelined row), or, for
    a row that ran eagerly, from its eager baseline (`eager_kind`) with the graph's beside;
    `estimators` keeps a graph's Estimator for the rows sharing it."""
    if isinstance(traced, PipelineModel):
        return _pipeline_row(run, traced)
    row = _graph_row(run, traced, {} if estimators is None else estimators)
    return _eager_row(run, row, layers, seq) if eager_kind(run) is not None else row


def validate(
    runs: list[PublishedRun],
    layers: int | None = None,
    seq: int | None = None,
    progress: Progress | None = None,
) -> list[RowResult]:
    """Each run's estimate, in order; a line per step to `progress` (the CLI's stderr)."""
    say = progress or (lambda _: None)
    traces: dict[Any, tuple[Any, dict[Any, Estimator]]] = {}
    results = []
    for i, run in enumerate(runs, start=1):
        head = f"[{i}/{len(runs)}] {run.id}"
        reused = run.trace_key in traces
        trace_seconds = 0.0
        if not reused:
            say(f"{head}: tracing {run.model} ({run.gpus} GPUs) ...")
            start = time.perf_counter()
            traces[run.trace_key] = (trace_run(run, layers, seq), {})
            trace_seconds = time.perf_counter() - start
        traced, estimators = traces[run.trace_key]
        start = time.perf_counter()
        result = estimate_run(run, traced, estimators, layers, seq)
        result.trace_seconds, result.trace_reused = trace_seconds, reused
        result.estimate_seconds = time.perf_counter() - start
        result.layers, result.seq = layers, seq
        say(
            f"{head}: {result.compared} {result.estimate_bytes / 2**30:.2f} GiB vs published "
            f"{run.published_gib:.2f} GiB ({result.seconds:.1f} s"
            f"{', trace reused' if reused else ''})"
        )
        results.append(result)
    return results
