"""The explorer on a pipelined job, in plain Python: a policy per stage, the stages side by
side with the pipelined peak of each one's rank, and any stage opened in the usual explorer.

Entry points: `StagesModel(graphs, layout, policy)` or `StagesModel.trace(workload, pipeline)`;
`open(stage) -> ExplorerModel` (its flips change that stage's policy only), `sync()` (after
any change in an open stage: the whole pipeline re-estimated), `strip()` (`StageStrip`).
"""

from __future__ import annotations

from collections.abc import Sequence
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
from workbench.search.stages import solve_stages
from workbench.show.viz.stages import StageStrip, stage_rows, stage_strip
from workbench.show.widgets.autosave import Autosave, default_autosave
from workbench.show.widgets.model import ExplorerModel
from workbench.show.widgets.policy_state import policy_label, start_policy
from workbench.units import format_bytes

__all__ = ["STAGES_STATE", "StagesModel"]

# What a front end shows of a pipelined job: attributes of `StagesModel`, each mirrored into a
# traitlet of that name (the open stage's own state is `model.STATE`'s).
STAGES_STATE: tuple[str, ...] = ("stages", "stages_svg", "stage")


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
        self.estimate: PipelineEstimate = self.pipeline.estimate(self.policies)

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
            explorer.set_graph_aspect(like.graph_aspect)
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
        self.estimate = self.pipeline.estimate(current)
        return True

    def set_policy(self, stage: int, policy: Policy | str) -> str:
        """Give stage `stage` `policy` (what still applies to its graph; undoable where the
        stage is open), autosave it, re-estimate; the words for the message line."""
        self.layout.check_stage(stage)
        chosen, dropped = restrict(self.graphs[stage], start_policy(policy))
        if stage in self.explorers:
            self.explorers[stage].load(chosen)
            note = self.explorers[stage].message
        else:
            self.policies[stage] = chosen
            self.estimate = self.pipeline.estimate(self.policies)
            note = self._autosaves[stage].save(chosen)
        self.sync()
        if dropped:
            note = f"{len(dropped)} entries do not match stage {stage}: " + " | ".join(dropped)
        return note

    def flip(self, stage: int, name: str) -> ExplorerModel:
        """Flip op `name` in stage `stage` (opened for it), as a click in its explorer does."""
        explorer = self.open(stage)
        explorer.flip(name)
        self.sync()
        return explorer

    def suggest(self, budget_bytes: int | None = None) -> str:
        """One policy per stage for the per-GPU budget (`solve_stages`; the strip's budget by
        default), each given to its stage as `set_policy` does; the words for the message."""
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        if budget is None:
            raise WorkbenchError("suggest needs a per-GPU budget: set_budget(bytes) first")
        plan = solve_stages(self.pipeline, budget)
        for stage, policy in enumerate(plan.policies):
            self.set_policy(stage, policy)
        peak = format_bytes(self.estimate.peak_bytes)
        if not plan.feasible:
            return f"no per-stage policies fit {format_bytes(budget)}: the lowest peak is {peak}"
        return f"one policy per stage within {format_bytes(budget)}: peak {peak}"
