"""The explorer's model: one exploring session over a graph, in plain Python. It holds what the
widget shows and runs every action its buttons and clicks call, so it is tested without
Jupyter; `workbench.show.widgets.explorer.PolicyExplorer` mirrors it into synced traitlets.

Entry point: `ExplorerModel(graph_or_workload_or_model_name, policy, autosave=...)`; actions
(`click`, `flip`, `search`, `suggest`, `sweep`, `run`, ...) update the attributes named in
`STATE`, and `on_change` is called while a long action (Run, Suggest, Sweep) is under way.
Each concern is a module of its own (`docs/design.md`, "The explorer"): the shared state and
the refresh (`core`), navigation, editing, solving, exporting and measured.
"""

from __future__ import annotations

from workbench.show.widgets.editing import Editing
from workbench.show.widgets.exporting import Exporting
from workbench.show.widgets.measured import Measured
from workbench.show.widgets.navigation import Navigation
from workbench.show.widgets.solving import Solving
from workbench.show.widgets.sources import load_source

__all__ = ["STATE", "ExplorerModel", "load_source"]

# What a front end shows: the model's attributes, each mirrored into a traitlet of that name.
STATE: tuple[str, ...] = (
    # the picture panel and navigation
    "svg",
    "view",
    "legend",
    "selected",
    "selected_id",
    "peak_ids",
    "focus",
    "graph_aspect",
    "graph_width",
    "modules",
    "ops",
    # the estimate panel and the history
    "details",
    "metrics",
    "timeline",
    "history",
    "history_plots",
    "profile",
    "baselines",
    # the policy and its edits
    "all_layers",
    "policy_json",
    "offload_text",
    "can_undo",
    "can_redo",
    "has_fsdp",
    "fsdp_reshard",
    # the export
    "export_format",
    "export_code",
    "export_path",
    # Suggest, Sweep and Run
    "running",
    "run_refusal",
    "status",
    "run_result",
    "budget_range",
    "suggest_method",
    "suggest_host_budget_bytes",
    # the message line
    "message",
)


class ExplorerModel(Navigation, Editing, Solving, Exporting, Measured):
    """Click an op to flip it, a module box to expand it; metrics come from the exact
    what-if estimate after every change; Run remats with torch's pass and measures for real.
    Every change is undoable and autosaved to `autosave` as JSON.

    Actions raise `WorkbenchError` (nothing changes then), except `click`, which explains
    itself on the message line; `explained()` turns errors into that line for callers.
    """

    def click(self, element_id: str, *, select_only: bool = False) -> None:
        """A click in the picture, by what the view says the element is: an op flips (and is
        selected), a module box or folded layers' frame opens, anything else explains
        itself."""
        with self.explained():
            element = self.canvas.element(element_id)
            if element is None or element.kind == "input":
                self.message = "this element has no decision to flip: click an op or a module"
            elif element.kind in ("op", "copy"):
                self.select(element.name)
                if not select_only:
                    self.flip(element.name)
            elif element.kind == "layers":
                self.show(f"layer:{element.layers[0]}")
            elif element.kind == "module" and not element.name:
                self.message = "ops outside any module: expand a layer or module instead"
            elif element.kind == "module":
                self.show(f"module:{element.name}")
            else:
                self.message = (
                    f"backward ops of {element.name} read these values; backward ops are never "
                    "saved or recomputed, so there is nothing to flip"
                )
