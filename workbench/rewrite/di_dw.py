"""Input gradients first, weight gradients after: a stage's backward as zero-bubble
schedules run it (torch's `I` and `W` actions; graph trainer's `graph_pp.split_di_dw`).

Entry point: `split_di_dw(graph) -> JointGraph`, the same nodes reordered so every op the
gradient of the stage's received input needs runs before the ops only parameter gradients
need; `graph.config["weight_grads_from"]` names the first of the latter (None: no such op).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from workbench.capture.graph import JointGraph
from workbench.errors import WorkbenchError

__all__ = ["WEIGHT_GRADS_FROM", "split_di_dw", "weight_grad_nodes"]

WEIGHT_GRADS_FROM = "weight_grads_from"


def weight_grad_nodes(graph: JointGraph) -> set[str]:
    """Backward ops no input gradient depends on: what a `W` action computes. The input
    gradient is the stage's last output (`workbench.capture.stages`); on the first stage,
    which receives token ids, every backward op is one."""
    stage = graph.config.get("stage")
    if stage is None:
        raise WorkbenchError(
            f"{graph.model_name!r} is not a pipeline stage (trace it with --pp): only a stage "
            "splits its backward into input and weight gradients"
        )
    outputs = graph.gm.graph.output_node().args[0]
    assert isinstance(outputs, list | tuple)
    needed: set[fx.Node] = set()
    if not stage["first"]:
        todo = [outputs[-1]]
        while todo:
            node = todo.pop()
            if isinstance(node, fx.Node) and node not in needed:
                needed.add(node)
                todo.extend(node.all_input_nodes)
    needed_names = {n.name for n in needed}
    return {
        name
        for name, info in graph.nodes.items()
        if info.phase == "backward" and name not in needed_names
    }


def split_di_dw(graph: JointGraph) -> JointGraph:
    """The stage's graph with its weight-gradient ops moved after all others (a valid order:
    nothing an input gradient needs reads them). Node names, facts and meta are unchanged."""
    weights = weight_grad_nodes(graph)
    nodes = list(graph.gm.graph.nodes)
    phase = {n: graph.nodes[n.name].phase for n in nodes}
    first = next((i for i, n in enumerate(nodes) if phase[n] == "backward"), len(nodes))
    # ops made after the backward began that no backward op reads (the loss's final view)
    # stay after it: one backward region, as torch's remat pass needs
    late = {
        n
        for n in nodes[first:-1]
        if phase[n] != "backward" and all(phase[u] != "backward" for u in n.users)
    }
    order = [n for n in nodes[:-1] if n.name not in weights and n not in late]
    order += [n for n in nodes if n.name in weights]
    order += [n for n in nodes if n in late] + [nodes[-1]]
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in order:
        env[node] = new.node_copy(node, lambda n: env[n])
    with _use_lazy_graph_module(True):  # its code is generated when first run, if ever
        gm = _make_graph_module(graph.gm, new)
    first_weight = next((n.name for n in order if n.name in weights), None)
    return dataclasses.replace(
        graph,
        gm=gm,
        nodes={n.name: graph.nodes[n.name] for n in order},
        config={**graph.config, WEIGHT_GRADS_FROM: first_weight},
    )
