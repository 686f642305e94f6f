"""The explorer on a pipelined job, in plain Python: a policy per stage, the stages side by
side with the pipelined peak of each one's rank, and any stage opened in the usual explorer.

Entry points: `StagesModel(graphs, layout, policy)` or `StagesModel.trace(workload, pipeline)`;
`open(stage) -> ExplorerModel` (its flips change that stage's policy only), `sync()` (after
any change in an open stage: the whole pipeline re-estimated), `strip()` (`StageStrip`);
per GPU over the schedule: `budget_range` (the Suggest slider's), `suggest(budget)`,
`sweep(points)`, and the `history` of the job's policies (`restore(index)`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.parallel import Parallel
from workbench.capture.stages import Pipeline, StageLayout, n_layers, trace_stages
from workbench.capture.tracing import Mode
from workbench.cost.estimate import OptimizerName
from workbench.cost.stages import PipelineEstimate, PipelineModel
from workbench.decide.decider import restrict
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError, check_int
from workbench.search.solve import fsdp_choices
from workbench.search.stages import StagePlan, solve_stages, stage_ladders
from workbench.show.viz.stages import StageStrip, stage_rows, stage_strip
from workbench.show.widgets.autosave import Autosave, default_autosave
from workbench.show.widgets.history import History, Point
from workbench.show.widgets.model import ExplorerModel
from workbench.show.widgets.panels import budget_slider, history_plots
from workbench.show.widgets.policy_state import policy_label, start_policy
from workbench.units import format_bytes

__all__ = ["STAGES_STATE", "StagesModel"]

# What a front end shows of a pipelined job: attributes of `StagesModel`, each mirrored into a
# traitlet of that name (the open stage's own state is `model.STATE`'s, but for these: the
# Suggest slider and the history are per GPU over the schedule).
STAGES_STATE: tuple[str, ...] = (
    "stages",
    "stages_svg",
    "stage",
    "budget_range",
    "history",
    "history_plots",
)


def _start_policies(policy: Policy | str | Sequence[Policy | str], stages: int) -> list[Policy]:
    """One policy per stage: the same for all, or one each in stage order."""
    if isinstance(policy, Policy | str):
        return [start_policy(policy)] * stages
    chosen = [start_policy(p) for p in policy]
    if len(chosen) != stages:
        raise WorkbenchError(
            f"give one policy, or one per stage ({stages} stages); got {len(chosen)}"
        )
    return chosen


class StagesModel:
    """A pipelined job's explorer session: the stage graphs, one policy per stage (each
    autosaved to its stage graph's own file), and the `PipelineModel` estimate of them all.

    A stage opened (`open`) is an `ExplorerModel` of its own: its edits and undo stack are
    that stage's; `sync` takes its current policy into `policies` and re-estimates, so every
    rank's pipelined peak follows the flip.
    """

    def __init__(
        self,
        graphs: Sequence[JointGraph],
        layout: StageLayout,
        policy: Policy | str | Sequence[Policy | str] = "default",
        *,
        profile: str = "h100",
        budget_bytes: int | None = None,
        optimizer: OptimizerName = "adamw",
    ) -> None:
        self.graphs = list(graphs)
        self.layout = layout
        self.pipeline = PipelineModel(self.graphs, layout, profile, optimizer)
        self.profile = self.pipeline.profile
        self.budget_bytes: int | None = None
        self.set_budget(budget_bytes)
        self.explorers: dict[int, ExplorerModel] = {}
        self.stage = -1  # the stage open in the explorer (-1: none yet)
        self._autosaves = [Autosave(default_autosave(g)) for g in self.graphs]
        self.notes: list[str] = []  # what recovering each stage's autosave said
        self.policies: list[Policy] = []
        for graph, save, start in zip(
            self.graphs, self._autosaves, _start_policies(policy, layout.n_stages), strict=True
        ):
            recovered, note = save.recover(graph, start)
            self.policies.append(recovered)
            if note:
                self.notes.append(f"stage {graph.config['stage']['stage']}: {note}")
        # the job's policies tried, each a point of its largest rank peak and pipelined step
        self.history_log = History()
        self._ladders: list[list[Policy]] | None = None  # each stage's choices, made once
        self._range: dict[str, Any] | None = None
        self.estimate = self._estimated(self.policies)

    @classmethod
    def trace(
        cls,
        workload: Workload,
        pipeline: Pipeline,
        *,
        mode: Mode = "fake",
        parallel: Parallel | None = None,
        **options: Any,
    ) -> StagesModel:
        """Trace every stage of `workload` under `pipeline` (`trace_stages`), then open the
        session on them; `options` are the constructor's."""
        graphs = trace_stages(workload, mode, parallel, pipeline)
        return cls(graphs, pipeline.layout(n_layers(workload)), **options)

    def __repr__(self) -> str:
        p = self.layout.pipeline
        return f"StagesModel({p.schedule}, pp {p.pp}, {self.layout.n_stages} stages)"

    # --- the strip ---------------------------------------------------------------------------

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One dict per stage (`stage_rows`): rank, layers, rank peak, microbatches in flight."""
        return stage_rows(self.estimate, self._labels(), self.budget_bytes)

    def strip(self) -> StageStrip:
        """The stages side by side (SVG), the open one outlined."""
        selected = self.stage if self.stage >= 0 else None
        return stage_strip(self.estimate, self._labels(), self.budget_bytes, selected)

    @property
    def stages(self) -> list[dict[str, Any]]:
        """The rows, under the name the widget's traitlet has."""
        return self.rows

    @property
    def stages_svg(self) -> str:
        return self.strip().svg()

    def _labels(self) -> list[str]:
        return [policy_label(p.to_json()) for p in self.policies]

    # --- per GPU over the schedule: the Suggest slider and the history ------------------------

    @property
    def budget_range(self) -> dict[str, Any]:
        """The Suggest slider in per-GPU terms: from the lowest largest-rank peak of full
        recompute on every stage to no AC's (both FSDP choices where the graphs have them),
        starting at the strip's budget, else at the job's peak."""
        if self._range is None:
            peaks = [
                self.pipeline.estimate(Policy(p, fsdp_reshard=r)).peak_bytes
                for p in ("full", "none")
                for r in fsdp_choices(self.graphs[0])
            ]
            low, high = min(peaks), max(peaks)
            self._range = budget_slider(low, high)
            self._range["note"] = (
                f"per GPU: each rank's pipelined peak over the schedule, from "
                f"{format_bytes(low)} (full recompute on every stage): Suggest and Sweep "
                "give each stage its own policy for a budget of the whole job"
            )
        return {**self._range, "start": self.budget_bytes or self.estimate.peak_bytes}

    @property
    def history(self) -> list[dict[str, Any]]:
        current = self._plan_json(self.policies)
        return self.history_log.to_json(self.profile, current)

    @property
    def history_plots(self) -> list[dict[str, Any]]:
        return history_plots(self.history, self.profile, per_gpu=True)

    @staticmethod
    def _plan_json(policies: Sequence[Policy]) -> dict[str, Any]:
        return {"stages": [p.to_json() for p in policies]}

    def _estimated(self, policies: Sequence[Policy], solver: str = "") -> PipelineEstimate:
        """The pipeline estimate of `policies`, and their point in the history."""
        estimate = self.pipeline.estimate(list(policies))
        labels = [policy_label(p.to_json()) for p in policies]
        label = " | ".join(labels) if len(set(labels)) > 1 else f"{labels[0]} on every stage"
        point = Point(
            self._plan_json(policies),
            estimate.peak_bytes,
            {self.profile: estimate.schedule.step_seconds},
            solver=solver,
            label=label,
        )
        self.history_log.add(point)
        return estimate

    def to_json(self) -> dict[str, Any]:
        """The estimate's figures (`PipelineEstimate.to_json`), the rows and each policy."""
        return {
            **self.estimate.to_json(),
            "budget_bytes": self.budget_bytes,
            "open_stage": self.stage if self.stage >= 0 else None,
            "rows": self.rows,
            "policies": [p.to_json() for p in self.policies],
        }

    # --- actions -----------------------------------------------------------------------------

    def set_budget(self, budget_bytes: int | None) -> None:
        """The per-GPU budget the bars are drawn against (None: scaled to the largest peak)."""
        if budget_bytes is not None:
            check_int("budget", budget_bytes, 1, 2**62, "bytes per GPU (None: no budget)")
        self.budget_bytes = budget_bytes

    def open(self, stage: int, like: ExplorerModel | None = None) -> ExplorerModel:
        """The explorer of stage `stage`'s graph under its policy (made on first open, kept
        with its undo stack after); `like` lends its profile, layer switch and panel shape."""
        self.layout.check_stage(stage)
        explorer = self.explorers.get(stage)
        if explorer is None:
            explorer = ExplorerModel(
                self.graphs[stage],
                self.policies[stage],
                profile=self.profile,
                autosave=self._autosaves[stage].path,
            )
            self.explorers[stage] = explorer
        if like is not None and like is not explorer:
            explorer.all_layers = like.all_layers
            if like.profile != explorer.profile:
                explorer.set_profile(like.profile)
            explorer.set_graph_panel(like.graph_aspect, like.graph_width)
        self.stage = stage
        self.sync()
        return explorer

    def sync(self) -> bool:
        """Take each open stage's current policy; re-estimate the pipeline when one changed
        (True then)."""
        current = [
            self.explorers[s].policy if s in self.explorers else p
            for s, p in enumerate(self.policies)
        ]
        if current == self.policies:
            return False
        self.policies = current
        self.estimate = self._estimated(current)
        return True

    def set_policy(self, stage: int, policy: Policy | str) -> str:
        """Give stage `stage` `policy` (what still applies to its graph; undoable where the
        stage is open), autosave it, re-estimate; the words for the message line."""
        note = self._give(stage, policy)
        self._reestimate()
        return note

    def _give(self, stage: int, policy: Policy | str) -> str:
        """`set_policy` but the estimate: the stage's policy set (through its explorer when
        open) and autosaved; the words for the message line."""
        self.layout.check_stage(stage)
        chosen, dropped = restrict(self.graphs[stage], start_policy(policy))
        if stage in self.explorers:
            self.explorers[stage].load(chosen)
            note = self.explorers[stage].message
        else:
            self.policies[stage] = chosen
            note = self._autosaves[stage].save(chosen)
        if dropped:
            note = f"{len(dropped)} entries do not match stage {stage}: " + " | ".join(dropped)
        return note

    def _reestimate(self, solver: str = "") -> None:
        """Take each open stage's policy and estimate the pipeline (a point of the history)."""
        self.policies = [
            self.explorers[s].policy if s in self.explorers else p
            for s, p in enumerate(self.policies)
        ]
        self.estimate = self._estimated(self.policies, solver)

    def flip(self, stage: int, name: str) -> ExplorerModel:
        """Flip op `name` in stage `stage` (opened for it), as a click in its explorer does."""
        explorer = self.open(stage)
        explorer.flip(name)
        self.sync()
        return explorer

    def ladders(self) -> list[list[Policy]]:
        """Each stage's choices (`stage_ladders`), made on first use and kept."""
        if self._ladders is None:
            self._ladders = stage_ladders(self.pipeline)
        return self._ladders

    def _plan(self, budget_bytes: int) -> StagePlan:
        return solve_stages(self.pipeline, budget_bytes, ladders=self.ladders())

    def suggest(self, budget_bytes: int | None = None) -> str:
        """One policy per stage for the per-GPU budget over the schedule (`solve_stages`; the
        strip's budget by default), each given to its stage as `set_policy` does; the strip's
        budget becomes the one suggested for. The words for the message line."""
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        if budget is None:
            raise WorkbenchError("suggest needs a per-GPU budget: set_budget(bytes) first")
        self.set_budget(budget)
        plan = self._plan(budget)
        for stage, policy in enumerate(plan.policies):
            self._give(stage, policy)
        self._reestimate(solver="per stage")
        worst = max(self.rows, key=lambda r: r["peak_bytes"])
        peak = f"{worst['peak']} (rank {worst['rank']})"
        if not plan.feasible:
            return (
                f"no per-stage policies fit {format_bytes(budget)} per GPU: the lowest rank "
                f"peak found is {peak}, each stage given its lowest"
            )
        labels = ", ".join(f"stage {s}: {label}" for s, label in enumerate(self._labels()))
        return (
            f"one policy per stage within {format_bytes(budget)} per GPU over the schedule: "
            f"largest rank peak {peak}; {labels} (the strip's budget is now this one)"
        )

    def sweep(self, points: int = 8, progress: Callable[[int, int], None] | None = None) -> str:
        """The per-stage plans for `points` per-GPU budgets across the slider's range into
        the history (each restorable), the job's policies unchanged; the words for the
        message."""
        check_int("points", points, 2, 64, "each point solves every stage's plan")
        low, high = self.budget_range["min"], self.budget_range["max"]
        budgets = [low + (high - low) * k // (points - 1) for k in range(points)]
        plans = []
        for k, budget in enumerate(budgets, start=1):
            if progress is not None:
                progress(k, points)
            plans.append(self._plan(budget))
        for plan in plans:
            self._estimated(plan.policies, solver="per stage")
        distinct = len({tuple(p.key() for p in plan.policies) for plan in plans})
        fits = sum(plan.feasible for plan in plans)
        return (
            f"Sweep: {points} per-GPU budgets from {format_bytes(low)} to {format_bytes(high)} "
            f"gave {distinct} plans of one policy per stage, now in the history ({fits} of the "
            f"{points} budgets met)"
        )

    def restore(self, index: int) -> str:
        """Give every stage its policy of history point `index` (`set_policy`: undoable in
        the open stage); the words for the message."""
        point = self.history_log.point(index)
        plans = point.policy.get("stages") if isinstance(point.policy, dict) else None
        if not isinstance(plans, list) or len(plans) != self.layout.n_stages:
            raise WorkbenchError(f"history point #{index} holds no policy per stage")
        for stage, data in enumerate(plans):
            self._give(stage, Policy.from_json(data))
        self._reestimate(point.solver)
        return f"restored {point.name}: largest rank peak {format_bytes(point.peak_bytes)}"
