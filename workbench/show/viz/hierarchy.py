"""Pictures of big graphs: a module-tree overview with identical layers folded into one box,
and one layer or module expanded to its ops.

Entry points: `overview(graph, decisions) -> Overview` (the numbers), `render_overview(...)`
and `expand(graph, decisions, "layer:N" | "module:PATH") -> View`; a view's `elements` say
which module a box or frame opens and which layers it stands for.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import torch.fx as fx

from workbench.capture.graph import JointGraph, NodeInfo
from workbench.cost.replay import recompute_flops_by_node, saved_bytes_by_node
from workbench.decide.decider import Decisions
from workbench.errors import WorkbenchError
from workbench.show.viz.elements import Element, Elements
from workbench.show.viz.network import forward_side, is_offload, is_recompute
from workbench.show.viz.render import Changes, View, new_digraph, op_view
from workbench.show.viz.style import FADED, ORANGE, SKY, WHITE, legend_label, signed, svg_id
from workbench.units import format_bytes, format_flops

__all__ = [
    "Box",
    "Group",
    "Overview",
    "expand",
    "layer_nodes",
    "near_changes",
    "overview",
    "render_overview",
    "split_layer",
]

Unit = tuple[str, int | None]  # (top-level module or layer container, layer index)


@dataclass
class Box:
    """Forward ops of one module (a layer-relative path when layers are folded)."""

    path: str  # `layers.0–31.attention`, `norm`, `` (top-level ops)
    title: str
    module: str  # what a click opens: `layers.0.attention` (the first layer's), `norm`, ``
    nodes: list[str] = field(default_factory=list)
    saved_bytes: int = 0
    recompute_flops: int = 0
    saved_ops: int = 0
    recompute_ops: int = 0
    offload_ops: int = 0  # among the saved ones
    changed: list[str] = field(default_factory=list)

    @property
    def svg_id(self) -> str:
        return svg_id("m", self.path)


@dataclass
class Group:
    """A top-level module, or a run of consecutive identical layers folded into one."""

    title: str  # `layers.0–31 ×32`, `tok_embeddings`
    layers: tuple[int, ...]
    boxes: dict[str, Box]  # layer-relative key -> box
    path: str = ""  # `layers.0–31`: the title without the count, as its frame's id names it
    module: str = ""  # what a click on its frame opens: `layers.0` (the first layer)

    @property
    def saved_bytes(self) -> int:
        return sum(b.saved_bytes for b in self.boxes.values())

    @property
    def recompute_flops(self) -> int:
        return sum(b.recompute_flops for b in self.boxes.values())


@dataclass
class Overview:
    groups: list[Group]
    edges: list[tuple[str, str]]  # box svg ids, data flow in the forward
    saved_bytes: int
    recompute_flops: int
    forward_ops: int
    backward_ops: int

    def group(self, title: str) -> Group:
        for group in self.groups:
            if group.title == title:
                return group
        raise WorkbenchError(
            f"no group {title!r}; groups are {', '.join(g.title for g in self.groups)}"
        )


def split_layer(module: str) -> tuple[str, int, str] | None:
    """`layers.3.attention.wq` -> ("layers", 3, "attention.wq"); None outside layers."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def _unit(info: NodeInfo, depth: int) -> tuple[Unit, str]:
    """((group prefix, layer), box key) of a forward op."""
    split = split_layer(info.module)
    if split is None:
        top = info.module.split(".")[0]
        return (top, None), top
    prefix, layer, rest = split
    return (prefix, layer), ".".join(rest.split(".")[:depth]) if rest else ""


def _signature(
    graph: JointGraph, names: list[str], decisions: Decisions | None, changes: Changes
) -> tuple[Hashable, ...]:
    """What must match for two layers to fold: ops, sizes, decisions and diff marks."""
    sig = []
    for name in names:
        info = graph.nodes[name]
        decision = (decisions or {}).get(name)
        split = split_layer(info.module)
        sig.append(
            (
                split[2] if split else info.module,
                info.op,
                info.bytes,
                (decision.policy, decision.forced) if decision else None,
                (changes[name].before, changes[name].after) if name in changes else None,
            )
        )
    return tuple(sig)


def _range(prefix: str, layers: tuple[int, ...]) -> str:
    if len(layers) == 1:
        return f"{prefix}.{layers[0]}"
    return f"{prefix}.{layers[0]}–{layers[-1]}"


