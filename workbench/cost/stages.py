"""A pipelined job's figures: each stage's graph estimated for its policy, split into the
phases torch's schedule runs (F, B or I and W), then simulated over the schedule.

Entry points: `PipelineModel(graphs, layout).estimate(policies) -> PipelineEstimate` and
`stage_cost(graph, estimate, estimator, profile)` (one stage's `StageCost`).

What a stage holds, as torch's `PipelineStage` with FSDP2 runs it (`stage.py`: until the last
microbatch's backward, `set_reshard_after_backward(False)` and
`set_requires_gradient_sync(False)`): its parameter shards and optimizer state, with FSDP the
unsharded parameters (compute dtype) the whole step and unsharded gradients (reduce dtype)
from its first backward on; without FSDP the gradients the graph returns. Per microbatch, from
its forward to its backward: what the forward saves, its output (kept for backward in
`fwd_cache`) and what it received. All else is a phase's transient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from workbench.capture.graph import JointGraph
from workbench.capture.models import DTYPES
from workbench.capture.pipeline import action_order, check_order
from workbench.capture.stages import StageLayout
from workbench.cost.estimate import CATEGORIES, Estimate, Estimator, OptimizerName
from workbench.cost.overlap import OverlapOptions
from workbench.cost.profiles import get_profile
from workbench.cost.schedule import (
    PhaseCost,
    ScheduleResult,
    ScheduleWalk,
    StageCost,
    simulate,
)
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError, check_type
from workbench.rewrite.di_dw import WEIGHT_GRADS_FROM, split_di_dw
from workbench.rewrite.remat import RECOMPUTED_SUFFIX

__all__ = ["PipelineEstimate", "PipelineModel", "StageCache", "stage_cost"]

_PARAMS = CATEGORIES.index("parameters")
_INPUTS = CATEGORIES.index("inputs")
_GATHERED = CATEGORIES.index("gathered")
_GRADS = CATEGORIES.index("gradients")


def _elements(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def stage_cost(
    graph: JointGraph, estimate: Estimate, estimator: Estimator, profile: str, stage: int
) -> StageCost:
    """One microbatch's phases of a stage's estimate (`graph` split by `split_di_dw` when
    its config names `weight_grads_from`), and what the stage holds the whole step."""
    storages = estimate.device_storages
    if storages is None:
        raise WorkbenchError("this estimate carries no storages to split into phases")
    index = estimator.index
    steps = len(estimate.order)
    traced = [index.index_of[estimator.traced_node(name)] for name in estimate.order]
    backward = next(
        (
            p
            for p, (i, name) in enumerate(zip(traced, estimate.order, strict=True))
            if index.phase[i] == "backward" or name.endswith(RECOMPUTED_SUFFIX)
        ),
        steps,
    )
    split = graph.config.get(WEIGHT_GRADS_FROM, "absent")
    bounds = [0, backward]
    if split != "absent":
        names = [index.names[i] for i in traced]
        bounds.append(names.index(split) if split in names else steps)
    bounds.append(steps)

    outputs: list[Any] = list(graph.gm.graph.output_node().args[0])  # type: ignore[arg-type]
    # returned in backward: the parameter gradients and, after the first stage, the
    # received input's gradient (sent on, so a transient of the backward)
    returned = (storages.category == _GRADS) & (storages.born >= backward)
    sent = np.zeros_like(returned)
    if not graph.config["stage"]["first"]:
        sent = returned & (storages.node == index.index_of[_storage_owner(graph, outputs[-1])])
    param_grad = returned & ~sent
    per_step = ~np.isin(storages.category, [_PARAMS, _INPUTS, _GATHERED]) & ~param_grad
    sizes = np.where(per_step, storages.sizes, 0)
    deltas = np.zeros(steps + 2, dtype=np.int64)
    np.add.at(deltas, storages.born, sizes)
    np.add.at(deltas, storages.freed + 1, -sizes)
    live = np.cumsum(deltas[:steps])

    inputs = {spec.fqn: graph.nodes[spec.placeholder].bytes for spec in graph.inputs}
    received = sum(b for fqn, b in inputs.items() if fqn in ("inputs[0]", "target"))
    grad_output = inputs.get("grad_output", 0)
    seconds = _phase_seconds(estimate, estimator, profile, traced, bounds)

    def alive_across(step: int) -> int:
        """Bytes made before `step` and still held at it: what the next phase inherits."""
        held = per_step & (storages.born < step) & (storages.freed >= step)
        return int(storages.sizes[held].sum())

    def peak(lo: int, hi: int) -> int:
        return int(live[lo:hi].max()) if hi > lo else 0

    forward_residue = alive_across(backward) + received
    kinds = ["F", "B"] if len(bounds) == 3 else ["F", "I", "W"]
    costs: dict[str, PhaseCost] = {
        "F": PhaseCost(seconds[0], peak(0, backward) + received, forward_residue)
    }
    start = forward_residue
    for k, kind in enumerate(kinds[1:], start=1):
        lo, hi = bounds[k], bounds[k + 1]
        residue = alive_across(hi) + received if kind == "I" else 0
        transient = max(peak(lo, hi) + received + grad_output - start, 0)
        costs[kind] = PhaseCost(seconds[k], transient, residue)
        start = residue
    return StageCost(
        stage=stage,
        resident_bytes=_resident_bytes(graph, estimate),
        grad_bytes=_grad_bytes(graph, storages, param_grad),
        phases=costs,
        send_bytes=graph.nodes[outputs[0].name].bytes if not graph.config["stage"]["last"] else 0,
    )


def _storage_owner(graph: JointGraph, node: Any) -> str:
    """The node whose output storage `node`'s value views (itself if not a view)."""
    while graph.nodes[node.name].is_view and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return str(node.name)


