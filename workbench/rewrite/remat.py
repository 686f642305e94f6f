"""Graph rematerialization: tag a copy of the joint graph, run torch's own remat pass, then
the offload pass for the activations the policy offloads.

Entry points: `tag_graph(graph, decisions) -> GraphModule` and `remat(graph, policy) ->
RematResult`. The JointGraph is never modified: torch's pass rewrites the tags it reads.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (  # noqa: E501
    remat_using_tags_for_fwd_loss_bwd_graph,
)

from workbench.capture.graph import JointGraph, short_op
from workbench.decide.decider import Decisions, decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.rewrite.index import graph_index
from workbench.rewrite.offload import OffloadReport, offload_pass
from workbench.rewrite.placement import OFFLOAD_META

RECOMPUTED_SUFFIX = "_recomputed"


class RematWarning(UserWarning):
    """The policy asked for recomputation that the rewritten graph does not do."""


@dataclass
class RematReport:
    """What the remat pass did. Saved: the storages of forward nodes that backward (or a
    recomputed copy) reads, by the node owning each (`GraphIndex.saved_by_node`), before
    the pass (what autograd keeps) and after it."""

    tagged_save: int
    tagged_recompute: int
    recomputed_nodes: list[str]
    saved_bytes_by_node_before: dict[str, int]
    saved_bytes_by_node_after: dict[str, int]
    forced: dict[str, str]
    problems: list[str] = field(default_factory=list)
    offload: OffloadReport | None = None  # what the offload pass did, when the policy offloads

    @property
    def saved_before(self) -> list[str]:
        return list(self.saved_bytes_by_node_before)

    @property
    def saved_after(self) -> list[str]:
        return list(self.saved_bytes_by_node_after)

    @property
    def saved_bytes_before(self) -> int:
        return sum(self.saved_bytes_by_node_before.values())

    @property
    def saved_bytes_after(self) -> int:
        return sum(self.saved_bytes_by_node_after.values())

    @property
    def bytes_no_longer_saved(self) -> int:
        """Bytes autograd would keep that the rewritten graph no longer keeps."""
        after = self.saved_bytes_by_node_after
        return sum(max(0, b - after.get(n, 0)) for n, b in self.saved_bytes_by_node_before.items())

    def to_json(self) -> dict[str, Any]:
        return {
            "tagged_save": self.tagged_save,
            "tagged_recompute": self.tagged_recompute,
            "recomputed_nodes": len(self.recomputed_nodes),
            "saved_before": len(self.saved_before),
            "saved_after": len(self.saved_after),
            "saved_bytes_before": self.saved_bytes_before,
            "saved_activation_bytes": self.saved_bytes_after,
            "bytes_no_longer_saved": self.bytes_no_longer_saved,
            "forced_saves": len(self.forced),
            "problems": self.problems,
            "offload": self.offload.to_json() if self.offload is not None else None,
        }


@dataclass
class RematResult:
    gm: fx.GraphModule
    decisions: Decisions
    report: RematReport

    def run(self, inputs: list[Any]) -> list[torch.Tensor]:
        """Execute under no_grad: the graph holds the backward; autograd must not."""
        with torch.no_grad():
            return list(self.gm(*inputs))


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule whose nodes have their own (shallow-copied) meta dicts."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


def returning(gm: fx.GraphModule, names: Iterable[str]) -> fx.GraphModule:
    """A copy of `gm` that also returns its nodes `names`, after its own outputs: they live
    until the step returns, as a runtime that keeps the backward's inputs to its end does
    (`Estimator.backward_input_nodes`, `backward_inputs="held"`)."""
    wanted = set(names)
    held = copy_graph_module(gm)
    nodes = [n for n in held.graph.nodes if n.name in wanted]
    missing = wanted - {n.name for n in nodes}
    if missing:
        raise WorkbenchError(f"returning: the graph has no node {', '.join(sorted(missing))}")
    output = held.graph.output_node()
    output.args = (tuple(output.args[0]) + tuple(nodes),)  # type: ignore[arg-type]
    held.recompile()
    return held


def tag_graph(graph: JointGraph, decisions: Decisions) -> fx.GraphModule:
    """A copy of the joint graph with `meta["recompute"]` set from `decisions`.

    On entry: `decisions` names forward or loss nodes of `graph` (as `decide` returns them).
    Returns a new GraphModule (the JointGraph is untouched) whose tagged nodes carry their
    `CheckpointPolicy`; every other node's tag is removed. Raises `WorkbenchError` for a
    decision on a backward node."""
    gm = copy_graph_module(graph.gm)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        decision = decisions.get(node.name)
        if decision is not None:
            if graph.nodes[node.name].phase == "backward":
                raise WorkbenchError(f"refusing to tag backward node {node.name!r}")
            node.meta["recompute"] = decision.policy
    return gm


def remat(
    graph: JointGraph, policy: Policy | Decisions, offload: OffloadOptions | None = None
) -> RematResult:
    """Tag, run `remat_using_tags_for_fwd_loss_bwd_graph`, then `offload_pass` on the nodes
    tagged offload (with the policy's offload options, or `offload` for bare decisions), and
    report what changed.

    On entry: `graph` as traced (backward nodes carry `meta["autograd_backward"]`, every node
    `meta[ORIGIN_KEY]`); a `Policy` is decided here, bare `Decisions` are taken as they are.
    Returns a `RematResult`: the rewritten GraphModule (run it under no_grad: it holds the
    backward), the decisions, and a `RematReport` (saved bytes as torch's pass leaves them,
    before offload; problems, each also warned as `RematWarning`). The JointGraph is never
    changed. Raises `WorkbenchError`, with torch's first line, when torch's pass refuses."""
    decisions = decide(graph, policy) if isinstance(policy, Policy) else policy
    if offload is None:
        offload = policy.offload if isinstance(policy, Policy) else OffloadOptions()
    gm = tag_graph(graph, decisions)
    try:
        out = remat_using_tags_for_fwd_loss_bwd_graph(gm)
    except RuntimeError as err:
        raise WorkbenchError(
            f"torch's remat pass refused the tagged graph of {graph.model_name!r}: "
            f"{str(err).splitlines()[0]}"
        ) from None
    recomputed = [
        n.name.removesuffix(RECOMPUTED_SUFFIX)
        for n in out.graph.nodes
        if n.name.endswith(RECOMPUTED_SUFFIX)
    ]
    index = graph_index(graph)
    rewritten = index.order_of(out)
    before = index.saved_by_node(index.identity())
    after = index.saved_by_node(rewritten)
    report = RematReport(
        tagged_save=sum(not d.recompute for d in decisions.values()),
        tagged_recompute=sum(d.recompute for d in decisions.values()),
        recomputed_nodes=recomputed,
        saved_bytes_by_node_before=before,
        saved_bytes_by_node_after=after,
        forced={n: d.reason for n, d in decisions.items() if d.forced},
    )
    read = index.read_directly(index.identity())
    wanted = {n for n in read if decisions.get(n) is not None and decisions[n].recompute}
    if wanted and not recomputed:
        report.problems.append(
            f"policy tags {len(wanted)} saved activations for recompute, but the remat pass "
            "recomputed nothing: check that backward nodes carry autograd_backward"
        )
    still_saved = sorted(wanted & index.read_directly(rewritten))
    if still_saved:
        report.problems.append(
            f"{len(still_saved)} activations tagged recompute are still saved "
            f"(e.g. {', '.join(still_saved[:3])})"
        )
    offloaded = [n for n, d in decisions.items() if d.offload]
    if offloaded:
        out = offload_pass(out, offloaded, lambda node: _layer(graph, node), offload)
        report.offload = out.meta[OFFLOAD_META]  # its `skipped` says what stayed and why
    for problem in report.problems:
        warnings.warn(problem, RematWarning, stacklevel=2)
    return RematResult(gm=out, decisions=decisions, report=report)


def _layer(graph: JointGraph, node: fx.Node) -> int | None:
    """The layer of the traced node a node of the rewritten graph comes from."""
    info = graph.traced_info(node)
    return info.layer if info is not None else None


@dataclass
class RegionSummary:
    """What a rematerialized graph keeps for backward and recomputes inside one module
    subtree: node names in graph order, bytes kept, and the ops recomputed (short names)."""

    module: str
    kept: list[str]
    kept_bytes: int
    recomputed: list[str]
    recomputed_ops: list[str]

    def line(self, graph: JointGraph) -> str:
        kept = ", ".join(f"{n} {short_op(graph.nodes[n].op)}" for n in self.kept) or "-"
        ops = ", ".join(self.recomputed_ops) or "-"
        return f"kept: {kept} | recomputed: {len(self.recomputed)} nodes ({ops})"


def region_summary(graph: JointGraph, result: RematResult, module: str) -> RegionSummary:
    """Kept activations and recomputed nodes of `result` whose module is `module` or below."""

    def inside(name: str) -> bool:
        info = graph.nodes.get(name)
        return info is not None and (info.module == module or info.module.startswith(module + "."))

    after = result.report.saved_bytes_by_node_after
    kept = [n for n in after if inside(n)]
    recomputed = [n for n in result.report.recomputed_nodes if inside(n)]
    ops = sorted({short_op(graph.nodes[n].op) for n in recomputed})
    return RegionSummary(module, kept, sum(after[n] for n in kept), recomputed, ops)