def _fold(
    graph: JointGraph,
    units: dict[Unit, list[str]],
    decisions: Decisions | None,
    changes: Changes,
) -> list[list[Unit]]:
    """Runs of consecutive units: identical layers of one container share a run."""
    runs: list[list[Unit]] = []
    last_sig: tuple[Hashable, ...] | None = None
    for unit, names in units.items():
        sig = _signature(graph, names, decisions, changes) if unit[1] is not None else None
        previous = runs[-1][-1] if runs else None
        if sig is not None and previous is not None and previous[0] == unit[0] and sig == last_sig:
            runs[-1].append(unit)
        else:
            runs.append([unit])
        last_sig = sig
    return runs


def overview(
    graph: JointGraph,
    decisions: Decisions | None = None,
    *,
    changes: Changes | None = None,
    depth: int = 1,
) -> Overview:
    """Group forward ops by module, `depth` levels below a layer; fold runs of consecutive
    layers whose ops, sizes and decisions are identical. Kept bytes are the saved activation
    bytes of `workbench.cost.replay.saved_bytes_by_node` (the estimate's figure), by the node owning
    each storage; recompute FLOPs those of `recompute_flops_by_node` (the estimate's too: what
    backward runs again, not every op tagged recompute)."""
    changes = changes or {}
    kept = saved_bytes_by_node(graph, decisions)
    redone = recompute_flops_by_node(graph, decisions)
    units: dict[Unit, list[str]] = {}
    box_key: dict[str, str] = {}
    for info in graph.ops():
        if forward_side(info):
            unit, key = _unit(info, depth)
            units.setdefault(unit, []).append(info.name)
            box_key[info.name] = key
    runs = _fold(graph, units, decisions, changes)
    groups: list[Group] = []
    box_of: dict[str, tuple[int, Box]] = {}
    for run in runs:
        prefix, first = run[0]
        layers = tuple(u[1] for u in run if u[1] is not None)
        if first is None:
            title = prefix or "(top level)"
        else:
            title = _range(prefix, layers) + (f" ×{len(layers)}" if len(layers) > 1 else "")
        span = _range(prefix, layers) if layers else prefix
        opens = _range(prefix, layers[:1]) if layers else prefix
        group = Group(title=title, layers=layers, boxes={}, path=span, module=opens)
        for unit in run:
            for name in units[unit]:
                key = box_key[name]
                if key not in group.boxes:
                    path, module = (
                        (f"{span}.{key}".rstrip("."), f"{opens}.{key}".rstrip("."))
                        if layers
                        else (prefix, prefix)
                    )
                    group.boxes[key] = Box(path=path, title=key or title, module=module)
                    if layers and not key:
                        group.boxes[key].title = "(the block's own ops)"
                group.boxes[key].nodes.append(name)
                box_of[name] = (len(groups), group.boxes[key])
        for box in group.boxes.values():
            box.saved_bytes = sum(kept.get(n, 0) for n in box.nodes)
            box.recompute_flops = sum(redone.get(n, 0) for n in box.nodes)
            box.recompute_ops = sum(is_recompute(decisions, n) for n in box.nodes)
            box.offload_ops = sum(is_offload(decisions, n) for n in box.nodes)
            box.saved_ops = len(box.nodes) - box.recompute_ops if decisions else 0
            box.changed = [n for n in box.nodes if n in changes]
        groups.append(group)
    edges: dict[tuple[str, str], None] = {}
    for node in graph.gm.graph.nodes:
        if node.name not in box_of:
            continue
        group_v, box_v = box_of[node.name]
        for arg in node.all_input_nodes:
            if arg.name not in box_of:
                continue
            group_u, box_u = box_of[arg.name]
            same_group_other_layer = (
                group_u == group_v and graph.nodes[arg.name].layer != graph.nodes[node.name].layer
            )
            if box_u is not box_v and not same_group_other_layer:
                edges[(box_u.svg_id, box_v.svg_id)] = None
    fwd = list(box_of)
    return Overview(
        groups=groups,
        edges=list(edges),
        saved_bytes=sum(kept.values()),
        recompute_flops=sum(redone.get(n, 0) for n in fwd),
        forward_ops=len(fwd),
        backward_ops=len(graph.by_phase("backward")),
    )


def _amount(total: float, layers: int, unit: Callable[[float], str]) -> str:
    if not total:
        return "none"
    return unit(total) + (f" ({unit(total / layers)} per layer)" if layers > 1 else "")


def _ops(count: int) -> str:
    return f"{count} op" if count == 1 else f"{count} ops"


