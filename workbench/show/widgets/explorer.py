"""The policy explorer widget: the anywidget shell around `ExplorerModel`. It holds the synced
traitlets `explorer.js` draws, runs the front end's requests (`workbench.show.widgets.actions`,
over anywidget's `invoke`) on the model, and mirrors the model back after each; the session
itself (plain Python) is `workbench.show.widgets.model`.

Entry points: `PolicyExplorer(graph_or_workload_or_model_name, policy=...)`, and
`PolicyExplorer.pipeline(workload, Pipeline(pp=...))` for a pipelined job (the stages side by
side above the explorer of the open one, `workbench.show.widgets.stages`). Every action is a
method (`flip`, `search`, `suggest`, `run`, `open_stage`, `load_snapshot`, ...), so it is
driven the same from a browser, a notebook cell or a test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anywidget
import traitlets
from anywidget.experimental import command

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.parallel import Parallel
from workbench.capture.stages import Pipeline, StageLayout
from workbench.capture.tracing import Mode
from workbench.cost.estimate import BudgetKind, Estimator
from workbench.cost.profiles import PROFILES
from workbench.decide.decider import Decisions
from workbench.decide.policy import Policy
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.interop.export import FORMATS
from workbench.show.viz.arrange import PANEL_ASPECT
from workbench.show.widgets.actions import perform
from workbench.show.widgets.model import STATE, ExplorerModel
from workbench.show.widgets.policy_state import policy_label
from workbench.show.widgets.stages import STAGES_STATE, StagesModel
from workbench.units import format_bytes

__all__ = ["PolicyExplorer"]

HERE = Path(__file__).parent


# PolicyExplorer keywords the per-stage explorer holds to one value: (name, that value, why)
_STAGE_SETTINGS = (
    ("passes", "workbench", "stages are estimated under the workbench's own passes"),
    ("budget_kind", "allocated", "a rank's pipelined peak sums allocated bytes"),
)


class PolicyExplorer(anywidget.AnyWidget):  # type: ignore[misc]
    """Click an op to flip it (shift-click only selects it), click a module box to expand it.

    Metrics come from the exact what-if estimate after every change; Run remats with
    torch's pass and measures for real. The policy is autosaved to `autosave` as JSON.
    `passes="graph-trainer"` shows graph trainer's cleaned graph and replays its pass
    stack on every change (`workbench.cost.pass_stacks`).
    `model` is the session this widget shows (`ExplorerModel`); every traitlet below is the
    model's attribute of the same name.
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
    history_plots: traitlets.List[dict[str, Any]] = traitlets.List().tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    presets: traitlets.List[str] = traitlets.List().tag(sync=True)  # set when made
    profiles = traitlets.List(list(PROFILES)).tag(sync=True)
    profile = traitlets.Unicode("h100").tag(sync=True)
    all_layers = traitlets.Bool(True).tag(sync=True)
    policy_json = traitlets.Dict().tag(sync=True)
    offload_text = traitlets.Unicode("").tag(sync=True)
    modules: traitlets.List[str] = traitlets.List().tag(sync=True)
    ops: traitlets.List[str] = traitlets.List().tag(sync=True)
    can_undo = traitlets.Bool(False).tag(sync=True)
    can_redo = traitlets.Bool(False).tag(sync=True)
    export_formats = traitlets.List(list(FORMATS)).tag(sync=True)
    export_format = traitlets.Unicode("policy_fn").tag(sync=True)
    export_code = traitlets.Unicode("").tag(sync=True)
    export_path = traitlets.Unicode("").tag(sync=True)
    running = traitlets.Bool(False).tag(sync=True)
    run_refusal = traitlets.Unicode("").tag(sync=True)  # why Run cannot measure ("": it can)
    status = traitlets.Unicode("").tag(sync=True)
    run_result = traitlets.Dict().tag(sync=True)
    budget_range = traitlets.Dict().tag(sync=True)
    suggest_method = traitlets.Unicode("greedy").tag(sync=True)
    # host bytes Suggest and the history's front may offload to (0: no offload)
    suggest_host_budget_bytes = traitlets.Int(0).tag(sync=True)
    # the FSDP choice of per-rank graphs: shown (and toggled) only where `has_fsdp`
    has_fsdp = traitlets.Bool(False).tag(sync=True)
    fsdp_reshard = traitlets.Bool(True).tag(sync=True)
    # the picture panel's width / height, set by the front end: views are arranged to fill it
    graph_aspect = traitlets.Float(PANEL_ASPECT).tag(sync=True)
    graph_width = traitlets.Int(0).tag(sync=True)  # and its width in pixels (0: not said yet)
    # the eager baselines' rows (`workbench.show.widgets.baselines`), once asked for this graph
    baselines: traitlets.List[dict[str, Any]] = traitlets.List().tag(sync=True)
    # a pipelined job (`PolicyExplorer.pipeline`): the stages' rows and strip, and the
    # stage shown (-1: none)
    stages: traitlets.List[dict[str, Any]] = traitlets.List().tag(sync=True)
    stages_svg = traitlets.Unicode("").tag(sync=True)
    stage = traitlets.Int(-1).tag(sync=True)  # every name in STAGES_STATE

    def __init__(
        self,
        source: JointGraph | Workload | str | ExplorerModel,
        policy: Policy | str = "default",
        *,
        profile: str = "h100",
        autosave: str | Path | None = None,
        workload: Workload | None = None,
        passes: str = "workbench",
        budget_kind: BudgetKind = "allocated",
        stages_model: StagesModel | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.presets = list(PRESETS)  # the registry as it is now, any preset added since import
        self.stages_model = stages_model  # the stages of a pipelined job (None: one graph)
        if isinstance(source, ExplorerModel):
            self.model = source
        else:
            self.model = ExplorerModel(
                source,
                policy,
                profile=profile,
                autosave=autosave,
                workload=workload,
                passes=passes,
                budget_kind=budget_kind,
            )
        self.model.on_change = self._sync
        self._sync()
        # traitlets the front end (or a notebook cell) sets: each forwarded to the model
        # shown (looked up at each set: opening another stage shows another model)
        self._setters: dict[str, Callable[[Any], None]] = {
            "profile": lambda name: self.model.set_profile(name),
            "all_layers": lambda on: setattr(self.model, "all_layers", bool(on)),
            "export_format": lambda fmt: self.model.set_export_format(fmt),
            "export_path": lambda path: self.model.set_export_path(path),
            "suggest_method": lambda method: setattr(self.model, "suggest_method", method),
            "suggest_host_budget_bytes": lambda n: self.model.set_host_budget(n),
            # the panel's shape and width arrive together: the view is arranged once
            "graph_aspect": lambda _: self._set_panel(),
            "graph_width": lambda _: self._set_panel(),
        }
        self.observe(self._on_set, names=list(self._setters))
        self.on_msg(self._on_msg)

    def _set_panel(self) -> None:
        self.model.set_graph_panel(self.graph_aspect, self.graph_width)

    @classmethod
    def pipeline(
        cls,
        source: Workload | Sequence[JointGraph],
        pipeline: Pipeline | StageLayout,
        policy: Policy | str | Sequence[Policy | str] = "default",
        *,
        mode: Mode = "fake",
        parallel: Parallel | None = None,
        profile: str = "h100",
        budget_bytes: int | None = None,
        stage: int = 0,
        **kwargs: Any,
    ) -> PolicyExplorer:
        """The explorer of a pipelined job: a workload traced stage by stage under
        `pipeline` (or its stage graphs and their `StageLayout`), one policy per stage
        (`policy` for all, or one each), the stages side by side with each rank's
        pipelined peak against `budget_bytes`, and stage `stage` open. Each stage is
        estimated as `estimate --pp` does: under the workbench's passes, in allocated bytes
        (another `passes` or `budget_kind` is refused, not dropped)."""
        for name, used, why in _STAGE_SETTINGS:
            if kwargs.get(name, used) != used:
                raise WorkbenchError(
                    f"pipeline: {name}={kwargs[name]!r} is not used by the per-stage explorer "
                    f"({why}); leave it out"
                )
        if isinstance(source, Workload):
            if not isinstance(pipeline, Pipeline):
                raise WorkbenchError("a workload is split by a Pipeline(pp=...), not a layout")
            stages = StagesModel.trace(
                source,
                pipeline,
                mode=mode,
                parallel=parallel,
                policy=policy,
                profile=profile,
                budget_bytes=budget_bytes,
            )
        else:
            layout = pipeline if isinstance(pipeline, StageLayout) else None
            if layout is None:
                raise WorkbenchError(
                    "stage graphs come with their StageLayout (Pipeline.layout(n_layers)); "
                    "give a Workload to trace them under a Pipeline"
                )
            stages = StagesModel(source, layout, policy, profile=profile, budget_bytes=budget_bytes)
        widget = cls(stages.open(stage), stages_model=stages, **kwargs)
        if stages.notes:
            widget.model.message = " · ".join(stages.notes)
            widget._sync()
        return widget

    def __repr__(self) -> str:
        where = f", stage {self.stage}" if self.stages_model is not None else ""
        label = policy_label(self.policy_json)
        return f"PolicyExplorer({self.graph.model_name}{where}, policy {label})"

    @property
    def graph(self) -> JointGraph:
        return self.model.graph

    @property
    def workload(self) -> Workload | None:
        return self.model.workload

    @property
    def estimator(self) -> Estimator:
        return self.model.estimator

    @property
    def policy(self) -> Policy:
        return self.model.policy

    @property
    def decisions(self) -> Decisions:
        return self.model.decisions

    @property
    def autosave_path(self) -> Path:
        return self.model.autosave.path

    # --- actions: the model's, then the traitlets mirror it --------------------------------

    def click(self, element_id: str, *, select_only: bool = False) -> None:
        """A click in the picture: an op flips (and is selected), a module box or layer
        expands, anything else explains itself."""
        with self._synced():
            self.model.click(element_id, select_only=select_only)

    def select(self, name: str) -> None:
        with self._synced():
            self.model.select(name)

    def flip(self, name: str) -> None:
        """Save -> recompute -> offload -> save, in every identical layer when `all_layers`."""
        with self._synced():
            self.model.flip(name)

    def show(self, view: str) -> None:
        """`overview`, `layer:N` or `module:PATH`."""
        with self._synced():
            self.model.show(view)

    def search(self, query: str) -> str:
        """Open and select the first forward op matching `query`; again: the next."""
        with self._synced():
            return self.model.search(query)

    def reveal(self, name: str) -> None:
        with self._synced():
            self.model.reveal(name)

    def go_to_peak(self) -> None:
        with self._synced():
            self.model.go_to_peak()

    def set_preset(self, name: str) -> None:
        with self._synced():
            self.model.set_preset(name)

    def set_fsdp_reshard(self, reshard: bool) -> None:
        with self._synced():
            self.model.set_fsdp_reshard(reshard)

    def add_selector(self, select: str, action: str) -> None:
        with self._synced():
            self.model.add_selector(select, action)

    def switch_op(self, module: str, op: str, action: str) -> None:
        with self._synced():
            self.model.switch_op(module, op, action)

    def remove_selector(self, index: int) -> None:
        with self._synced():
            self.model.remove_selector(index)

    def edit_selector(self, index: int, action: str) -> None:
        with self._synced():
            self.model.edit_selector(index, action)

    def set_override(self, key: str, action: str | None) -> None:
        with self._synced():
            self.model.set_override(key, action)

    def set_offload(
        self, budget_bytes: int | None = None, prefetch_layers: int = 1, defer_layers: int = 0
    ) -> None:
        with self._synced():
            self.model.set_offload(budget_bytes, prefetch_layers, defer_layers)

    def undo(self) -> None:
        with self._synced():
            self.model.undo()

    def redo(self) -> None:
        with self._synced():
            self.model.redo()

    def reset(self) -> None:
        with self._synced():
            self.model.reset()

    def restore(self, index: int) -> None:
        """Load the policy of history point `index`; for a pipelined job, the policy of
        every stage of a point of its per-GPU history."""
        with self._synced():
            if self.stages_model is None:
                self.model.restore(index)
            else:
                self.model.message = self.stages_model.restore(index)

    def set_host_budget(self, budget_bytes: int) -> None:
        with self._synced():
            self.model.set_host_budget(budget_bytes)

    def suggest(self, budget_bytes: int, method: str | None = None) -> None:
        """The solver's cheapest policy whose peak fits `budget_bytes`; for a pipelined job,
        one policy per stage whose every rank's pipelined peak fits it (per GPU)."""
        if self.stages_model is not None:
            self.suggest_stages(budget_bytes)
            return
        with self._synced():
            self.model.suggest(budget_bytes, method)

    def sweep(self, points: int = 8) -> None:
        """The solver's memory-vs-time front into the history; for a pipelined job, per-stage
        plans for per-GPU budgets into the job's history."""
        if self.stages_model is None:
            with self._synced():
                self.model.sweep(points)
            return
        stages, shown = self.stages_model, self.model

        def progress(done: int, total: int) -> None:
            shown.status = f"solving per-GPU budget {done} of {total}…"
            shown.on_change()

        with self._synced(), shown.busy(f"Sweep: solving {points} per-GPU budgets…"):
            words = stages.sweep(points, progress)
        shown.message = words

    def save_export(self, path: str | None = None) -> Path:
        with self._synced():
            return self.model.save_export(path)

    def run(self, repeats: int = 3) -> dict[str, Any]:
        with self._synced():
            return self.model.run(repeats)

    def load_snapshot(self, path: str | Path, device: int | None = None) -> dict[str, Any]:
        """A memory snapshot of a run of the current policy's rematerialized graph against
        its estimate: the timeline draws the measured live bytes beside the estimate's
        (`ExplorerModel.load_snapshot`); returns the comparison's JSON."""
        with self._synced():
            return self.model.load_snapshot(path, device)

    def show_baselines(self) -> list[dict[str, Any]]:
        """No AC, eager SAC and eager full AC as eager runs them, under torch's memory
        trackers: rows of the side panel beside the estimate, run once per graph
        (`ExplorerModel.show_baselines`)."""
        with self._synced():
            return self.model.show_baselines()

    def open_stage(self, stage: int) -> None:
        """Show stage `stage` of a pipelined job (its own policy and undo stack); the
        profile, layer switch and panel shape carry over."""
        with self._synced():
            self._open_stage(stage)

    def set_stage_budget(self, budget_bytes: int | None) -> None:
        """The per-GPU budget the stages' bars are drawn against (None: no budget)."""
        with self._synced():
            self._stages().set_budget(budget_bytes)

    def suggest_stages(self, budget_bytes: int | None = None) -> str:
        """One policy per stage within the per-GPU budget over the schedule (the stages'
        budget by default), each given to its stage; the message says whether they fit."""
        stages, shown = self._stages(), self.model
        budget = stages.budget_bytes if budget_bytes is None else budget_bytes
        words = "per GPU" if budget is None else f"{format_bytes(budget)} per GPU"
        with self._synced():
            with shown.busy(f"Suggest: one policy per stage for {words}…"):
                message = stages.suggest(budget_bytes)
            self.model.message = message
        return message

    def _stages(self) -> StagesModel:
        if self.stages_model is None:
            raise WorkbenchError(
                "this explorer shows one graph; open a pipelined job with "
                "PolicyExplorer.pipeline(workload, Pipeline(pp=...)) to switch stages"
            )
        return self.stages_model

    def _open_stage(self, stage: int) -> None:
        opened = self._stages().open(stage, like=self.model)
        if opened is not self.model:
            self.model.on_change = lambda: None
            self.model = opened
            self.model.on_change = self._sync
            self.model.message = (
                f"stage {stage} open: its edits change its policy only; the metrics are its "
                "one-microbatch graph's, the strip's peaks each rank's pipelined peak; "
                "Suggest, Sweep and the history are per GPU over the schedule"
            )

    # --- requests and traitlets from the front end ------------------------------------------

    @command
    def act(self, request: Any, _buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """The front end's requests (anywidget's `invoke("act", {type, ...})`): each runs as
        `_act` does, and the reply says whether it did and the message line after it."""
        return self._act(request), []

    def _on_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """A plain message (`model.send({type, ...})`, where a front end has no `invoke`):
        run as a request, without a reply; anywidget's own requests are answered by `act`."""
        if isinstance(content, dict) and content.get("kind") == "anywidget-command":
            return
        self._act(content)

    def _act(self, content: Any) -> dict[str, Any]:
        """Run one front-end request (`actions.perform`). Nothing escapes: every failure
        sets the message line, and the model is whatever it was before."""
        shown = self.model
        ok = False
        with self._synced():
            shown.message = ""
            try:
                perform(content, shown, self)
                ok = True
            except WorkbenchError as err:
                shown.message = str(err)
            except Exception as err:  # a bug must not kill the widget: say what happened
                name = content.get("type")  # a dict: anything else is refused above
                shown.message = f"{name} failed: {type(err).__name__}: {err}"
        return {"ok": ok, "message": self.model.message}

    def _on_set(self, change: dict[str, Any]) -> None:
        """A traitlet set from outside: the model takes it (a bad value is refused on the
        message line and the traitlet shows the model's again)."""
        name, value = change["name"], change["new"]
        if getattr(self.model, name) == value:
            return  # the widget mirroring the model
        with self._synced():
            try:
                self._setters[name](value)
            except WorkbenchError as err:
                self.model.message = str(err)

    @contextlib.contextmanager
    def _synced(self) -> Iterator[None]:
        """Run an action of the model, then mirror it (also when the action failed)."""
        try:
            yield
        finally:
            self._sync()

    def _sync(self) -> None:
        """Every traitlet from the model (traitlets send only the ones that changed); for a
        pipelined job the shown stage's policy goes into the pipeline's estimate first."""
        with self.hold_sync():
            pipelined = self.stages_model is not None
            for name in STATE:
                if not (pipelined and name in STAGES_STATE):  # the job's, below
                    setattr(self, name, getattr(self.model, name))
            if self.stages_model is not None:
                self.stages_model.sync()
                for name in STAGES_STATE:
                    setattr(self, name, getattr(self.stages_model, name))
