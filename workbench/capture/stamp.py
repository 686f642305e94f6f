"""Identical transformer blocks traced once and stamped: a 126-layer rank in seconds.

Entry points: `trace_layers(build, layers, mode, parallel)` (trace three layers, stamp the
rest; `workbench.capture.trace.trace` calls it for reference models in fake mode) and
`stamp_graph(template, template_layers, layers)`, which turns a graph traced on three layers
into the graph of any number of them, node for node what a full trace makes.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.capture.fresh import FreshValues, flat
from workbench.capture.graph import GRAPH_TRAINER_MODULE, InputSpec, JointGraph, describe_nodes
from workbench.capture.ops import layer_of
from workbench.capture.tracing import Mode, collector_paused, last_input
from workbench.capture.workload import Workload
from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    from workbench.capture.parallel import Parallel

__all__ = [
    "TEMPLATE_LAYERS",
    "StampRefused",
    "keep_layers",
    "stamp_graph",
    "template_key",
    "trace_layers",
]

# first layer, one middle layer (stamped), last layer: the fewest that show every neighbour
TEMPLATE_LAYERS = 3
TraceFn = Callable[[Workload, Mode, "Parallel | None"], JointGraph]


class StampRefused(WorkbenchError):
    """The template's layers are not copies of one another: trace every layer instead."""


def trace_layers(
    build: Callable[[list[int]], Workload],
    layers: Sequence[int],
    mode: Mode,
    parallel: Parallel | None = None,
    *,
    trace_fn: TraceFn,
    templates: dict[Hashable, tuple[JointGraph, list[int]]] | None = None,
    kernels: str,
) -> JointGraph:
    """The graph of `build(layers)`'s step, tracing `build(layers[:3])` and stamping its
    middle layer for `layers[1:-1]` and its last for `layers[-1]` (fake mode, more than three
    layers); else, or when the template's layers are not positionally identical, the full
    trace (with a note saying why). `build(ids)` returns a workload whose model holds exactly
    those layer ids; `trace_fn` traces one workload without stamping
    (`functools.partial(workbench.capture.trace.trace, stamp=False)`). `templates` keeps the
    traced templates between calls (pipeline stages): a later call whose three first layers
    differ from a kept template's only in their ids stamps from it without tracing.
    `kernels`: what `trace_fn` traces for (part of a kept template's key)."""
    ids = [int(i) for i in layers]
    if mode != "fake" or len(ids) < TEMPLATE_LAYERS:
        return trace_fn(build(ids), mode, parallel)
    head = build(ids[:TEMPLATE_LAYERS])
    key = template_key(head, ids[:TEMPLATE_LAYERS], mode, parallel, kernels)
    kept = templates.get(key) if templates is not None else None
    if kept is None:
        traced = trace_fn(head, mode, parallel)
        if templates is None and len(ids) == TEMPLATE_LAYERS:
            return traced
        kept = (traced, ids[:TEMPLATE_LAYERS])  # kept apart from the graphs handed out
        if templates is not None:
            templates[key] = kept
    template, template_layers = kept
    full = build(ids)
    try:
        _check_alike(full, ids)
        graph = stamp_graph(template, template_layers, ids)
        # tied parameters once (the workbench's traces) or each time (graph trainer's)
        expected = [
            [name for name, _ in full.model.named_parameters(remove_duplicate=dedup)]
            for dedup in (True, False)
        ]
        if graph.param_names not in expected:
            raise StampRefused(f"the stamped parameters differ from {full.name!r}'s")
    except StampRefused as why:
        graph = trace_fn(full, mode, parallel)
        graph.notes.append(f"layers not stamped ({why}): all {len(ids)} traced")
        return graph
    graph.model_name = full.name
    # the workload's notes, then what tracing added (an EP graph's routing) and the stamp's
    graph.notes = [*full.notes, *graph.notes[len(head.notes) :]]
    graph.config = {**template.config, **full.config, "stamped": len(ids) - TEMPLATE_LAYERS}
    return graph