def _box_label(box: Box, layers: int, decisions: bool, changes: Changes) -> str:
    lines = [box.title]
    ops = _ops(len(box.nodes) // layers) + (" per layer" if layers > 1 else "")
    if decisions:
        ops += f": {box.saved_ops // layers} tagged save, {box.recompute_ops // layers} recompute"
        if box.offload_ops:
            ops += f", {box.offload_ops // layers} of the saved offloaded"
    lines.append(ops)
    lines.append(f"kept for backward: {_amount(box.saved_bytes, layers, format_bytes)}")
    lines.append(f"recompute: {_amount(box.recompute_flops, layers, format_flops)}")
    if box.changed:
        dbytes = sum(changes[n].saved_bytes_delta for n in box.changed)
        dflops = sum(changes[n].recompute_flops_delta for n in box.changed)
        per = " per layer" if layers > 1 else ""
        lines.append(
            f"CHANGED {_ops(len(box.changed) // layers)}{per}: "
            f"kept {signed(format_bytes(dbytes))}, "
            f"recompute {signed(format_flops(dflops))}" + (" in total" if layers > 1 else "")
        )
    return "\n".join(lines)


def _box_attrs(box: Box, decisions: bool, diffing: bool) -> dict[str, str]:
    if diffing and not box.changed:
        return {"fillcolor": FADED, "fontcolor": "#777777", "style": "filled"}
    attrs = {"style": "filled"}
    if diffing:
        attrs.update(penwidth="3", color="#000000")
    total = box.saved_ops + box.recompute_ops
    if not decisions or total == 0:
        attrs["fillcolor"] = WHITE
    elif box.recompute_ops == 0:
        attrs["fillcolor"] = SKY
    elif box.saved_ops == 0:
        attrs["fillcolor"] = ORANGE
    else:
        attrs.update(style="striped", fillcolor=f"{SKY};{box.saved_ops / total:.3f}:{ORANGE}")
    return attrs


def render_overview(
    graph: JointGraph,
    decisions: Decisions | None = None,
    *,
    changes: Changes | None = None,
    title: str = "",
    depth: int = 1,
) -> View:
    """The overview as a picture: one box per module, layers folded into clusters."""
    diffing = changes is not None
    changes = changes or {}
    data = overview(graph, decisions, changes=changes, depth=depth)
    heading = title or f"{graph.model_name}: overview by module"
    lines = [
        f"whole step{' after the change' if diffing else ''}: kept for backward "
        f"{format_bytes(data.saved_bytes)}, recompute "
        f"{format_flops(data.recompute_flops)}; {data.forward_ops} forward ops, "
        f"{data.backward_ops} backward ops (not drawn)",
        "kept for backward = forward outputs backward reads that are not recomputed",
        "recompute = FLOPs backward runs again (remat's copies of the ops it reads)",
        *[
            f"'{g.title}' = {len(g.layers)} identical layers drawn once; figures are totals"
            for g in data.groups
            if len(g.layers) > 1
        ],
        "expand one with the view 'layer:N' or 'module:PATH'",
    ]
    rows = [
        (SKY, "box colour: share of its ops tagged save (blue)"),
        (ORANGE, "... and tagged recompute (orange), striped by op count"),
    ]
    if diffing:
        dbytes = sum(r.saved_bytes_delta for r in changes.values())
        dflops = sum(r.recompute_flops_delta for r in changes.values())
        lines[0:0] = [
            f"the change: {len(changes)} activations, kept for backward "
            f"{signed(format_bytes(dbytes))}, recompute {signed(format_flops(dflops))}"
        ]
        lines.append("bold black outline: box holds ops whose decision changed (CHANGED line)")
        rows.append((FADED, "unchanged between the two policies"))
    dot = new_digraph("overview", legend_label(heading, lines, rows))
    dot.attr("node", shape="box")
    elements: Elements = {}
    for index, group in enumerate(data.groups):
        layers = len(group.layers)
        if group.layers:
            held = tuple(n for box in group.boxes.values() for n in box.nodes)
            elements[svg_id("g", group.path)] = Element(
                "layers", group.module, group.title, group.layers, held
            )
        for box in group.boxes.values():
            elements[box.svg_id] = Element(
                "module", box.module, box.title, group.layers, tuple(box.nodes)
            )
        if not group.layers:
            (box,) = group.boxes.values()
            dot.node(
                box.svg_id,
                _box_label(box, 1, bool(decisions), changes),
                id=box.svg_id,
                **_box_attrs(box, bool(decisions), diffing),
            )
            continue
        with dot.subgraph(name=f"cluster_{index}") as cluster:
            per_layer = (
                f" · {format_bytes(group.saved_bytes / layers)} kept per layer"
                if layers > 1
                else ""
            )
            cluster.attr(
                label=f"{group.title} · kept {format_bytes(group.saved_bytes)}{per_layer} · "
                f"recompute {format_flops(group.recompute_flops)}",
                style="rounded",
                color="#888888",
                id=svg_id("g", group.path),
            )
            for box in group.boxes.values():
                cluster.node(
                    box.svg_id,
                    _box_label(box, layers, bool(decisions), changes),
                    id=box.svg_id,
                    **_box_attrs(box, bool(decisions), diffing),
                )
    for u, v in data.edges:
        dot.edge(u, v)
    boxes = sum(e.kind == "module" for e in elements.values())
    return View(dot, boxes, len(data.edges), elements, legend_rows=rows, links=list(data.edges))


def layer_nodes(graph: JointGraph, target: str) -> tuple[list[str], str]:
    """Forward ops of `layer:N` or `module:PATH` (the module and everything below it)."""
    forward = [i for i in graph.ops() if forward_side(i)]
    kind, _, arg = target.partition(":")
    if kind == "layer":
        layers = sorted({i.layer for i in forward if i.layer is not None})
        if not arg.isdigit() or int(arg) not in layers:
            choices = f"0–{layers[-1]}" if layers else "none: this model has no layers"
            raise WorkbenchError(f"no layer {arg!r} in {graph.model_name!r}; layers are {choices}")
        return [i.name for i in forward if i.layer == int(arg)], f"layer {arg}"
    if kind == "module":
        names = [i.name for i in forward if i.module == arg or i.module.startswith(arg + ".")]
        if not names:
            modules = sorted({i.module for i in forward})
            close = difflib.get_close_matches(arg, modules, n=3, cutoff=0.5)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise WorkbenchError(
                f"no forward ops in module {arg!r} of {graph.model_name!r}{hint}; modules look "
                f"like {', '.join(modules[:4])}"
            )
        return names, f"module {arg}"
    raise WorkbenchError(f"cannot expand {target!r}: use 'layer:N' or 'module:PATH'")


def near_changes(
    graph: JointGraph, names: list[str], changed: Iterable[str], hops: int
) -> list[str]:
    """Of `names` (graph order kept), the `changed` ones and those within `hops` data-flow
    edges of one (either direction, through `names` only): a changed region with context."""
    members = set(names)
    region = {n for n in changed if n in members}
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    frontier = set(region)
    for _ in range(hops):
        step = set()
        for name in frontier:
            node = nodes[name]
            step |= {m.name for m in (*node.all_input_nodes, *node.users) if m.name in members}
        frontier = step - region
        region |= step
    return [n for n in names if n in region]


def expand(
    graph: JointGraph,
    decisions: Decisions | None,
    target: str,
    *,
    gm: fx.GraphModule | None = None,
    changes: Changes | None = None,
    title: str = "",
    force: bool = False,
    context: int | None = None,
) -> View:
    """One layer (`layer:N`) or module (`module:PATH`) at op level, with the backward ops
    that read its activations summarised per backward module. With `changes` and `context`,
    only the changed ops and those within `context` edges of one (`near_changes`): a diff
    cropped to what changed."""
    names, what = layer_nodes(graph, target)
    heading = title or f"{graph.model_name}: {what}, {len(names)} forward ops"
    if context is not None:
        if context < 0:
            raise WorkbenchError(f"context must be 0 or more hops, not {context}")
        shown = near_changes(graph, names, changes or {}, context)
        if not shown:
            where = sorted({_where(graph.nodes[n]) for n in changes or {}})
            raise WorkbenchError(
                f"no op changed in {what}; changes are in {', '.join(where) or 'no view'}"
            )
        changed = sum(n in (changes or {}) for n in shown)
        heading += (
            f" · cropped: {_ops(changed)} changed here and the ops up to {context} edge(s) "
            f"from them, {len(shown)} of {len(names)} drawn"
        )
        names = shown
    return op_view(graph, names, decisions, gm=gm, changes=changes, title=heading, force=force)


def _where(info: NodeInfo) -> str:
    """The view that draws an op: `layer:N`, or `module:PATH` outside the layers."""
    return f"layer:{info.layer}" if info.layer is not None else f"module:{info.module}"