def _phase_seconds(
    estimate: Estimate,
    estimator: Estimator,
    profile: str,
    traced: list[int],
    bounds: list[int],
) -> list[float]:
    """The step's estimated time shared among the phases by their compute-stream time."""
    per_node = np.asarray(estimator.seconds[profile])
    compute = per_node[traced]
    total = float(compute.sum())
    step = estimate.step_seconds[profile]
    return [
        step * float(compute[lo:hi].sum()) / total if total else 0.0
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]


def _resident_bytes(graph: JointGraph, estimate: Estimate) -> int:
    """Parameter shards, optimizer state, cuBLAS's workspaces and, with FSDP, the stage's
    unsharded parameters in the compute dtype (kept between microbatches)."""
    held = sum(estimate.timeline[c][0] for c in ("parameters", "optimizer", "workspaces"))
    fsdp = int(graph.config.get("fsdp", 1))
    if fsdp == 1:
        return held
    low = DTYPES[graph.config.get("param_dtype", "bfloat16")].itemsize
    return held + sum(
        _elements(graph.nodes[s.placeholder].shapes[0]) * fsdp * low
        for s in graph.inputs
        if s.kind == "param"
    )


def _grad_bytes(graph: JointGraph, storages: Any, param_grad: np.ndarray) -> int:
    """Gradients a stage accumulates over microbatches: with FSDP unsharded in the reduce
    dtype (torch's stage defers the reduce-scatter to the last backward), else as returned."""
    fsdp = int(graph.config.get("fsdp", 1))
    if fsdp == 1:
        return int(storages.sizes[param_grad].sum())
    reduce = DTYPES[graph.config.get("reduce_dtype", "float32")].itemsize
    return sum(
        _elements(graph.nodes[s.placeholder].shapes[0]) * fsdp * reduce
        for s in graph.inputs
        if s.kind == "param"
    )


