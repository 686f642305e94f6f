"""Pictures of the joint graph and its decisions: networkx export, Graphviz views (overview,
layer, diff), and matplotlib plots of memory and trade-offs.

Entry points: `render_view(graph, decisions, "overview" | "layer:N" | ..., aspect=...) -> View`
(its `elements` say what each drawn id stands for; `aspect` arranges it to fill a panel),
`diff` (its `render(..., context=k)` crops to what changed), the plots.
"""

from workbench.show.viz.arrange import ARRANGEMENTS, arrange
from workbench.show.viz.diff import PolicyDiff, diff, remat_diff
from workbench.show.viz.elements import Element, ElementKind, Elements
from workbench.show.viz.hierarchy import (
    Overview,
    expand,
    near_changes,
    overview,
    render_overview,
)
from workbench.show.viz.network import DiffRow, to_networkx
from workbench.show.viz.plots import (
    pareto_front,
    plot_layer_saved_bytes,
    plot_memory_timeline,
    plot_tradeoff,
    save_figure,
)
from workbench.show.viz.render import MAX_LAYOUT_NODES, View, op_view, to_svg, whole_graph
from workbench.show.viz.style import svg_id
from workbench.show.viz.views import VIEWS, parse_view, render_view

__all__ = [
    "ARRANGEMENTS",
    "MAX_LAYOUT_NODES",
    "VIEWS",
    "DiffRow",
    "Element",
    "ElementKind",
    "Elements",
    "Overview",
    "PolicyDiff",
    "View",
    "arrange",
    "diff",
    "expand",
    "near_changes",
    "op_view",
    "overview",
    "pareto_front",
    "parse_view",
    "plot_layer_saved_bytes",
    "plot_memory_timeline",
    "plot_tradeoff",
    "remat_diff",
    "render_overview",
    "render_view",
    "save_figure",
    "svg_id",
    "to_networkx",
    "to_svg",
    "whole_graph",
]
