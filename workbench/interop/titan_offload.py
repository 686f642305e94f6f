"""Offload placement parity: graph trainer's CPU offload pass against the workbench's, on one
rematerialized graph.

Entry points: `offload_passes(graph, policy)` (both passes, for the policy's prefetch and
defer), `offload_mismatches(passes)` (each step the two put after different nodes, named by
its row of `OFFLOAD_PLACEMENT`: where the two differ, and why).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models.torchtitan import torchtitan_log
from workbench.decide.decider import decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.interop.titan import (
    MODULE_FQN,
    Difference,
    graph_trainer_registry,
)
from workbench.rewrite.offload import offload_pass
from workbench.rewrite.placement import OFFLOAD_META, REPLAYED_VIEW, is_offload_node
from workbench.rewrite.remat import copy_graph_module, remat

__all__ = [
    "OFFLOAD_PLACEMENT",
    "STEP_NAMES",
    "OffloadMismatch",
    "OffloadPasses",
    "OffloadSteps",
    "offload_mismatches",
    "offload_passes",
]

# Where graph trainer's offload pass places the steps otherwise than the workbench's
# `offload_pass` for the same options, on the same graph (`offload_mismatches` names the
# row behind each step it finds apart; docs/torchtitan.md shows it as
# `differences_table(OFFLOAD_PLACEMENT)`).
# With defer >= 1 and prefetch 0 the two agree step for step on both Llama3 debug models.
OFFLOAD_PLACEMENT: tuple[Difference, ...] = (
    Difference(
        key="defer 0",
        rule="`defer_layers` 0 (`cpu_offload_defer_n_layers 0`)",
        workbench="the device original is freed right after its last forward reader, found "
        "through every alias of its storage",
        graph_trainer="0.3.0's pass refuses the graph: its free is left right after the copy "
        "but names that reader as `last_use_of_storage`, and its own lint fails; sorted, the "
        "free would follow the reader's first getitem, and its alias walk stops at ops "
        "outside its view list (`unbind`, `split_with_sizes`), so q/k/v views of a matmul "
        "would still be read after the free",
        why="torchtitan 0.3.0 cannot run defer 0, so the export asks it for 1 (freed at the "
        "end of the layer after the producer's: more device memory than the workbench's 0); "
        "the workbench's rule frees as early as is safe",
        scope="offloading",
    ),
)


class OffloadSteps(NamedTuple):
    """Where one offloaded value's four steps land: for each, the name of the node of the
    rematerialized graph it follows (the other offload steps and the views replayed on
    reloads are not nodes of that graph, so they do not count)."""

    copy: str
    free: str
    reload: str
    wait: str


STEP_NAMES = OffloadSteps._fields


@dataclass(frozen=True)
class OffloadPasses:
    """One rematerialized graph offloaded by each pass: `workbench` by `offload_pass`,
    `graph_trainer` by `apply_cpu_offload_pass` (its replayed views marked as ours, so
    `Estimator.order_of` reads both), the values offloaded with the layers of each one's
    producer and first backward reader, the options, and `refused`: graph trainer's own
    error when its pass refused the graph (its closing lint), which was then sorted as its
    bucketing pass would sort it, to show where it meant the steps to go."""

    workbench: fx.GraphModule
    graph_trainer: fx.GraphModule
    # offloaded node -> layers of (producer, first backward reader; the producer's where the
    # reader is outside the layers): what prefetch is counted from and where it is needed
    layers: dict[str, tuple[int | None, int | None]]
    options: OffloadOptions
    refused: str | None = None

    def landings(self) -> tuple[dict[str, OffloadSteps], dict[str, OffloadSteps]]:
        """Per offloaded node, the nodes its steps follow: the workbench's, graph trainer's."""
        return _steps(self.workbench, list(self.layers)), _steps(
            self.graph_trainer, list(self.layers)
        )


@dataclass(frozen=True)
class OffloadMismatch:
    """A step of an offloaded value that the two passes put after different nodes, and the
    key of the `OFFLOAD_PLACEMENT` row that explains it (`unexplained` if none does)."""

    node: str
    step: str
    workbench: str
    graph_trainer: str
    difference: str


def offload_mismatches(passes: OffloadPasses) -> list[OffloadMismatch]:
    """Every step the two passes place apart, by offloaded node then step, each named by
    its row of `OFFLOAD_PLACEMENT`. Steps sharing a gap between two nodes may run in another
    order there: that moves no device memory (only reloads allocate, only in backward)."""
    ours, theirs = passes.landings()
    result = []
    for name in passes.layers:
        for step, a, b in zip(STEP_NAMES, ours[name], theirs[name], strict=True):
            if a == b:
                continue
            if step == "free" and passes.refused is not None:
                key = "defer 0"
            else:
                key = "unexplained"
            result.append(OffloadMismatch(name, step, a, b, key))
    return result


def offload_passes(graph: JointGraph, policy: Policy | str) -> OffloadPasses:
    """Both offload passes, for the policy's prefetch/defer options, on the same graph:
    torch's remat pass run on the policy's decisions (offloads saved), then each pass on a
    copy, graph trainer's on the values the workbench's offloaded, tagged MUST_CPU_OFFLOAD
    again (torch's remat pass rewrites those tags to MUST_SAVE). Graph trainer runs its pass
    before its own remat pass; one graph keeps placement apart from the remat passes'
    differences, so the what-if can price each placement rule."""
    graph_trainer_registry()  # a clear error without torchtitan
    policy = policy if isinstance(policy, Policy) else Policy(policy)
    decisions = decide(graph, policy)
    saved = {
        name: tag._replace(policy=CheckpointPolicy.MUST_SAVE) if tag.offload else tag
        for name, tag in decisions.items()
    }
    base = remat(graph, saved).gm
    layer_of = {
        node.name: getattr(graph.traced_info(node), "layer", None) for node in base.graph.nodes
    }
    ours = offload_pass(
        copy_graph_module(base),
        [name for name, tag in decisions.items() if tag.offload],
        lambda node: layer_of[node.name],
        policy.offload,
    )
    report = ours.meta[OFFLOAD_META]
    offloaded = report.names
    nodes = [node.name for node in base.graph.nodes]
    layers = {}
    for name, value in zip(offloaded, report.values, strict=True):
        producer, reader = (
            layer_of[nodes[value.producer]],
            layer_of[nodes[value.first_backward_use]],
        )
        layers[name] = (producer, producer if reader is None else reader)
    theirs = copy_graph_module(base)
    for node in theirs.graph.nodes:
        node.meta.pop("recompute", None)
        module = getattr(graph.traced_info(node), "module", "")
        node.meta["custom"] = {**(node.meta.get("custom") or {}), MODULE_FQN: module}
        if node.name in offloaded:
            node.meta["recompute"] = CheckpointPolicy.MUST_CPU_OFFLOAD
    refused = _graph_trainer_offload(theirs, policy.offload)
    for node in theirs.graph.nodes:
        if node.name not in layer_of and not is_offload_node(node):
            node.meta[REPLAYED_VIEW] = True
    return OffloadPasses(ours, theirs, layers, policy.offload, refused)


def _graph_trainer_offload(gm: fx.GraphModule, options: OffloadOptions) -> str | None:
    """Run `apply_cpu_offload_pass` on `gm`. With defer 0 its forward wait stays right after
    the copy but names the last forward reader as `last_use_of_storage`, and its closing
    lint refuses the graph: return that error, the graph sorted as graph trainer's
    bucketing pass sorts (`_stable_topological_sort`, which puts the wait right after that
    reader)."""
    from torch._dynamo.graph_deduplication import _stable_topological_sort
    from torchtitan.experiments.graph_trainer.cpu_offload import apply_cpu_offload_pass

    try:
        with torchtitan_log(logging.WARNING):
            apply_cpu_offload_pass(
                gm,
                prefetch_lookahead=options.prefetch_layers,
                defer_n_layers=options.defer_layers,
            )
    except RuntimeError as err:
        if "topologically ordered" not in str(err):
            raise
        _stable_topological_sort(gm.graph, {})
        gm.graph.lint()
        gm.recompile()
        return str(err).splitlines()[0]
    return None


def _steps(gm: fx.GraphModule, offloaded: list[str]) -> dict[str, OffloadSteps]:
    """For each offloaded node, the node of the rematerialized graph each of its steps
    follows in `gm`: the copy reads the node, the free waits on the copy, the reload reads
    the free's host tensor and the wait reads the reload."""
    follows: dict[fx.Node, str] = {}
    last = ""
    for node in gm.graph.nodes:
        if is_offload_node(node) or node.meta.get(REPLAYED_VIEW):
            follows[node] = last
        else:
            last = node.name

    def step(node: fx.Node, op: str) -> fx.Node:
        return next(u for u in node.users if is_offload_node(u) and u.target._opname == op)  # type: ignore[union-attr]

    by_name = {n.name: n for n in gm.graph.nodes}
    result = {}
    for name in offloaded:
        copy = step(by_name[name], "offload")
        free = step(copy, "wait_tensor")
        reload = step(free, "reload")
        wait = step(reload, "wait_tensor")
        result[name] = OffloadSteps(*(follows[s] for s in (copy, free, reload, wait)))
    return result