class StageCache:
    """What pipelines over the same stage graph objects share: each graph's di/dw split, its
    estimators and its costs per policy. A planner keeps one per group of layouts sharing
    graphs and drops it with them; a `PipelineModel` alone gets its own."""

    def __init__(self) -> None:
        # by id, each entry holding its graph: an id is not reused while the graph lives
        self._split: dict[int, tuple[JointGraph, JointGraph]] = {}
        self._estimators: dict[tuple[int, Any], tuple[JointGraph, Estimator]] = {}
        self.costs: dict[tuple[int, str], tuple[StageCost, Estimate]] = {}

    def split(self, graph: JointGraph) -> JointGraph:
        if id(graph) not in self._split:
            self._split[id(graph)] = (graph, split_di_dw(graph))
        return self._split[id(graph)][1]

    def estimator(
        self,
        graph: JointGraph,
        profile: str,
        optimizer: OptimizerName,
        overlap: OverlapOptions | None,
    ) -> Estimator:
        key = (id(graph), (profile, optimizer, overlap))
        if key not in self._estimators:
            estimator = Estimator(graph, profiles=[profile], optimizer=optimizer, overlap=overlap)
            self._estimators[key] = (graph, estimator)
        return self._estimators[key][1]


@dataclass
class PipelineEstimate:
    """Figures of one pipelined step: each stage's graph estimate and cost, the schedule's
    simulation (per-rank peaks, in-flight microbatches, bubbles, step time)."""

    layout: StageLayout
    estimates: list[Estimate]
    costs: list[StageCost]
    schedule: ScheduleResult
    profile: str
    tokens: int  # per step of one pipeline (its local batch)
    gpus: int  # sharing one rank's tokens: pp x tp (x cp)

    @property
    def peak_bytes(self) -> int:
        return self.schedule.peak_bytes

    @property
    def tokens_per_second_per_gpu(self) -> float:
        step = self.schedule.step_seconds
        return self.tokens / step / self.gpus if step > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        stages = []
        ranks = {r.rank: r for r in self.schedule.ranks}
        for row, cost, est in zip(self.schedule.stages, self.costs, self.estimates, strict=True):
            stage = row.stage
            stages.append(
                {
                    "stage": stage,
                    "rank": row.rank,
                    "peak_bytes": row.peak_bytes,
                    "inflight_microbatches": row.inflight_microbatches,
                    "bubble_seconds": ranks[row.rank].bubble_seconds,
                    "bubble_fraction": ranks[row.rank].bubble_fraction,
                    "layers": list(self.layout.layers[stage]),
                    "resident_bytes": cost.resident_bytes,
                    "grad_bytes": cost.grad_bytes,
                    "microbatch_bytes": cost.phases["F"].residue_bytes,
                    "saved_activation_bytes": est.saved_activation_bytes,
                    "recompute_flops": est.recompute_flops,
                    "phase_seconds": {k: p.seconds for k, p in cost.phases.items()},
                }
            )
        return {
            "peak_bytes": self.peak_bytes,
            "profile": self.profile,
            "pipeline": self.layout.to_json(),
            "stages": stages,
            "ranks": [
                {k: v for k, v in r.to_json().items() if k != "timeline"}
                for r in self.schedule.ranks
            ],
            "est_step_seconds": self.schedule.step_seconds,
            "est_tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
        }


def _check_stages(graphs: Sequence[JointGraph], layout: StageLayout) -> None:
    """The arguments of `PipelineModel`: a StageLayout and its stage graphs, in stage order.
    Each graph says which stage it was traced for: one stands for stage i if it is stage
    i's, or alike (as many layers, the same first/last role: a planner traces alike middle
    stages once); another order would pair a stage's graph with another's place."""
    check_type("layout", layout, StageLayout, "a StageLayout (Pipeline.layout)")
    check_type("graphs", graphs, (list, tuple), "a list of stage graphs")
    if len(graphs) != layout.n_stages:
        raise WorkbenchError(
            f"a pipeline of {layout.n_stages} stages needs a graph per stage, got {len(graphs)}"
        )
    last = layout.n_stages - 1
    for i, graph in enumerate(graphs):
        check_type(f"graphs[{i}]", graph, JointGraph, "a JointGraph (trace_stages)")
        stage = graph.config.get("stage")
        if not isinstance(stage, dict):
            raise WorkbenchError(f"graphs[{i}] is no stage's graph: trace it with trace_stages")
        role = (len(stage.get("layers", ())), stage.get("first"), stage.get("last"))
        if stage.get("stage") != i and role != (len(layout.layers[i]), i == 0, i == last):
            raise WorkbenchError(
                f"graphs[{i}] is the graph of stage {stage.get('stage')}: give the stage "
                "graphs in stage order, as trace_stages returns them"
            )


