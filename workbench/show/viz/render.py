"""Op-level Graphviz pictures: one node per FX node, coloured by its save/recompute decision.

Entry points: `op_view(graph, names, decisions) -> View` (a chosen set of nodes, their
outside inputs and backward readers summarised), `whole_graph(...)`, `to_svg`, `write`.
Every `View` says what each of its elements stands for (`View.elements`); `op_elements(graph)`
the same for every op and backward summary any op view may draw.
"""

from __future__ import annotations

import collections
import html
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import graphviz
import torch.fx as fx

from workbench.capture.graph import JointGraph, short_op
from workbench.cost.replay import recompute_flops_by_node, saved_bytes_by_node
from workbench.decide.decider import Decisions
from workbench.decide.tags import Why
from workbench.errors import WorkbenchError
from workbench.files import write_file
from workbench.show.viz.elements import Element, Elements
from workbench.show.viz.network import (
    DiffRow,
    forward_side,
    is_offload,
    is_recompute,
    node_facts,
    original_of,
)
from workbench.show.viz.style import (
    BLUE,
    COLLECTIVE_STYLE,
    COLLECTIVE_WORDS,
    DECISION_KINDS,
    FADED,
    GREEN,
    GREY,
    KIND_STYLE,
    ORANGE,
    Kind,
    forced_words,
    is_collective,
    kind_rows,
    legend_label,
    node_kind,
    short_shape,
    svg_id,
)
from workbench.units import format_bytes, format_flops

__all__ = [
    "Changes",
    "Drawing",
    "EDGE_WORDS",
    "FORMATS",
    "MAX_LAYOUT_NODES",
    "OFFLOAD_EDGE_WORDS",
    "View",
    "check_layout_size",
    "new_digraph",
    "op_elements",
    "op_view",
    "to_svg",
    "whole_graph",
    "write",
]

# dot needs 70-125 s for ~2,000 op nodes: past this, ask for the overview instead.
MAX_LAYOUT_NODES = 1500

# Fewer network-simplex and crossing-minimisation passes: a two-layer joint graph (500 ops)
# lays out in 2 s instead of minutes, at the cost of a few more edge crossings.
QUICK_LAYOUT_ABOVE = 200
QUICK_LAYOUT = {"nslimit": "2", "mclimit": "0.3"}

# What an op view's box shows, and where an SVG shows the rest (its tooltips): pictures
# written as images without tooltips (`STILL_FORMATS`) leave out the hover words.
BOX_WORDS = "box: op · output shape and dtype · output size"
HOVER_WORDS = "; hover for node name and reason"
STILL_FORMATS = ("png", "pdf")
# What the edges into a backward note mean (the static legend's and the explorer's words).
EDGE_WORDS = (
    "blue edge into a note: value kept in memory until backward reads it",
    "orange dashed edge: backward needs it, but it is recomputed instead of kept",
)
OFFLOAD_EDGE_WORDS = "green edge: kept in host memory (offloaded), reloaded before backward"

# node name -> its diff row: what a diff picture highlights.
Changes = Mapping[str, DiffRow]

FONT = "Helvetica"
FORMATS = ("svg", "png", "pdf", "dot")


@dataclass
class Drawing:
    """What an op view draws before it is arranged: nodes (id -> Graphviz attributes, label
    included) and edges (tail, head, attributes) in drawing order, so that the same picture
    can be laid out again in another arrangement (`workbench.show.viz.arrange`)."""

    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    edges: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    order: list[str | int] = field(default_factory=list)  # node ids and edge indices as drawn

    def node(self, node_id: str, label: str, **attrs: str) -> None:
        self.nodes[node_id] = {"label": label, "id": node_id, **attrs}
        self.order.append(node_id)

    def edge(self, tail: str, head: str, **attrs: str) -> None:
        self.order.append(len(self.edges))
        self.edges.append((tail, head, attrs))

    def digraph(self, dot: graphviz.Digraph) -> graphviz.Digraph:
        """`dot` (a graph with its attributes and no body) holding the drawing as drawn."""
        for item in self.order:
            if isinstance(item, str):
                dot.node(item, **self.nodes[item])
            else:
                tail, head, attrs = self.edges[item]
                dot.edge(tail, head, **attrs)
        return dot