def _check_alike(workload: Workload, ids: Sequence[int]) -> None:
    """Every layer after the first must be built as the template's middle one: the template
    sees three layers, the stamp copies them over the others (a layer changed by hand is
    refused here, not copied over)."""
    layers = getattr(workload.model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise StampRefused(f"model {workload.name!r} keeps no layers ModuleDict")

    def build_of(layer: nn.Module) -> Hashable:
        return (
            tuple((p, type(m), "forward" in m.__dict__) for p, m in layer.named_modules()),
            tuple((n, t.shape, t.dtype, t.requires_grad) for n, t in layer.named_parameters()),
            tuple((n, t.shape, t.dtype) for n, t in layer.named_buffers()),
        )

    middle = build_of(layers[str(ids[1])])
    for i in ids[2:]:
        if build_of(layers[str(i)]) != middle:
            raise StampRefused(f"layer {i} is not built as layer {ids[1]}")


def template_key(
    workload: Workload, ids: Sequence[int], mode: Mode, parallel: Parallel | None, kernels: str
) -> Hashable:
    """What a template's graph depends on, its layers' ids aside: the model's module types
    and parameter and buffer shapes (layer ids replaced by their place in `ids`), the batch,
    the loss, a pipeline stage's place (first, last), the mode, the parallel layout (less pp:
    a stage's graph is the same in any pipeline depth) and the kernels traced. Not the
    workload's name, config or notes, nor the stage's number: a stamped graph takes those
    from `build(layers)`."""

    def local(path: str) -> str:
        layer = layer_of(path)
        if layer is None or layer not in ids:
            return path
        return _renamed(path, layer, -1 - ids.index(layer))

    model = workload.model
    tensors = [*model.named_parameters(), *model.named_buffers()]
    batch = [*workload.inputs, last_input(workload)]
    stage = workload.stage
    return (
        type(model),
        workload.loss_fn,
        (stage.first, stage.last) if stage is not None else None,
        mode,
        None if parallel is None else replace(parallel, pp=1),
        kernels,
        tuple((local(path), type(m).__name__) for path, m in model.named_modules()),
        tuple((local(n), tuple(t.shape), t.dtype) for n, t in tensors),
        tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in batch),
    )


def stamp_graph(
    template: JointGraph, template_layers: Sequence[int], layers: Sequence[int]
) -> JointGraph:
    """The graph of `layers` from a fake-mode graph traced on the three `template_layers`:
    the first template layer becomes `layers[0]`, copies of the middle one `layers[1:-1]`,
    the last one `layers[-1]`. Nodes come in the order and with the names, arguments,
    module paths (renamed), seq_nr (shifted) and fresh fake values a full trace gives.
    Raises `StampRefused` when the template's layers are not copies of one another."""
    ids = [int(i) for i in template_layers]
    layers = [int(i) for i in layers]
    if len(ids) != TEMPLATE_LAYERS or len(layers) < TEMPLATE_LAYERS:
        raise StampRefused(f"need {TEMPLATE_LAYERS} template layers and at least as many layers")
    if template.mode != "fake":
        raise StampRefused("real-mode graphs keep their example tensors: trace every layer")
    cut = _segments(template, ids)
    previous = _check_neighbours(cut, ids)
    stamper = _Stamper(template, cut, previous, ids, layers)
    with collector_paused():  # as while tracing: the collector would walk the graph again
        try:
            graph = stamper.build()
        except KeyError as missing:  # a read the checks did not foresee
            raise StampRefused(f"no stamped counterpart for {missing}") from None
        with _use_lazy_graph_module(True):
            gm = _make_graph_module(stamper.attribute_root(), graph)
        nodes = describe_nodes(gm)
    inputs = [
        InputSpec(new.name, spec.kind, _renamed(spec.fqn, unit.source, unit.target))
        for new, spec, unit, _ in stamper.placeholders
    ]
    notes = [*template.notes]
    if len(layers) > TEMPLATE_LAYERS:
        notes.append(f"layers {layers[2]}-{layers[-2]} stamped from layer {ids[1]}")
    if layers[:2] != ids[:2]:
        notes.append(
            f"layers {layers[0]}, {layers[1]}, {layers[-1]} renamed from the template's "
            f"{', '.join(map(str, ids))}"
        )
    return JointGraph(
        gm=gm,
        nodes=nodes,
        inputs=inputs,
        model_name=template.model_name,
        mode=template.mode,
        tokens=template.tokens,
        config={**template.config, "stamped": len(layers) - TEMPLATE_LAYERS},
        mesh_dims=dict(template.mesh_dims),
        notes=notes,
    )