class PipelineModel:
    """The estimators of a pipeline's stage graphs (split into input and weight gradients
    for zero-bubble schedules) over its schedule: `estimate(policies)` is the what-if."""

    def __init__(
        self,
        graphs: Sequence[JointGraph],
        layout: StageLayout,
        profile: str = "h100",
        optimizer: OptimizerName = "adamw",
        overlap: OverlapOptions | None = None,
        cache: StageCache | None = None,
    ) -> None:
        _check_stages(graphs, layout)
        self.layout = layout
        self.order = action_order(layout.pipeline.schedule, layout.pipeline.pp, layout.microbatches)
        check_order(self.order, layout.microbatches)
        self.walk = ScheduleWalk.of(self.order)  # walked once, simulated for every policy
        kinds = {a.kind for actions in self.order.values() for a in actions}
        self.cache = cache or StageCache()
        self.graphs = [self.cache.split(g) if "W" in kinds else g for g in graphs]
        self.profile = get_profile(profile).name
        self.estimators = [
            self.cache.estimator(g, self.profile, optimizer, overlap) for g in self.graphs
        ]
        device = get_profile(profile)
        ranks = int(graphs[0].config.get("world_size", 1))
        self.p2p_bytes_per_s = (
            device.inter_node_bytes_per_s
            if ranks >= device.ranks_per_node
            else device.intra_node_bytes_per_s
        )
        # torchtitan's tokens/s/GPU: a rank's tokens over the ranks sharing them (all but
        # the data-parallel ones: pp x tp x cp)
        self.gpus = layout.pipeline.pp * ranks // int(graphs[0].config.get("fsdp", 1))
        seq = int(graphs[0].config.get("seq", 0)) or graphs[0].tokens
        self.tokens = int(graphs[0].config.get("local_batch", 1)) * seq

    def stage_cost(
        self, stage: int, policy: Policy, policy_key: str | None = None
    ) -> tuple[StageCost, Estimate]:
        """Stage `stage`'s cost and estimate for `policy` (`policy_key`: its JSON, when the
        caller has it), kept per graph and policy: a search asks again, and stages sharing a
        graph (alike middle stages) share them."""
        graph, estimator = self.graphs[stage], self.estimators[stage]
        key = (id(estimator), policy_key or policy.key())
        if key not in self.cache.costs:
            estimate = estimator.estimate(policy)
            cost = stage_cost(graph, estimate, estimator, self.profile, stage)
            self.cache.costs[key] = (cost, estimate)
        cost, estimate = self.cache.costs[key]
        return (cost if cost.stage == stage else replace(cost, stage=stage)), estimate

    def estimate(self, policies: Policy | Sequence[Policy]) -> PipelineEstimate:
        """One policy for every stage, or one per stage (in stage order)."""
        chosen = [policies] * self.layout.n_stages if isinstance(policies, Policy) else policies
        if len(chosen) != self.layout.n_stages:
            raise WorkbenchError(
                f"give one policy, or one per stage ({self.layout.n_stages}); got {len(chosen)}"
            )
        keys = {id(p): p.key() for p in chosen}  # a search hands the same few around
        figures = [self.stage_cost(s, p, keys[id(p)]) for s, p in enumerate(chosen)]
        costs = {cost.stage: cost for cost, _ in figures}
        result = simulate(self.walk, costs, p2p_bytes_per_s=self.p2p_bytes_per_s)
        return PipelineEstimate(
            layout=self.layout,
            estimates=[e for _, e in figures],
            costs=[c for c, _ in figures],
            schedule=result,
            profile=self.profile,
            tokens=self.tokens,
            gpus=self.gpus,
        )
