"""The policy explorer: click ops to cycle save/recompute/offload, watch memory and time, run,
export.

Entry point: `PolicyExplorer(graph_or_workload_or_model_name, policy=...)`. All state is in
traitlets and every action is a method, so it is driven the same from a browser or a test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.ops import layer_pattern
from workbench.capture.trace import trace
from workbench.cost.estimate import Estimate, Estimator
from workbench.cost.profiles import PROFILES
from workbench.decide.decider import (
    Decisions,
    decidable,
    decide,
    flip,
    layer_key,
    next_action,
    node_keys,
    rules_of,
    validate,
)
from workbench.decide.offloadable import OffloadOptions, offload_refusal_in
from workbench.decide.policy import ACTIONS, Action, Policy, Selector, offload_options
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.files import write_file
from workbench.interop.export import FORMATS, export
from workbench.search.solve import fsdp_choices
from workbench.show.viz import node_from_svg_id, overview, render_view, svg_id
from workbench.show.viz.hierarchy import Group
from workbench.show.viz.style import COLLECTIVE_WORDS
from workbench.show.widgets.session import Autosave, Edits, History, Point, policy_label
from workbench.units import format_bytes, format_flops

HERE = Path(__file__).parent


def _load(source: JointGraph | Workload | str) -> tuple[JointGraph, Workload | None]:
    """The graph to explore, and the workload when known (Run compares against eager)."""
    if isinstance(source, JointGraph):
        return source, None
    if isinstance(source, str):
        source = load_workload(source)
    if isinstance(source, Workload):
        return trace(source, mode="real"), source
    raise WorkbenchError(
        f"PolicyExplorer takes a JointGraph, a Workload or a model name, "
        f"not {type(source).__name__}"
    )


def _module_of_box(path: str) -> str:
    """`layers.0–31.attention` (identical layers folded) -> `layers.0.attention`."""
    return re.sub(r"\.(\d+)–\d+(?=\.|$)", r".\1", path)


# File name endings of each export format: code is `.py`, torchtitan's options are command
# line flags for its run script, the policy itself is JSON.
EXPORT_NAMES = {
    "policy_fn": "_sac_policy_fn.py",
    "graph_pass": "_sac_graph_pass.py",
    "torchtitan": "_sac_torchtitan.sh",
    "json": "_sac_policy.json",
}

TIMELINE_POINTS = 240  # columns of the small memory timeline under the metrics

_MISSING = object()


def _field(content: dict[str, Any], name: str, kind: type, default: Any = _MISSING) -> Any:
    """One field of a front-end message, checked: a one-line error names what is wrong."""
    action = content.get("type")
    if name not in content or content[name] is None:
        if default is not _MISSING:
            return default
        raise WorkbenchError(f"message {action!r} lacks the field {name!r} ({kind.__name__})")
    value = content[name]
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise WorkbenchError(
            f"message {action!r}: field {name!r} must be {kind.__name__}, "
            f"not {type(value).__name__}"
        )
    return value


def _downsample(values: list[int], width: int) -> list[int]:
    """At most `width` columns, each the largest value of its span (peaks stay visible)."""
    if len(values) <= width:
        return list(values)
    return [
        max(values[i * len(values) // width : max((i + 1) * len(values) // width, i + 1)])
        for i in range(width)
    ]


class PolicyExplorer(anywidget.AnyWidget):  # type: ignore[misc]
    """Click an op to flip it (shift-click only selects it), click a module box to expand it.

    Metrics come from the exact what-if estimate after every change; Run remats with
    torch's pass and measures for real. The policy is autosaved to `autosave` as JSON.
    The session logic (undo/redo, history, autosave) lives in `workbench.show.widgets.session`;
    this class holds the synced state and forwards actions.
    """

    _esm = HERE / "explorer.js"
    _css = HERE / "explorer.css"

    svg = traitlets.Unicode("").tag(sync=True)
    view = traitlets.Unicode("overview").tag(sync=True)
    legend = traitlets.Dict().tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)
    selected_id = traitlets.Unicode("").tag(sync=True)
    peak_ids: traitlets.List[str] = traitlets.List().tag(sync=True)
    focus = traitlets.Dict().tag(sync=True)
    details = traitlets.Dict().tag(sync=True)
    metrics = traitlets.Dict().tag(sync=True)
    timeline = traitlets.Dict().tag(sync=True)
    history: traitlets.List[dict[str, Any]] = traitlets.List().tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    presets = traitlets.List(list(PRESETS)).tag(sync=True)
    profiles = traitlets.List(list(PROFILES)).tag(sync=True)
    profile = traitlets.Unicode("h100").tag(sync=True)
    all_layers = traitlets.Bool(True).tag(sync=True)
    policy_json = traitlets.Dict().tag(sync=True)
    modules: traitlets.List[str] = traitlets.List().tag(sync=True)
    ops: traitlets.List[str] = traitlets.List().tag(sync=True)
    can_undo = traitlets.Bool(False).tag(sync=True)
    can_redo = traitlets.Bool(False).tag(sync=True)
    export_formats = traitlets.List(list(FORMATS)).tag(sync=True)
    export_format = traitlets.Unicode("policy_fn").tag(sync=True)
    export_code = traitlets.Unicode("").tag(sync=True)
    export_path = traitlets.Unicode("").tag(sync=True)
    running = traitlets.Bool(False).tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)
    run_result = traitlets.Dict().tag(sync=True)
    budget_range = traitlets.Dict().tag(sync=True)
    suggest_method = traitlets.Unicode("greedy").tag(sync=True)
    # host bytes Suggest and the history's front may offload to (0: no offload)
    suggest_host_budget_bytes = traitlets.Int(0).tag(sync=True)
    # the FSDP choice of per-rank graphs: shown (and toggled) only where `has_fsdp`
    has_fsdp = traitlets.Bool(False).tag(sync=True)
    fsdp_reshard = traitlets.Bool(True).tag(sync=True)

    def __init__(
        self,
        source: JointGraph | Workload | str,
        policy: Policy | str = "default",
        *,
        profile: str = "h100",
        autosave: str | Path | None = None,
        workload: Workload | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.graph, loaded = _load(source)
        self.workload = workload or loaded
        if profile not in PROFILES:
            raise WorkbenchError(
                f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}"
            )
        self.estimator = Estimator(self.graph, list(PROFILES))
        self.autosave = Autosave(autosave or _default_autosave(self.graph.model_name))
        self.export_path = str(
            self.autosave.path.with_name(self.graph.model_name + EXPORT_NAMES[self.export_format])
        )
        self._written_exports: dict[Path, str] = {}
        self._export_error = ""
        self._decisions: Decisions = {}
        self._estimate: Estimate | None = None
        self._preset_decisions: dict[tuple[str, bool], Decisions] = {}
        self._search: tuple[str, int] = ("", -1)
        self.history_log = History()
        infos = [i for i in self.graph.nodes.values() if decidable(i)]
        self.modules = sorted({layer_pattern(i.module) for i in infos})
        self.ops = sorted({i.op for i in infos})
        self.profile = profile
        start = Policy(policy) if isinstance(policy, str) else policy
        recovered, note = self.autosave.recover(self.graph, start)
        self.edits = Edits(recovered)
        self._take_host_budget(recovered)
        choices = fsdp_choices(self.graph)
        self.has_fsdp = len(choices) > 1
        peaks = [
            self.estimator.estimate(Policy(p, fsdp_reshard=r)).peak_bytes
            for p in ("full", "none")
            for r in choices
        ]
        self.budget_range = {"min": min(peaks), "max": max(peaks)}
        self.on_msg(self._on_msg)
        self.observe(self._on_profile, names=["profile"])
        self.observe(self._on_export_format, names=["export_format"])
        self._refresh(record=True)
        self.message = note
        self._autosave()

    @property
    def policy(self) -> Policy:
        return self.edits.policy

    @property
    def autosave_path(self) -> Path:
        return self.autosave.path

    # --- actions (what the front end's buttons and clicks call) ---------------------------

    def click(self, element_id: str, *, select_only: bool = False) -> None:
        """A click in the picture: an op flips (and is selected), a module box or layer
        expands, anything else explains itself."""
        kind = element_id.split("-", 1)[0]
        with self._explained():
            if kind == "n":
                name = node_from_svg_id(element_id, "n")
                self.select(name)
                if not select_only:
                    self.flip(name)
            elif kind == "m":
                path = _module_of_box(node_from_svg_id(element_id, "m"))
                if not path:
                    self.message = "ops outside any module: expand a layer or module instead"
                else:
                    self.show(f"module:{path}")
            elif kind == "g":
                title = node_from_svg_id(element_id, "g")  # `layers.0–2` (or its title)
                group = _module_of_box(re.sub(r" ×\d+$", "", title))
                layer = re.search(r"\.(\d+)$", group)
                self.show(f"layer:{layer.group(1)}" if layer else f"module:{group}")
            elif kind == "b":
                module = node_from_svg_id(element_id, "b")
                self.message = (
                    f"backward ops of {module} read these values; backward ops are never "
                    "saved or recomputed, so there is nothing to flip"
                )
            else:
                self.message = "this element has no decision to flip: click an op or a module"

    def select(self, name: str) -> None:
        if name not in self.graph.nodes:
            raise WorkbenchError(f"no node {name!r} in {self.graph.model_name!r}")
        self.selected = name
        self.selected_id = svg_id("n", name)
        self.details = self._details(name)
        self.timeline = self._timeline()

    def flip(self, name: str) -> None:
        """Move one op's decision on, save -> recompute -> offload -> save (offload only where
        the rules allow it; the message says why not), in every identical layer when
        `all_layers`."""
        old = self._decisions
        before = old.get(name)
        skipped = None
        if before is not None and name in self.graph.nodes and decidable(self.graph.nodes[name]):
            _, skipped = next_action(self.graph, self.policy, name, self._decisions)
        policy = flip(self.graph, self.policy, name, all_layers=self.all_layers,
                      decisions=self._decisions)  # fmt: skip
        self._change(policy)
        after = self._decisions[name]
        if before is not None and after.action == before.action:
            self.message = f"{name} stays {_WORDS[after.action]}: {after.explanation}"
        else:
            where = "in every identical layer" if self.all_layers else "in this layer"
            self.message = f"{name} is now {_WORDS[after.action]} {where}"
        if skipped:
            self.message += f" (offload not offered: {skipped})"
        self.message += _newly_forced(old, self._decisions, name)
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
        text = query.strip().lower()
        if not text:
            raise WorkbenchError("type part of a node name (mm_4), an op (mm) or a module (wo)")
        matches = self._matches(text)
        if not matches:
            raise WorkbenchError(
                f"no forward op matches {query.strip()!r} by node name, op or module"
            )
        previous, index = self._search
        index = (index + 1) % len(matches) if previous == text else 0
        self._search = (text, index)
        name = matches[index]
        self.reveal(name)
        info = self.graph.nodes[name]
        self.message = (
            f"{name} ({info.op} in {info.module or 'top level'}): "
            f"match {index + 1} of {len(matches)} for {query.strip()!r}"
            + ("; search again for the next" if len(matches) > 1 else "")
        )
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
        self.focus = {"id": target, "serial": self.focus.get("serial", 0) + 1}

    def go_to_peak(self) -> None:
        """Show where the estimated peak happens: the op, or the forward ops of the module
        whose backward runs at the peak."""
        est = self._current_estimate()
        name, twins = self._peak_twins()
        if not twins:
            raise WorkbenchError(f"the peak is at {est.peak_node}, which no view draws")
        info = self.graph.nodes[name]
        self.reveal(twins[0])
        drawn = html.unescape(self.svg)
        shown = [i for i in self.peak_ids if f'id="{i}"' in drawn] or [svg_id("n", twins[0])]
        self.focus = {"id": shown[0], "serial": self.focus.get("serial", 0) + 1}
        if decidable(info):
            where = "its recomputed copy" if est.peak_node != name else "this op"
        else:
            where = f"the backward of {info.module or 'top level'}; its forward ops are marked"
        peak = format_bytes(est.peak_bytes)
        self.message = f"peak {peak} while {est.peak_node} runs ({info.phase}): {where}"

    def _edited(self, **changes: Any) -> Policy:
        """The current policy with some fields changed; the rest (the FSDP choice) kept."""
        current = {
            "selectors": list(self.policy.selectors),
            "overrides": dict(self.policy.overrides),
        }
        return dataclasses.replace(self.policy, **{**current, **changes})

    def set_fsdp_reshard(self, reshard: bool) -> None:
        """The FSDP choice of a per-rank graph: reshard after forward (redo each parameter's
        all-gather in backward) or keep the gathered weights unsharded until backward."""
        if not self.has_fsdp:
            raise WorkbenchError(
                f"the graph of {self.graph.model_name!r} has no FSDP parameter all-gathers: "
                "trace it with parallel=Parallel(fsdp=N) (--fsdp N) to choose resharding"
            )
        self._change(self._edited(fsdp_reshard=bool(reshard)))
        self.message = (
            "FSDP: reshard after forward (all-gathers redone in backward)"
            if reshard
            else "FSDP: keep unsharded (gathered weights held from forward to backward)"
        )
        self._autosave()

    def set_preset(self, name: str) -> None:
        """A new preset under the same selectors and overrides."""
        self._change(self._edited(preset=name))
        self._autosave()

    def add_selector(self, select: str, action: str) -> None:
        """`MODULE::OP` saved or recomputed everywhere it matches (later selectors win)."""
        selector = Selector(select, action)  # type: ignore[arg-type]
        policy = self._edited(selectors=[*self.policy.selectors, selector])
        validate(self.graph, policy)
        self._change(policy)
        self.message = f"added selector: {action} {select}"
        self._autosave()

    def switch_op(self, module: str, op: str, action: str) -> None:
        """Save or recompute every `op` under `module` (e.g. all aten.mm in attention)."""
        if action not in ACTIONS:
            raise WorkbenchError(f"action {action!r} must be one of {ACTIONS}")
        pattern = module if module.endswith("**") else f"{module}.**" if module else "**"
        self.add_selector(f"{pattern}::{op}", action)

    def remove_selector(self, index: int) -> None:
        selectors = list(self.policy.selectors)
        if not 0 <= index < len(selectors):
            raise WorkbenchError(f"no selector #{index}; there are {len(selectors)}")
        del selectors[index]
        self._change(self._edited(selectors=selectors))
        self._autosave()

    def edit_selector(self, index: int, action: str) -> None:
        """Change what selector #index does (save or recompute)."""
        selectors = list(self.policy.selectors)
        if not 0 <= index < len(selectors):
            raise WorkbenchError(f"no selector #{index}; there are {len(selectors)}")
        selectors[index] = Selector(selectors[index].select, action)  # type: ignore[arg-type]
        self._change(self._edited(selectors=selectors))
        self._autosave()

    def set_offload(
        self, budget_bytes: int | None = None, prefetch_layers: int = 1, defer_layers: int = 0
    ) -> None:
        """The policy's offload options: host budget (None: no limit), reload N layers early,
        free the device copy M layers late (checked as a policy file's are)."""
        options = offload_options(OffloadOptions(budget_bytes, prefetch_layers, defer_layers))
        self._change(self._edited(offload=options))
        self.message = f"offload options: {options._asdict()}"
        self._autosave()

    def set_override(self, key: str, action: str | None) -> None:
        """Set one override's action, or remove it (`action=None`)."""
        overrides = dict(self.policy.overrides)
        if key not in overrides:
            raise WorkbenchError(f"no override {key!r}; the policy has {len(overrides)}")
        if action is None:
            del overrides[key]
        else:
            overrides[key] = action  # type: ignore[assignment]
        self._change(self._edited(overrides=overrides))
        self._autosave()

    def undo(self) -> None:
        self._apply(self.edits.undo())
        self._autosave()

    def redo(self) -> None:
        self._apply(self.edits.redo())
        self._autosave()

    def reset(self) -> None:
        """Back to the preset alone, keeping its FSDP choice (undoable)."""
        self._change(self._edited(selectors=[], overrides={}))
        self._autosave()

    def restore(self, index: int) -> None:
        """Load the policy of a point in the history (undoable), and the host budget its
        offloads were solved for."""
        policy = self.history_log.policy(index)
        self._change(policy)
        self._take_host_budget(policy)
        self._autosave()

    def set_host_budget(self, budget_bytes: int) -> None:
        """The host bytes Suggest and Sweep may offload to (0: they do not offload)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise WorkbenchError(
                f"host budget must be 0 (no offload) or more bytes, got {budget_bytes!r}"
            )
        self.suggest_host_budget_bytes = budget_bytes
        self.message = (
            f"Suggest and Sweep may offload up to {format_bytes(budget_bytes)} to host memory"
            if budget_bytes
            else "Suggest and Sweep do not offload (host budget 0)"
        )

    def suggest(self, budget_bytes: int, method: str | None = None) -> None:
        """Load the solver's cheapest policy whose estimated peak fits `budget_bytes`
        (undoable, like any other change)."""
        from workbench.search.solve import SolveOptions, solve

        options = SolveOptions(method=method or self.suggest_method, profile=self.profile,  # type: ignore[arg-type]
                               host_budget_bytes=self.suggest_host_budget_bytes)  # fmt: skip
        solution = solve(self.graph, int(budget_bytes), options, estimator=self.estimator)
        rebased = _rebased(self.graph, solution.policy, self.policy)
        choice = "reshard after forward" if solution.policy.fsdp_reshard else "keep unsharded"
        fsdp = f"; FSDP {choice}" if self.has_fsdp else ""
        own = len(solution.policy.overrides) + len(solution.policy.selectors)
        # Keep the user's preset unless that takes far more rows than the solver's own base.
        if rebased is not None and len(rebased.overrides) <= 2 * own + 8:
            policy, note = rebased, ""
        else:
            policy = solution.policy
            note = f" (on {self.policy.preset!r} it would take many more overrides)"
        self._change(policy)
        host = self.suggest_host_budget_bytes
        offloaded = (
            f", offloads {format_bytes(solution.estimate.offloaded_bytes)} to host (budget "
            f"{format_bytes(host)})"
            if host
            else ", no offload (host budget 0)"
        )
        self.message = (
            f"suggested by {solution.method} for a budget of {format_bytes(budget_bytes)}: "
            f"peak {format_bytes(solution.estimate.peak_bytes)}, recompute "
            f"{format_flops(solution.estimate.recompute_flops)}{offloaded}{fsdp}; "
            f"preset {policy.preset!r}{note} with "
            f"{len(policy.selectors)} selectors and {len(policy.overrides)} overrides (listed "
            "under Policy); refine it by clicking ops"
        )
        self._autosave()

    def sweep(self, points: int = 8) -> None:
        """Put the solver's memory-vs-time front into the history (each point restorable)."""
        from workbench.search.pareto import pareto
        from workbench.search.solve import SolveOptions

        def progress(done: int, total: int, _solution: object) -> None:
            self.status = f"solving budget {done} of {total}…"

        options = SolveOptions(method=self.suggest_method, profile=self.profile,  # type: ignore[arg-type]
                               host_budget_bytes=self.suggest_host_budget_bytes)  # fmt: skip
        solutions = pareto(self.graph, points=points, options=options, progress=progress,
                           estimator=self.estimator)  # fmt: skip
        for solution in solutions:
            est = solution.estimate
            self.history_log.add(Point(solution.policy.to_json(), est.peak_bytes,
                                       dict(est.step_seconds), solver=solution.method))  # fmt: skip
        self.history = self.history_log.to_json(self.profile)
        self.status = f"{len(solutions)} solver points added to the history"

    def save_export(self, path: str | None = None) -> Path:
        """Write the shown code. A file that changed since this explorer wrote it is kept."""
        if self._export_error:
            raise WorkbenchError(self._export_error)
        target = Path(path or self.export_path)
        if target.is_dir():
            raise WorkbenchError(f"{str(target)!r} is a folder: name a file to export to")
        ours = self._written_exports.get(target)
        if os.path.lexists(target) and (ours is None or _read_bytes(target) != ours.encode()):
            raise WorkbenchError(
                f"{str(target)!r} exists and was not written by this explorer (or was edited "
                "since): choose another export path"
            )
        write_file(target, self.export_code, overwrite=os.path.lexists(target))
        self._written_exports[target] = self.export_code
        self.export_path = str(target)
        self.message = f"saved {self.export_format} export to {target}"
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
        self.running, self.status = True, "rematerializing with torch's pass and measuring…"
        try:
            result = measure_policy(
                self.workload,
                self.policy,
                graph=self.graph,
                estimator=self.estimator,
                repeats=repeats,
            )
        except BaseException:
            self.status = "Run failed: see the message line"
            raise
        finally:
            self.running = False
        summary = {**result.to_json(), "policy": self.policy.to_json()}
        self.run_result = summary
        self.status = self._run_status()
        self.history_log.add(Point(self.policy.to_json(), result.graph_sac.peak_bytes,
                                   {summary["device"]: result.graph_sac.step_seconds},
                                   measured=True, extra={"device": summary["device"]}))  # fmt: skip
        self.history = self.history_log.to_json(self.profile)
        return summary

    # --- messages from the front end ------------------------------------------------------

    def _on_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """Run one front-end message. Nothing escapes: every failure sets the message line."""
        if not isinstance(content, dict):
            self.message = f"ignored a message that is not an object: {type(content).__name__}"
            return
        c = content
        handlers: dict[str, Callable[[], object]] = {
            "click": lambda: self.click(
                _field(c, "id", str), select_only=_field(c, "shift", bool, False)
            ),  # fmt: skip
            "show": lambda: self.show(_field(c, "view", str)),
            "search": lambda: self.search(_field(c, "query", str)),
            "peak": self.go_to_peak,
            "preset": lambda: self.set_preset(_field(c, "name", str)),
            "fsdp": lambda: self.set_fsdp_reshard(_field(c, "reshard", bool)),
            "selector": lambda: self.add_selector(
                _field(c, "select", str), _field(c, "action", str)
            ),  # fmt: skip
            "switch": lambda: self.switch_op(
                _field(c, "module", str), _field(c, "op", str), _field(c, "action", str)
            ),  # fmt: skip
            "remove_selector": lambda: self.remove_selector(_field(c, "index", int)),
            "edit_selector": lambda: self.edit_selector(
                _field(c, "index", int), _field(c, "action", str)
            ),  # fmt: skip
            "override": lambda: self.set_override(
                _field(c, "key", str), _field(c, "action", str, None)
            ),  # fmt: skip
            "offload": lambda: self.set_offload(
                _field(c, "budget_bytes", int, None),
                _field(c, "prefetch_layers", int, 1),
                _field(c, "defer_layers", int, 0),
            ),  # fmt: skip
            "undo": self.undo,
            "redo": self.redo,
            "reset": self.reset,
            "restore": lambda: self.restore(_field(c, "index", int)),
            "save_export": lambda: self.save_export(_field(c, "path", str, "") or None),
            "run": self.run,
            "suggest": lambda: self.suggest(_field(c, "budget", int)),
            "sweep": self.sweep,
            "host_budget": lambda: self.set_host_budget(_field(c, "bytes", int)),
        }
        action = c.get("type")
        if not isinstance(action, str) or action not in handlers:
            self.message = f"unknown action {action!r}; known: {', '.join(handlers)}"
            return
        try:
            with self._explained():
                handlers[action]()
        except Exception as err:  # a bug must not kill the widget: say what happened
            self.message = f"{action} failed: {type(err).__name__}: {err}"

    @contextlib.contextmanager
    def _explained(self) -> Iterator[None]:
        """Errors become the message line; the policy is whatever it was before."""
        self.message = ""
        try:
            yield
        except WorkbenchError as err:
            self.message = str(err)

    # --- state ----------------------------------------------------------------------------

    def _change(self, policy: Policy) -> None:
        if policy == self.policy:
            return
        decisions = decide(self.graph, policy)  # raises before anything changes
        self.edits.change(policy)
        self._apply(policy, decisions)

    def _apply(self, policy: Policy, decisions: Decisions | None = None) -> None:
        self._decisions = decide(self.graph, policy) if decisions is None else decisions
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

    def _on_profile(self, _change: Any) -> None:
        self._refresh()
        self.history = self.history_log.to_json(self.profile)

    def _on_export_format(self, change: Any) -> None:
        old = Path(self.export_path)
        ending = EXPORT_NAMES[change["new"]]
        if old.name == self.graph.model_name + EXPORT_NAMES.get(change["old"], ""):
            self.export_path = str(old.with_name(self.graph.model_name + ending))
        else:
            self.export_path = str(old.with_suffix(Path(ending).suffix))
        self._show_export()

    def _show_export(self) -> None:
        """The export shown; a format that cannot say the policy (policy_fn and offload)
        shows why instead, and Save refuses it."""
        try:
            self.export_code = export(self.policy, self.export_format, graph=self.graph)
            self._export_error = ""
        except WorkbenchError as err:
            self._export_error = str(err)
            self.export_code = f"# cannot export as {self.export_format}: {err}\n"

    def _current_estimate(self) -> Estimate:
        if self._estimate is None:
            self._estimate = self.estimator.estimate(self._decisions)
        return self._estimate

    def _refresh(self, record: bool = False, decided: bool = False) -> None:
        if not decided:
            self._decisions = decide(self.graph, self.policy)
        self._estimate = None
        estimate = self._current_estimate()
        self.policy_json = self.policy.to_json()
        self.fsdp_reshard = self.policy.fsdp_reshard
        self.can_undo, self.can_redo = self.edits.can_undo, self.edits.can_redo
        self.metrics = self._metrics(estimate)
        self.timeline = self._timeline()
        self._show_export()
        if self.selected:
            self.details = self._details(self.selected)
        self.status = self._run_status()
        self._draw()
        if record:
            self.history_log.add(Point(self.policy.to_json(), estimate.peak_bytes,
                                       dict(estimate.step_seconds)))  # fmt: skip
        self.history = self.history_log.to_json(self.profile)

    def _run_status(self) -> str:
        """The last Run's result, said to be stale once the policy has changed since."""
        r = self.run_result
        if not r:
            return ""
        line = (
            f"measured on {r['device']}: peak {format_bytes(r['peak_bytes'])} "
            f"(estimated {format_bytes(r['estimated_peak_bytes'])}), "
            f"{r['step_seconds'] * 1e3:.1f} ms/step, "
            f"{'bitwise equal to eager' if r['bitwise_equal'] else 'NOT bitwise equal'}"
        )
        if r["policy"] == self.policy.to_json():
            return line
        label = policy_label(r["policy"])
        return f"last Run was for {label} ({line}); Run again to measure this policy"

    def _draw(self) -> None:
        picture = render_view(
            self.graph, self._decisions, self.view, policy_name=self.policy.preset
        )
        # the widget draws its own legend beside the picture (with the hexagons' line)
        hexagons = COLLECTIVE_WORDS in picture.dot.graph_attr.get("label", "")
        picture.dot.graph_attr["label"] = ""
        self.svg = picture.svg()
        groups = overview(self.graph, self._decisions).groups if self.view == "overview" else []
        self.legend = self._legend(groups, hexagons)
        self.peak_ids = self._peak_ids(groups)

    def _legend(self, groups: list[Group], hexagons: bool = False) -> dict[str, Any]:
        """Title and lines for the picture: folded layers named as this model has them."""
        est = self._current_estimate()
        lines = [
            f"kept for backward (whole step): {format_bytes(est.saved_activation_bytes)} · "
            f"peak {format_bytes(est.peak_bytes)} at {est.peak_node}"
        ]
        if self.view == "overview":
            folded = [g.title for g in groups if len(g.layers) > 1]
            for title in folded:
                count = title.rsplit("×", 1)[-1]
                lines.append(
                    f"'{title}': {count} identical layers drawn once; box figures are totals"
                )
            lines.append("box colour: share of its ops saved (blue) and recomputed (orange)")
            if self.policy.offloads:
                lines.append("box text: how many of the saved ops are offloaded to host memory")
            lines.append("click a box to open it; click a layer's frame to open the whole layer")
            where = "overview"
        else:
            lines.append("blue: saved · orange: recomputed · grey note: backward ops reading it")
            if self.policy.offloads:
                lines.append("green: saved in host memory (offloaded), reloaded for backward")
            lines.append("click an op to flip it; shift-click selects only")
            if hexagons:
                lines.append(COLLECTIVE_WORDS)
            where = self.view
        title = f"{self.graph.model_name} · policy {policy_label(self.policy_json)}: {where}"
        return {"title": title, "lines": lines}

    def _peak_twins(self) -> tuple[str, list[str]]:
        """The graph node the peak happens at, and the forward ops that stand for it in a
        picture: itself, or for a backward op the forward ops of its module."""
        name = self._current_estimate().peak_node.removesuffix("_recomputed")
        info = self.graph.nodes.get(name)
        if info is None:
            return name, []
        if decidable(info):
            return name, [name]
        same = [n for n, i in self.graph.nodes.items() if decidable(i) and i.module == info.module]
        return name, same

    def _peak_ids(self, groups: list[Group]) -> list[str]:
        """SVG ids that stand for the peak node in the current view (op, note or box)."""
        name, twins = self._peak_twins()
        info = self.graph.nodes.get(name)
        if info is None:
            return []
        ids = [svg_id("n", n) for n in [name, *twins]] + [svg_id("b", info.module)]
        for group in groups:
            ids += [b.svg_id for b in group.boxes.values() if set(twins) & set(b.nodes)]
        return list(dict.fromkeys(ids))

    def _step_seconds(self, est: Estimate) -> float:
        return est.step_seconds[self.profile]

    def _metrics(self, est: Estimate) -> dict[str, Any]:
        step = self._step_seconds(est)
        return {
            "peak_bytes": est.peak_bytes,
            "peak": format_bytes(est.peak_bytes),
            "peak_node": est.peak_node,
            "saved_bytes": est.saved_activation_bytes,
            "saved": format_bytes(est.saved_activation_bytes),
            "recompute_flops": est.recompute_flops,
            "recompute": format_flops(est.recompute_flops),
            "recomputed_nodes": len(est.recomputed_nodes),
            "profile": self.profile,
            "step_seconds": step,
            "step": f"{step * 1e3:.2f} ms",
            "tokens_per_second": est.tokens / step if step else 0.0,
            "tokens_per_second_text": f"{est.tokens / step:,.0f} tokens/s" if step else "-",
        }

    def _timeline(self) -> dict[str, Any]:
        """Live bytes over the step (downsampled), with the peak and the selected op marked."""
        est = self._current_estimate()
        totals = est.totals()
        steps = len(totals)
        marks = {"peak": est.peak_index / max(steps - 1, 1)}
        if self.selected:
            spots = [
                i for i, n in enumerate(est.order) if n.removesuffix("_recomputed") == self.selected
            ]
            if spots:
                marks["selected"] = spots[0] / max(steps - 1, 1)
                if len(spots) > 1:
                    marks["recomputed"] = spots[-1] / max(steps - 1, 1)
        return {"values": _downsample(totals, TIMELINE_POINTS), "max": max(totals, default=0),
                "steps": steps, "marks": marks}  # fmt: skip

    def _details(self, name: str) -> dict[str, Any]:
        info = self.graph.nodes[name]
        decision = self._decisions.get(name)
        preset_of = (self.policy.preset, self.policy.fsdp_reshard)
        if preset_of not in self._preset_decisions:
            preset_policy = Policy(preset_of[0], fsdp_reshard=preset_of[1])
            self._preset_decisions[preset_of] = decide(self.graph, preset_policy)
        preset = self._preset_decisions[preset_of].get(name)
        consumers = self.estimator.backward_readers(name)
        return {
            "name": name,
            "op": info.op,
            "phase": info.phase,
            "module": info.module,
            "layer": info.layer,
            "shape": " · ".join("×".join(map(str, s)) for s in info.shapes) or "-",
            "dtype": info.dtype or "-",
            "bytes": format_bytes(info.bytes),
            "flops": format_flops(info.flops),
            "backward_consumers": consumers,
            "source": info.source or "-",
            "decision": "-" if decision is None else decision.policy.name,
            "action": "-" if decision is None else decision.action,
            "reason": "-" if decision is None else decision.reason,
            "preset_decision": "-" if preset is None else preset.policy.name,
            "can_flip": decision is not None and not decision.forced,
            "offload": self._offload_words(name),
        }

    def _offload_words(self, name: str) -> str:
        """Whether the op's output may be offloaded, and why not."""
        if name not in self._decisions:
            return "-"
        refusal = offload_refusal_in(rules_of(self.graph).plan, self._decisions, name,
                                     self.policy.preset)  # fmt: skip
        return "possible" if refusal is None else f"not possible: it {refusal}"

    def _matches(self, text: str) -> list[str]:
        """Forward ops by node name (exact first), then op, then module containing `text`."""
        infos = [i for i in self.graph.nodes.values() if decidable(i)]
        exact = [i.name for i in infos if i.name.lower() == text]
        by_name = [i.name for i in infos if text in i.name.lower() and i.name not in exact]
        by_op = [i.name for i in infos if text in i.op.lower()]
        by_module = [i.name for i in infos if text in i.module.lower()]
        return list(dict.fromkeys(exact + by_name + by_op + by_module))