def keep_layers(workload: Workload, ids: Sequence[int]) -> Workload:
    """`workload` with a model holding only the layers `ids` (keys of its `layers`
    ModuleDict, shared, not copied: a meta model costs nothing): the builder `trace` gives
    `trace_layers`. The whole model when `ids` are all its layers."""
    model = workload.model
    keys = [str(i) for i in ids]
    layers = getattr(model, "layers", None)
    held = list(layers) if isinstance(layers, nn.ModuleDict) else []
    missing = [k for k in keys if k not in held]
    if missing or not isinstance(layers, nn.ModuleDict):
        raise WorkbenchError(
            f"model {workload.name!r} has no layers {missing or keys} to keep (its layers "
            f"ModuleDict holds {held[:3]}{' ...' if len(held) > 3 else ''})"
        )
    if keys == held:
        return workload
    kept = copy.copy(model)
    kept._modules = dict(model._modules)
    kept.layers = nn.ModuleDict({k: layers[k] for k in keys})
    part = copy.copy(workload)
    part.model = kept
    return part


@dataclass
class _Group:
    """One place where the three template layers follow one another: their runs of
    consecutive nodes, in graph order ascending (forward) or descending (backward)."""

    runs: dict[int, list[fx.Node]]
    ascending: bool


@dataclass
class _Cut:
    """The template cut into each node's layer (None outside the layers) and the groups;
    `position` places a layer node in its group (group index, index in its run)."""

    layer: dict[fx.Node, int | None]
    groups: list[_Group] = field(default_factory=list)
    position: dict[fx.Node, tuple[int, int]] = field(default_factory=dict)
    at: dict[tuple[int, int, int], fx.Node] = field(default_factory=dict)  # (layer, *position)


def _node_layers(template: JointGraph, ids: Sequence[int]) -> dict[fx.Node, int | None]:
    """Each node's layer: its module's, a placeholder's parameter's, or (for a node outside
    every module computed from one layer's parameters alone, a shard's view) theirs."""
    fqn = {spec.placeholder: spec.fqn for spec in template.inputs}
    kind = {spec.placeholder: spec.kind for spec in template.inputs}
    layer: dict[fx.Node, int | None] = {}
    derived: set[fx.Node] = set()
    previous: int | None = None  # the layer of the placeholder before
    for node in template.gm.graph.nodes:
        found: int | None = None
        if node.op == "placeholder":
            # graph trainer's tracer gives each DTensor parameter its mesh just after it
            found = previous if kind[node.name] == "mesh" else layer_of(fqn[node.name])
            previous = found
        elif node.op != "output":
            found = template.nodes[node.name].layer
            inputs = node.all_input_nodes
            if found is None and inputs:
                owners = {layer[n] for n in inputs}
                own = all(n.op == "placeholder" or n in derived for n in inputs)
                if own and len(owners) == 1 and None not in owners:
                    found = owners.pop()
                    derived.add(node)
        if found is not None and found not in ids:
            raise StampRefused(f"node {node.name} belongs to layer {found}, not a template layer")
        if found is not None and node.op == "get_attr" and not _is_subgraph(template, node):
            raise StampRefused(f"layer {found} holds a constant ({node.name})")
        layer[node] = found
    return layer


