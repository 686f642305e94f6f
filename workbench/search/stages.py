"""One policy per pipeline stage under one per-GPU budget: a stage whose rank holds more
microbatches in flight recomputes more.

Entry points: `stage_ladders(model)` (each stage's choices, least recompute first, from the
solver on that stage's graph) and `solve_stages(model, budget_bytes, per_stage=True)`.

The budget binds per rank, over the schedule (`PipelineModel.estimate`), not per graph: a
stage's own solve cannot see how many microbatches its rank holds, so the solver proposes
each stage's front of policies and the schedule's simulation chooses among them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.cost.stages import PipelineEstimate, PipelineModel
from workbench.decide.policy import Policy
from workbench.errors import INT64_MAX, WorkbenchError, check_int
from workbench.search.solve import SolveOptions, Solver

__all__ = ["StagePlan", "solve_stages", "stage_ladders"]

GIB = 2**30
BASE_PRESETS = ("none", "default", "full")  # the choices every stage has


def stage_ladders(
    model: PipelineModel, points: int = 6, options: SolveOptions | None = None
) -> list[list[Policy]]:
    """Per stage: the presets and the solver's policies for `points` budgets from full
    recompute's peak to no AC's on that stage's graph, least recompute time first."""
    check_int("points", points, 2, 64, "each point is a solve")
    options = options or SolveOptions(profile=model.profile)
    ladders: list[list[Policy]] = []
    shapes: dict[tuple[Any, ...], list[Policy]] = {}
    for stage, (graph, estimator) in enumerate(zip(model.graphs, model.estimators, strict=True)):
        # the solver's keys are layer-relative (`layers.*`): stages of the same role and
        # layer count get the same choices
        role = graph.config["stage"]
        shape = (role["first"], role["last"], len(role["layers"]))
        if shape in shapes:
            ladders.append(shapes[shape])
            continue
        solver = Solver(graph, options, estimator)
        found = {p.key(): p for p in (Policy(name) for name in BASE_PRESETS)}
        for budget in np.linspace(solver.floor_bytes, solver.top_bytes, points):
            policy = solver.solve(int(budget)).policy
            found.setdefault(policy.key(), policy)
        seconds = {
            key: model.stage_cost(stage, p)[1].recompute_seconds[model.profile]
            for key, p in found.items()
        }
        shapes[shape] = [found[k] for k in sorted(found, key=lambda k: (seconds[k], k))]
        ladders.append(shapes[shape])
    return ladders


@dataclass
class StagePlan:
    """The policies chosen per stage, the pipeline's figures with them, and whether every
    rank's peak is within the budget."""

    policies: list[Policy]
    estimate: PipelineEstimate
    budget_bytes: int
    feasible: bool
    per_stage: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "feasible": self.feasible,
            "per_stage": self.per_stage,
            "policies": [p.to_json() for p in self.policies],
            **self.estimate.to_json(),
        }


def solve_stages(
    model: PipelineModel,
    budget_bytes: int,
    per_stage: bool = True,
    ladders: Sequence[Sequence[Policy]] | None = None,
) -> StagePlan:
    """The fastest step whose every rank's peak is within `budget_bytes`. Per stage: start
    each stage at its least recompute, then, while a rank is over, move one of its stages
    down its ladder to the rung saving that rank most bytes per second of step time added.
    Uniform (`per_stage=False`): the one policy of all the ladders that, given to every
    stage, fits with the fastest step. Infeasible plans come back with `feasible=False`
    holding the lowest-peak choice found."""
    budget = check_int("budget_bytes", budget_bytes, 1, INT64_MAX, "int64")
    rungs = [list(ladder) for ladder in (ladders or stage_ladders(model))]
    if len(rungs) != model.layout.n_stages or not all(rungs):
        raise WorkbenchError(
            f"give a non-empty ladder of policies per stage ({model.layout.n_stages} stages)"
        )
    if not per_stage:
        return _uniform(model, budget, rungs)
    at = [0] * len(rungs)
    est = model.estimate([r[0] for r in rungs])
    while est.peak_bytes > budget:
        worst = max(est.schedule.stages, key=lambda row: row.peak_bytes)
        best: tuple[float, int, int, PipelineEstimate] | None = None
        for stage in model.layout.stages_of(worst.rank):
            for rung in range(at[stage] + 1, len(rungs[stage])):
                trial = [rungs[s][rung if s == stage else at[s]] for s in range(len(rungs))]
                candidate = model.estimate(trial)
                saved = worst.peak_bytes - _rank_peak(candidate, worst.rank)
                added = max(candidate.schedule.step_seconds - est.schedule.step_seconds, 1e-12)
                if saved > 0 and (best is None or saved / added > best[0]):
                    best = (saved / added, stage, rung, candidate)
        if best is None:  # no rung of the worst rank's stages lowers its peak
            break
        at[best[1]] = best[2]
        est = best[3]
    policies = [rungs[s][at[s]] for s in range(len(rungs))]
    return StagePlan(policies, est, budget, est.peak_bytes <= budget, per_stage=True)


def _rank_peak(estimate: PipelineEstimate, rank: int) -> int:
    return max(row.peak_bytes for row in estimate.schedule.stages if row.rank == rank)


def _uniform(model: PipelineModel, budget: int, rungs: list[list[Policy]]) -> StagePlan:
    choices = {p.key(): p for ladder in rungs for p in ladder}
    results = []
    for policy in choices.values():
        try:
            results.append((policy, model.estimate(policy)))
        except WorkbenchError:  # names ops of one stage only (the loss's): not for all
            continue
    fits = [(p, e) for p, e in results if e.peak_bytes <= budget]
    if fits:
        policy, est = min(fits, key=lambda pe: (pe[1].schedule.step_seconds, pe[1].peak_bytes))
    else:
        policy, est = min(results, key=lambda pe: pe[1].peak_bytes)
    n = model.layout.n_stages
    return StagePlan([policy] * n, est, budget, bool(fits), per_stage=False)
