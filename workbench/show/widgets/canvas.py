"""The explorer's picture panel in plain Python: the open view, arranged for the panel's shape
(each view laid out once per shape), and what the library says each of its elements is.

Entry point: `Canvas(graph)`; `draw(decisions, policy, estimate, estimator)` makes the picture
(`picture`, `svg`, `legend`, `peak_ids`), `element(id)` names what a click hit.
"""

from __future__ import annotations

from typing import Any

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimate, Estimator
from workbench.decide.decider import Decisions
from workbench.decide.policy import Policy
from workbench.errors import check_int
from workbench.show.viz import Element, View, render_view
from workbench.show.viz.arrange import PANEL_ASPECT, panel_aspect
from workbench.show.viz.render import op_elements
from workbench.show.widgets.panels import legend_panel, peak_ids

__all__ = ["MAX_PANEL_PX", "Canvas"]

MAX_PANEL_PX = 100_000  # the widest picture panel a front end may say it has


class Canvas:
    """The picture of one view (`overview`, `layer:N` or `module:PATH`) for a panel of
    `aspect` (width / height) and `width` pixels (0: not known yet), with the legend and the
    peak's ids the front end marks."""

    def __init__(self, graph: JointGraph) -> None:
        self.graph = graph
        self.view = "overview"
        self.aspect = PANEL_ASPECT
        self.width = 0
        # (view, aspect) -> arrangement, per panel width (one layout per shape and size)
        self.arranged: dict[tuple[str, float], str] = {}
        self._arranged_at: dict[int, dict[tuple[str, float], str]] = {0: self.arranged}
        self._anywhere: dict[str, Element] = op_elements(graph)
        self.picture: View | None = None
        self.svg = ""
        self.legend: dict[str, Any] = {}
        self.peak_ids: list[str] = []

    def set_aspect(self, aspect: float) -> bool:
        """Take the panel's shape (checked); True when it changed, so the view is drawn
        again."""
        return self.set_panel(aspect, self.width)

    def set_panel(self, aspect: float, width: int) -> bool:
        """Take the panel's shape and its width in pixels (both checked; 0: not known); True
        when either changed, so the view is drawn again."""
        checked = panel_aspect(aspect)
        pixels = check_int("panel width", width, 0, MAX_PANEL_PX, "pixels; 0: not known")
        if (checked, pixels) == (self.aspect, self.width):
            return False
        self.aspect, self.width = checked, pixels
        self.arranged = self._arranged_at.setdefault(pixels, {})
        return True

    def draw(
        self, decisions: Decisions, policy: Policy, estimate: Estimate, estimator: Estimator
    ) -> View:
        """The picture of the current view, and what the library says its elements are."""
        known = (self.view, self.aspect)
        picture = render_view(
            self.graph,
            decisions,
            self.view,
            policy_name=policy.preset,
            aspect=self.aspect,
            arrangement=self.arranged.get(known),
            width=self.width or None,
        )
        self.picture = picture
        self.arranged[known] = picture.arrangement
        self.svg = picture.svg(legend=False)  # the widget draws its legend beside it
        self.legend = legend_panel(self.graph.model_name, self.view, picture, estimate, policy)
        self.peak_ids = peak_ids(self.graph, estimator, estimate.peak_node, picture)
        return picture

    def element(self, element_id: str) -> Element | None:
        """What `element_id` is in the picture, or as any op of the graph."""
        drawn = self.picture.elements.get(element_id) if self.picture is not None else None
        return drawn or self._anywhere.get(element_id)
