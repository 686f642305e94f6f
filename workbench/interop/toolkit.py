"""A training step as torchtitan's compiler toolkit ran it (graph trainer's `aot` mode until it
traced the whole step): AOTAutograd exports the model's joint graph, joint passes tag it, torch's
default partitioner splits it, forward and backward run as FX GraphModules and the loss runs
eagerly between them. Measured beside the workbench's estimate of the same tags, the check of
`Estimator(backward_inputs=...)` and of the partition: for real on the CPU, or one rank of a
torchtitan job sharded by graph trainer on fake tensors under torch's `MemTracker`.

Entry points: `apply_sac(gm)` (the toolkit's `apply_sac` joint pass of 2026-02, a pass on an
AOTAutograd joint graph), `apply_sac_decisions(graph)` (its rule on the workbench's graph, as
`default_partition_reading` says the default partitioner reads it), `apply_sac_pass(gm)` and
`apply_sac_pass_decisions(graph)` (graph trainer's pass of 2026-03, getitems tagged as their op),
`eager_sac_decisions(graph)` (torchtitan's eager SAC wrappers as the toolkit traced them, read the
same way),
`toolkit_decisions(graph, tags)` (which of them stands for `tags`),
`measure_toolkit_step(workload, tags, backward_inputs)` (the CPU) and
`track_toolkit_rank(workload, parallel, tags, backward_inputs, kernels)` (a fake rank).
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Sequence
from typing import Any, Literal, cast, get_args

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import (
    aot_compile_joint_with_descriptors,
    aot_export_joint_with_descriptors,
)
from torch._functorch.partitioners import get_default_op_list
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.parallel import Parallel
from workbench.capture.titan_rank import is_titan_workload, titan_loss, titan_rank_model
from workbench.capture.workload import Workload
from workbench.cost.estimate import BackwardInputs
from workbench.cost.measure import Measurement, measure_run
from workbench.decide.decider import Decisions, decide
from workbench.decide.policy import Policy, Selector
from workbench.decide.tags import Tag, Why
from workbench.errors import WorkbenchError
from workbench.interop.trackers import TrackedStep, track_step

__all__ = [
    "APPLY_SAC_PASS_SAVE_OPS",
    "APPLY_SAC_SAVE_OPS",
    "Tags",
    "apply_sac",
    "apply_sac_decisions",
    "apply_sac_pass",
    "apply_sac_pass_decisions",
    "default_partition_reading",
    "eager_sac_decisions",
    "TOOLKIT_TAGS",
    "measure_toolkit_step",
    "toolkit_decisions",
    "track_toolkit_rank",
]

Tags = Literal["none", "apply_sac", "apply_sac_pass", "eager_sac"]
TOOLKIT_TAGS: tuple[Tags, ...] = get_args(Tags)

_aten = torch.ops.aten
# What `apply_sac` saves (torchtitan a764c981, compiler_toolkit/passes.py DEFAULT_SAC_SAVE_OPS)
# that a Llama step has: the GPU's attention kernels and flex attention's op, which the list
# names, and the CPU's flash kernel standing for them on a CPU trace.
APPLY_SAC_SAVE_OPS = frozenset(
    {
        _aten.mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_attention_math.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.higher_order.flex_attention,
        _aten.max.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)


# What graph trainer's `apply_sac_pass` saves (torchtitan fca8ab7b, PR #2570, graph_trainer/
# passes.py `_get_default_sac_save_ops`): torch's partitioner's compute-intensive ops, the SDPA
# kernels that list lacks, flex attention, inductor's code and the collectives it names.
APPLY_SAC_PASS_SAVE_OPS = frozenset(
    {
        *(cast(Any, op).default for op in get_default_op_list().compute_intensive_ops),
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_attention_math.default,
        _aten._scaled_dot_product_fused_attention_overrideable.default,
        torch.ops.higher_order.flex_attention,
        torch.ops.higher_order.inductor_compiled_code,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    }
)
# Nodes `apply_sac_pass` gives their first argument's tag: a tuple's items, a collective's wait.
_FOLLOWERS = (operator.getitem, torch.ops._c10d_functional.wait_tensor.default)


def _every_other_matmul(
    nodes: list[fx.Node], save_ops: frozenset[Any], followers: tuple[Any, ...] = ()
) -> dict[fx.Node, CheckpointPolicy]:
    """The rule of both passes on ops in graph order: every second matmul recomputed (one count
    that never restarts), `save_ops` saved, every other op recomputed. A node whose target is
    in `followers` takes the tag of the node it reads (apply_sac_pass: getitems and waits);
    other getitems stay untagged (apply_sac)."""
    count, tags = 0, dict[fx.Node, CheckpointPolicy]()
    for node in nodes:
        if node.op != "call_function":
            continue
        if node.target in followers:
            parent = node.args[0]
            if isinstance(parent, fx.Node) and parent in tags:
                tags[node] = tags[parent]
            continue
        if node.target is operator.getitem:
            continue
        if node.target is _aten.mm.default:
            count += 1
            saved = count % 2 == 1
        else:
            saved = node.target in save_ops
        tags[node] = CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
    return tags


def apply_sac(gm: fx.GraphModule) -> fx.GraphModule:
    """The toolkit's `apply_sac` joint pass: its rule on every op up to the forward's first
    output (the logits), one AC region (`ac_graph_id` 0); the loss, outside the graph, is
    untouched."""
    nodes = list(gm.graph.nodes)
    logits = nodes[-1].all_input_nodes[0]
    forward = nodes[: nodes.index(logits) + 1]
    for node, policy in _every_other_matmul(forward, APPLY_SAC_SAVE_OPS).items():
        node.meta["recompute"], node.meta["ac_graph_id"] = policy, 0
    gm.recompile()
    return gm


def apply_sac_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Graph trainer's `apply_sac_pass` joint pass of 2026-03 (PR #2570): its rule on every op
    of the joint graph, backward's too (which the partitioner never saves), one AC region."""
    for node, policy in _every_other_matmul(
        list(gm.graph.nodes), APPLY_SAC_PASS_SAVE_OPS, _FOLLOWERS
    ).items():
        node.meta["recompute"], node.meta["ac_graph_id"] = policy, 0
    gm.recompile()
    return gm


