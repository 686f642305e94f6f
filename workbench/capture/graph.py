"""`JointGraph`: one FX graph of forward + loss + backward, with the facts SAC decides on.

Entry points: `JointGraph` (built by `workbench.capture.trace.trace`; `collectives()` lists a
per-rank graph's communication) and `describe_nodes(gm)`, which reads `node.meta` (val,
custom["module"], autograd_backward, seq_nr, stack_trace).
"""

from __future__ import annotations

import collections
import functools
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from workbench.capture.degrees import Degrees
from workbench.capture.ops import is_random, layer_of, layer_pattern, mutates, op_key, op_name

__all__ = [
    "ORIGIN_KEY",
    "InputSpec",
    "JointGraph",
    "NodeInfo",
    "describe_nodes",
    "node_op",
    "short_op",
]

Phase = Literal["input", "forward", "loss", "backward", "output"]
InputKind = Literal["param", "buffer", "input", "target", "mesh"]

LOSS_MODULE = "loss"
# graph trainer's own module annotation (`annotate_module_fqns`, `common_utils._MODULE_FQN`):
# read where the workbench's `module` is absent, so its traced graphs keep its module paths.
GRAPH_TRAINER_MODULE = "module_fqn"
# node.meta key holding (trace token, node name): FX copies meta onto every copy of a node,
# and torch's remat pass renames nodes, so this is how a rewritten graph maps back to the
# trace it came from (and only to that one: the token differs per trace).
ORIGIN_KEY = "workbench_origin"


@dataclass(frozen=True)
class NodeInfo:
    """Facts about one graph node. `module` is the owning module path ("" = the root)."""

    name: str
    op: str
    phase: Phase
    module: str
    layer: int | None
    shapes: tuple[tuple[int, ...], ...]
    dtype: str | None
    bytes: int
    flops: int
    is_view: bool
    is_mutation: bool
    is_random: bool
    source: str
    graph_level: bool = False

    @property
    def pattern_key(self) -> str:
        """`MODULE_PATTERN::OP` (`layers.*.attention.wq::aten.mm.default`): the op in every
        identical layer, all its occurrences there. Not an override key: those add `#k`
        (`OpFacts.key`, `node_keys`)."""
        return op_key(layer_pattern(self.module), self.op)


@dataclass(frozen=True)
class InputSpec:
    """A placeholder of the traced step: what it stands for in the user's model."""

    placeholder: str
    kind: InputKind
    fqn: str


# torch's functional collectives (what DTensor emits while tracing), by their short kind.
COLLECTIVE_OPS: dict[str, str] = {
    "_c10d_functional.all_gather_into_tensor.default": "all_gather",
    "_c10d_functional.reduce_scatter_tensor.default": "reduce_scatter",
    "_c10d_functional.all_reduce.default": "all_reduce",
    "_c10d_functional.all_to_all_single.default": "all_to_all",
    "_c10d_functional.broadcast.default": "broadcast",
    "_c10d_functional.wait_tensor.default": "wait",
}


@dataclass(frozen=True)
class Collective:
    """One communication op of a rank's step. `bytes` is the larger of its input and
    output: the whole buffer the group exchanges (all-gather output, reduce-scatter input).
    `mesh_dim` names the device-mesh dimension of its process group, when known."""

    node: str
    kind: str
    group: str
    mesh_dim: str | None
    bytes: int
    phase: Phase


