"""A training step as torchtitan's compiler toolkit ran it (graph trainer's `aot` mode until it
traced the whole step): AOTAutograd exports the model's joint graph, joint passes tag it, torch's
default partitioner splits it, forward and backward run as FX GraphModules and the loss runs
eagerly between them. Measured for real on the CPU, beside the workbench's estimate of the same
tags: the check of `Estimator(backward_inputs=...)` and of the partition against a real run.

Entry points: `apply_sac(gm)` (the toolkit's `apply_sac` joint pass of 2026-02, a pass on an
AOTAutograd joint graph), `apply_sac_decisions(graph)` (its rule on the workbench's graph) and
`measure_toolkit_step(workload, tags, backward_inputs)`.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import (
    aot_compile_joint_with_descriptors,
    aot_export_joint_with_descriptors,
)
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.workload import Workload
from workbench.cost.estimate import BackwardInputs
from workbench.cost.measure import Measurement, measure_run
from workbench.decide.decider import Decisions, decide
from workbench.decide.policy import Policy
from workbench.decide.tags import Tag, Why

__all__ = ["APPLY_SAC_SAVE_OPS", "Tags", "apply_sac", "apply_sac_decisions", "measure_toolkit_step"]

Tags = Literal["none", "apply_sac"]

_aten = torch.ops.aten
# What `apply_sac` saves (torchtitan a764c981, compiler_toolkit/passes.py DEFAULT_SAC_SAVE_OPS)
# that a Llama step has, with the CPU's flash kernel standing for the GPU's attention kernels
# the list names (it is seeded: the partitioner would have to replay its random state).
APPLY_SAC_SAVE_OPS = frozenset(
    {
        _aten.mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_attention_math.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten.max.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)


def _apply_sac_policy(nodes: list[fx.Node]) -> dict[fx.Node, CheckpointPolicy]:
    """apply_sac's rule on forward ops in graph order: every second matmul of the whole step
    recomputed (its count never restarts), the save list saved, every other op recomputed;
    getitems untagged."""
    count, tags = 0, {}
    for node in nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if node.target is _aten.mm.default:
            count += 1
            saved = count % 2 == 1
        else:
            saved = node.target in APPLY_SAC_SAVE_OPS
        tags[node] = CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
    return tags


def apply_sac(gm: fx.GraphModule) -> fx.GraphModule:
    """The toolkit's `apply_sac` joint pass: its rule on every op up to the forward's first
    output (the logits), one AC region (`ac_graph_id` 0); the loss, outside the graph, is
    untouched."""
    nodes = list(gm.graph.nodes)
    logits = nodes[-1].all_input_nodes[0]
    forward = nodes[: nodes.index(logits) + 1]
    for node, policy in _apply_sac_policy(forward).items():
        node.meta["recompute"], node.meta["ac_graph_id"] = policy, 0
    gm.recompile()
    return gm


def apply_sac_decisions(graph: JointGraph) -> Decisions:
    """apply_sac's rule as decisions on the workbench's graph: its forward ops tagged in graph
    order, the loss's left as autograd keeps them (saved), forced tags kept."""
    decisions = dict(decide(graph, Policy("none")))
    forward = [n for n in graph.gm.graph.nodes if graph.nodes[n.name].phase == "forward"]
    for node, policy in _apply_sac_policy(forward).items():
        if not decisions[node.name].forced:
            decisions[node.name] = Tag(policy, Why.PRESET, "apply_sac")
    return decisions


def _as_traced(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """The toolkit's forward compiler without passes: the partitioned GraphModule itself."""
    return gm


def measure_toolkit_step(
    workload: Workload, tags: Tags = "none", backward_inputs: BackwardInputs = "held"
) -> Measurement:
    """One step of `workload` (on the CPU, real tensors) as the toolkit ran it, its peak
    measured: the joint graph `tags`-tagged, split by the default partitioner; the backward
    called as `f(*args)` (`held`: the toolkit's compiler returned the GraphModule, whose
    caller's argument list keeps every input) or with FX's boxed codegen (`freed`)."""
    params = [*workload.model.parameters(), *workload.model.buffers()]

    def backward_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
        if backward_inputs == "freed":
            gm.graph.set_codegen(fx.graph._BoxedCodeGen())
            gm.recompile()
        return gm

    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, workload.model, tuple(workload.inputs))
        if tags == "apply_sac":
            joint.graph_module = apply_sac(joint.graph_module)
        compiled = aot_compile_joint_with_descriptors(
            joint, fw_compiler=_as_traced, bw_compiler=backward_compiler
        )

    loss_fn = workload.loss_fn
    assert loss_fn is not None  # a Workload sets its default loss when built

    def step() -> list[torch.Tensor]:
        logits = compiled(*params, *workload.inputs)
        loss = loss_fn(logits, workload.target)
        del logits
        with warnings.catch_warnings():  # AOTAutograd's advice to box: the toolkit did not
            warnings.filterwarnings("ignore", "Your compiler for AOTAutograd is returning")
            loss.backward()
        for p in workload.model.parameters():
            p.grad = None  # after the peak: the next run starts without gradients
        return [loss.detach()]

    held = [*params, *workload.inputs, workload.target]
    return measure_run("toolkit step", step, held, tokens=1, warmup=1, repeats=1)