def apply_sac_pass_decisions(graph: JointGraph) -> Decisions:
    """`apply_sac_pass`'s tags on the workbench's graph: its rule on the forward ops in graph
    order, which tags every getitem as its op, so the default partitioner's reading is the tags
    themselves; the loss's nodes left as autograd keeps them (saved); forced tags kept."""
    decisions = dict(decide(graph, Policy("none")))
    forward = [n for n in graph.gm.graph.nodes if graph.nodes[n.name].phase == "forward"]
    for node, policy in _every_other_matmul(forward, APPLY_SAC_PASS_SAVE_OPS, _FOLLOWERS).items():
        if not decisions[node.name].forced:
            decisions[node.name] = Tag(policy, Why.PRESET, "apply_sac_pass")
    return decisions


def apply_sac_decisions(graph: JointGraph) -> Decisions:
    """apply_sac's tags on the workbench's graph, as torch's default partitioner (which the
    toolkit ran) reads them: its rule on the forward ops in graph order, then the partitioner's
    reading (`default_partition_reading`); the loss's nodes left as autograd keeps them
    (saved); forced tags kept."""
    decisions = dict(decide(graph, Policy("none")))
    forward = [n for n in graph.gm.graph.nodes if graph.nodes[n.name].phase == "forward"]
    for node, policy in _every_other_matmul(forward, APPLY_SAC_SAVE_OPS).items():
        if not decisions[node.name].forced:
            decisions[node.name] = Tag(policy, Why.PRESET, "apply_sac")
    return default_partition_reading(graph, decisions)


def eager_sac_decisions(graph: JointGraph) -> Decisions:
    """torchtitan's eager SAC wrappers (`SelectiveAC`) on the workbench's graph, as the toolkit
    traced them and the default partitioner reads them: inside each block the checkpoint HOP
    tags every op with the wrappers' rule, getitems with their op's (the `eager` preset: every
    second matmul of a block recomputed, the save list kept, the block's output saved), flex
    attention kept as the wrappers' save list keeps it; outside the blocks nothing is tagged,
    read as `default_partition_reading` reads untagged nodes, so the views of the output
    projection's gathered weight are saved and keep it from forward to backward."""
    flex = any(info.op == "flex_attention" for info in graph.nodes.values())
    selectors = [Selector("**::flex_attention", "save")] if flex else []
    inside = decide(graph, Policy("eager", selectors=selectors))
    outside = default_partition_reading(graph, decide(graph, Policy("none", fsdp_reshard=False)))
    return {
        name: inside[name] if graph.nodes[name].layer is not None else outside[name]
        for name in inside
    }