@dataclass(eq=False)
class JointGraph:
    """The traced train step: outputs are `[loss, *grads]`, grads in `param_names` order.

    Never mutated after tracing; compared and hashed by identity, so modules can cache what
    they derive from it (`weakref.WeakKeyDictionary`)."""

    gm: fx.GraphModule
    nodes: dict[str, NodeInfo]
    inputs: list[InputSpec]
    model_name: str
    mode: Literal["real", "fake"]
    tokens: int
    config: dict[str, Any] = field(default_factory=dict)
    example_inputs: list[Any] | None = None
    # Process-group name -> device-mesh dimension ("fsdp", "tp", "ep", ...) of a per-rank graph.
    mesh_dims: dict[str, str] = field(default_factory=dict)
    # What the graph assumes that the model as shipped does not say (expert routing, ...).
    notes: list[str] = field(default_factory=list)

    @property
    def param_names(self) -> list[str]:
        return [spec.fqn for spec in self.inputs if spec.kind == "param"]

    def by_phase(self, phase: Phase) -> list[NodeInfo]:
        return [info for info in self.nodes.values() if info.phase == phase]

    def ops(self) -> Iterator[NodeInfo]:
        """Call nodes (no placeholders or output)."""
        return (i for i in self.nodes.values() if i.phase not in ("input", "output"))

    def traced_info(self, node: fx.Node) -> NodeInfo | None:
        """The facts of the traced node a node of a rewritten copy of this graph comes from
        (`meta[ORIGIN_KEY]`: torch's remat pass renames what it copies); None for nodes a
        pass added and for another trace's nodes."""
        origin = node.meta.get(ORIGIN_KEY)
        if origin is None or origin[0] != self._token:
            return None
        return self.nodes.get(origin[1])

    @functools.cached_property
    def _token(self) -> str | None:
        """The trace's token in `meta[ORIGIN_KEY]` (`describe_nodes` sets one per trace)."""
        origin = next(iter(self.gm.graph.nodes)).meta.get(ORIGIN_KEY)
        return origin[0] if origin is not None else None

    @property
    def world_size(self) -> int:
        return int(self.config.get("world_size", 1))

    @property
    def degrees(self) -> Degrees:
        """The job's degrees this graph is one rank of (all 1 on one device)."""
        return Degrees.from_json(self.config)

    def collectives(self) -> list[Collective]:
        """Communication ops in graph order (waits included: they end a collective)."""
        return list(self._collectives)

    @functools.cached_property
    def _collectives(self) -> tuple[Collective, ...]:
        found = []
        for node in self.gm.graph.nodes:
            kind = COLLECTIVE_OPS.get(self.nodes[node.name].op)
            if kind is None:
                continue
            group = str(node.args[-1]) if kind != "wait" else ""
            if kind == "wait":
                started = next(iter(node.all_input_nodes), None)
                group = str(started.args[-1]) if started is not None and started.args else ""
            sizes = [self.nodes[n.name].bytes for n in node.all_input_nodes]
            found.append(
                Collective(
                    node=node.name,
                    kind=kind,
                    group=group,
                    mesh_dim=self.mesh_dims.get(group),
                    bytes=max([self.nodes[node.name].bytes, *sizes]),
                    phase=self.nodes[node.name].phase,
                )
            )
        return tuple(found)

    def collective_counts(self) -> dict[str, int]:
        """How many collectives of each kind (`all_gather`, ..., `wait`) the step runs."""
        counts: dict[str, int] = {}
        for c in self.collectives():
            counts[c.kind] = counts.get(c.kind, 0) + 1
        return counts

    def summary(self) -> dict[str, Any]:
        counts = {p: 0 for p in ("forward", "loss", "backward")}
        for info in self.ops():
            counts[info.phase] += 1
        return {
            "model": self.model_name,
            "mode": self.mode,
            "nodes": len(self.gm.graph.nodes),
            "forward_nodes": counts["forward"],
            "loss_nodes": counts["loss"],
            "backward_nodes": counts["backward"],
            "params": len(self.param_names),
            "param_bytes": sum(
                self.nodes[s.placeholder].bytes for s in self.inputs if s.kind == "param"
            ),
            "tokens": self.tokens,
            "world_size": self.world_size,
            "collectives": self.collective_counts(),
            "attention_ops": self.attention_counts(),
            **self.config,
            **({"notes": list(self.notes)} if self.notes else {}),
        }

    def attention_counts(self) -> dict[str, int]:
        """Forward attention kernels by op name (`workbench.capture.kernels.ATTENTION_OPS`):
        which kernels the graph was traced with, the CPU's or a GPU's."""
        from workbench.capture.kernels import ATTENTION_OPS

        counts = collections.Counter(
            i.op for i in self.ops() if i.op in ATTENTION_OPS and i.phase != "backward"
        )
        return dict(sorted(counts.items()))

    def run(self, inputs: Sequence[Any] | None = None) -> list[torch.Tensor]:
        """Execute the step under no_grad (the graph already holds the backward)."""
        from workbench.errors import WorkbenchError

        args = list(inputs) if inputs is not None else self.example_inputs
        if args is None:
            raise WorkbenchError(
                f"graph of {self.model_name!r} was traced in fake mode and holds no tensors: "
                "trace with mode='real' or pass inputs"
            )
        if self.mesh_dims and not torch.distributed.is_initialized():
            raise WorkbenchError(
                f"per-rank graph of {self.model_name!r} runs collectives: run it inside the "
                "process group it was traced in (workbench.capture.parallel.fake_process_group and "
                "trace_rank(..., mesh), or a real group)"
            )
        with torch.no_grad():
            return list(self.gm(*args))


