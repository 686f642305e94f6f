"""Torch's own partitioners on a model's joint graph: min-cut once, min-cut again on the forward
it produced, and the tag-driven default partition; what each keeps, named by first-joint nodes.

Entry points: `partition_model(workload)`, `repartition_forward(first)`,
`partition_saving(first, saved)`, `gathered_saved` (FSDP weights kept instead of re-gathered),
and `as_joint_graph` / `partition_decisions` for pictures.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function, aot_module, make_boxed_func
from torch._functorch.compile_utils import fx_graph_cse
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._library.fake_class_registry import FakeScriptObject
from torch.fx.traceback import preserve_node_meta
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph, NodeInfo, describe_nodes
from workbench.capture.tracing import annotate_modules
from workbench.capture.workload import Workload
from workbench.decide.decider import Decisions
from workbench.decide.engine import fsdp_tag
from workbench.decide.facts import unshard_chains
from workbench.decide.tags import Tag, Why
from workbench.errors import WorkbenchError
from workbench.rewrite.index import distinct_storage_bytes

PartitionFn = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


@dataclass
class Partition:
    """One run of a torch partitioner: the forward and backward it returned and the
    forward's example inputs; the joint graph it was given when captured (a copy, dead code
    eliminated and CSE'd as min-cut does before it cuts), min-cut's activation memory
    budget, and `step()`, which runs forward and backward for real and returns
    `[loss, *grads]`, when the run came through `aot_function`."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_fwd_outputs: int
    forward_inputs: list[Any]
    joint: fx.GraphModule | None = None
    budget: float | None = None
    step: Callable[[], list[torch.Tensor]] | None = None

    @functools.cached_property
    def kept(self) -> Saved:
        """The saved outputs as activations and aliases of inputs, with their bytes."""
        return split_saved(self.forward, describe_nodes(self.forward), self.saved)

    @functools.cached_property
    def replayed(self) -> list[NodeInfo]:
        """Backward nodes that depend on no incoming gradient: forward work run again."""
        return _replayed(self.backward, describe_nodes(self.backward))

    @property
    def recompute_flops(self) -> int:
        return sum(i.flops for i in self.replayed)

    def joint_graph(self) -> fx.GraphModule:
        """The joint graph the partitioner was given (runs of `partition_model` keep it)."""
        if self.joint is None:
            raise WorkbenchError(
                "this partition was not captured with its joint graph: use partition_model"
            )
        return self.joint

    @property
    def saved(self) -> list[str]:
        """Forward outputs beyond the user's: what the backward receives (names as in the
        joint graph; parameters and inputs included)."""
        outputs = self.forward.graph.output_node().args[0]
        assert isinstance(outputs, (tuple, list))
        return [o.name for o in outputs[self.num_fwd_outputs :] if isinstance(o, fx.Node)]

    @property
    def recomputed(self) -> list[str]:
        """Forward ops of the joint graph that the backward runs again."""
        forward = set(forward_ops(self.joint_graph()))
        return [
            n.name
            for n in self.backward.graph.nodes
            if n.op == "call_function" and n.name in forward
        ]


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


def forward_ops(joint: fx.GraphModule) -> list[str]:
    """Call nodes of the joint graph that autograd did not emit for the backward."""
    return [
        n.name
        for n in joint.graph.nodes
        if n.op == "call_function" and not n.meta.get("autograd_backward")
    ]


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy; pytree's LeafSpec deprecation warning on copying the codegen is noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm)


