"""The other pass stack: AOTAutograd's min-cut partitioner with an activation memory budget.

Entry point: `min_cut_partition(workload, budget) -> Partition` traces the same train step
through `aot_function` (its `kept` and `replayed` say what the forward saves and the backward
replays); `graph_sac_saved` counts a graph SAC result alike; `saved_by_op` summarizes either.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from studies.partition import Partition, Saved, split_saved
from workbench.capture.graph import JointGraph, NodeInfo, short_op
from workbench.capture.workload import Workload
from workbench.rewrite.index import graph_index
from workbench.rewrite.remat import RematResult


def saved_by_op(infos: Iterable[NodeInfo]) -> dict[str, tuple[int, int]]:
    """`op -> (count, bytes)` over saved tensors, largest bytes first, each at its own size.
    Views and getitems are named by what they are (`view`, `getitem`), not their source."""
    table: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for info in infos:
        row = table[short_op(info.op)]
        row[0] += 1
        row[1] += info.bytes
    return {op: (n, b) for op, (n, b) in sorted(table.items(), key=lambda kv: -kv[1][1])}


def graph_sac_saved(graph: JointGraph, result: RematResult) -> Saved:
    """What a graph SAC result hands from forward to backward, as the partitioner's saved
    outputs are counted (the values backward reads, split into activations and aliases)."""
    return split_saved(result.gm, graph.nodes, read_by_backward(graph, result))


def read_by_backward(graph: JointGraph, result: RematResult) -> list[str]:
    """Forward nodes that the rewritten graph's backward reads directly, in graph order."""
    index = graph_index(graph)
    read = index.read_directly(index.order_of(result.gm))
    return [name for name in graph.nodes if name in read]


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
    forward_inputs = [*params, *buffers, *inputs, target]
    return Partition(captured["fw"], captured["bw"], 1, forward_inputs, budget=budget, step=step)
