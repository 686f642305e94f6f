"""Pareto fronts: the solver's answers over a sweep of budgets, memory against cost.

Entry point: `pareto(graph, budgets=None, points=20, options=SolveOptions(...))`, a sweep
from full recompute to no AC (on per-rank graphs over both FSDP choices, as `solve` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimator
from workbench.errors import INT64_MAX, check_int
from workbench.search.solve import Solution, SolveOptions, Solver

__all__ = ["Progress", "pareto"]

MAX_POINTS = 1000  # budgets in one front: each is a whole solve

# Called after each budget: (budgets done, budgets in all, that budget's solution).
Progress = Callable[[int, int, Solution], None]


def pareto(
    graph: JointGraph,
    budgets: Sequence[int] | None = None,
    *,
    points: int = 20,
    options: SolveOptions | None = None,
    estimator: Estimator | None = None,
    progress: Progress | None = None,
) -> list[Solution]:
    """Solutions for `budgets` (default: `points` evenly spaced from full recompute's peak
    to no AC's), smallest budget first. Where a larger budget's solution costs more than a
    smaller one's, the smaller one's is kept: the front never gets worse with memory.
    Each point is `solve`'s answer for its budget under `options` (`SolveOptions`): the
    better FSDP choice for that budget, offload within the host budget."""
    if budgets is None:
        check_int("points", points, 2, MAX_POINTS, "each point is a solve")
    else:
        budgets = [check_int("budgets", b, 1, INT64_MAX, "int64") for b in budgets]
    solver = Solver(graph, options, estimator)
    if budgets is None:
        low, high = solver.floor_bytes, solver.top_bytes
        budgets = [int(b) for b in np.linspace(low, max(high, low), points)]
    solutions: list[Solution] = []
    ordered = sorted(int(b) for b in budgets)
    for k, budget in enumerate(ordered):
        solution = solver.solve(budget)
        if solutions and solutions[-1].cost() < solution.cost():
            previous = solutions[-1]
            solution.policy, solution.estimate = previous.policy, previous.estimate
        solutions.append(solution)
        if progress is not None:
            progress(k + 1, len(ordered), solution)
    return solutions
