"""Fitting a picture to the panel that shows it: of the Graphviz arrangements of a view (top to
bottom, left to right, or a long top-to-bottom chain wrapped into side-by-side columns), the
one whose drawing a panel of the given aspect shows at the largest scale; for a panel of a
known width, the one it shows the most of at a legible scale (where none fits whole, one cut
at the right while the panel's bottom stays empty loses to one that fills it).

Entry points: `arrange(view, aspect, width) -> View`, `fit_scale(size, panel)` and
`on_screen(size, panel, legible)`; `ARRANGEMENTS` names them. Graphviz lays out every
candidate; nothing here places a node itself.
"""

from __future__ import annotations

import dataclasses

import graphviz
import networkx as nx

from workbench.errors import WorkbenchError
from workbench.show.viz.render import Drawing, View

__all__ = [
    "ARRANGEMENTS",
    "ASPECTS",
    "MAX_COLUMNS",
    "PANEL_ASPECT",
    "arrange",
    "drawn_size",
    "fit_scale",
    "laid_out",
    "on_screen",
    "panel_aspect",
]

MAX_COLUMNS = 4  # a long chain wraps into at most this many columns
ARRANGEMENTS = ("TB", "LR", *(f"TB/{k}" for k in range(2, MAX_COLUMNS + 1)))
# A candidate replaces the plain top-to-bottom drawing only when it is this much larger on
# screen: a view does not jump between arrangements for a few points.
GAIN = 1.1
PANEL_ASPECT = 1.6  # the explorer's picture panel, width / height, until its front end says
ASPECTS = (0.1, 10.0)  # the panel aspects a picture is arranged for
# How the explorer's front end fits a picture (`explorer.js`): labels never below LEGIBLE_PX
# pixels, nor above MAX_SCALE times their size.
LEGIBLE_PX = 9
MAX_SCALE = 1.5


def panel_aspect(aspect: object) -> float:
    """A panel's width / height, checked: a number within `ASPECTS`.

    >>> panel_aspect(2)
    2.0
    """
    if isinstance(aspect, bool) or not isinstance(aspect, int | float):
        raise WorkbenchError(f"panel aspect must be a number, not {type(aspect).__name__}")
    if not ASPECTS[0] <= aspect <= ASPECTS[1]:
        raise WorkbenchError(
            f"panel aspect (width / height) must lie in {ASPECTS[0]}–{ASPECTS[1]}, got {aspect!r}"
        )
    return float(aspect)


def fit_scale(size: tuple[float, float], panel: tuple[float, float]) -> float:
    """Screen units per drawing unit when a drawing of `size` fits whole in `panel`.

    >>> fit_scale((200, 100), (100, 100)), fit_scale((100, 400), (800, 200))
    (0.5, 0.5)
    """
    width, height = size
    return min(panel[0] / max(width, 1e-9), panel[1] / max(height, 1e-9))


def on_screen(
    size: tuple[float, float], panel: tuple[float, float], legible: float
) -> tuple[float, float]:
    """How much of a drawing of `size` (points) a panel of `panel` pixels shows as the
    front end fits it (whole where that keeps labels at `legible` pixels per point, else at
    that scale, cut), and at what scale: (fraction shown, pixels per point).

    >>> on_screen((200, 100), (400, 400), 0.9)
    (1.0, 1.5)
    >>> on_screen((1000, 100), (400, 400), 0.9)
    (0.4444444444444444, 0.9)
    """
    scale = max(min(fit_scale(size, panel), MAX_SCALE), legible)
    width, height = size[0] * scale, size[1] * scale
    return min(1.0, panel[0] / max(width, 1e-9)) * min(1.0, panel[1] / max(height, 1e-9)), scale


def drawn_size(dot: graphviz.Digraph) -> tuple[float, float]:
    """Width and height in points of `dot` as Graphviz lays it out, without its title and
    legend (a front end draws its own)."""
    bare = dot.copy()
    bare.graph_attr["label"] = ""
    head = bare.pipe(format="plain", encoding="utf-8").split("\n", 1)[0].split()
    return float(head[2]) * 72, float(head[3]) * 72


def _ranks(drawing: Drawing) -> dict[str, int]:
    """Each node's rank from the top, as `dot` ranks them: the longest chain of edges
    above it, and a node read but fed by none (a weight, an input) just above its first
    reader."""
    flow = nx.DiGraph()
    flow.add_nodes_from(drawing.nodes)
    flow.add_edges_from((t, h) for t, h, a in drawing.edges if a.get("constraint") != "false")
    ranks = {n: k for k, layer in enumerate(nx.topological_generations(flow)) for n in layer}
    for node in flow:
        if flow.in_degree(node) == 0 and flow.out_degree(node) > 0:
            ranks[node] = min(ranks[s] for s in flow.successors(node)) - 1
    return ranks


