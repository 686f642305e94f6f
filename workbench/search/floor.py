"""How low the peak goes: the lowest peak the solver reaches at eager's step time, without
and with offload, and the floor no save/recompute/offload policy passes (what sets it).

Entry points: `floor_search(graph, estimator, SolveOptions(...))` (its figures),
`floor_policy(graph)` (full recompute with everything allowed offloaded) and
`floor_table(result)` (the figures as a short table); `python -m workbench floor`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimate, Estimator
from workbench.decide.decider import decide, layer_key, rules_of
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Action, Policy
from workbench.errors import WorkbenchError
from workbench.search.solve import SOLVER_DEFER_LAYERS, Solution, SolveOptions, Solver, fsdp_choices
from workbench.units import format_bytes

__all__ = ["floor_policy", "floor_search", "floor_table"]

GIB = 2**30


def floor_policy(graph: JointGraph, fsdp_reshard: bool = True) -> Policy:
    """Full recompute, and every node it still saves that the rules may offload offloaded
    (layer by layer, no host limit, deferred as the solver defers): the lowest device peak
    a save/recompute/offload policy reaches where the activations full recompute cannot
    drop are what remains of them."""
    full = Policy("full", fsdp_reshard=fsdp_reshard)
    rules, tags = rules_of(graph), decide(graph, full)
    offload: Action = "offload"
    overrides = {
        layer_key(graph.nodes[name], rules.keys[name]): offload
        for name, tag in tags.items()
        if not tag.recompute and rules.offload_refusal(name, tags, "full") is None
    }
    return Policy(
        "full",
        overrides=overrides,
        fsdp_reshard=fsdp_reshard,
        offload=OffloadOptions(defer_layers=SOLVER_DEFER_LAYERS),
    )


def floor_search(
    graph: JointGraph,
    estimator: Estimator,
    options: SolveOptions | None = None,
    *,
    tolerance_bytes: int = 2**20,
    step_rtol: float = 1e-9,
) -> dict[str, Any]:
    """What offload buys at `eager`'s step time: eager's estimated peak and step; without
    offload (host budget 0) and with `options.host_budget_bytes` (default here 64 GiB), the
    lowest device peak `solve` reaches whose step time is at most eager's (times 1 +
    `step_rtol`, for summation order); and the floor, `floor_policy`, with what sets its
    peak.

    Found by bisection over solve's device budget, from eager's peak down to the floor's,
    until the bracket is `tolerance_bytes` wide. Sound because step time is a constant plus
    the solver's cost (recompute and exposed copy time), which it minimises within the
    budget: at eager's peak its answer costs at most eager's (eager is a preset it weighs),
    and a smaller budget can only cost more, so "as fast as eager" holds above one budget
    and not below it. A pareto front answers only at its grid of budgets; a fine grid costs
    as many solves. `options.method` is solve's: greedy and knapsack are heuristics, and
    where their cost is not monotone in the budget the answer meets eager's time but is not
    proven the lowest. Every figure is the exact estimate of the returned policy
    (`Estimator.estimate`); a budget below full recompute's peak counts as too low. The
    objective must be step time (`recompute_time`), on a profile `estimator` holds."""
    options = options or SolveOptions(host_budget_bytes=64 * GIB)
    profile = _checked_profile(estimator, options, tolerance_bytes)
    eager = estimator.estimate(Policy("eager"))
    limit = eager.step_seconds[profile] * (1 + step_rtol)
    floor_at, floor = min(
        (
            (policy, estimator.estimate(policy))
            for policy in (floor_policy(graph, c) for c in fsdp_choices(graph))
        ),
        key=lambda pair: pair[1].peak_bytes,
    )
    searched: dict[str, Any] = {}
    solves: dict[str, int] = {}
    host_budget = options.host_budget_bytes
    for key, host in (("without_offload", 0), ("with_offload", host_budget)):
        solver = Solver(graph, dataclasses.replace(options, host_budget_bytes=host), estimator)
        bracket = (floor.peak_bytes - 1, eager.peak_bytes)
        solution, solves[key] = _lowest(solver, bracket, limit, profile, tolerance_bytes)
        searched[key] = (
            None
            if solution is None
            else {
                **_point(solution.estimate, eager, profile),
                "budget_bytes": solution.budget_bytes,
                "policy": solution.policy.to_json(),
            }
        )
    return {
        "model": graph.model_name,
        "mode": graph.mode,
        "world_size": graph.world_size,
        "profile": profile,
        "optimizer": estimator.optimizer,
        "host_budget_bytes": host_budget,
        "eager": {
            "peak_bytes": eager.peak_bytes,
            "est_step_seconds": eager.step_seconds[profile],
        },
        **searched,
        "floor": {
            **_point(floor, eager, profile),
            **_peak_cause(estimator, floor),
            "policy": floor_at.to_json(),
        },
        "search": {
            "how": f"bisection over solve's device budget ({options.method}), from eager's "
            "peak down",
            "method": options.method,
            "solves": solves,
            "tolerance_bytes": tolerance_bytes,
            "step_rtol": step_rtol,
        },
    }


def _checked_profile(estimator: Estimator, options: SolveOptions, tolerance_bytes: int) -> str:
    """The profile `floor_search` times on, once its settings are checked."""
    profile = options.profile_name
    if options.objective != "recompute_time":
        raise WorkbenchError(
            f"floor_search bisects on step time: use objective 'recompute_time', not "
            f"{options.objective!r}"
        )
    if profile not in {p.name for p in estimator.profiles}:
        raise WorkbenchError(
            f"the estimator has no profile {profile!r}: build it with "
            f"Estimator(graph, profiles=[{profile!r}])"
        )
    if tolerance_bytes < 1:
        raise WorkbenchError(f"tolerance_bytes must be 1 or more, got {tolerance_bytes}")
    return profile


def _lowest(
    solver: Solver, bracket: tuple[int, int], limit: float, profile: str, tolerance_bytes: int
) -> tuple[Solution | None, int]:
    """The lowest-peak solution within `limit` seconds on `profile`, bisecting the device
    budget inside `bracket` (below the floor's peak, eager's peak) until it is
    `tolerance_bytes` wide; and the solves it took. None when even eager's budget is too
    slow."""
    floor_below, eager_peak = bracket
    best = solver.solve(eager_peak)  # any error here is the caller's to see
    if best.estimate.step_seconds[profile] > limit:
        return None, 1
    low, high, solves = floor_below, best.estimate.peak_bytes, 1
    while high - low > tolerance_bytes:
        budget = (low + high) // 2
        solves += 1
        found = solver.solve(budget) if budget >= solver.floor_bytes else None
        if found is None or found.estimate.step_seconds[profile] > limit:
            low = budget
            continue
        high = found.estimate.peak_bytes  # within the budget
        if high < best.estimate.peak_bytes:
            best = found
    return best, solves


def _point(est: Estimate, eager: Estimate, profile: str) -> dict[str, Any]:
    """One searched point's figures on `profile`, and how far below eager's peak it is."""
    return {
        "peak_bytes": est.peak_bytes,
        "host_peak_bytes": est.host_peak_bytes,
        "offloaded_bytes": est.offloaded_bytes,
        "exposed_transfer_seconds": est.exposed_transfer_seconds.get(profile, 0.0),
        "est_step_seconds": est.step_seconds[profile],
        "below_eager_pct": round(100 * (1 - est.peak_bytes / eager.peak_bytes), 2),
    }


def _peak_cause(estimator: Estimator, est: Estimate) -> dict[str, Any]:
    """Where the peak is (node, phase, node-order steps after it) and how much of it is the
    training state no policy moves: parameters, gradients and optimizer state."""
    phase = estimator.graph.nodes[estimator.traced_node(est.peak_node)].phase
    after = len(est.order) - 1 - est.peak_index
    state = sum(est.peak_breakdown.get(c, 0) for c in ("parameters", "gradients", "optimizer"))
    return {
        "peak_node": est.peak_node,
        "peak_phase": phase,
        "steps_after_peak": after,
        "peak_breakdown": est.peak_breakdown,
        "state_bytes": state,
        "optimizer_bytes": estimator.optimizer_bytes,
        "set_by": (
            f"{phase} op {est.peak_node}, {after} of {len(est.order)} steps before the end; "
            f"parameters + gradients + optimizer state {format_bytes(state)} of "
            f"{format_bytes(est.peak_bytes)}"
        ),
    }


def floor_table(result: dict[str, Any]) -> str:
    """`floor_search`'s figures as a short table (GiB, or MiB below 1 GiB; milliseconds)."""
    eager = result["eager"]
    unit, scale = ("GiB", GIB) if eager["peak_bytes"] >= GIB else ("MiB", 2**20)
    rows = [
        ("eager", {**eager, "host_peak_bytes": 0, "below_eager_pct": 0.0}),
        ("solver, no offload", result["without_offload"]),
        (f"solver, host {result['host_budget_bytes'] / GIB:g} GiB", result["with_offload"]),
        ("floor (full + offload all)", result["floor"]),
    ]
    lines = [
        f"{result['model']} ({result['mode']}, {result['world_size']} rank(s)), profile "
        f"{result['profile']}, optimizer {result['optimizer']}: lowest peak at eager's step time",
        f"{'policy':<28}{'peak ' + unit:>10}{'host ' + unit:>10}{'step ms':>12}{'below eager':>13}",
    ]
    for label, row in rows:
        if row is None:
            lines.append(f"{label:<28}{'none is as fast as eager':>45}")
            continue
        lines.append(
            f"{label:<28}{row['peak_bytes'] / scale:>10.2f}{row['host_peak_bytes'] / scale:>10.2f}"
            f"{row['est_step_seconds'] * 1e3:>12.3f}{row['below_eager_pct']:>12.2f}%"
        )
    lines.append(f"floor's peak: {result['floor']['set_by']}")
    if "time_basis" in result:
        lines.append(f"step time: {result['time_basis'][result['profile']]}")
    solves = result["search"]["solves"]
    lines.append(
        f"search: {result['search']['how']}, {solves['without_offload']} + "
        f"{solves['with_offload']} solves, to {format_bytes(result['search']['tolerance_bytes'])}"
    )
    return "\n".join(lines)
