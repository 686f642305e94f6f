"""Benchmarks: measured figures for tracing, the what-if, rendering and what offload buys.

Entry points: `bench_trace`, `bench_whatif`, `bench_render` and `bench_offload(graph,
estimator, profile, host_budget_bytes)`; `python -m workbench bench ...` prints them.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimate, Estimator, estimate_remat
from workbench.decide.decider import decide, flip, layer_key, node_keys, rules_of
from workbench.decide.offloadable import OffloadOptions, offload_refusal_in
from workbench.decide.policy import Action, Policy
from workbench.errors import WorkbenchError
from workbench.rewrite.remat import remat
from workbench.search.solve import (
    SOLVER_DEFER_LAYERS,
    Solution,
    SolveOptions,
    fsdp_choices,
    solve,
)
from workbench.units import format_bytes

__all__ = [
    "bench_offload",
    "bench_render",
    "bench_trace",
    "bench_whatif",
    "offload_floor_policy",
    "offload_table",
    "percentile",
]

GIB = 2**30


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, so p90 is never below p50.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile([1.0, 2.0, 3.0, 4.0], 0.9)
    (2.0, 4.0)
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def bench_trace(trace_once: Callable[[], tuple[JointGraph, float]], repeat: int) -> dict[str, Any]:
    """Median of `repeat` traces (each returns the graph and its seconds)."""
    times, summary = [], {}
    for _ in range(repeat):
        graph, seconds = trace_once()
        times.append(seconds)
        summary = graph.summary()
    return {
        "model": summary["model"],
        "mode": summary["mode"],
        "nodes": summary["nodes"],
        "world_size": summary["world_size"],
        "collectives": summary["collectives"],
        "seconds": round(statistics.median(times), 3),
        "all_seconds": [round(t, 3) for t in times],
        "cpu_count": os.cpu_count(),
    }


def bench_whatif(
    graph: JointGraph, policy: Policy, *, flips: int, full_path: int, seed: int
) -> dict[str, Any]:
    """Random flips (save -> recompute -> offload where allowed): the what-if's time per
    flip (flip, decide, replay with the offload steps, simulate) against
    the full path (tag, torch's remat pass, simulate), and whether both gave equal figures.
    Also the median time of each what-if stage, to say where the time goes."""
    estimator = Estimator(graph)
    decisions = decide(graph, policy)
    candidates = sorted(n for n, d in decisions.items() if not d.forced)
    rng = random.Random(seed)
    whatif, full, exact = [], [], True
    stages: dict[str, list[float]] = {"decide": [], "replay": [], "simulate": []}
    for k in range(flips):
        node = rng.choice(candidates)
        start = time.perf_counter()
        policy = flip(graph, policy, node, all_layers=rng.random() < 0.5, decisions=decisions)
        decisions = decide(graph, policy)
        replayed = time.perf_counter()
        schedule = estimator.schedule_for(decisions, policy.offload)
        simulated = time.perf_counter()
        fast = estimator.simulate(schedule)
        end = time.perf_counter()
        whatif.append(end - start)
        stages["decide"].append(replayed - start)
        stages["replay"].append(simulated - replayed)
        stages["simulate"].append(end - simulated)
        if k < full_path:
            start = time.perf_counter()
            slow = estimate_remat(graph, remat(graph, decisions, policy.offload), estimator)
            full.append(time.perf_counter() - start)
            exact = exact and fast == slow
    return {
        "model": graph.model_name,
        "nodes": len(graph.gm.graph.nodes),
        "flips": flips,
        "whatif_p50_seconds": round(statistics.median(whatif), 4),
        "whatif_p90_seconds": round(percentile(whatif, 0.9), 4),
        "stage_p50_seconds": {k: round(statistics.median(v), 4) for k, v in stages.items()},
        "full_path_seconds": round(statistics.median(full), 3) if full else None,
        "full_path_runs": len(full),
        "equal_to_full_path": exact,
        "cpu_count": os.cpu_count(),
    }


def bench_render(graph: JointGraph, policy: Policy, repeat: int) -> dict[str, Any]:
    """Time the overview and one layer's view (build + `dot` layout to SVG), median of
    `repeat` runs; deciding is timed apart."""
    from workbench.show.viz import render_view

    start = time.perf_counter()
    decisions = decide(graph, policy)
    decide_seconds = time.perf_counter() - start
    layers = sorted({i.layer for i in graph.ops() if i.layer is not None})
    layer_view = f"layer:{layers[len(layers) // 2]}" if layers else "overview"
    result: dict[str, Any] = {"model": graph.model_name, "mode": graph.mode}
    for key, view_name in (("overview", "overview"), ("layer", layer_view)):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            view = render_view(graph, decisions, view_name)
            view.svg()
            times.append(time.perf_counter() - start)
        result[f"{key}_seconds"] = round(statistics.median(times), 3)
        result[f"{key}_nodes"] = view.nodes
    return {
        **result,
        "layer_view": layer_view,
        "graph_nodes": len(graph.nodes),
        "decide_seconds": round(decide_seconds, 3),
        "cpu_count": os.cpu_count(),
    }


def offload_floor_policy(graph: JointGraph, fsdp_reshard: bool = True) -> Policy:
    """Full recompute, and every node it still saves that the rules may offload offloaded
    (layer by layer, no host limit, deferred as the solver defers): the lowest device peak
    a save/recompute/offload policy reaches where the activations full recompute cannot
    drop are what remains of them."""
    full = Policy("full", fsdp_reshard=fsdp_reshard)
    tags, plan, keys = decide(graph, full), rules_of(graph).plan, node_keys(graph)
    offload: Action = "offload"
    overrides = {
        layer_key(graph.nodes[name], keys[name]): offload
        for name, tag in tags.items()
        if not tag.recompute and offload_refusal_in(plan, tags, name, "full") is None
    }
    return Policy(
        "full",
        overrides=overrides,
        fsdp_reshard=fsdp_reshard,
        offload=OffloadOptions(defer_layers=SOLVER_DEFER_LAYERS),
    )


def bench_offload(
    graph: JointGraph,
    estimator: Estimator,
    profile: str = "h100",
    host_budget_bytes: int = 64 * GIB,
    *,
    tolerance_bytes: int = 2**20,
    step_rtol: float = 1e-9,
    method: str = "greedy",
) -> dict[str, Any]:
    """What offload buys at `eager`'s step time: eager's estimated peak and step; for host
    budget 0 (no offload) and `host_budget_bytes`, the lowest device peak `solve` reaches
    whose step time is at most eager's (times 1 + `step_rtol`, for summation order); and
    the floor, `offload_floor_policy`, with what sets its peak.

    Found by bisection over solve's device budget, from eager's peak down to the floor's,
    until the bracket is `tolerance_bytes` wide. Sound because step time is a constant plus
    the solver's cost (recompute and exposed copy time), which it minimises within the
    budget: at eager's peak its answer costs at most eager's (eager is a preset it weighs),
    and a smaller budget can only cost more, so "as fast as eager" holds above one budget
    and not below it. A pareto front answers only at its grid of budgets; a fine grid costs
    as many solves. `method` is solve's: greedy and knapsack are heuristics, and where
    their cost is not monotone in the budget the answer meets eager's time but is not
    proven the lowest. Every figure is the exact
    estimate of the returned policy (`Estimator.estimate`); a budget below full recompute's
    peak, which `solve` refuses, counts as too low."""
    if profile not in {p.name for p in estimator.profiles}:
        raise WorkbenchError(
            f"the estimator has no profile {profile!r}: build it with "
            f"Estimator(graph, profiles=[{profile!r}])"
        )
    if tolerance_bytes < 1:
        raise WorkbenchError(f"tolerance_bytes must be 1 or more, got {tolerance_bytes}")
    eager = estimator.estimate(Policy("eager"))
    limit = eager.step_seconds[profile] * (1 + step_rtol)
    floor_policy, floor = min(
        (
            (policy, estimator.estimate(policy))
            for policy in (offload_floor_policy(graph, c) for c in fsdp_choices(graph))
        ),
        key=lambda pair: pair[1].peak_bytes,
    )

    def solved(budget: int, host: int) -> Solution:
        options = SolveOptions(method=method, profile=profile, host_budget_bytes=host)  # type: ignore[arg-type]
        return solve(graph, budget, options, estimator=estimator)

    def lowest(host: int) -> tuple[Solution | None, int]:
        """The lowest-peak solution within eager's time, and the solves it took."""
        best = solved(eager.peak_bytes, host)  # any error here is the caller's to see
        if best.estimate.step_seconds[profile] > limit:
            return None, 1
        low, high, solves = floor.peak_bytes - 1, best.estimate.peak_bytes, 1
        while high - low > tolerance_bytes:
            budget = (low + high) // 2
            solves += 1
            try:
                found: Solution | None = solved(budget, host)
            except WorkbenchError:  # the same call succeeded at eager's peak: too low
                found = None
            if found is None or found.estimate.step_seconds[profile] > limit:
                low = budget
                continue
            high = found.estimate.peak_bytes  # within the budget
            if high < best.estimate.peak_bytes:
                best = found
        return best, solves

    def point(est: Estimate) -> dict[str, Any]:
        return {
            "peak_bytes": est.peak_bytes,
            "host_peak_bytes": est.host_peak_bytes,
            "offloaded_bytes": est.offloaded_bytes,
            "exposed_transfer_seconds": est.exposed_transfer_seconds.get(profile, 0.0),
            "est_step_seconds": est.step_seconds[profile],
            "below_eager_pct": round(100 * (1 - est.peak_bytes / eager.peak_bytes), 2),
        }

    searched: dict[str, Any] = {}
    solves: dict[str, int] = {}
    for key, host in (("without_offload", 0), ("with_offload", host_budget_bytes)):
        solution, solves[key] = lowest(host)
        searched[key] = (
            None
            if solution is None
            else {
                **point(solution.estimate),
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
        "host_budget_bytes": host_budget_bytes,
        "eager": {
            "peak_bytes": eager.peak_bytes,
            "est_step_seconds": eager.step_seconds[profile],
        },
        **searched,
        "floor": {
            **point(floor),
            **_peak_cause(estimator, floor),
            "policy": floor_policy.to_json(),
        },
        "search": {
            "how": f"bisection over solve's device budget ({method}), from eager's peak down",
            "method": method,
            "solves": solves,
            "tolerance_bytes": tolerance_bytes,
            "step_rtol": step_rtol,
        },
    }


def _peak_cause(estimator: Estimator, est: Estimate) -> dict[str, Any]:
    """Where the peak is (node, phase, schedule steps after it) and how much of it is the
    training state no policy moves: parameters, gradients and optimizer state."""
    phase = estimator.graph.nodes[estimator.origin(est.peak_node)].phase
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


def offload_table(result: dict[str, Any]) -> str:
    """`bench_offload`'s figures as a short table (GiB, or MiB below 1 GiB; milliseconds)."""
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
    solves = result["search"]["solves"]
    lines.append(
        f"search: {result['search']['how']}, {solves['without_offload']} + "
        f"{solves['with_offload']} solves, to {format_bytes(result['search']['tolerance_bytes'])}"
    )
    return "\n".join(lines)