def _segments(template: JointGraph, ids: Sequence[int]) -> _Cut:
    """Cut the template into runs and check that they come as the three layers in a row. A
    run is one layer's, in forward or in backward (the last layer's backward follows its
    forward at once on a stage without the loss)."""
    cut = _Cut(layer=_node_layers(template, ids))
    runs: list[tuple[int | None, list[fx.Node]]] = []
    backward = False
    for node in template.gm.graph.nodes:
        owner, was_backward = cut.layer[node], backward
        backward = bool(node.meta.get("autograd_backward"))
        if runs and runs[-1][0] == owner and backward == was_backward:
            runs[-1][1].append(node)
        else:
            runs.append((owner, [node]))
    k = 0
    while k < len(runs):
        if runs[k][0] is None:
            k += 1
            continue
        owners = [owner for owner, _ in runs[k : k + TEMPLATE_LAYERS]]
        if owners not in (list(ids), list(reversed(ids))):
            raise StampRefused(f"layers {owners} follow one another at node {runs[k][1][0].name}")
        group = _Group(
            runs={owner: nodes for owner, nodes in runs[k : k + TEMPLATE_LAYERS]},  # type: ignore[misc]
            ascending=owners[0] == ids[0],
        )
        for owner, nodes in group.runs.items():
            for p, node in enumerate(nodes):
                cut.position[node] = (len(cut.groups), p)
                cut.at[(owner, len(cut.groups), p)] = node
        cut.groups.append(group)
        k += TEMPLATE_LAYERS
    return cut


def _is_subgraph(template: JointGraph, node: fx.Node) -> bool:
    """A `get_attr` of a graph an op takes (a flex attention's score or mask function)."""
    return isinstance(getattr(template.gm, str(node.target), None), fx.GraphModule)


_DIGITS_RE = re.compile(r"\d+$")
_ARG_RE = re.compile(r"arg\d+_1")


def _attr_prefix(target: str) -> str:
    """What make_fx numbers a subgraph attribute after (`sdpa_score3` -> `sdpa_score`).

    >>> _attr_prefix("joint_graph12"), _attr_prefix("sdpa_mask0")
    ('joint_graph', 'sdpa_mask')
    """
    return _DIGITS_RE.sub("", target)


def _same_target(a: fx.Node, b: fx.Node) -> bool:
    """Two layers' nodes run the same thing: the same op, or (`get_attr`) subgraphs of the
    same prefix and code, as make_fx gives each call its own numbered copy."""
    if a.op != "get_attr":
        return a.target == b.target
    owner = a.graph.owning_module
    first, second = (getattr(owner, str(n.target), None) for n in (a, b))
    if not isinstance(first, fx.GraphModule) or not isinstance(second, fx.GraphModule):
        return a.target == b.target
    same_prefix = _attr_prefix(str(a.target)) == _attr_prefix(str(b.target))
    return same_prefix and first.code == second.code


_SUFFIX_RE = re.compile(r"_(\d+)$")


def _name_base(name: str) -> str:
    """A node name without FX's counter (`mul_12` -> `mul`).

    >>> _name_base("mul_12"), _name_base("sym_size_int"), _name_base("getitem_3")
    ('mul', 'sym_size_int', 'getitem')
    """
    return _SUFFIX_RE.sub("", name)


def _name_gaps(graph: fx.Graph) -> dict[fx.Node, int]:
    """Per call node, how many names of its base FX handed out since the previous node of
    that base and no node holds now: nodes the tracer made and erased (graph trainer's trace
    of expert routing drops unused size arithmetic). A stamped copy skips as many, so its
    nodes get the full trace's names."""
    names = {node.name for node in graph.nodes}
    last: dict[str, int] = {}
    gaps: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        base = _name_base(node.name)
        match = _SUFFIX_RE.search(node.name)
        number = int(match.group(1)) if match and base != node.name else 0
        if base not in last:  # FX never hands out a builtin's bare name (`slice` -> `slice_1`)
            last[base] = -1 if fx.graph._Namespace().create_name(base, None) == base else 0
        skipped = range(last[base] + 1, number)
        gap = sum((f"{base}_{k}" if k else base) not in names for k in skipped)
        if gap > 0:
            gaps[node] = gap
        last[base] = max(number, last[base])
    return gaps