@dataclass
class View:
    """A laid-out-on-demand picture: the Graphviz graph, how many nodes and edges it has, and
    what each element id stands for. Jupyter shows it as SVG.

    `legend_rows` are the colour samples its legend explains, (colour, words) from
    `style.KIND_STYLE`, for a front end that draws its own legend; `links` the drawn edges
    between element ids; `drawing` what an op view was drawn from (None for the overview);
    `arrangement` how it is laid out (`workbench.show.viz.arrange`).
    """

    dot: graphviz.Digraph
    nodes: int
    edges: int
    elements: Elements = field(default_factory=dict)
    legend_rows: list[tuple[str, str]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    drawing: Drawing | None = None
    arrangement: str = "TB"

    def around(self, element_id: str, hops: int = 1) -> list[str]:
        """`element_id` and the elements within `hops` drawn edges of it, in drawing order:
        what must be in view to see an element with its neighbourhood.

        >>> ops = {name: Element("op", name) for name in "abc"}
        >>> view = View(graphviz.Digraph(), 3, 2, ops, links=[("a", "b"), ("b", "c")])
        >>> view.around("c"), view.around("c", hops=2)
        (['b', 'c'], ['a', 'b', 'c'])
        """
        near = {element_id}
        for _ in range(hops):
            near |= {v for u, v in self.links if u in near} | {
                u for u, v in self.links if v in near
            }
        return [i for i in self.elements if i in near]

    @property
    def collectives(self) -> list[str]:
        """Ids of the communication ops drawn (hexagons)."""
        return [i for i, element in self.elements.items() if element.collective]

    def svg(self, legend: bool = True) -> str:
        """The SVG; `legend=False` leaves out the title and legend (a front end that draws
        its own beside the picture)."""
        if legend:
            return to_svg(self.dot)
        bare = self.dot.copy()
        bare.graph_attr["label"] = ""
        return to_svg(bare)

    def write(self, path: str | Path, overwrite: bool = False) -> Path:
        return write(self.dot, path, overwrite)

    def _repr_svg_(self) -> str:
        return self.svg()

    def __repr__(self) -> str:
        """The text a front end shows when it withholds SVG (an untrusted notebook)."""
        return (
            f"Graphviz picture: {self.nodes} nodes, {self.edges} edges. Its SVG is hidden "
            "because this notebook is not trusted: File > Trust Notebook, or `jupyter trust "
            "NOTEBOOK` (`make lab` does it); `.write('view.png')` saves it as an image."
        )


def check_layout_size(count: int, force: bool) -> None:
    if count > MAX_LAYOUT_NODES and not force:
        raise WorkbenchError(
            f"this view has {count} nodes; Graphviz needs minutes for more than "
            f"{MAX_LAYOUT_NODES}. Use the overview (view 'overview'), one layer "
            "('layer:N') or one module ('module:PATH'), or pass force=True (--force)"
        )


def new_digraph(name: str, label: str, rankdir: str = "TB") -> graphviz.Digraph:
    return graphviz.Digraph(
        name=name,
        graph_attr={
            "rankdir": rankdir,
            "label": label,
            "labelloc": "t",
            "labeljust": "l",
            "fontname": FONT,
            "fontsize": "12",
            "nodesep": "0.25",
            "ranksep": "0.35",
        },
        node_attr={"shape": "box", "style": "filled,rounded", "fontname": FONT, "fontsize": "10"},
        edge_attr={"fontname": FONT, "fontsize": "9", "color": "#555555"},
    )


def _op_label(
    graph: JointGraph,
    name: str,
    decisions: Decisions | None,
    kept: tuple[dict[str, int], dict[str, int]],
    change: DiffRow | None,
) -> str:
    info = node_facts(graph, name)
    assert info is not None
    lines = [short_op(info.op), short_shape(info), format_bytes(info.bytes)]
    if original_of(name) is not None and name not in graph.nodes:
        lines[0] += " (recomputed copy)"
    elif forward_side(info) and name in kept[1] and is_offload(decisions, name):
        lines[2] += " · offloaded for bwd"
    elif forward_side(info) and name in kept[1]:
        lines[2] += " · kept for bwd"
    elif forward_side(info) and name in kept[0] and is_recompute(decisions, name):
        lines[2] += " · recomputed for bwd"
    decision = (decisions or {}).get(name)
    if decision is not None and decision.forced:
        lines.append(forced_words(decision))
    if change is not None:
        lines.append(f"changed: {change.before} → {change.after}")
    return "\n".join(lines)


def _tooltip(graph: JointGraph, name: str, decisions: Decisions | None) -> str:
    info = node_facts(graph, name)
    assert info is not None
    decision = (decisions or {}).get(name)
    parts = [name, info.op, f"module: {info.module or '(top level)'}", f"phase: {info.phase}"]
    if info.flops:
        parts.append(f"FLOPs: {format_flops(info.flops)}")
    if decision is not None:
        parts.append(f"{decision.policy.name} ({decision.reason})")
    if info.source:
        parts.append(info.source)
    return "\n".join(parts)


def _kind(graph: JointGraph, name: str, decisions: Decisions | None) -> Kind:
    if original_of(name) is not None and name not in graph.nodes:
        return "recomputed_copy"
    info = node_facts(graph, name)
    assert info is not None
    return node_kind(info, (decisions or {}).get(name))


def _attrs(kind: Kind, change: DiffRow | None, diffing: bool) -> dict[str, str]:
    attrs = dict(KIND_STYLE[kind][0])
    if "style" in attrs:
        attrs["style"] += ",rounded"
    if diffing and change is None and kind != "recomputed_copy":
        attrs.update(fillcolor=FADED, fontcolor="#888888")
        attrs.pop("peripheries", None)
    if change is not None:
        attrs.update(penwidth="3", color="#000000")
    return attrs


def _legend_rows(
    kinds: Iterable[Kind], diffing: bool, fsdp: Iterable[Kind] = ()
) -> list[tuple[str, str]]:
    rows = kind_rows(kinds, fsdp)
    rows.append((GREY, "note: backward ops of that module reading values from here"))
    if diffing:
        rows.append((FADED, "unchanged between the two policies"))
    return rows


def op_view(
    graph: JointGraph,
    names: Iterable[str],
    decisions: Decisions | None = None,
    *,
    gm: fx.GraphModule | None = None,
    changes: Changes | None = None,
    title: str = "",
    force: bool = False,
) -> View:
    """One box per node in `names` (graph order kept), plus `*_recomputed` copies of them
    when `gm` (a remat output) is given. Forward values from outside the set appear as one
    "from MODULE" input per module; backward readers as one grey note per backward module,
    reached by a blue edge (value kept) or an orange dashed one (value recomputed).

    Raises WorkbenchError past MAX_LAYOUT_NODES unless `force`.
    """
    source = {n.name: n for n in (gm or graph.gm).graph.nodes}
    shown = list(dict.fromkeys(names))
    unknown = [n for n in shown if n not in graph.nodes]
    if unknown:
        raise WorkbenchError(f"no such nodes in {graph.model_name!r}: {', '.join(unknown[:5])}")
    copies = [] if gm is None else [f"{n}_recomputed" for n in shown if f"{n}_recomputed" in source]
    check_layout_size(len(shown) + len(copies), force)
    ops = _OpSet(shown, copies, source)
    infos = {n: node_facts(graph, n) for n in ops.members}
    collectives = {n for n, info in infos.items() if info is not None and is_collective(info)}
    # What autograd keeps, and what stays kept under `decisions` (storages by their owner).
    kept = saved_bytes_by_node(graph, None), saved_bytes_by_node(graph, decisions)
    lines, rows = _op_legend(graph, ops, decisions, kept[1], changes, collectives)
    drawing = Drawing()
    elements: Elements = {}
    _draw_ops(drawing, elements, graph, ops, decisions, kept, changes, collectives)
    outside, readers = _draw_inputs(drawing, elements, graph, ops)
    _draw_backward_readers(drawing, elements, readers, ops, decisions)
    _draw_copy_edges(drawing, ops)
    dot = new_digraph(
        "ops", legend_label(title or f"{graph.model_name}: {len(shown)} ops", lines, rows)
    )
    if len(ops.members) > QUICK_LAYOUT_ABOVE:
        dot.graph_attr.update(QUICK_LAYOUT)
    drawing.digraph(dot)
    links = [(tail, head) for tail, head, _ in drawing.edges]
    count = len(ops.members) + len(outside) + len(readers)
    return View(dot, count, len(links), elements, rows, links, drawing)


@dataclass(frozen=True)
class _OpSet:
    """The nodes an op view draws: the chosen ones in graph order, their recomputed copies
    in the remat output, and the graph the edges are read from (that output, or the
    traced graph)."""

    shown: list[str]
    copies: list[str]
    source: dict[str, fx.Node]

    @property
    def members(self) -> set[str]:
        return set(self.shown) | set(self.copies)


def _op_legend(
    graph: JointGraph,
    ops: _OpSet,
    decisions: Decisions | None,
    kept: dict[str, int],
    changes: Changes | None,
    collectives: set[str],
) -> tuple[list[str], list[tuple[str, str]]]:
    """The legend's lines (what the view keeps and runs again, what boxes, hovers and edges
    mean) and its colour rows, for the kinds of box the view holds."""
    redone = recompute_flops_by_node(graph, decisions)
    fwd = [n for n in ops.shown if forward_side(graph.nodes[n])]
    lines = [
        f"kept for backward here: {format_bytes(sum(kept.get(n, 0) for n in fwd))}"
        f" · run again in backward here: {format_flops(sum(redone.get(n, 0) for n in fwd))}",
        BOX_WORDS + HOVER_WORDS,
        *EDGE_WORDS,
    ]
    kinds: list[Kind] = [*DECISION_KINDS, "backward"]
    if any(is_offload(decisions, n) for n in fwd):  # only then: pictures without stay as were
        lines.append(OFFLOAD_EDGE_WORDS)
        kinds.insert(len(DECISION_KINDS), "offload")
    if ops.copies:
        kinds.append("recomputed_copy")
    if collectives:
        lines.append(COLLECTIVE_WORDS)
    tags = decisions or {}
    fsdp = {_kind(graph, n, decisions) for n in ops.shown if n in tags and tags[n].why is Why.FSDP}
    return lines, _legend_rows(kinds, changes is not None, fsdp)


def _draw_ops(
    drawing: Drawing,
    elements: Elements,
    graph: JointGraph,
    ops: _OpSet,
    decisions: Decisions | None,
    kept: tuple[dict[str, int], dict[str, int]],
    changes: Changes | None,
    collectives: set[str],
) -> None:
    """A box per op and per recomputed copy, coloured by its decision (faded where a diff
    leaves it unchanged), a hexagon for a collective."""
    diffing = changes is not None
    for name in [*ops.shown, *ops.copies]:
        kind = _kind(graph, name, decisions)
        change = (changes or {}).get(name)
        traced = original_of(name) if name in ops.copies else name
        assert traced is not None
        elements[svg_id("n", name)] = Element(
            "copy" if name in ops.copies else "op",
            traced,
            nodes=(traced,),
            collective=name in collectives,
        )
        attrs = _attrs(kind, change, diffing)
        if name in collectives:  # a hexagon; the box's own style (a copy's dashes) stays
            attrs = {**COLLECTIVE_STYLE, **attrs}
        drawing.node(
            svg_id("n", name),
            _op_label(graph, name, decisions, kept, change),
            tooltip=_tooltip(graph, name, decisions),
            **attrs,
        )


def _draw_copy_edges(drawing: Drawing, ops: _OpSet) -> None:
    """A dashed edge from each original to its recomputed copy, laid out last (no rank
    constraint)."""
    for copy in ops.copies:
        original = original_of(copy)
        assert original is not None
        drawing.edge(
            svg_id("n", original),
            svg_id("n", copy),
            style="dashed",
            color=ORANGE,
            constraint="false",
            tooltip="recomputed copy of this node",
        )


def _draw_inputs(
    drawing: Drawing, elements: Elements, graph: JointGraph, ops: _OpSet
) -> tuple[dict[str, None], dict[str, dict[str, None]]]:
    """The edges between drawn ops, one "from MODULE" input per module whose forward values
    they read; and, per backward module, the drawn values it reads (drawn by
    `_draw_backward_readers`)."""
    joint = {n.name: n for n in graph.gm.graph.nodes}
    members = ops.members
    outside: dict[str, None] = {}
    readers: dict[str, dict[str, None]] = collections.defaultdict(dict)
    for name in [*ops.shown, *ops.copies]:
        node = ops.source.get(name) or joint[name]
        for arg in node.all_input_nodes:
            if arg.name in members:
                drawing.edge(svg_id("n", arg.name), svg_id("n", name))
                continue
            info = node_facts(graph, arg.name)
            if info is not None and forward_side(info) and original_of(arg.name) is None:
                module = info.module
                if module not in outside:
                    outside[module] = None
                    elements[svg_id("i", module)] = Element("input", module)
                    drawing.node(
                        svg_id("i", module),
                        f"from {module or '(top level)'}",
                        shape="plaintext",
                        style="",
                        fontcolor="#555555",
                    )
                drawing.edge(svg_id("i", module), svg_id("n", name), color="#999999")
        if name not in ops.source:
            continue
        for user in ops.source[name].users:
            info = node_facts(graph, user.name)
            if user.name in members or info is None or info.phase != "backward":
                continue
            if original_of(user.name) is not None and user.name not in graph.nodes:
                continue  # recomputed chains outside the view
            readers[info.module][name] = None
    return outside, readers


def _draw_backward_readers(
    drawing: Drawing,
    elements: Elements,
    readers: dict[str, dict[str, None]],
    ops: _OpSet,
    decisions: Decisions | None,
) -> None:
    """A grey note per backward module reading drawn values, reached by a blue edge (kept),
    a green one (offloaded) or an orange dashed one (recomputed)."""
    for module, values in readers.items():
        elements[svg_id("b", module)] = Element("backward", module)
        drawing.node(
            svg_id("b", module),
            f"backward of {module or '(top level)'}\nreads {len(values)} value(s) from here",
            shape="note",
            style="filled",
            fillcolor=GREY,
        )
        for name in values:
            recomputed = is_recompute(decisions, name) or name in ops.copies
            offloaded = not recomputed and is_offload(decisions, name)
            drawing.edge(
                svg_id("n", name),
                svg_id("b", module),
                color=ORANGE if recomputed else GREEN if offloaded else BLUE,
                style="dashed" if recomputed else "solid",
                penwidth="1.2" if recomputed else "2",
            )


def op_elements(graph: JointGraph) -> Elements:
    """The element every op view draws for each op of the graph and for each module's
    backward summary, by id: what a click names when the view it came from is gone."""
    ops = list(graph.ops())
    elements: Elements = {
        svg_id("n", i.name): Element("op", i.name, nodes=(i.name,), collective=is_collective(i))
        for i in ops
    }
    for module in sorted({i.module for i in ops if i.phase == "backward"}):
        elements[svg_id("b", module)] = Element("backward", module)
    return elements


def whole_graph(
    graph: JointGraph,
    decisions: Decisions | None = None,
    *,
    gm: fx.GraphModule | None = None,
    force: bool = False,
) -> View:
    """Every forward, loss and backward op: only for small graphs (see MAX_LAYOUT_NODES)."""
    names = [i.name for i in graph.ops()]
    return op_view(
        graph,
        names,
        decisions,
        gm=gm,
        title=f"{graph.model_name}: the whole step, {len(names)} ops",
        force=force,
    )


def to_svg(dot: graphviz.Digraph) -> str:
    """Lay out with `dot`; the same graph and decisions give byte-identical SVG."""
    return dot.pipe(format="svg", encoding="utf-8")


def write(dot: graphviz.Digraph, path: str | Path, overwrite: bool = False) -> Path:
    """Write SVG, PNG, PDF or DOT source, chosen by the file suffix (never replacing an
    existing file unless `overwrite`). An image without tooltips (PNG, PDF) has no legend
    line that says to hover."""
    target = Path(path)
    fmt = target.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise WorkbenchError(
            f"cannot write {str(target)!r}: suffix must be one of "
            f"{', '.join('.' + f for f in FORMATS)}"
        )
    if fmt in STILL_FORMATS:
        dot = dot.copy()
        label = dot.graph_attr.get("label", "")
        dot.graph_attr["label"] = label.replace(html.escape(HOVER_WORDS), "")
    data = dot.source if fmt == "dot" else dot.pipe(format=fmt)
    return write_file(target, data, overwrite=overwrite)
