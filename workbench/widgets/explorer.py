"""The policy explorer: click ops to flip save/recompute, watch memory and time, run, export.

Entry point: `PolicyExplorer(graph_or_workload_or_model_name, policy=...)`. All state is in
traitlets and every action is a method, so it is driven the same from a browser or a test.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from workbench.errors import WorkbenchError
from workbench.estimate import Estimate, Estimator
from workbench.export import FORMATS, export
from workbench.files import write_file
from workbench.graph import JointGraph, layer_pattern
from workbench.models import Workload, load_workload
from workbench.policy import (
    ACTIONS,
    PRESETS,
    Decisions,
    Policy,
    Selector,
    decidable,
    decide,
    flip,
    restrict,
    validate,
)
from workbench.profiles import PROFILES
from workbench.trace import trace
from workbench.viz import node_from_svg_id, pareto_front, render_view, svg_id
from workbench.viz.style import human_bytes, human_flops

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


class PolicyExplorer(anywidget.AnyWidget):  # type: ignore[misc]
    """Click an op to flip it (shift-click only selects it), click a module box to expand it.

    Metrics come from the exact what-if estimate after every change; Run remats with
    torch's pass and measures for real. The policy is autosaved to `autosave` as JSON.
    """

    _esm = HERE / "explorer.js"
    _css = HERE / "explorer.css"

    svg = traitlets.Unicode("").tag(sync=True)
    view = traitlets.Unicode("overview").tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)
    selected_id = traitlets.Unicode("").tag(sync=True)
    details = traitlets.Dict().tag(sync=True)
    metrics = traitlets.Dict().tag(sync=True)
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
        self.autosave_path = Path(autosave or f"{self.graph.model_name}.policy.json")
        self.export_path = str(self.autosave_path.with_name(f"{self.graph.model_name}_sac.py"))
        self._written_exports: dict[Path, str] = {}
        self._undo: list[Policy] = []
        self._redo: list[Policy] = []
        self._decisions: Decisions = {}
        self._preset_decisions: dict[str, Decisions] = {}
        infos = [i for i in self.graph.nodes.values() if decidable(i)]
        self.modules = sorted({layer_pattern(i.module) for i in infos})
        self.ops = sorted({i.op for i in infos})
        self.profile = profile
        start = Policy(policy) if isinstance(policy, str) else policy
        self.policy = self._recover(start)
        low, high = (self.estimator.estimate(Policy(p)).peak_bytes for p in ("full", "none"))
        self.budget_range = {"min": min(low, high), "max": max(low, high)}
        self.on_msg(self._on_msg)
        self.observe(lambda change: self._refresh(), names=["profile", "export_format"])
        self._refresh(record=True)

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
                group = _module_of_box(node_from_svg_id(element_id, "g"))
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

    def flip(self, name: str) -> None:
        """Reverse one op's decision (in every identical layer when `all_layers`)."""
        before = self._decisions.get(name)
        policy = flip(self.graph, self.policy, name, all_layers=self.all_layers,
                      decisions=self._decisions)  # fmt: skip
        self._change(policy)
        after = self._decisions[name]
        if before is not None and after.recompute == before.recompute:
            self.message = (
                f"{name} stays {'recomputed' if after.recompute else 'saved'}: {after.explanation}"
            )
        else:
            where = "in every identical layer" if self.all_layers else "in this layer"
            self.message = f"{name} is now {'recomputed' if after.recompute else 'saved'} {where}"

    def show(self, view: str) -> None:
        """`overview`, `layer:N` or `module:PATH`."""
        previous = self.view
        self.view = view
        try:
            self._draw()
        except WorkbenchError:
            self.view = previous
            raise

    def set_preset(self, name: str) -> None:
        """A new preset under the same selectors and overrides."""
        self._change(Policy(name, list(self.policy.selectors), dict(self.policy.overrides)))

    def add_selector(self, select: str, action: str) -> None:
        """`MODULE::OP` saved or recomputed everywhere it matches (later selectors win)."""
        selector = Selector(select, action)  # type: ignore[arg-type]
        policy = Policy(self.policy.preset, [*self.policy.selectors, selector],
                        dict(self.policy.overrides))  # fmt: skip
        validate(self.graph, policy)
        self._change(policy)
        self.message = f"added selector: {action} {select}"

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
        self._change(Policy(self.policy.preset, selectors, dict(self.policy.overrides)))

    def undo(self) -> None:
        if not self._undo:
            raise WorkbenchError("nothing to undo")
        self._redo.append(self.policy)
        self._apply(self._undo.pop())

    def redo(self) -> None:
        if not self._redo:
            raise WorkbenchError("nothing to redo")
        self._undo.append(self.policy)
        self._apply(self._redo.pop())

    def reset(self) -> None:
        """Back to the preset alone (undoable)."""
        self._change(Policy(self.policy.preset))

    def restore(self, index: int) -> None:
        """Load the policy of a point in the history (undoable)."""
        if not 0 <= index < len(self.history):
            raise WorkbenchError(f"no history point #{index}; there are {len(self.history)}")
        self._change(Policy.from_json(self.history[index]["policy"]))

    def suggest(self, budget_bytes: int, method: str | None = None) -> None:
        """Load the solver's cheapest policy whose estimated peak fits `budget_bytes`
        (undoable, like any other change)."""
        from workbench.solve import solve

        solution = solve(self.graph, int(budget_bytes), method=method or self.suggest_method,
                         profile=self.profile, estimator=self.estimator)  # fmt: skip
        self._change(solution.policy)
        self.message = (
            f"suggested by {solution.method} for a budget of {human_bytes(budget_bytes)}: "
            f"peak {human_bytes(solution.estimate.peak_bytes)}, recompute "
            f"{human_flops(solution.estimate.recompute_flops)}; refine it by clicking ops"
        )

    def sweep(self, points: int = 8) -> None:
        """Put the solver's memory-vs-time front into the history (each point restorable)."""
        from workbench.solve import pareto

        def progress(done: int, total: int, _solution: object) -> None:
            self.status = f"solving budget {done} of {total}…"

        solutions = pareto(self.graph, n=points, method=self.suggest_method, profile=self.profile,
                           progress=progress, estimator=self.estimator)  # fmt: skip
        for solution in solutions:
            est = solution.estimate
            self._add_point(est.peak_bytes, est.step_seconds[self.profile],
                            policy=solution.policy, solver=solution.method)  # fmt: skip
        self.status = f"{len(solutions)} solver points added to the history"

    def save_export(self, path: str | None = None) -> Path:
        """Write the shown code. A file that changed since this explorer wrote it is kept."""
        target = Path(path or self.export_path)
        if target.exists() and self._written_exports.get(target) != target.read_text():
            raise WorkbenchError(
                f"{str(target)!r} exists and was not written by this explorer (or was edited "
                "since): choose another export path"
            )
        write_file(target, self.export_code, overwrite=target.exists())
        self._written_exports[target] = self.export_code
        self.message = f"saved {self.export_format} export to {target}"
        return target

    def run(self, repeats: int = 3) -> dict[str, Any]:
        """Remat with torch's pass and measure on the graph's device (GPU when the graph was
        traced on one, else CPU), with the bitwise check against eager."""
        from workbench.measure import measure_policy

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
        finally:
            self.running = False
        summary = {**result.to_json(), "policy": self.policy.to_json()}
        self.run_result = summary
        self.status = (
            f"measured on {summary['device']}: peak {human_bytes(summary['peak_bytes'])} "
            f"(estimated {human_bytes(summary['estimated_peak_bytes'])}), "
            f"{summary['step_seconds'] * 1e3:.1f} ms/step, "
            f"{'bitwise equal to eager' if summary['bitwise_equal'] else 'NOT bitwise equal'}"
        )
        self._add_point(
            result.graph_sac.peak_bytes, result.graph_sac.step_seconds, measured=True,
            device=summary["device"],
        )  # fmt: skip
        return summary

    # --- messages from the front end ------------------------------------------------------

    def _on_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        action = content.get("type")
        handlers: dict[str, Callable[[], object]] = {
            "click": lambda: self.click(content["id"], select_only=bool(content.get("shift"))),
            "show": lambda: self.show(content["view"]),
            "preset": lambda: self.set_preset(content["name"]),
            "selector": lambda: self.add_selector(content["select"], content["action"]),
            "switch": lambda: self.switch_op(content["module"], content["op"], content["action"]),
            "remove_selector": lambda: self.remove_selector(int(content["index"])),
            "undo": self.undo,
            "redo": self.redo,
            "reset": self.reset,
            "restore": lambda: self.restore(int(content["index"])),
            "save_export": lambda: self.save_export(content.get("path") or None),
            "run": self.run,
            "suggest": lambda: self.suggest(int(content["budget"])),
            "sweep": self.sweep,
        }
        if action not in handlers:
            self.message = f"unknown action {action!r}"
            return
        with self._explained():
            handlers[action]()

    @contextlib.contextmanager
    def _explained(self) -> Iterator[None]:
        """Errors become the message line; the policy is whatever it was before."""
        self.message = ""
        try:
            yield
        except WorkbenchError as err:
            self.message = str(err)

    # --- state ----------------------------------------------------------------------------

    def _recover(self, policy: Policy) -> Policy:
        """The autosaved policy when there is one (keeping what still applies)."""
        path = self.autosave_path
        if not path.exists():
            return policy
        try:
            saved = Policy.load(path)
        except WorkbenchError as err:
            kept = path.with_name(path.name + ".unreadable")
            path.rename(kept)
            self.message = f"{err}; kept it as {kept.name} and started from {policy.preset!r}"
            return policy
        kept_policy, dropped = restrict(self.graph, saved)
        if dropped:
            self.message = (
                f"restored {path.name}; {len(dropped)} entries no longer match this graph "
                "and were left out: " + " | ".join(dropped)
            )
        else:
            self.message = f"restored the autosaved policy from {path.name}"
        return kept_policy

    def _change(self, policy: Policy) -> None:
        if policy == self.policy:
            return
        self._undo.append(self.policy)
        self._redo.clear()
        self._apply(policy)

    def _apply(self, policy: Policy) -> None:
        previous = self.policy
        self.policy = policy
        try:
            self._refresh(record=True)
        except WorkbenchError:
            self.policy = previous
            self._refresh()
            raise

    def _refresh(self, record: bool = False) -> None:
        self._decisions = decide(self.graph, self.policy)
        estimate = self.estimator.estimate(self._decisions)
        self.policy_json = self.policy.to_json()
        self.can_undo, self.can_redo = bool(self._undo), bool(self._redo)
        self.metrics = self._metrics(estimate)
        self.export_code = export(self.policy, self.export_format, graph=self.graph)
        if self.selected:
            self.details = self._details(self.selected)
        self._draw()
        if record:
            self._add_point(estimate.peak_bytes, self._step_seconds(estimate))
            self._autosave()

    def _draw(self) -> None:
        picture = render_view(
            self.graph, self._decisions, self.view, policy_name=self.policy.preset
        )
        self.svg = picture.svg()

    def _autosave(self) -> None:
        self.autosave_path.parent.mkdir(parents=True, exist_ok=True)
        self.policy.save(self.autosave_path, overwrite=True)

    def _step_seconds(self, est: Estimate) -> float:
        return est.step_seconds[self.profile]

    def _metrics(self, est: Estimate) -> dict[str, Any]:
        step = self._step_seconds(est)
        return {
            "peak_bytes": est.peak_bytes,
            "peak": human_bytes(est.peak_bytes),
            "peak_node": est.peak_node,
            "saved_bytes": est.saved_activation_bytes,
            "saved": human_bytes(est.saved_activation_bytes),
            "recompute_flops": est.recompute_flops,
            "recompute": human_flops(est.recompute_flops),
            "recomputed_nodes": len(est.recomputed_nodes),
            "profile": self.profile,
            "step_seconds": step,
            "step": f"{step * 1e3:.2f} ms",
            "tokens_per_second": est.tokens / step if step else 0.0,
            "tokens_per_second_text": f"{est.tokens / step:,.0f} tokens/s" if step else "-",
        }

    def _add_point(
        self,
        peak: int,
        seconds: float,
        measured: bool = False,
        policy: Policy | None = None,
        **extra: Any,
    ) -> None:
        policy_json = (policy or self.policy).to_json()
        points = [
            p
            for p in self.history
            if not (p["policy"] == policy_json and p["measured"] == measured)
        ]
        label = ("solver: " if "solver" in extra else "") + self._label(policy_json)
        points.append({"peak_bytes": peak, "step_seconds": seconds, "measured": measured,
                       "name": label, "policy": policy_json, **extra})  # fmt: skip
        front = {id(p) for p in pareto_front(points)}
        self.history = [{**p, "index": i, "pareto": id(p) in front} for i, p in enumerate(points)]

    @staticmethod
    def _label(policy: dict[str, Any]) -> str:
        changes = len(policy["selectors"]) + len(policy["overrides"])
        return policy["preset"] + (f" + {changes} edits" if changes else "")

    def _details(self, name: str) -> dict[str, Any]:
        info = self.graph.nodes[name]
        decision = self._decisions.get(name)
        preset_name = self.policy.preset
        if preset_name not in self._preset_decisions:
            self._preset_decisions[preset_name] = decide(self.graph, Policy(preset_name))
        preset = self._preset_decisions[preset_name].get(name)
        consumers = self.estimator.backward_readers(name)
        return {
            "name": name,
            "op": info.op,
            "phase": info.phase,
            "module": info.module,
            "layer": info.layer,
            "shape": " · ".join("×".join(map(str, s)) for s in info.shapes) or "-",
            "dtype": info.dtype or "-",
            "bytes": human_bytes(info.bytes),
            "flops": human_flops(info.flops),
            "backward_consumers": consumers,
            "source": info.source or "-",
            "decision": "-" if decision is None else decision.policy.name,
            "reason": "-" if decision is None else decision.reason,
            "preset_decision": "-" if preset is None else preset.policy.name,
            "can_flip": decision is not None and not decision.forced,
        }
