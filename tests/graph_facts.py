"""Test helper: forward nodes a graph's backward reads directly (its data edges only)."""

from __future__ import annotations

import torch.fx as fx

from workbench.capture.graph import JointGraph


def read_by_backward(graph: JointGraph, gm: fx.GraphModule | None = None) -> set[str]:
    """Forward and loss nodes of `gm` (default: the joint graph) with a backward user."""

    def backward(node: fx.Node) -> bool:
        info = graph.nodes.get(node.name)
        return bool(node.meta.get("autograd_backward")) or (
            info is not None and info.phase == "backward"
        )

    return {
        node.name
        for node in (gm or graph.gm).graph.nodes
        if node.op not in ("placeholder", "output")
        and not backward(node)
        and any(backward(user) for user in node.users)
    }