def _recording(
    partition_fn: PartitionFn,
    runs: list[tuple[fx.GraphModule, fx.GraphModule, fx.GraphModule, int]],
) -> PartitionFn:
    def partition(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        before = _copy(joint)
        before.graph.eliminate_dead_code()
        before.graph = fx_graph_cse(before.graph)  # as min-cut does first: the names it saves
        before.recompile()
        fw, bw = partition_fn(joint, inputs, **kwargs)
        runs.append((before, fw, bw, kwargs["num_fwd_outputs"]))
        return fw, bw

    return partition


def _compile(
    compile_fn: Callable[..., Any], target: Any, args: list[Any], partition_fn: PartitionFn
) -> Partition:
    runs: list[tuple[fx.GraphModule, fx.GraphModule, fx.GraphModule, int]] = []
    seen: list[list[torch.Tensor]] = []

    def forward_compiler(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        seen.append(list(example_inputs))
        return make_boxed_func(gm)

    compiled = compile_fn(
        target,
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=_recording(partition_fn, runs),
    )
    compiled(*args)
    joint, fw, bw, num_fwd_outputs = runs[-1]
    return Partition(fw, bw, num_fwd_outputs, seen[-1], joint=joint)


def partition_model(
    workload: Workload, partition_fn: PartitionFn = min_cut_rematerialization_partition
) -> Partition:
    """AOT-compile `workload.model` (forward to its output; the loss stays outside) with
    `partition_fn`, recording the joint graph it partitions. Joint nodes carry module paths
    (`meta["custom"]["module"]`) like a workbench trace, so `as_joint_graph` can draw them."""
    model = copy.deepcopy(workload.model)
    with annotate_modules(model), preserve_node_meta():
        return _compile(aot_module, model, list(workload.inputs), partition_fn)


def repartition_forward(
    first: Partition, partition_fn: PartitionFn = min_cut_rematerialization_partition
) -> Partition:
    """Compile `first.forward` again with `partition_fn`: a second partitioner pass over an
    already partitioned forward, whose outputs (the first pass's saved tensors among them) all
    get gradients. Inputs the first backward gave a gradient require grad again; opaque inputs
    (a sharded model's device mesh) are passed as the objects they stand for."""
    returned = first.backward.graph.output_node().args[0]
    assert isinstance(returned, (tuple, list))
    grads = [g is not None for g in returned]
    args = [
        t.detach().clone().requires_grad_(g and t.is_floating_point())
        if isinstance(t, torch.Tensor)
        else _real_object(t)
        for t, g in zip(first.forward_inputs, grads, strict=True)
    ]
    return _compile(aot_function, first.forward, args, partition_fn)


def _real_object(value: Any) -> Any:
    """The object behind an opaque input AOT recorded as fake (a sharded model's device
    mesh): compiling again needs the object itself."""
    if isinstance(value, FakeScriptObject):
        return object.__getattribute__(value, "real_obj")
    return value


def structural_keys(gm: fx.GraphModule, inputs: list[str] | None = None) -> dict[str, str]:
    """A key per node from its op and the keys of its arguments, placeholders keyed by
    `inputs` (default, and past the end of `inputs`: their own names): two traces of the same
    computation get equal keys."""
    placeholders = iter(inputs) if inputs is not None else None
    keys: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            own = f"{gm.__class__.__name__}:{node.name}" if placeholders is not None else node.name
            keys[node.name] = next(placeholders, own) if placeholders is not None else own
        elif node.op == "call_function":
            args = fx.node.map_arg((node.args, node.kwargs), lambda a: keys[a.name])
            keys[node.name] = hashlib.sha1(f"{node.target}{args}".encode()).hexdigest()
    return keys


def to_first_names(first: Partition, second: Partition, names: Iterable[str]) -> list[str]:
    """Names in the second pass's joint graph -> the first joint graph's node computing the
    same value (the first such node when the first graph computes it twice); unmatched names
    (the second pass's own backward) are dropped."""
    placeholders = [n.name for n in first.forward.graph.nodes if n.op == "placeholder"]
    ours: dict[str, str] = {}
    for name, key in structural_keys(first.joint_graph()).items():
        ours.setdefault(key, name)
    theirs = structural_keys(second.joint_graph(), placeholders)
    return [ours[theirs[n]] for n in names if n in theirs and theirs[n] in ours]


def partition_saving(
    first: Partition,
    saved: Iterable[str],
    partition_fn: PartitionFn = default_partition,
    *,
    follow_views: bool = True,
    fsdp_reshard: bool | None = None,
) -> Partition:
    """Partition a copy of `first.joint` with every forward op tagged: MUST_SAVE if named in
    `saved`, PREFER_RECOMPUTE otherwise (torch's SAC tags, as graph SAC writes them). Random
    ops (attention has a dropout seed) are MUST_SAVE, as `workbench.decide.policy.decide` forces:
    recomputing them would need RNG functionalization, which needs a fake mode. Min-cut also
    saves views that autograd emitted for the backward (a weight's transpose, a detach of the
    attention output); tags live on forward ops, so `follow_views` also tags the forward node
    each saved view is built on, the same storage. `fsdp_reshard` (True or False) then tags
    every node of each FSDP unshard chain (`rules.unshard_chains`: cast, all-gather, wait,
    views) as the policy option does: recompute in backward (re-gather) or keep the
    gathered copy, whatever `saved` says of them."""
    joint = _copy(first.joint_graph())
    keep = set(saved)
    if follow_views:  # min-cut may save a view built by backward ops: tag the forward base
        keep |= {_base(n).name for n in joint.graph.nodes if n.name in keep}
    chains = unshard_chains(joint) if fsdp_reshard is not None else {}
    for node in joint.graph.nodes:
        if node.op == "call_function" and not node.meta.get("autograd_backward"):
            random = isinstance(node.target, torch._ops.OpOverload) and (
                torch.Tag.nondeterministic_seeded in node.target.tags
            )
            if node.name in chains:
                node.meta["recompute"] = fsdp_tag(bool(fsdp_reshard)).policy
            elif node.name in keep or random:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            else:
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    fw, bw = partition_fn(_copy(joint), None, num_fwd_outputs=first.num_fwd_outputs)
    return Partition(fw, bw, first.num_fwd_outputs, first.forward_inputs, joint=joint)


def _base(node: fx.Node) -> fx.Node:
    """The node owning the storage `node` views (views, detach and getitem followed back)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        target = node.target
        is_view = isinstance(target, torch._ops.OpOverload) and any(
            r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns
        )
        if not is_view:
            break
        node = node.args[0]
    return node


def is_view(node: fx.Node) -> bool:
    """An op whose output aliases its first input (view, transpose, detach...)."""
    return _base(node) is not node


def compute_ops(joint: fx.GraphModule, names: Iterable[str]) -> list[str]:
    """`names` without views: the ops that cost compute when run again."""
    nodes = {n.name: n for n in joint.graph.nodes}
    return [name for name in names if not is_view(nodes[name])]


def activation_bytes(joint: fx.GraphModule, names: Iterable[str]) -> int:
    """Bytes of the distinct storages behind `names` that are not graph inputs (parameters
    and data are held anyway): views and aliases of one tensor count once."""
    wanted = set(names)
    nodes = [n for n in joint.graph.nodes if n.op == "placeholder" or n.name in wanted]
    return distinct_storage_bytes(nodes)


def gathered_saved(joint: fx.GraphModule, names: Iterable[str]) -> list[str]:
    """The names among `names` whose storage is an FSDP-gathered parameter (its base is on an
    unshard chain of `joint`: the all-gathered weight, or a view of it such as its
    transpose): what a partition keeps for backward instead of gathering again."""
    chains = unshard_chains(joint)
    nodes = {n.name: n for n in joint.graph.nodes}
    return [name for name in names if name in nodes and _base(nodes[name]).name in chains]


def as_joint_graph(partition: Partition, name: str) -> JointGraph:
    """The partition's joint graph as a workbench `JointGraph`, for `workbench.show.viz`."""
    gm = partition.joint_graph()
    tokens = sum(t.numel() for t in partition.forward_inputs if not t.is_floating_point())
    return JointGraph(gm, describe_nodes(gm), [], name, "real", tokens)


def partition_decisions(graph: JointGraph, recomputed: Iterable[str], why: str) -> Decisions:
    """A partition as graph-SAC tags, for pictures and `workbench.show.viz.diff`: forward ops the
    backward runs again `recompute`, the rest `save` (kept where backward reads them, as a
    save tag means to the remat pass)."""
    again = set(recomputed)
    return {
        name: Tag(
            CheckpointPolicy.MUST_RECOMPUTE if name in again else CheckpointPolicy.MUST_SAVE,
            Why.PARTITIONER,
            why,
        )
        for name in forward_ops(graph.gm)
    }