def toolkit_decisions(graph: JointGraph, tags: Tags) -> Decisions:
    """The workbench's decisions standing for a toolkit step tagged `tags`, as the default
    partitioner reads the tags: no AC keeps FSDP's gathered weights (the toolkit's views kept
    them; an unsharded graph has none), the rest is each tagging's reading."""
    if tags == "none":
        return decide(graph, Policy("none", fsdp_reshard=False))
    readings = {
        "apply_sac": apply_sac_decisions,
        "apply_sac_pass": apply_sac_pass_decisions,
        "eager_sac": eager_sac_decisions,
    }
    return readings[tags](graph)


def _multi_output(node: fx.Node) -> bool:
    return bool(node.users) and all(u.target is operator.getitem for u in node.users)


def default_partition_reading(graph: JointGraph, decisions: Decisions) -> Decisions:
    """What AOTAutograd's `default_partition` (torch 2.13, partitioners.py) does with tags that
    leave getitems untagged, as decisions torch's remat pass replays node for node: it never
    saves a multi-output op (its `MUST_SAVE` is skipped, so that no tuple is saved) and saves
    an untagged node only where a backward node reads it directly; the rest backward needs is
    recomputed. So an attention kernel or a fused RMSNorm whose outputs backward reads through
    views or `detach` is recomputed, and their statistics backward reads directly are saved."""
    reading = dict(decisions)
    why = (Why.PARTITIONER, "default partitioner")
    for node in graph.gm.graph.nodes:
        if (
            graph.nodes[node.name].phase != "forward"
            or node.op != "call_function"
            or not _multi_output(node)
            or reading[node.name].forced
        ):
            continue
        reading[node.name] = Tag(CheckpointPolicy.PREFER_RECOMPUTE, *why)
        for item in node.users:
            if reading[item.name].forced:
                continue
            direct = any(graph.nodes[user.name].phase != "forward" for user in item.users)
            policy = CheckpointPolicy.MUST_SAVE if direct else CheckpointPolicy.PREFER_RECOMPUTE
            reading[item.name] = Tag(policy, *why)
    return reading


def _as_traced(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """The toolkit's forward compiler without passes: the partitioned GraphModule itself."""
    return gm


def _backward_compiler(backward_inputs: BackwardInputs) -> Any:
    """The toolkit's bw_compiler: the partitioned GraphModule itself, called `f(*args)` by
    AOTAutograd (`held`: its caller's argument list keeps every input), or with FX's boxed
    codegen (`freed`: each input dropped after its last use)."""

    def compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
        if backward_inputs == "freed":
            gm.graph.set_codegen(fx.graph._BoxedCodeGen())
            gm.recompile()
        return gm

    return compiler


def _compile(
    model: torch.nn.Module, inputs: tuple[Any, ...], tags: Tags, backward_inputs: BackwardInputs
) -> Any:
    """The toolkit's joint graph builder without passes: AOTAutograd's export of `model`, the
    tags, the default partitioner, forward and backward as GraphModules."""
    if tags == "eager_sac":
        return _compile_eager_sac(model, inputs, backward_inputs)
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, model, inputs)
        if tags == "apply_sac":
            joint.graph_module = apply_sac(joint.graph_module)
        elif tags == "apply_sac_pass":
            joint.graph_module = apply_sac_pass(joint.graph_module)
        return aot_compile_joint_with_descriptors(
            joint, fw_compiler=_as_traced, bw_compiler=_backward_compiler(backward_inputs)
        )


def _compile_eager_sac(
    model: torch.nn.Module, inputs: tuple[Any, ...], backward_inputs: BackwardInputs
) -> Any:
    """The toolkit's step of a model in torchtitan's eager SAC wrappers: torchtitan's
    `SelectiveAC` wraps each block (its op rule: the save list kept, every second matmul of a
    block recomputed), graph trainer's `export_joint` captures the step with dynamo (each
    wrapper a checkpoint HOP with its own `ac_graph_id`) and AOTAutograd inlines the HOPs with
    the rule's tags, which the default partitioner reads."""
    from torch._guards import tracing
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.experiments.graph_trainer.graph_utils import export_joint

    try:
        SelectiveAC(SelectiveAC.Config()).apply(model)
        joint, context = export_joint(model, inputs)
    finally:  # `apply` turns dynamo's LRU cache off for the process; on is torch's default
        torch._C._dynamo.eval_frame._set_lru_cache(True)  # type: ignore[attr-defined]
    with tracing(context):
        return aot_compile_joint_with_descriptors(
            joint, fw_compiler=_as_traced, bw_compiler=_backward_compiler(backward_inputs)
        )