def _same_facts(a: fx.Node, b: fx.Node, why: str) -> None:
    """The facts a stamp copies must agree between the middle and the last layer."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    for x, y in zip(flat(va), flat(vb), strict=False):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor) or (
            isinstance(x, torch.Tensor)
            and (x.shape != y.shape or x.stride() != y.stride() or x.dtype != y.dtype)
        ):
            raise StampRefused(f"{why} differ in the value of {a.name} and {b.name}")
    for key in ("autograd_backward", "is_gradient_acc", "stack_trace"):
        if a.meta.get(key) != b.meta.get(key):
            raise StampRefused(f"{why} differ in {key} at {a.name} and {b.name}")


def _references(node: fx.Node) -> tuple[Any, list[fx.Node]]:
    """The node's arguments with each node replaced by None, and those nodes in order."""
    found: list[fx.Node] = []

    def note(n: fx.Node) -> None:
        found.append(n)

    shape = fx.node.map_arg((node.args, node.kwargs), note)  # type: ignore[arg-type,func-returns-value]
    return shape, found


def _check_neighbours(cut: _Cut, ids: Sequence[int]) -> dict[fx.Node, fx.Node]:  # noqa: C901
    """The middle and the last template layer must be the same nodes position for
    position: same targets, constant arguments and facts; their own nodes at the same
    positions; shared nodes the same; the middle layer's reads of the first layer matched
    by the last layer's reads of the middle one (returned: first-layer node -> middle-layer
    node); the middle layer's reads of the last one where the last reads outside the layers.
    Nothing outside the layers may read the middle layer, nor the first and last each other."""
    first, middle, last = ids
    previous: dict[fx.Node, fx.Node] = {}
    why = f"layers {middle} and {last}"
    for group in cut.groups:
        a_nodes, b_nodes = group.runs[middle], group.runs[last]
        if len(a_nodes) != len(b_nodes):
            raise StampRefused(
                f"{why} differ in length at {a_nodes[0].name} ({len(a_nodes)} vs "
                f"{len(b_nodes)} nodes)"
            )
        for a, b in zip(a_nodes, b_nodes, strict=True):
            if a.op != b.op or (a.op != "placeholder" and not _same_target(a, b)):
                raise StampRefused(f"{why} differ at {a.name} ({a.target} vs {b.target})")
            _same_facts(a, b, why)
            shape_a, refs_a = _references(a)
            shape_b, refs_b = _references(b)
            if shape_a != shape_b:
                raise StampRefused(f"{why} differ in the arguments of {a.name} and {b.name}")
            for x, y in zip(refs_a, refs_b, strict=True):
                lx, ly = cut.layer[x], cut.layer[y]
                if lx is None and x is y:
                    continue
                if lx == middle and ly == last and cut.position[x] == cut.position[y]:
                    continue
                if lx == first and ly == middle:
                    if previous.setdefault(x, y) is not y:
                        raise StampRefused(f"{why}: {x.name} of layer {first} is read twice")
                    continue
                if lx == last and ly is None:
                    continue  # the next layer's node, where the last layer reads the model's end
                raise StampRefused(f"{why}: {a.name} reads {x.name} where {b.name} reads {y.name}")
    for node, owner in cut.layer.items():
        if owner == middle or node.op == "output":
            continue
        for x in node.all_input_nodes:
            if (owner is None and cut.layer[x] == middle) or {owner, cut.layer[x]} == {first, last}:
                raise StampRefused(f"{node.name} reads {x.name} across the stamped layers")
    return previous


_LAYER_RE = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _renamed(text: str, old: int, new: int) -> str:
    """`layers.{old}.x` -> `layers.{new}.x` (the first numbered component, as `layer_of`).

    >>> _renamed("layers.1.attention.wq.weight", 1, 40), _renamed("norm.weight", 1, 40)
    ('layers.40.attention.wq.weight', 'norm.weight')
    """
    if old == new or layer_of(text) != old:
        return text
    return _LAYER_RE.sub(str(new), text, count=1)


@dataclass
class _Copy:
    """One stamped layer (or the nodes outside the layers): its template layer, its id,
    its node map, seq_nr map and fake values."""

    source: int
    target: int
    fresh: FreshValues
    env: dict[fx.Node, fx.Node] = field(default_factory=dict)
    seq: dict[int, int] = field(default_factory=dict)