def node_op(node: fx.Node) -> str:
    """`aten.mm.default` for OpOverloads, the placeholder/output kind otherwise."""
    return op_name(node.target) if node.op == "call_function" else node.op


def short_op(op: str) -> str:
    """`aten.mm.default` -> `mm`: the op's name without namespace or overload."""
    parts = op.split(".")
    return parts[1] if len(parts) == 3 else op


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _schema_flags(node: fx.Node) -> tuple[bool, bool, bool]:
    """(is_view, is_mutation, is_random): mutation and randomness as the rules judge them."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False, False, False
    returns = target._schema.returns
    is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return is_view, mutates(target), is_random(target)


def _grouped_mm_flops(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """torch's flop counter has no formula for `_grouped_mm`: every output element is one
    dot product of the contraction length, also when the groups split that length."""
    if a.dim() == 2 and b.dim() == 2:  # groups split the contraction (weight gradients)
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


def _cpu_flash_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    """torch's flop counter has no formula for the CPU's flash op: its SDPA count."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward_flops(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_EXTRA_FLOPS: dict[Any, Any] = {
    torch.ops.aten._grouped_mm: _grouped_mm_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
}


def _flops(node: fx.Node) -> int:
    """FLOPs of the node's op by torch's flop counter (higher-order ops such as flex
    attention included, with the `sparsity_hint` their node carries), causal attention
    counted for the pairs it attends (`_causal_share`)."""
    target = node.target
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    if isinstance(target, torch._ops.HigherOrderOperator):
        formula = flop_registry.get(target)
        if formula is None:
            return 0
        return int(formula(*args, **kwargs, out_val=node.meta.get("val"), _node_meta=node.meta))
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    packet = target.overloadpacket
    formula = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
    if formula is None:
        return 0
    flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    return int(flops * _causal_share(target, args, kwargs))


def _causal_share(target: torch._ops.OpOverload, args: Any, kwargs: Any) -> float:
    """The share of (query, key) pairs a causal SDPA kernel attends, (S + 1) / 2S for S
    queries and keys: torch's flop counter counts every pair ("we aren't accounting for
    causal attention here"); the fused kernels skip the masked ones. 1 for other ops."""
    names = [a.name for a in target._schema.arguments]
    if "is_causal" not in names:
        return 1.0
    given = dict(zip(names, args, strict=False)) | kwargs
    query = given.get("query")
    if not given.get("is_causal") or not isinstance(query, torch.Tensor):
        return 1.0
    seq = int(query.shape[-2])
    return (seq + 1) / (2 * seq)


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _source(node: fx.Node) -> str:
    """Innermost frame outside torch itself: `file.py:LINE in fn: code`."""
    frames = _FRAME_RE.findall(node.meta.get("stack_trace") or "")
    for path, line, fn, code in reversed(frames):
        if "/torch/" not in path:
            return f"{path.rsplit('/', 1)[-1]}:{line} in {fn}: {code.strip()}"
    return ""


