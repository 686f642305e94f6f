"""The explorer's navigation: which view is open, which op is selected, what a search finds and
where the estimated peak happens; the front end centres what `focus` names.

Entry point: `Navigation` (`select`, `show`, `search`, `reveal`, `go_to_peak`,
`set_graph_aspect`, `set_graph_panel`), one of the concerns `ExplorerModel` combines.
"""

from __future__ import annotations

import itertools

from workbench.decide.decider import decidable
from workbench.errors import WorkbenchError
from workbench.show.viz import svg_id
from workbench.show.widgets.core import ExplorerCore
from workbench.show.widgets.panels import (
    match_words,
    peak_twins,
    peak_words,
    search_matches,
    timeline_panel,
)
from workbench.units import format_bytes

__all__ = ["Navigation"]

# Every focus request of the process, numbered once: a front end centres a request whose
# number it has not handled yet, so two sessions shown in one view (a pipelined job's stages)
# never hand it a number it has already seen.
_FOCUS_SERIALS = itertools.count(1)


class Navigation(ExplorerCore):
    """Views, the selection, search and Go to peak: none of them changes the policy."""

    _search: tuple[str, int] = ("", -1)  # the last query and the index of its match shown

    def select(self, name: str) -> None:
        if name not in self.graph.nodes:
            raise WorkbenchError(f"no node {name!r} in {self.graph.model_name!r}")
        self.selected, self.selected_id = name, svg_id("n", name)
        self.details = self._details(name)
        self._timeline = timeline_panel(self.estimate, self.estimator, self.decisions, name)

    def show(self, view: str) -> None:
        """`overview`, `layer:N` or `module:PATH`."""
        previous = self.canvas.view
        self.canvas.view = view
        try:
            self._draw()
        except WorkbenchError:
            self.canvas.view = previous
            raise

    def set_graph_aspect(self, aspect: float) -> None:
        """The picture panel's width / height (the front end says it): the view is arranged
        again to fill it."""
        self.set_graph_panel(aspect, self.canvas.width)

    def set_graph_panel(self, aspect: float, width: int) -> None:
        """The picture panel's width / height and its width in pixels (the front end says
        both): the view is arranged again to show the most of it with labels legible."""
        if self.canvas.set_panel(aspect, width):
            self._draw()

    def search(self, query: str) -> str:
        """Open the view holding the first forward op whose name, op or module contains
        `query` and select it; the same query again moves to the next match."""
        if not isinstance(query, str):
            raise TypeError(f"search: query must be text, got {query!r}")
        text = query.strip().lower()
        if not text:
            raise WorkbenchError("type part of a node name (mm_4), an op (mm) or a module (wo)")
        matches = search_matches(self.graph, text)
        if not matches:
            raise WorkbenchError(
                f"no forward op matches {query.strip()!r} by node name, op or module"
            )
        previous, index = self._search
        index = (index + 1) % len(matches) if previous == text else 0
        self._search = (text, index)
        name = matches[index]
        self.reveal(name)
        self.message = match_words(self.graph.nodes[name], index, len(matches), query.strip())
        return name

    def reveal(self, name: str) -> None:
        """Open the view that draws `name` (its layer, else its module), select and centre it."""
        info = self.graph.nodes.get(name)
        if info is None:
            raise WorkbenchError(f"no node {name!r} in {self.graph.model_name!r}")
        if info.layer is not None:
            self.show(f"layer:{info.layer}")
        elif info.module:
            self.show(f"module:{info.module}")
        else:
            raise WorkbenchError(f"{name} lies outside every module; it is not drawn alone")
        self.select(name)
        target = svg_id("n", name) if decidable(info) else svg_id("b", info.module)
        self.focus = {
            "id": target,
            "ids": self.picture.around(target),
            "serial": next(_FOCUS_SERIALS),
        }

    def go_to_peak(self) -> None:
        """Open the view where the estimated peak happens, centred on the op that stands for
        it: the op itself (for its recomputed copy or offload steps too), or the forward ops
        of the module whose backward runs at the peak."""
        est = self.estimate
        name, twins = peak_twins(self.graph, self.estimator, est.peak_node)
        if not twins:
            raise WorkbenchError(f"the peak is at {est.peak_node}, which no view draws")
        self.reveal(twins[0])
        where = peak_words(self.graph, self.decisions, name, est.peak_node)
        phase = self.graph.nodes[name].phase
        peak = format_bytes(est.peak_bytes)
        self.message = f"peak {peak} while {est.peak_node} runs ({phase}): {where}"