_WORDS = {"save": "saved", "recompute": "recomputed", "offload": "offloaded"}
NEWLY_FORCED_NAMED = 3  # nodes a flip's message names when it forces others


def _newly_forced(before: Decisions, after: Decisions, flipped: str) -> str:
    """What a flip forced elsewhere (a save no request can undo), for the message line:
    `; forced in turn: add_, add__1 saved (written in place (...))`, or nothing."""
    forced = [n for n, d in after.items() if d.forced and n != flipped and not before[n].forced]
    if not forced:
        return ""
    named, rest = ", ".join(forced[:NEWLY_FORCED_NAMED]), len(forced) - NEWLY_FORCED_NAMED
    more = f" and {rest} more" if rest > 0 else ""
    return f"; forced in turn: {named}{more} saved ({after[forced[0]].explanation})"


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _rebased(graph: JointGraph, policy: Policy, base: Policy) -> Policy | None:
    """`policy`'s save/recompute decisions as overrides on `base`'s preset and selectors (so
    a suggestion keeps the user's preset and lists what it changes) with `policy`'s FSDP
    choice, or None when the rules that depend on final decisions (layer boundaries) would
    make them differ."""
    want = decide(graph, policy)
    start = Policy(
        base.preset, list(base.selectors), fsdp_reshard=policy.fsdp_reshard, offload=policy.offload
    )
    have = decide(graph, start)
    keys = node_keys(graph)
    by_key: dict[str, list[str]] = {}
    for name in want:
        if name in keys:
            by_key.setdefault(keys[name], []).append(name)
    overrides: dict[str, Action] = {}
    for key, names in by_key.items():
        differ = [n for n in names if want[n].action != have[n].action]
        if not differ:
            continue
        if len({want[n].action for n in names}) == 1:
            overrides[key] = want[names[0]].action  # type: ignore[assignment]
            continue
        for n in differ:
            overrides[layer_key(graph.nodes[n], key)] = want[n].action  # type: ignore[assignment]
    rebased = Policy(
        base.preset, list(base.selectors), overrides, policy.fsdp_reshard, offload=policy.offload
    )
    got = decide(graph, rebased)
    same = all(got[n].action == d.action for n, d in want.items())
    return rebased if same else None


def _default_autosave(model_name: str) -> Path:
    """`MODEL.policy.json` in `$SAC_WORKBENCH_AUTOSAVE_DIR` (tests point it at a temporary
    folder, so a test run leaves nothing for the next session), else the working folder."""
    folder = os.environ.get("SAC_WORKBENCH_AUTOSAVE_DIR") or "."
    return Path(folder) / f"{model_name}.policy.json"
