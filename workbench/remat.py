"""Graph rematerialization: tag a copy of the joint graph, run torch's own remat pass.

Entry points: `tag_graph(graph, decisions) -> GraphModule` and `remat(graph, policy) ->
RematResult`. The JointGraph is never modified: torch's pass rewrites the tags it reads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (  # noqa: E501
    remat_using_tags_for_fwd_loss_bwd_graph,
)

from workbench.errors import WorkbenchError
from workbench.graph import JointGraph, short_op
from workbench.policy import Decisions, Policy, decide

RECOMPUTED_SUFFIX = "_recomputed"


class RematWarning(UserWarning):
    """The policy asked for recomputation that the rewritten graph does not do."""


@dataclass
class RematReport:
    """What the remat pass did. Saved = forward outputs that backward reads."""

    tagged_save: int
    tagged_recompute: int
    recomputed_nodes: list[str]
    saved_before: list[str]
    saved_after: list[str]
    saved_bytes_before: int
    saved_bytes_after: int
    bytes_no_longer_saved: int
    forced: dict[str, str]
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "tagged_save": self.tagged_save,
            "tagged_recompute": self.tagged_recompute,
            "recomputed_nodes": len(self.recomputed_nodes),
            "saved_before": len(self.saved_before),
            "saved_after": len(self.saved_after),
            "saved_bytes_before": self.saved_bytes_before,
            "saved_bytes_after": self.saved_bytes_after,
            "bytes_no_longer_saved": self.bytes_no_longer_saved,
            "forced_saves": len(self.forced),
            "problems": self.problems,
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


def tag_graph(graph: JointGraph, decisions: Decisions) -> fx.GraphModule:
    """Copy of the joint graph with `meta["recompute"]` set on forward nodes only."""
    gm = copy_graph_module(graph.gm)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        decision = decisions.get(node.name)
        if decision is not None:
            if graph.nodes[node.name].phase == "backward":
                raise WorkbenchError(f"refusing to tag backward node {node.name!r}")
            node.meta["recompute"] = decision.policy
    return gm


def saved_activations(graph: JointGraph, gm: fx.GraphModule | None = None) -> list[str]:
    """Forward nodes of `gm` (default: the joint graph) whose outputs backward reads.

    Backward is known from the JointGraph's phases, not only from node.meta, so a graph
    whose autograd_backward marks went missing still shows what it saves.
    """
    gm = graph.gm if gm is None else gm

    def backward(node: fx.Node) -> bool:
        info = graph.nodes.get(node.name)
        return bool(node.meta.get("autograd_backward")) or (
            info is not None and info.phase == "backward"
        )

    return [
        node.name
        for node in gm.graph.nodes
        if node.op not in ("placeholder", "output")
        and not backward(node)
        and any(backward(user) for user in node.users)
    ]


def _bytes(graph: JointGraph, names: list[str]) -> int:
    """Output bytes of forward nodes (views counted at their size: an upper bound)."""
    return sum(graph.nodes[n].bytes for n in names)


def remat(graph: JointGraph, policy: Policy | Decisions) -> RematResult:
    """Tag, run `remat_using_tags_for_fwd_loss_bwd_graph`, and report what changed."""
    decisions = decide(graph, policy) if isinstance(policy, Policy) else policy
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
    before, after = saved_activations(graph), saved_activations(graph, out)
    after_set = set(after)
    freed = _bytes(graph, [n for n in before if n not in after_set])
    report = RematReport(
        tagged_save=sum(not d.recompute for d in decisions.values()),
        tagged_recompute=sum(d.recompute for d in decisions.values()),
        recomputed_nodes=recomputed,
        saved_before=before,
        saved_after=after,
        saved_bytes_before=_bytes(graph, before),
        saved_bytes_after=_bytes(graph, after),
        bytes_no_longer_saved=freed,
        forced={n: d.reason for n, d in decisions.items() if d.forced},
    )
    wanted = {n for n in before if decisions.get(n) is not None and decisions[n].recompute}
    if wanted and not recomputed:
        report.problems.append(
            f"policy tags {len(wanted)} saved activations for recompute, but the remat pass "
            "recomputed nothing: check that backward nodes carry autograd_backward"
        )
    still_saved = sorted(wanted & after_set)
    if still_saved:
        report.problems.append(
            f"{len(still_saved)} activations tagged recompute are still saved "
            f"(e.g. {', '.join(still_saved[:3])})"
        )
    for problem in report.problems:
        warnings.warn(problem, RematWarning, stacklevel=2)
    return RematResult(gm=out, decisions=decisions, report=report)


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

    kept = [n for n in result.report.saved_after if inside(n)]
    recomputed = [n for n in result.report.recomputed_nodes if inside(n)]
    ops = sorted({short_op(graph.nodes[n].op) for n in recomputed})
    return RegionSummary(module, kept, _bytes(graph, kept), recomputed, ops)
