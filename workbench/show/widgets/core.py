"""What every concern of the explorer's session shares: the graph and its estimator, the policy
state, the picture panel, the history, the export and autosave files, the message line, and
the one refresh that every change of policy ends in.

Entry point: `ExplorerCore(source, policy, ...)`, the base of the concerns' action classes
(`navigation`, `editing`, `solving`, `exporting`, `measured`) that `ExplorerModel` combines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.capture.kernels import KERNEL_TARGETS
from workbench.capture.models import Workload
from workbench.capture.ops import layer_pattern
from workbench.cost.estimate import BudgetKind, Estimate, check_budget_kind
from workbench.cost.pass_stacks import estimator_for
from workbench.cost.profiles import PROFILES
from workbench.decide.decider import Decisions, decidable
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.search.solve import fsdp_choices
from workbench.show.viz import View
from workbench.show.widgets.autosave import Autosave, graph_key
from workbench.show.widgets.canvas import Canvas
from workbench.show.widgets.exports import Exports
from workbench.show.widgets.history import History, Point
from workbench.show.widgets.panels import (
    budget_slider,
    details_panel,
    history_plots,
    metrics_panel,
    offload_line,
    run_status,
    timeline_panel,
    with_measured,
)
from workbench.show.widgets.policy_state import PolicyState, policy_label, start_policy
from workbench.show.widgets.sources import load_source

__all__ = ["ExplorerCore", "check_profile"]


def check_profile(profile: str) -> str:
    """`profile` when it names a device profile; else the error lists them."""
    if profile not in PROFILES:
        raise WorkbenchError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    return profile


class ExplorerCore:
    """One exploring session's shared state. Each concern's actions (a subclass each) change
    it through `_change` (a new policy, undoable) and `_autosave`, and `_refresh` recomputes
    every panel after a change of policy."""

    def __init__(
        self,
        source: JointGraph | Workload | str,
        policy: Policy | str = "default",
        *,
        profile: str = "h100",
        autosave: str | Path | None = None,
        workload: Workload | None = None,
        passes: str = "workbench",
        budget_kind: BudgetKind = "allocated",
    ) -> None:
        traced, loaded = load_source(source, profile if profile in KERNEL_TARGETS else None)
        self.budget_kind = check_budget_kind(budget_kind)  # what Suggest's and Sweep's hold
        self.workload = workload or loaded
        self.profile = check_profile(profile)
        # the pass stack's graph and what-if (`cost.pass_stacks`): with graph-trainer each
        # flip replays graph trainer's passes on its cleaned graph's indices
        self.passes = passes
        self.estimator = estimator_for(traced, passes, list(PROFILES))
        self.graph = self.estimator.graph
        self.autosave = Autosave.of(self.graph, autosave)
        self.exports = Exports(graph_key(self.graph), self.autosave.path.parent)
        self.on_change: Callable[[], None] = lambda: None
        self.all_layers = True
        self.message = self.status = self.selected = self.selected_id = ""
        self.focus: dict[str, Any] = {}
        self.canvas = Canvas(self.graph)
        self.details: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}
        self._timeline: dict[str, Any] = {}
        # a loaded memory snapshot's live bytes per step and its label, drawn beside the
        # estimate's (`measured.Measured.load_snapshot`)
        self.measured: tuple[list[int], str] | None = None
        self.run_result: dict[str, Any] = {}
        self.running = False
        self.suggest_method = "greedy"
        self.suggest_host_budget_bytes = 0  # host bytes Suggest and Sweep may offload to
        self.history_log = History()
        infos = [i for i in self.graph.nodes.values() if decidable(i)]
        self.modules = sorted({layer_pattern(i.module) for i in infos})
        self.ops = sorted({i.op for i in infos})
        recovered, note = self.autosave.recover(self.graph, start_policy(policy))
        self.state = PolicyState(self.graph, self.estimator, recovered)
        self._take_host_budget(recovered)
        choices = fsdp_choices(self.graph)
        self.has_fsdp = len(choices) > 1
        peaks = [
            self.estimator.estimate(Policy(p, fsdp_reshard=r)).budget_bytes(budget_kind)
            for p in ("full", "none")
            for r in choices
        ]
        self.budget_range = budget_slider(min(peaks), max(peaks))
        self._refresh()
        self.message = note
        self._autosave()

    def __repr__(self) -> str:
        label = policy_label(self.policy_json)
        return f"{type(self).__name__}({self.graph.model_name}, policy {label})"

    # --- the policy state ---------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self.state.policy

    @property
    def decisions(self) -> Decisions:
        return self.state.decisions

    @property
    def estimate(self) -> Estimate:
        """The what-if estimate of the current decisions under the policy's offload options
        (prefetch, defer), computed once per change."""
        return self.state.estimate

    @property
    def policy_json(self) -> dict[str, Any]:
        return self.policy.to_json()

    @property
    def fsdp_reshard(self) -> bool:
        return self.policy.fsdp_reshard

    @property
    def can_undo(self) -> bool:
        return self.state.can_undo

    @property
    def can_redo(self) -> bool:
        return self.state.can_redo

    @property
    def run_refusal(self) -> str:
        """Why Run cannot measure this session's graph, "" when it can: the front end
        disables the button and says this as its tooltip."""
        if self.graph.example_inputs is None or self.workload is None:
            return (
                "Run needs real tensors and the model: open the explorer on a Workload or a "
                "model name (a graph traced on fake tensors can only be estimated)"
            )
        return ""

    @property
    def offload_text(self) -> str:
        """The policy's offload options in words; "" when it keeps the defaults."""
        changed = self.policy.offload != OffloadOptions()
        return offload_line(self.policy.offload) if changed else ""

    # --- the picture panel (`canvas`) ---------------------------------------------------------

    @property
    def view(self) -> str:
        return self.canvas.view

    @property
    def graph_aspect(self) -> float:
        """The picture panel's width / height: views are arranged to fill it."""
        return self.canvas.aspect

    @property
    def graph_width(self) -> int:
        """The picture panel's width in pixels (0 until the front end says it)."""
        return self.canvas.width

    @property
    def picture(self) -> View:
        """The picture of the current view, and what the library says its elements are."""
        assert self.canvas.picture is not None  # drawn by the first refresh
        return self.canvas.picture

    @property
    def svg(self) -> str:
        return self.canvas.svg

    @property
    def legend(self) -> dict[str, Any]:
        return self.canvas.legend

    @property
    def peak_ids(self) -> list[str]:
        return self.canvas.peak_ids

    # --- the estimate panel, the history ------------------------------------------------------

    @property
    def timeline(self) -> dict[str, Any]:
        """Live memory over the step, with a loaded snapshot's line beside it when there is
        one."""
        if self.measured is None:
            return self._timeline
        return with_measured(self._timeline, *self.measured)

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.history_log.to_json(self.profile, self.policy.to_json())

    @property
    def history_plots(self) -> list[dict[str, Any]]:
        return history_plots(self.history, self.profile)

    # --- settings and errors ------------------------------------------------------------------

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Errors become the message line; the policy is whatever it was before."""
        self.message = ""
        try:
            yield
        except WorkbenchError as err:
            self.message = str(err)

    def set_profile(self, profile: str) -> None:
        """The device profile step times are estimated on (the history is re-timed)."""
        self.profile = check_profile(profile)
        self.metrics = metrics_panel(self.estimate, profile, self.estimator)

    # --- what every change ends in ------------------------------------------------------------

    def _change(self, policy: Policy) -> None:
        """Make `policy` current (undoable) and refresh; decided first, so a policy the rules
        refuse changes nothing."""
        if self.state.change(policy):
            self._refresh()

    def _edit(self, policy: Policy, message: str = "") -> None:
        """Make an edited policy current, say so when there is something to say, autosave."""
        self._change(policy)
        if message:
            self.message = message
        self._autosave()

    def _take_host_budget(self, policy: Policy) -> None:
        """An offloading policy with a host budget (the solver's, or one autosaved) sets
        the host budget Suggest and Sweep use, so a session goes on where it was."""
        if policy.offloads and policy.offload.budget_bytes is not None:
            self.suggest_host_budget_bytes = policy.offload.budget_bytes

    def _autosave(self) -> None:
        """Save the policy; a failure or a move to another file is added to the message."""
        note = self.autosave.save(self.policy)
        if note:
            self.message = f"{self.message} · {note}" if self.message else note

    def _refresh(self) -> None:
        """Every panel after a change of policy, and the policy's point in the history."""
        est = self.estimate
        self.metrics = metrics_panel(est, self.profile, self.estimator)
        self._timeline = timeline_panel(est, self.estimator, self.decisions, self.selected)
        self.exports.show(self.policy, self.graph)
        if self.selected:
            self.details = self._details(self.selected)
        self.status = run_status(self.run_result, self.policy)
        self._draw()
        point = Point(self.policy.to_json(), est.peak_bytes, dict(est.step_seconds))
        self.history_log.add(point)

    def _draw(self) -> None:
        self.canvas.draw(self.decisions, self.policy, self.estimate, self.estimator)

    def _details(self, name: str) -> dict[str, Any]:
        """The side panel's rows for op `name`, beside what its preset alone decides."""
        preset = self.state.preset_decisions()
        return details_panel(self.graph, self.estimator, self.decisions, preset, self.policy, name)