def _backward(loss: torch.Tensor) -> None:
    with warnings.catch_warnings():  # AOTAutograd's advice to box: the toolkit did not
        warnings.filterwarnings("ignore", "Your compiler for AOTAutograd is returning")
        loss.backward()


def measure_toolkit_step(
    workload: Workload, tags: Tags = "none", backward_inputs: BackwardInputs = "held"
) -> Measurement:
    """One step of `workload` (on the CPU, real tensors) as the toolkit ran it, its peak
    measured: the joint graph `tags`-tagged, split by the default partitioner; the backward
    called as `f(*args)` (`held`: the toolkit's compiler returned the GraphModule, whose
    caller's argument list keeps every input) or with FX's boxed codegen (`freed`)."""
    if tags == "eager_sac":
        raise WorkbenchError(
            "eager_sac wraps graph trainer's blocks in torchtitan's SelectiveAC: measure it on "
            "a sharded torchtitan rank (bench toolkit --mode fake with a torchtitan: model and "
            f"--fsdp/--tp), not on {workload.name!r}'s step; tags here: none, apply_sac or "
            "apply_sac_pass"
        )
    params = [*workload.model.parameters(), *workload.model.buffers()]
    compiled = _compile(workload.model, tuple(workload.inputs), tags, backward_inputs)
    loss_fn = workload.loss_fn
    assert loss_fn is not None  # a Workload sets its default loss when built

    def step() -> list[torch.Tensor]:
        logits = compiled(*params, *workload.inputs)
        loss = loss_fn(logits, workload.target)
        del logits
        _backward(loss)
        for p in workload.model.parameters():
            p.grad = None  # after the peak: the next run starts without gradients
        return [loss.detach()]

    held = [*params, *workload.inputs, workload.target]
    return measure_run("toolkit step", step, held, tokens=1, warmup=1, repeats=1)


def _fake_mode_of(model: torch.nn.Module) -> FakeTensorMode:
    """The fake mode graph trainer's model was built in (its parameters' local shards')."""
    param: torch.Tensor = next(model.parameters())
    local = param.to_local() if isinstance(param, DTensor) else param
    mode = getattr(local, "fake_mode", None)
    if not isinstance(mode, FakeTensorMode):
        raise WorkbenchError("a toolkit rank runs on fake tensors: build its workload in fake mode")
    return mode


def track_toolkit_rank(
    workload: Workload,
    parallel: Parallel,
    tags: Tags = "none",
    backward_inputs: BackwardInputs = "held",
    kernels: str = "h100",
) -> TrackedStep:
    """One rank's step of a torchtitan job as the toolkit ran it, on fake tensors under torch's
    `MemTracker` (`workbench.interop.trackers.track_step`): graph trainer's model sharded by its
    own `parallelize` (SimpleFSDP, TP) on the fake process group, traced for `kernels`, then
    `measure_toolkit_step`'s step (AOTAutograd's export, `tags`, the default partitioner, a
    backward holding or freeing its inputs) with graph trainer's loss run eagerly between
    forward and backward. Bytes are the tensors' (no allocator, no GPU library workspaces)."""
    if not is_titan_workload(workload):
        raise WorkbenchError(
            f"a sharded toolkit step runs graph trainer's model: give a torchtitan: model, not "
            f"{workload.name!r} (a workbench model's step runs unsharded, for real)"
        )
    if workload.stage is not None or parallel.pp > 1 or parallel.ep > 1 or parallel.cp > 1:
        raise WorkbenchError(
            "a toolkit step is measured for FSDP and TP ranks only: drop --pp/--ep/--cp"
        )
    with titan_rank_model(workload, "fake", parallel, kernels) as rank:
        model, fake_mode = rank.model, _fake_mode_of(rank.model)
        ids, labels = (fake_mode.from_tensor(t) for t in (rank.first, rank.last))
        compiled = _compile(model, (ids,), tags, backward_inputs)
        state = [*(p for _, p in model.named_parameters(remove_duplicate=False)), *model.buffers()]
        loss_fn, tokens = titan_loss(model), float(workload.tokens)

        def step() -> torch.Tensor:
            logits = compiled(*state, ids)
            loss, _ = loss_fn(logits, labels, global_valid_tokens=tokens)
            del logits
            _backward(loss)
            for p in model.parameters():
                p.grad = None
            return loss.detach()

        with fake_mode:
            _, tracked = track_step(step, model, held=[ids, labels])
    return tracked
