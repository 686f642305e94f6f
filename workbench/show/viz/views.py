"""Named views, as the CLI and the explorer ask for them: `overview`, `layer:N`,
`module:PATH`, `diff:OTHER_POLICY`, `graph` (every op; small graphs only).

Entry point: `render_view(graph, decisions, view, ...) -> View`; `parse_view(view)` checks one.
"""

from __future__ import annotations

import torch.fx as fx

from workbench.capture.graph import JointGraph
from workbench.decide.decider import Decisions, decide
from workbench.decide.policy import parse_policy
from workbench.errors import WorkbenchError
from workbench.show.viz.arrange import arrange, laid_out
from workbench.show.viz.diff import diff
from workbench.show.viz.hierarchy import expand, render_overview
from workbench.show.viz.render import View, whole_graph

__all__ = [
    "VIEWS",
    "parse_view",
    "render_view",
]

VIEWS = ("overview", "layer:N", "module:PATH", "diff:OTHER_POLICY", "graph")


def parse_view(view: str) -> tuple[str, str]:
    """`layer:3` -> ("layer", "3"); raises WorkbenchError listing the valid views."""
    kind, sep, arg = view.partition(":")
    valid = (kind in ("overview", "graph") and not sep) or (
        kind in ("layer", "module", "diff") and arg
    )
    if kind == "layer" and not arg.isdigit():
        valid = False
    if not valid:
        raise WorkbenchError(f"unknown view {view!r}; valid views are {', '.join(VIEWS)}")
    return kind, arg


def render_view(
    graph: JointGraph,
    decisions: Decisions | None,
    view: str,
    *,
    policy_name: str = "",
    gm: fx.GraphModule | None = None,
    force: bool = False,
    aspect: float | None = None,
    arrangement: str | None = None,
    width: int | None = None,
) -> View:
    """Build the named view. `diff:OTHER` compares `decisions` (named `policy_name`) with
    the preset or policy file OTHER, drawn on the overview. `arrangement` lays it out as
    named (`arrange.ARRANGEMENTS`); else `aspect` (a panel's width / height, and its `width`
    in pixels where known) picks the one that fills such a panel best; else it is drawn top
    to bottom."""
    picture = _view(graph, decisions, view, policy_name, gm, force)
    if arrangement is not None:
        return laid_out(picture, arrangement)
    return picture if aspect is None else arrange(picture, aspect, width)


def _view(
    graph: JointGraph,
    decisions: Decisions | None,
    view: str,
    policy_name: str,
    gm: fx.GraphModule | None,
    force: bool,
) -> View:
    kind, arg = parse_view(view)
    label = f" · policy {policy_name}" if policy_name else ""
    if kind == "overview":
        return render_overview(
            graph, decisions, title=f"{graph.model_name}{label}: overview by module"
        )
    if kind == "graph":
        return whole_graph(graph, decisions, gm=gm, force=force)
    if kind == "diff":
        other = decide(graph, parse_policy(arg))
        changed = diff(graph, decisions or {}, other, names=(policy_name or "this policy", arg))
        return changed.render(graph)
    return expand(graph, decisions, f"{kind}:{arg}", gm=gm, force=force)