def describe_nodes(gm: fx.GraphModule) -> dict[str, NodeInfo]:
    """Facts for every node (and `meta[ORIGIN_KEY]`, its name, on each).

    Forward nodes take their module from `meta["custom"]["module"]`; backward nodes from
    the forward node with the same `seq_nr`. Gradient-accumulation nodes carry the loss's
    seq_nr, so they take the module of the fresh gradient they add (a running sum of the
    residual stream would otherwise drift across layers), or else that of the backward op
    consuming the sum. Forward nodes from the first one annotated
    `custom["phase_hint"] == "loss"` on form the loss; a node no module annotates (the
    loss gradient's seed `ones_like`, which `autograd.grad` makes outside the loss
    function) belongs to no module ("" = the root), as graph trainer's tracer leaves it.
    """
    module_of_seq: dict[int, str] = {}
    modules: dict[fx.Node, str] = {}
    graph_level: dict[fx.Node, None] = {}  # ordered set
    phases: dict[fx.Node, Phase] = {}
    in_loss = False
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        if node.op == "placeholder":
            phases[node], modules[node] = "input", ""
        elif node.op == "output":
            phases[node], modules[node] = "output", ""
        elif node.meta.get("autograd_backward"):
            phases[node] = "backward"
            if node.meta.get("is_gradient_acc"):
                modules[node] = _accumulated_module(node, modules)
            else:
                modules[node] = module_of_seq.get(node.meta.get("seq_nr", -1), "")
            if not modules[node]:
                graph_level[node] = None
        else:
            module = custom.get("module", custom.get(GRAPH_TRAINER_MODULE))
            loss_hint = (custom.get("phase_hint"), custom.get(GRAPH_TRAINER_MODULE))
            in_loss = in_loss or LOSS_MODULE in loss_hint
            phases[node] = "loss" if in_loss else "forward"
            modules[node] = module if module is not None else ""
            seq_nr = node.meta.get("seq_nr")
            if seq_nr is not None:
                module_of_seq.setdefault(seq_nr, modules[node])
    for node in reversed([n for n in graph_level if n.meta.get("is_gradient_acc")]):
        consumers = [modules[u] for u in node.users if modules.get(u)]
        if consumers:
            modules[node] = consumers[0]
            del graph_level[node]
    infos: dict[str, NodeInfo] = {}
    token = uuid.uuid4().hex
    for node in gm.graph.nodes:
        node.meta[ORIGIN_KEY] = (token, node.name)
        tensors = _tensors(node.meta.get("val"))
        is_view, is_mutation, is_random = _schema_flags(node)
        infos[node.name] = NodeInfo(
            name=node.name,
            op=node_op(node),
            phase=phases[node],
            module=modules[node],
            layer=layer_of(modules[node]),
            shapes=tuple(tuple(int(s) for s in t.shape) for t in tensors),
            dtype=str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
            bytes=int(sum(t.numel() * t.element_size() for t in tensors)),
            flops=_flops(node),
            is_view=is_view,
            is_mutation=is_mutation,
            is_random=is_random,
            source=_source(node),
            graph_level=node in graph_level,
        )
    return infos


def _accumulated_module(node: fx.Node, modules: dict[fx.Node, str]) -> str:
    inputs = node.all_input_nodes
    fresh = [n for n in inputs if not n.meta.get("is_gradient_acc")] or inputs
    return _common_module([modules[n] for n in fresh])


def _common_module(paths: list[str]) -> str:
    """Longest common dotted prefix of the non-empty module paths."""
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    common: list[str] = []
    for components in zip(*parts, strict=False):
        if len(set(components)) != 1:
            break
        common.append(components[0])
    return ".".join(common)
