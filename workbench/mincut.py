"""The other pass stack: AOTAutograd's min-cut partitioner with an activation memory budget.

Entry point: `min_cut_partition(workload, budget)` traces the same train step through
`aot_function` and returns the forward and backward graphs it chose, what the forward saves,
and what the backward replays; `saved_by_op` summarizes either stack's saves by op.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from workbench.graph import JointGraph, NodeInfo, describe_nodes, short_op
from workbench.index import distinct_storage_bytes
from workbench.models import Workload
from workbench.remat import RematResult


@dataclass
class Partition:
    """What the min-cut partitioner chose at one budget. `saved`: the forward's outputs that
    the backward reads (see `Saved`); `replayed`: backward nodes that depend on no incoming
    gradient, i.e. forward work recomputed in backward."""

    budget: float
    fw_gm: fx.GraphModule
    bw_gm: fx.GraphModule
    saved: Saved
    replayed: list[NodeInfo]
    step: Callable[[], list[torch.Tensor]]

    @property
    def recompute_flops(self) -> int:
        return sum(i.flops for i in self.replayed)


def saved_by_op(infos: Iterable[NodeInfo]) -> dict[str, tuple[int, int]]:
    """`op -> (count, bytes)` over saved tensors, largest bytes first, each at its own size.
    Views and getitems are named by what they are (`view`, `getitem`), not their source."""
    table: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for info in infos:
        row = table[short_op(info.op)]
        row[0] += 1
        row[1] += info.bytes
    return {op: (n, b) for op, (n, b) in sorted(table.items(), key=lambda kv: -kv[1][1])}


@dataclass
class Saved:
    """Tensors a forward keeps for backward: `activations`, and `aliases` (graph inputs such
    as parameters and tokens, or views of them like a weight's transpose: no memory of their
    own). `bytes`: the distinct storages behind the activations (a saved view of a saved
    tensor, or two views of one tensor, counted once)."""

    activations: list[NodeInfo]
    aliases: list[NodeInfo]
    bytes: int


def split_saved(gm: fx.GraphModule, infos: dict[str, NodeInfo], names: Iterable[str]) -> Saved:
    """Follow each saved tensor through view ops to the node that owns its storage."""
    nodes = {n.name: n for n in gm.graph.nodes}
    activations: list[NodeInfo] = []
    aliases: list[NodeInfo] = []
    for name in names:
        node = nodes[name]
        while node.op == "call_function" and infos[node.name].is_view and node.all_input_nodes:
            node = node.all_input_nodes[0]
        (aliases if node.op == "placeholder" else activations).append(infos[name])
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kept = distinct_storage_bytes([*inputs, *(nodes[i.name] for i in activations)])
    return Saved(activations, aliases, kept)


def graph_sac_saved(graph: JointGraph, result: RematResult) -> Saved:
    """What a graph SAC result keeps for backward."""
    return split_saved(result.gm, graph.nodes, result.report.saved_after)


def _replayed(bw_gm: fx.GraphModule, infos: dict[str, NodeInfo]) -> list[NodeInfo]:
    from_grad: set[fx.Node] = set()
    replayed = []
    for node in bw_gm.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                from_grad.add(node)
        elif node.op == "call_function":
            if any(a in from_grad for a in node.all_input_nodes):
                from_grad.add(node)
            else:
                replayed.append(infos[node.name])
    return replayed


def min_cut_partition(workload: Workload, budget: float = 1.0) -> Partition:
    """Trace loss(model(inputs)) with `aot_function` (parameters, buffers
    and the target as inputs), partition the
    joint graph with `min_cut_rematerialization_partition` under
    `torch._functorch.config.activation_memory_budget = budget` and capture both graphs.
    The returned `step()` runs the partitioned forward and backward for real (eager kernels)
    and returns `[loss, *grads]` in `model.parameters()` order, like `eager_step`."""
    assert workload.loss_fn is not None
    model, loss_fn = workload.model, workload.loss_fn
    params = [p for _, p in model.named_parameters()]
    buffers = [b for _, b in model.named_buffers()]
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    inputs, target = list(workload.inputs), workload.target
    captured: dict[str, fx.GraphModule] = {}

    def capture(kind: str, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        captured[kind] = gm
        return make_boxed_func(gm)

    def train_loss(*args: torch.Tensor) -> torch.Tensor:
        values = dict(zip(names, args[: len(names)], strict=True))
        out = torch.func.functional_call(model, values, tuple(args[len(names) : -1]))
        loss: torch.Tensor = loss_fn(out, args[-1])
        return loss

    compiled = aot_function(
        train_loss,
        fw_compiler=functools.partial(capture, "fw"),
        bw_compiler=functools.partial(capture, "bw"),
        partition_fn=min_cut_rematerialization_partition,
    )

    def step() -> list[torch.Tensor]:
        loss = compiled(*params, *buffers, *inputs, target)
        grads = torch.autograd.grad(loss, params)
        return [loss.detach(), *grads]

    with functorch_config.patch(activation_memory_budget=budget):
        step()  # traces and partitions on the first call
    fw_gm, bw_gm = captured["fw"], captured["bw"]
    fw_infos, bw_infos = describe_nodes(fw_gm), describe_nodes(bw_gm)
    outputs = next(n for n in fw_gm.graph.nodes if n.op == "output").args[0]
    names = [n.name for n in outputs[1:] if isinstance(n, fx.Node)]
    saved = split_saved(fw_gm, fw_infos, names)
    return Partition(budget, fw_gm, bw_gm, saved, _replayed(bw_gm, bw_infos), step)
