"""The explorer's model: one exploring session over a graph, in plain Python. It holds what the
widget shows and runs every action its buttons and clicks call, so it is tested without
Jupyter; `workbench.show.widgets.explorer.PolicyExplorer` mirrors it into synced traitlets.

Entry point: `ExplorerModel(graph_or_workload_or_model_name, policy, autosave=...)`; actions
(`click`, `flip`, `search`, `suggest`, `sweep`, `run`, ...) update the attributes named in
`STATE`, and `on_change` is called while a long action (Run, Suggest, Sweep) is under way.
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
from workbench.cost.pipelines import estimator_for
from workbench.cost.profiles import PROFILES
from workbench.decide.decider import Decisions, decidable, decide, flip, next_action
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.errors import INT64_MAX, WorkbenchError, check_int
from workbench.search.solve import fsdp_choices
from workbench.show.viz import Elements, View, render_view, svg_id
from workbench.show.viz.arrange import PANEL_ASPECT, panel_aspect
from workbench.show.viz.render import op_elements
from workbench.show.widgets.panels import (
    budget_slider,
    details_panel,
    history_plots,
    legend_panel,
    match_words,
    metrics_panel,
    newly_forced,
    offload_line,
    peak_ids,
    peak_twins,
    peak_words,
    run_status,
    search_matches,
    timeline_panel,
)
from workbench.show.widgets.policy_edits import (
    edited,
    op_switch,
    with_offload,
    with_override,
    with_selector,
    with_selector_action,
    without_selector,
)
from workbench.show.widgets.session import (
    Autosave,
    Edits,
    Exports,
    History,
    Point,
    load_source,
    policy_label,
    start_policy,
)
from workbench.show.widgets.suggest import suggestion
from workbench.units import format_bytes

__all__ = ["STATE", "ExplorerModel", "load_source"]

# What a front end shows: the model's attributes, each mirrored into a traitlet of that name.
STATE: tuple[str, ...] = (
    "svg", "view", "legend", "selected", "selected_id", "peak_ids", "focus", "details",
    "metrics", "timeline", "history", "history_plots", "message", "profile", "all_layers",
    "policy_json", "modules", "ops", "can_undo", "can_redo", "export_format", "export_code",
    "export_path", "running", "status", "run_result", "budget_range", "suggest_method",
    "suggest_host_budget_bytes", "has_fsdp", "fsdp_reshard", "offload_text", "graph_aspect",
)  # fmt: skip
_WORDS = {"save": "saved", "recompute": "recomputed", "offload": "offloaded"}


class ExplorerModel:
    """Click an op to flip it, a module box to expand it; metrics come from the exact
    what-if estimate after every change; Run remats with torch's pass and measures for real.
    Every change is undoable and autosaved to `autosave` as JSON.

    Actions raise `WorkbenchError` (nothing changes then), except `click`, which explains
    itself on the message line; `explained()` turns errors into that line for callers.
    """

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
        if profile not in PROFILES:
            raise WorkbenchError(
                f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}"
            )
        # the pass pipeline's graph and what-if (`cost.pipelines`): with graph-trainer each
        # flip re-runs graph trainer's passes on its cleaned graph
        self.passes = passes
        self.estimator = estimator_for(traced, passes, list(PROFILES))
        self.graph = self.estimator.graph
        self.autosave = Autosave.of(self.graph, autosave)
        self.exports = Exports(self.graph.model_name, self.autosave.path.parent)
        self.on_change: Callable[[], None] = lambda: None
        self.profile, self.view, self.all_layers = profile, "overview", True
        self.message = self.status = self.selected = self.selected_id = ""
        self.focus: dict[str, Any] = {}
        # the picture panel's width / height: views are arranged to fill it
        self.graph_aspect = PANEL_ASPECT
        self._arranged: dict[tuple[str, float], str] = {}  # (view, aspect) -> arrangement
        self.details: dict[str, Any] = {}
        self.run_result: dict[str, Any] = {}
        self.running = False
        self.suggest_method = "greedy"
        self.suggest_host_budget_bytes = 0  # host bytes Suggest and Sweep may offload to
        self.decisions: Decisions = {}
        self._estimate: Estimate | None = None
        self._preset_decisions: dict[tuple[str, bool], Decisions] = {}
        self._search: tuple[str, int] = ("", -1)
        self._anywhere: Elements = op_elements(self.graph)
        self.history_log = History()
        infos = [i for i in self.graph.nodes.values() if decidable(i)]
        self.modules = sorted({layer_pattern(i.module) for i in infos})
        self.ops = sorted({i.op for i in infos})
        start = start_policy(policy)
        recovered, note = self.autosave.recover(self.graph, start)
        self.edits = Edits(recovered)
        self._take_host_budget(recovered)
        choices = fsdp_choices(self.graph)
        self.has_fsdp = len(choices) > 1
        peaks = [
            self.estimator.estimate(Policy(p, fsdp_reshard=r)).budget_bytes(budget_kind)
            for p in ("full", "none")
            for r in choices
        ]
        self.budget_range = budget_slider(min(peaks), max(peaks))
        self._refresh(record=True)
        self.message = note
        self._autosave()

    # --- what the front end shows, derived on demand -----------------------------------------

    @property
    def policy(self) -> Policy:
        return self.edits.policy

    @property
    def policy_json(self) -> dict[str, Any]:
        return self.policy.to_json()

    @property
    def fsdp_reshard(self) -> bool:
        return self.policy.fsdp_reshard

    @property
    def can_undo(self) -> bool:
        return self.edits.can_undo

    @property
    def can_redo(self) -> bool:
        return self.edits.can_redo

    @property
    def offload_text(self) -> str:
        """The policy's offload options in words; "" when it keeps the defaults."""
        changed = self.policy.offload != OffloadOptions()
        return offload_line(self.policy.offload) if changed else ""

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.history_log.to_json(self.profile)

    @property
    def history_plots(self) -> list[dict[str, Any]]:
        return history_plots(self.history, self.profile)

    @property
    def export_format(self) -> str:
        return self.exports.format

    @property
    def export_code(self) -> str:
        return self.exports.code

    @property
    def export_path(self) -> str:
        return str(self.exports.path)

    @property
    def estimate(self) -> Estimate:
        """The what-if estimate of the current decisions under the policy's offload options
        (prefetch, defer), computed once per change."""
        if self._estimate is None:
            schedule = self.estimator.schedule_for(self.decisions, self.policy.offload)
            self._estimate = self.estimator.simulate(schedule)
        return self._estimate

    def __repr__(self) -> str:
        return f"ExplorerModel({self.graph.model_name}, policy {policy_label(self.policy_json)})"

    # --- actions ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Errors become the message line; the policy is whatever it was before."""
        self.message = ""
        try:
            yield
        except WorkbenchError as err:
            self.message = str(err)

    def click(self, element_id: str, *, select_only: bool = False) -> None:
        """A click in the picture, by what the view says the element is: an op flips (and is
        selected), a module box or folded layers' frame opens, anything else explains
        itself."""
        with self.explained():
            element = self.picture.elements.get(element_id) or self._anywhere.get(element_id)
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

    def select(self, name: str) -> None:
        if name not in self.graph.nodes:
            raise WorkbenchError(f"no node {name!r} in {self.graph.model_name!r}")
        self.selected, self.selected_id = name, svg_id("n", name)
        self.details = self._details(name)
        self.timeline = timeline_panel(self.estimate, self.estimator, self.decisions, name)

    def flip(self, name: str) -> None:
        """Move one op's decision on, save -> recompute -> offload -> save (offload only where
        the rules allow it; the message says why not), in every identical layer when
        `all_layers`."""
        old = self.decisions
        before = old.get(name)
        skipped = None
        if before is not None and name in self.graph.nodes and decidable(self.graph.nodes[name]):
            _, skipped = next_action(self.graph, self.policy, name, self.decisions)
        policy = flip(self.graph, self.policy, name, all_layers=self.all_layers,
                      decisions=self.decisions)  # fmt: skip
        self._change(policy)
        after = self.decisions[name]
        if before is not None and after.action == before.action:
            self.message = f"{name} stays {_WORDS[after.action]}: {after.explanation}"
        else:
            where = "in every identical layer" if self.all_layers else "in this layer"
            self.message = f"{name} is now {_WORDS[after.action]} {where}"
        if skipped is not None:
            self.message += f" (offload not offered: {name} {skipped.words})"
        self.message += newly_forced(old, self.decisions, name)
        self._autosave()

    def show(self, view: str) -> None:
        """`overview`, `layer:N` or `module:PATH`."""
        previous = self.view
        self.view = view
        try:
            self._draw()
        except WorkbenchError:
            self.view = previous
            raise

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
        self.focus = {"id": target, "ids": self.picture.around(target),
                      "serial": self.focus.get("serial", 0) + 1}  # fmt: skip

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

    # --- policy edits (each undoable and autosaved) -------------------------------------------

    def set_preset(self, name: str) -> None:
        """A new preset under the same selectors and overrides."""
        self._edit(edited(self.policy, preset=name))

    def set_fsdp_reshard(self, reshard: bool) -> None:
        """The FSDP choice of a per-rank graph: reshard after forward (redo each parameter's
        all-gather in backward) or keep the gathered weights unsharded until backward."""
        if not self.has_fsdp:
            raise WorkbenchError(
                f"the graph of {self.graph.model_name!r} has no FSDP parameter all-gathers: "
                "trace it with parallel=Parallel(fsdp=N) (--fsdp N) to choose resharding"
            )
        self._edit(
            edited(self.policy, fsdp_reshard=bool(reshard)),
            "FSDP: reshard after forward (all-gathers redone in backward)"
            if reshard
            else "FSDP: keep unsharded (gathered weights held from forward to backward)",
        )

    def add_selector(self, select: str, action: str) -> None:
        """`MODULE::OP` saved, recomputed or offloaded everywhere it matches (later win)."""
        policy = with_selector(self.graph, self.policy, select, action)
        self._edit(policy, f"added selector: {action} {select}")

    def switch_op(self, module: str, op: str, action: str) -> None:
        """Save or recompute every `op` under `module` (e.g. all aten.mm in attention)."""
        self.add_selector(op_switch(module, op, action), action)

    def remove_selector(self, index: int) -> None:
        self._edit(without_selector(self.policy, index))

    def edit_selector(self, index: int, action: str) -> None:
        """Change what selector #index does (save, recompute or offload)."""
        self._edit(with_selector_action(self.policy, index, action))

    def set_override(self, key: str, action: str | None) -> None:
        """Set one override's action, or remove it (`action=None`)."""
        self._edit(with_override(self.policy, key, action))

    def set_offload(
        self, budget_bytes: int | None = None, prefetch_layers: int = 1, defer_layers: int = 0
    ) -> None:
        """The policy's offload options: host budget (None: no limit), reload N layers early,
        free the device copy M layers late."""
        policy = with_offload(self.policy, budget_bytes, prefetch_layers, defer_layers)
        self._edit(policy, f"offload options: {offload_line(policy.offload)}")

    def undo(self) -> None:
        self._apply(self.edits.undo())
        self._autosave()

    def redo(self) -> None:
        self._apply(self.edits.redo())
        self._autosave()

    def reset(self) -> None:
        """Back to the preset alone, keeping its FSDP choice (undoable)."""
        self._edit(edited(self.policy, selectors=[], overrides={}))

    def load(self, policy: Policy) -> None:
        """Make `policy` current (undoable, autosaved): a stage's policy set from outside."""
        self._edit(policy, f"loaded policy {policy_label(policy.to_json())}")

    def restore(self, index: int) -> None:
        """Load the policy of a point in the history (undoable), and the host budget its
        offloads were solved for."""
        policy = self.history_log.policy(index)
        self._change(policy)
        self._take_host_budget(policy)
        self._autosave()

    # --- settings -----------------------------------------------------------------------------

    def set_profile(self, profile: str) -> None:
        """The device profile step times are estimated on (the history is re-timed)."""
        if profile not in PROFILES:
            raise WorkbenchError(
                f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}"
            )
        self.profile = profile
        self.metrics = metrics_panel(self.estimate, profile, self.estimator)

    def set_graph_aspect(self, aspect: float) -> None:
        """The picture panel's width / height (the front end says it): the view is arranged
        again to fill it."""
        if panel_aspect(aspect) != self.graph_aspect:
            self.graph_aspect = panel_aspect(aspect)
            self._draw()

    def set_export_format(self, fmt: str) -> None:
        """Show the policy in another export format; the export file's ending follows."""
        self.exports.set_format(fmt)
        self.exports.show(self.policy, self.graph)
        self.message = self.exports.format_words()

    def set_host_budget(self, budget_bytes: int) -> None:
        """The host bytes Suggest and Sweep may offload to (0: they do not offload)."""
        check_int("host budget", budget_bytes, 0, INT64_MAX, "bytes; 0: no offload")
        self.suggest_host_budget_bytes = budget_bytes
        self.message = (
            f"Suggest and Sweep may offload up to {format_bytes(budget_bytes)} to host memory"
            if budget_bytes
            else "Suggest and Sweep do not offload (host budget 0)"
        )

    # --- solver, export and Run ---------------------------------------------------------------

    def suggest(self, budget_bytes: int, method: str | None = None) -> None:
        """Load the solver's cheapest policy whose estimated peak fits `budget_bytes`
        (undoable, like any other change)."""
        budget = format_bytes(budget_bytes) if isinstance(budget_bytes, int) else budget_bytes
        with self._busy(f"Suggest: solving for a budget of {budget}…"):
            policy, message = suggestion(
                self.graph, self.policy, budget_bytes, method=method or self.suggest_method,
                profile=self.profile, estimator=self.estimator, has_fsdp=self.has_fsdp,
                host_budget_bytes=self.suggest_host_budget_bytes,
                budget_kind=self.budget_kind,
            )  # fmt: skip
        self._change(policy)
        self.message = message
        self._autosave()

    def sweep(self, points: int = 8) -> None:
        """Put the solver's memory-vs-time front into the history (each point restorable)."""
        from workbench.search.pareto import pareto
        from workbench.search.solve import SolveOptions

        def progress(done: int, total: int, _solution: object) -> None:
            self.status = f"solving budget {done} of {total}…"
            self.on_change()

        options = SolveOptions(method=self.suggest_method, profile=self.profile,  # type: ignore[arg-type]
                               host_budget_bytes=self.suggest_host_budget_bytes,
                               budget_kind=self.budget_kind)  # fmt: skip
        with self._busy(f"Sweep: solving {points} budgets…"):
            solutions = pareto(self.graph, points=points, options=options, progress=progress,
                               estimator=self.estimator)  # fmt: skip
        for solution in solutions:
            est = solution.estimate
            self.history_log.add(Point(solution.policy.to_json(), est.peak_bytes,
                                       dict(est.step_seconds), solver=solution.method))  # fmt: skip
        self.status = f"{len(solutions)} solver points added to the history"

    def save_export(self, path: str | None = None) -> Path:
        """Write the shown code. A file that changed since this explorer wrote it is kept."""
        target = self.exports.save(path)
        self.message = self.exports.saved_words(target)
        return target

    def run(self, repeats: int = 3) -> dict[str, Any]:
        """Remat with torch's pass and measure on the graph's device (GPU when the graph was
        traced on one, else CPU), with the bitwise check against eager."""
        from workbench.interop.baselines import measure_policy

        if self.graph.example_inputs is None or self.workload is None:
            raise WorkbenchError(
                "Run needs real tensors and the model: open the explorer on a Workload or a "
                "model name (a graph traced on fake tensors can only be estimated)"
            )
        try:
            with self._busy("Run: rematerializing with torch's pass and measuring…"):
                result = measure_policy(self.workload, self.policy, graph=self.graph,
                                        estimator=self.estimator, repeats=repeats)  # fmt: skip
        except BaseException:
            self.status = "Run failed: see the message line"
            raise
        summary = {**result.to_json(), "policy": self.policy.to_json(),
                   "optimizer": self.estimator.optimizer,
                   "optimizer_bytes": self.estimator.optimizer_bytes}  # fmt: skip
        self.run_result = summary
        self.status = run_status(summary, self.policy)
        self.history_log.add(Point(self.policy.to_json(), result.graph_sac.peak_bytes,
                                   {summary["device"]: result.graph_sac.step_seconds},
                                   measured=True, extra={"device": summary["device"]}))  # fmt: skip
        return summary

    # --- state --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _busy(self, words: str) -> Iterator[None]:
        """A long action (Run, Suggest, Sweep): `running` and `status` say so, and reach the
        front end at once (`on_change`), until it ends, also when it fails; then the status
        line is the last Run's again (an action may say more)."""
        self.running, self.status = True, words
        self.on_change()
        try:
            yield
        finally:
            self.running = False
            self.status = run_status(self.run_result, self.policy)

    def _edit(self, policy: Policy, message: str = "") -> None:
        """Make an edited policy current, say so when there is something to say, autosave."""
        self._change(policy)
        if message:
            self.message = message
        self._autosave()

    def _change(self, policy: Policy) -> None:
        """Make `policy` current (undoable); decided first, so a bad one changes nothing."""
        if policy == self.policy:
            return
        decisions = decide(self.graph, policy)
        self.edits.change(policy)
        self._apply(policy, decisions)

    def _apply(self, policy: Policy, decisions: Decisions | None = None) -> None:
        self.decisions = decide(self.graph, policy) if decisions is None else decisions
        self._refresh(record=True, decided=True)

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

    def _refresh(self, record: bool = False, decided: bool = False) -> None:
        """Every panel after a change of policy."""
        if not decided:
            self.decisions = decide(self.graph, self.policy)
        self._estimate = None
        est = self.estimate
        self.metrics = metrics_panel(est, self.profile, self.estimator)
        self.timeline = timeline_panel(est, self.estimator, self.decisions, self.selected)
        self.exports.show(self.policy, self.graph)
        if self.selected:
            self.details = self._details(self.selected)
        self.status = run_status(self.run_result, self.policy)
        self._draw()
        if record:
            self.history_log.add(Point(self.policy.to_json(), est.peak_bytes,
                                       dict(est.step_seconds)))  # fmt: skip

    def _draw(self) -> None:
        """The picture of the current view, and what the library says its elements are."""
        known = (self.view, self.graph_aspect)
        self.picture: View = render_view(
            self.graph, self.decisions, self.view, policy_name=self.policy.preset,
            aspect=self.graph_aspect, arrangement=self._arranged.get(known),
        )  # fmt: skip
        self._arranged[known] = self.picture.arrangement
        self.svg = self.picture.svg(legend=False)  # the widget draws its legend beside it
        est = self.estimate
        self.legend = legend_panel(self.graph.model_name, self.view, self.picture, est,
                                   self.policy)  # fmt: skip
        self.peak_ids = peak_ids(self.graph, self.estimator, est.peak_node, self.picture)

    def _details(self, name: str) -> dict[str, Any]:
        preset_of = (self.policy.preset, self.policy.fsdp_reshard)
        if preset_of not in self._preset_decisions:
            preset_policy = Policy(preset_of[0], fsdp_reshard=preset_of[1])
            self._preset_decisions[preset_of] = decide(self.graph, preset_policy)
        return details_panel(self.graph, self.estimator, self.decisions,
                             self._preset_decisions[preset_of], self.policy, name)  # fmt: skip