class _Stamper:
    """Builds the stamped graph node by node, in the order a full trace creates them, so
    FX's namespace gives each node the full trace's name."""

    def __init__(
        self,
        template: JointGraph,
        cut: _Cut,
        previous: dict[fx.Node, fx.Node],
        ids: Sequence[int],
        layers: Sequence[int],
    ) -> None:
        self.template, self.cut, self.previous, self.ids = template, cut, previous, ids
        self.graph = fx.Graph()
        keys: dict[int, StorageWeakRef] = {}
        self.root = _Copy(-1, -1, FreshValues(keys))  # nodes outside the layers
        self.shift = 0  # seq_nr numbers the stamped layers emitted so far took
        self.placeholders: list[tuple[fx.Node, InputSpec, _Copy, fx.Node]] = []
        self.specs = {spec.placeholder: spec for spec in template.inputs}
        self.forward_seqs = {
            n.meta.get("seq_nr")
            for n in template.gm.graph.nodes
            if not n.meta.get("autograd_backward")
        }
        first, middle, last = ids
        n = len(layers)
        sources = [first, *[middle] * (n - 2), last]
        self.copies = [_Copy(s, t, FreshValues(keys)) for s, t in zip(sources, layers, strict=True)]
        self.names: dict[Any, str] = {}  # an op's name as make_fx derives it
        self.modules: dict[tuple[str, int, int], str] = {}
        self.attributes: dict[str, Any] = {}  # what the stamped graph's get_attrs read
        self.gaps = _name_gaps(template.gm.graph)
        self.counts: dict[str, int] = {}  # subgraph copies numbered so far, by prefix

    def _at(self, index: int, middle_node: fx.Node) -> fx.Node:
        """Copy `index`'s node at `middle_node`'s place (the last copy: the last layer's)."""
        unit = self.copies[index]
        if unit.source == self.ids[2]:
            middle_node = self.cut.at[(self.ids[2], *self.cut.position[middle_node])]
        return unit.env[middle_node]

    def _lookup(self, index: int, node: fx.Node) -> fx.Node:
        """The new node copy `index` reads where its template layer reads `node`."""
        owner = self.cut.layer[node]
        unit = self.copies[index]
        if owner is None:
            return self.root.env[node]
        if owner == unit.source:
            return unit.env[node]
        first, middle, last = self.ids
        if owner == first and index == 1 or owner == middle and index == 0:
            return self.copies[1 - index].env[node]
        if owner == first:  # a copy of the middle layer reads the one before it
            return self._at(index - 1, self.previous[node])
        if owner == middle:  # the last layer reads the last copy
            return self._at(index - 1, node)
        twin = self.cut.at[(middle, *self.cut.position[node])]
        return self._at(index + 1, twin)  # a middle layer reads the next one (backward)

    def _outside(self, node: fx.Node) -> fx.Node:
        """What a node outside the layers reads: the first layer is the first stamped one,
        the last the last (the middle one is refused by `_check_neighbours`)."""
        owner = self.cut.layer[node]
        if owner is None:
            return self.root.env[node]
        return self.copies[0 if owner == self.ids[0] else -1].env[node]

    def emit(self, index: int | None, node: fx.Node, shift: int) -> None:
        """Append `node` as copy `index` makes it (outside the layers when None)."""
        unit = self.root if index is None else self.copies[index]
        if index is None:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._outside)
        else:
            args, kwargs = fx.node.map_arg(
                (node.args, node.kwargs), lambda n: self._lookup(index, n)
            )
        target, name = self._target_and_name(node)
        for _ in range(self.gaps.get(node, 0)):  # names the full trace gave nodes it erased
            self.graph._graph_namespace.create_name(_name_base(node.name), None)
        new = self.graph.create_node(node.op, target, args, kwargs, name=name)
        if node.op == "placeholder":
            self.placeholders.append((new, self.specs[node.name], unit, node))
        meta = dict(node.meta)
        fresh = unit.fresh
        for x, y in zip(node.all_input_nodes, new.all_input_nodes, strict=True):
            if x not in unit.env:  # outside the copy: its storages are another copy's
                fresh.seed(x.meta.get("val"), y.meta.get("val"))
        meta["val"] = fresh(meta.get("val"))
        if "eager_input_vals" in meta:
            meta["eager_input_vals"] = fresh.mapped(meta["eager_input_vals"])
        if unit.source != unit.target and isinstance(meta.get("custom"), dict):
            custom = dict(meta["custom"])
            for field_ in ("module", GRAPH_TRAINER_MODULE):  # ours, and graph trainer's
                if isinstance(custom.get(field_), str):
                    key = (custom[field_], unit.source, unit.target)
                    if key not in self.modules:
                        self.modules[key] = _renamed(*key)
                    custom[field_] = self.modules[key]
            meta["custom"] = custom
        seq = meta.get("seq_nr")
        if isinstance(seq, int):
            if meta.get("autograd_backward") and seq in self.forward_seqs:
                meta["seq_nr"] = unit.seq.get(seq, self.root.seq.get(seq, seq + shift))
            elif meta.get("autograd_backward"):
                meta["seq_nr"] = seq + shift
            else:
                meta["seq_nr"] = unit.seq[seq] = seq + shift
        new.meta = meta
        unit.env[node] = new

    def _target_and_name(self, node: fx.Node) -> tuple[Any, str | None]:
        """The new node's target and name as a full trace makes them (None: FX's own)."""
        target = node.target
        if node.op == "placeholder":  # make_fx's `argN_1`; inputs lifted after tracing keep theirs
            numbered = _ARG_RE.fullmatch(str(target)) is not None
            return (f"arg{len(self.placeholders)}_1" if numbered else target), None
        if node.op == "get_attr":
            attribute = self._attribute(str(target))
            return attribute, attribute
        if isinstance(target, torch._ops.OpOverload):  # as make_fx names an op's node
            name = self.names.get(target)
            if name is None:
                name = self.names[target] = self._op_name(node, target)
            return target, name
        return target, None

    def _op_name(self, node: fx.Node, target: torch._ops.OpOverload) -> str:
        """The name make_fx gives `target`'s nodes: its packet's (`mm`), or, for the size
        queries it records for symbolic sizes (`aten.sym_size.int`), its overload's too
        (`sym_size_int`): the template's node says which."""
        full = re.sub(r"\W", "_", self.graph._target_to_str(target.__name__))
        if node.name == full or node.name.startswith(f"{full}_"):
            return full
        return self.graph._target_to_str(target.overloadpacket.__name__)

    def _attribute(self, target: str) -> str:
        """A `get_attr`'s target in the stamped graph: a subgraph gets the next number of its
        prefix, as make_fx numbers one copy per call (`sdpa_score0`, `sdpa_score1`, ...), and
        the template's module under that name; other attributes keep their target."""
        value = getattr(self.template.gm, target)
        if not isinstance(value, fx.GraphModule):
            self.attributes[target] = value
            return target
        prefix = _attr_prefix(target)
        count = self.counts.get(prefix, 0)
        self.counts[prefix] = count + 1
        self.attributes[f"{prefix}{count}"] = value
        return f"{prefix}{count}"

    def attribute_root(self) -> nn.Module:
        """The module the stamped graph's `get_attr`s read from."""
        root = nn.Module()
        for target, value in self.attributes.items():
            if isinstance(value, nn.Module):
                root.add_module(target, value)
            else:
                setattr(root, target, value)
        return root

    def build(self) -> fx.Graph:
        starts: dict[fx.Node, _Group] = {}
        for group in self.cut.groups:
            starts[group.runs[self.ids[0 if group.ascending else 2]][0]] = group
        output: fx.Node | None = None
        for node in self.template.gm.graph.nodes:
            if node.op == "output":
                output = node
            elif self.cut.layer[node] is None:
                self.emit(None, node, self.shift)
            elif node in starts:
                self._emit_group(starts[node])
        assert output is not None
        self._emit_output(output)
        return self.graph

    def _emit_group(self, group: _Group) -> None:
        """The three template runs as every stamped layer's run, in the template's order.
        seq_nr the autograd counter handed out while a layer ran (in forward; in backward,
        for autograd functions DTensor runs there) advance by the template's step from one
        layer to the next, and those of a backward op are its forward op's."""
        _, middle, last = self.ids
        n = len(self.copies)
        counted = [self._counted(group.runs[layer]) for layer in (middle, last)]
        step = 0
        if counted[0] and counted[1]:
            step = counted[1][0] - counted[0][0]
        if not group.ascending:
            step = -step
        order = range(n) if group.ascending else range(n - 1, -1, -1)
        for index in order:
            unit = self.copies[index]
            before = index - 1 if group.ascending else n - 2 - index  # stamped layers before
            extra = min(max(before, 0), n - 3) * step
            for node in group.runs[unit.source]:
                self.emit(index, node, self.shift + extra)
        self.shift += (n - 3) * step

    def _counted(self, nodes: list[fx.Node]) -> list[int]:
        """seq_nr the counter handed out at these nodes (not a backward op's forward's)."""
        seqs = [n.meta.get("seq_nr") for n in nodes]
        return [
            s
            for n, s in zip(nodes, seqs, strict=True)
            if isinstance(s, int)
            and not (n.meta.get("autograd_backward") and s in self.forward_seqs)
        ]

    def _mesh(self, value: Any) -> bool:
        """A mesh placeholder: graph trainer's tracer gives every DTensor parameter one, and a
        gradient's mesh in the outputs is the last of its object's placeholders."""
        if not isinstance(value, fx.Node) or value.op != "placeholder":
            return False
        spec = self.specs.get(value.name)
        return spec is not None and spec.kind == "mesh"

    def _emit_output(self, node: fx.Node) -> None:
        """The outputs (`[loss, *grads, ...]`): those outside the layers as they are, each
        run of the three layers' gradients as every stamped layer's, in layer order."""
        outputs = node.args[0]
        if not isinstance(outputs, (list, tuple)):
            raise StampRefused(f"the step returns {type(outputs).__name__}, not a list")
        runs: list[tuple[int | None, list[Any]]] = []
        for value in outputs:
            owner = self.cut.layer[value] if isinstance(value, fx.Node) else None
            if self._mesh(value) and runs and runs[-1][0] is not None:
                runs[-1][1].append(value)  # a DTensor gradient's mesh follows its local tensor
            elif runs and owner is not None and runs[-1][0] == owner:
                runs[-1][1].append(value)
            else:
                runs.append((owner, [value]))
        new_outputs: list[Any] = []
        grads = 0  # layer values (not meshes) the stamped layers add to the template's
        k = 0
        while k < len(runs):
            owner, values = runs[k]
            triple = dict(runs[k : k + TEMPLATE_LAYERS])
            if list(triple) != list(self.ids) or len(triple[self.ids[1]]) != len(
                triple[self.ids[2]]
            ):  # outside the layers, or one layer's value (a stage's output)
                new_outputs += [self._outside(v) if isinstance(v, fx.Node) else v for v in values]
                k += 1
                continue
            for unit in self.copies:
                values = triple[unit.source]
                new_outputs += [self._outside(v) if self._mesh(v) else unit.env[v] for v in values]
                grads += sum(not self._mesh(v) for v in values)
            grads -= sum(not self._mesh(v) for layer in self.ids for v in triple[layer])
            k += TEMPLATE_LAYERS
        params = sum(spec.kind == "param" for _, spec, _, _ in self.placeholders)
        added = params - sum(spec.kind == "param" for spec in self.template.inputs)
        if grads != added:
            raise StampRefused("the gradients do not follow the parameters layer by layer")
        new = self.graph.output(type(outputs)(new_outputs))
        new.meta = dict(node.meta)
        if isinstance(node.meta.get("seq_nr"), int):
            new.meta["seq_nr"] = node.meta["seq_nr"] + self.shift