def _columns(view: View, columns: int) -> graphviz.Digraph:
    """The op view wrapped into `columns` side-by-side columns, each a run of ranks: every
    column an invisible cluster, edges between columns left out of the ranking."""
    drawing = view.drawing
    assert drawing is not None
    ranks = _ranks(drawing)
    length = -(-(max(ranks.values(), default=0) + 1) // columns)
    column = {n: min(r // length, columns - 1) for n, r in ranks.items()}
    dot = graphviz.Digraph(
        name=view.dot.name,
        graph_attr=dict(view.dot.graph_attr),
        node_attr=dict(view.dot.node_attr),
        edge_attr=dict(view.dot.edge_attr),
    )
    # an invisible anchor above each column, chained left to right on one rank: the
    # columns read in order
    dot.graph_attr["newrank"] = "true"
    anchor = {"style": "invis", "label": "", "width": "0", "height": "0", "fixedsize": "true"}
    for k in range(columns):
        with dot.subgraph(name=f"cluster_column_{k}") as sub:
            sub.attr(style="invis", label="")
            sub.node(f"column-{k}", **anchor)
            for node_id in drawing.nodes:
                if column[node_id] == k:
                    sub.node(node_id, **drawing.nodes[node_id])
                    if ranks[node_id] == k * length or (k and ranks[node_id] < k * length):
                        dot.edge(f"column-{k}", node_id, style="invis")
    with dot.subgraph() as top:
        top.attr(rank="same")
        for k in range(columns):
            top.node(f"column-{k}")
    for k in range(1, columns):
        dot.edge(f"column-{k - 1}", f"column-{k}", style="invis")
    for tail, head, attrs in drawing.edges:
        crossing = {"constraint": "false"} if column[tail] != column[head] else {}
        dot.edge(tail, head, **attrs, **crossing)
    return dot


def laid_out(view: View, arrangement: str) -> View:
    """`view` in `arrangement` (one of `ARRANGEMENTS`; wrapping needs an op view)."""
    if arrangement not in ARRANGEMENTS:
        raise WorkbenchError(
            f"unknown arrangement {arrangement!r}; choose one of {', '.join(ARRANGEMENTS)}"
        )
    if arrangement.startswith("TB/"):
        if view.drawing is None:
            raise WorkbenchError(
                f"arrangement {arrangement!r} wraps an op view's ranks; the overview is "
                "arranged 'TB' or 'LR'"
            )
        dot = _columns(view, int(arrangement[3:]))
    else:
        dot = view.dot.copy()
        dot.graph_attr["rankdir"] = arrangement
    return dataclasses.replace(view, dot=dot, arrangement=arrangement)


def arrange(view: View, aspect: float, width: int | None = None) -> View:
    """`view` arranged to fill a panel `aspect` times as wide as high: left to right when
    the plain drawing is wider than the panel, wrapped into columns (op views) when it is
    taller, whichever fits at the largest scale (at least `GAIN` times the plain one's).
    With the panel's `width` in pixels, every arrangement is tried and the one that shows
    the most of the picture with labels legible (`on_screen`) wins, then the largest scale."""
    plain = dataclasses.replace(view, arrangement="TB")
    size = drawn_size(plain.dot)
    if width:
        return _most_shown(view, plain, size, (width, width / panel_aspect(aspect)))
    panel = (panel_aspect(aspect), 1.0)
    best, best_scale = plain, fit_scale(size, panel) * GAIN
    if size[0] / size[1] > aspect:
        tries = ["LR"]
    else:
        tries = [f"TB/{k}" for k in range(2, MAX_COLUMNS + 1)] if view.drawing else []
    for arrangement in tries:
        candidate = laid_out(view, arrangement)
        scale = fit_scale(drawn_size(candidate.dot), panel)
        if scale <= best_scale:
            break  # more columns only make it wider
        best, best_scale = candidate, scale
    return best


def _most_shown(
    view: View, plain: View, size: tuple[float, float], panel: tuple[float, float]
) -> View:
    """Of every arrangement of `view`, the one a panel of `panel` pixels shows the most of
    at a legible scale, then at the largest scale (the plain one's counted `GAIN` times)."""
    legible = LEGIBLE_PX / float(view.dot.node_attr.get("fontsize", "10"))
    shown, scale = on_screen(size, panel, legible)
    best, key = plain, (round(shown, 3), scale * GAIN)
    tries = ["LR", *(f"TB/{k}" for k in range(2, MAX_COLUMNS + 1) if view.drawing)]
    for arrangement in tries:
        candidate = laid_out(view, arrangement)
        shown, scale = on_screen(drawn_size(candidate.dot), panel, legible)
        if (round(shown, 3), scale) > key:
            best, key = candidate, (round(shown, 3), scale)
    return best
