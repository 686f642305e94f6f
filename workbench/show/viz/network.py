"""The joint graph as a networkx DiGraph, for analyses the workbench does not ship.

Entry point: `to_networkx(graph, decisions=None, gm=None)`; `forward_side(info)`,
`is_recompute` and `is_offload` are shared with the pictures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch.fx as fx

from workbench.capture.graph import JointGraph, NodeInfo
from workbench.decide.decider import Decisions
from workbench.rewrite.remat import RECOMPUTED_SUFFIX

__all__ = [
    "DiffRow",
    "forward_side",
    "is_offload",
    "is_recompute",
    "node_facts",
    "original_of",
    "to_networkx",
]


def forward_side(info: NodeInfo) -> bool:
    """Forward and loss ops: the ones whose outputs are saved or recomputed."""
    return info.phase in ("forward", "loss")


def original_of(name: str) -> str | None:
    """`mm_3_recomputed` -> `mm_3`; None for nodes that are not remat copies."""
    return name.removesuffix(RECOMPUTED_SUFFIX) if name.endswith(RECOMPUTED_SUFFIX) else None


def node_facts(graph: JointGraph, name: str) -> NodeInfo | None:
    """NodeInfo of a node, or of its original for a `*_recomputed` copy."""
    info = graph.nodes.get(name)
    original = original_of(name)
    if info is None and original is not None:
        info = graph.nodes.get(original)
    return info


def to_networkx(
    graph: JointGraph, decisions: Decisions | None = None, gm: fx.GraphModule | None = None
) -> nx.DiGraph:
    """One networkx node per FX node, keyed by name, with every NodeInfo field as an
    attribute plus `policy`, `reason`, `forced` (None when undecided).

    Edges follow data flow; `saved=True` marks forward->backward edges (an activation kept
    for backward). With `gm` (a remat output) the structure is gm's: its `*_recomputed`
    copies carry `original=NAME`, `recomputed=True`, phase "backward", and an edge
    `original -> copy` with `kind="recomputed_copy"` when the original is still there.
    """
    source = graph.gm if gm is None else gm
    decisions = decisions or {}
    out = nx.DiGraph(model=graph.model_name, mode=graph.mode, tokens=graph.tokens)
    phase: dict[str, str] = {}
    for node in source.graph.nodes:
        info = node_facts(graph, node.name)
        facts: dict[str, Any] = dataclasses.asdict(info) if info is not None else {}
        facts["name"] = node.name
        original = original_of(node.name) if node.name not in graph.nodes else None
        facts["original"] = original
        facts["recomputed"] = original is not None
        if original is not None or node.meta.get("autograd_backward"):
            facts["phase"] = "backward"
        decision = decisions.get(node.name)
        facts["policy"] = decision.policy.name if decision else None
        facts["reason"] = decision.reason if decision else None
        facts["forced"] = decision.forced if decision else None
        phase[node.name] = facts.get("phase", "forward")
        out.add_node(node.name, **facts)
    for node in source.graph.nodes:
        for user in node.users:
            saved = phase[node.name] in ("forward", "loss") and phase[user.name] == "backward"
            out.add_edge(node.name, user.name, saved=saved, kind="saved" if saved else "data")
    for name, facts in list(out.nodes(data=True)):
        original = facts["original"]
        if original is not None and original in out:
            out.add_edge(original, name, saved=False, kind="recomputed_copy")
    return out


def is_recompute(decisions: Decisions | None, name: str) -> bool:
    decision = (decisions or {}).get(name)
    return decision is not None and decision.recompute


def is_offload(decisions: Decisions | None, name: str) -> bool:
    """Tagged to be offloaded to host memory between forward and backward."""
    decision = decisions.get(name) if decisions else None
    return decision is not None and decision.offload


@dataclass(frozen=True)
class DiffRow:
    """One activation whose fate changed: `before`/`after` are `save`, `recompute` or
    `offload` for two policies, `kept`, `recomputed` or `not kept` for a graph before and
    after remat. `offloaded_bytes_delta`: bytes it moves to host memory, after minus before."""

    node: str
    module: str
    op: str
    layer: int | None
    before: str
    after: str
    bytes: int
    flops: int
    saved_bytes_delta: int
    recompute_flops_delta: int
    offloaded_bytes_delta: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
