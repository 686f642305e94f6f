"""The what-if under a pass pipeline: figures of the graph the chosen pipeline makes.

Entry point: `estimator_for(graph, passes, ...) -> Estimator`. `workbench`: the Estimator of
the traced graph, which replays torch's remat pass and the workbench's offload pass on
indices. `graph-trainer`: a `PipelineEstimator` of graph trainer's cleaned graph, whose every
schedule is that of the graph graph trainer's own passes make (`run_pipeline`), so it is exact
against them by construction, at the cost of running them on each estimate.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import DEFAULT_PROFILES, Estimator, OptimizerName
from workbench.cost.profiles import DeviceProfile
from workbench.decide.decider import Decisions
from workbench.decide.offloadable import OffloadOptions
from workbench.rewrite.graph_trainer import prepare, run_pipeline
from workbench.rewrite.schedule import Flat

__all__ = ["PipelineEstimator", "estimator_for"]


class PipelineEstimator(Estimator):
    """An Estimator of a cleaned graph (`rewrite.graph_trainer.cleanup`) whose schedules are
    those of graph trainer's pipeline: tagging, its offload pass, its remat pass."""

    passes = "graph-trainer"

    def schedule_for(self, decisions: Decisions, options: OffloadOptions | None = None) -> Flat:
        """The schedule of the graph graph trainer's passes make of `graph` tagged with
        `decisions` (offloads placed with `options`)."""
        result = run_pipeline(self.graph, decisions, options or OffloadOptions())
        return self.index.flat(self.schedule_of(result.gm))


def estimator_for(
    graph: JointGraph,
    passes: str = "workbench",
    profiles: Iterable[str | DeviceProfile] = DEFAULT_PROFILES,
    optimizer: OptimizerName = "adamw",
    **options: Any,
) -> Estimator:
    """The Estimator of the graph a pass pipeline analyses (`prepare(graph, passes)`; a
    prepared graph is taken as it is); `options` are Estimator's allocator, overlap and
    calibration settings."""
    prepared = prepare(graph, passes)
    if passes == "workbench":
        return Estimator(prepared, profiles, optimizer, **options)
    return PipelineEstimator(prepared, profiles, optimizer, **options)
