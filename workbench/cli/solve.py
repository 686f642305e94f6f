"""`solve`, `pareto` and `floor`: the cheapest policy within a budget, the memory-vs-recompute
front with the presets beside it, and what offload buys at eager's step time.

Entry points: `cmd_solve`, `cmd_pareto` and `cmd_floor` (each `args -> Result`); `Floor`, the
floor's result (a table for people).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from workbench.cli.args import (
    budget_from_args,
    check_budget,
    cost_options_from_args,
    passes_json,
    prepared_from_args,
    solve_options_from_args,
    trace_from_args,
)
from workbench.cli.report import Report
from workbench.errors import INT64_MAX, check_int
from workbench.files import check_writable

__all__ = ["Floor", "cmd_floor", "cmd_pareto", "cmd_solve"]


def cmd_solve(args: argparse.Namespace) -> Report:
    """The cheapest policy (recompute time or FLOPs) whose estimated peak fits a budget."""
    from workbench.cost.calibrate import time_basis
    from workbench.cost.pass_stacks import estimator_for
    from workbench.search.solve import solve

    options = solve_options_from_args(args)
    check_budget(args)
    cost = cost_options_from_args(args)
    graph, trace_seconds = prepared_from_args(args)
    estimator = estimator_for(graph, args.passes, (args.profile,), args.optimizer, **cost)
    budget = budget_from_args(args, estimator)
    solution = solve(graph, budget, options, estimator=estimator)
    return Report(
        {
            "model": graph.model_name,
            "trace_seconds": round(trace_seconds, 3),
            **solution.to_json(),
            "time_basis": time_basis(estimator.profiles, estimator.calibration),
            **passes_json(args, graph, solution.policy),
        }
    )


def cmd_pareto(args: argparse.Namespace) -> Report:
    """Solutions from full recompute to no AC, presets beside them; a line per budget on
    stderr."""
    from workbench.cost.calibrate import time_basis
    from workbench.cost.estimate import Estimator
    from workbench.search.pareto import MAX_POINTS, pareto
    from workbench.search.solve import Solution, fsdp_choices, preset_points

    options = solve_options_from_args(args)
    check_int("--points", args.points, 2, MAX_POINTS, "each point is a solve")
    cost = cost_options_from_args(args)
    if args.plot is not None:
        from workbench.show.viz.plots import figure_format

        figure_format(args.plot, "--plot")
        check_writable(args.plot, overwrite=args.overwrite)
    graph, trace_seconds = trace_from_args(args)
    start = time.perf_counter()

    def progress(done: int, total: int, solution: Solution) -> None:
        est = solution.estimate
        keep = "" if solution.policy.fsdp_reshard else ", FSDP keep unsharded"
        print(
            f"[{done}/{total}] budget {(solution.budget_bytes or 0) / 2**30:.3f} GiB: peak "
            f"{est.peak_bytes / 2**30:.3f} GiB, recompute "
            f"{est.recompute_seconds[args.profile] * 1e3:.3f} ms{keep} ({solution.seconds:.2f} s)",
            file=sys.stderr,
            flush=True,
        )

    estimator = Estimator(graph, (args.profile,), args.optimizer, **cost)

    def front(host_budget: int) -> list[Solution]:
        with_host = dataclasses.replace(options, host_budget_bytes=host_budget)
        return pareto(
            graph, points=args.points, options=with_host, estimator=estimator, progress=progress
        )

    points = front(0)
    # with a host budget, the front with offload beside the one without
    offload = (
        {"offload_points": [p.to_json() for p in front(args.host_budget_bytes)]}
        if args.host_budget_bytes
        else {}
    )
    seconds = time.perf_counter() - start

    def presets(fsdp_reshard: bool) -> dict[str, Any]:
        return {
            name: {
                "peak_bytes": est.peak_bytes,
                "recompute_flops": est.recompute_flops,
                "est_recompute_seconds": est.recompute_seconds[args.profile],
                "est_step_seconds": est.step_seconds[args.profile],
            }
            for name, est in preset_points(graph, args.profile, estimator, fsdp_reshard).items()
        }

    # on graphs with FSDP all-gathers, the presets under the other FSDP choice too
    other = {"presets_keep_unsharded": presets(False)} if False in fsdp_choices(graph) else {}
    solved = [p.to_json() for p in points]
    plot = {} if args.plot is None else {"plot": _plot_front(args, solved, presets(True))}
    return Report(
        {
            "model": graph.model_name,
            "points": solved,
            **offload,
            "presets": presets(True),
            **plot,
            "time_basis": time_basis(estimator.profiles, estimator.calibration),
            **other,
            "seconds": round(seconds, 3),
            "trace_seconds": round(trace_seconds, 3),
            "cpu_count": os.cpu_count(),
        }
    )


def _plot_front(
    args: argparse.Namespace, points: list[dict[str, Any]], presets: dict[str, Any]
) -> str:
    """`pareto --plot`: the solver's points (unnamed) and the presets (named), peak against
    estimated step time, with the front drawn through them (`plot_tradeoff`); the path."""
    from workbench.show.viz.plots import plot_tradeoff, save_figure

    drawn = [("", p) for p in points] + list(presets.items())
    figure = plot_tradeoff(
        [
            {
                "name": name,
                "peak_bytes": p["peak_bytes"],
                "step_seconds": p["est_step_seconds"],
                "measured": False,
            }
            for name, p in drawn
        ]
    )
    return str(save_figure(figure, args.plot, overwrite=args.overwrite))


class Floor(Report):
    """`floor`'s figures; a person reads them as `floor_table`'s table and the time taken."""

    def __str__(self) -> str:
        from workbench.search.floor import floor_table

        data = self.data
        took = f"{data['seconds']:.1f} s (trace {data['trace_seconds']:.1f} s)"
        return f"{floor_table(data)}\n{took}"


def _profile_with_host_link(name: str, link: str) -> Any:
    """`floor --host-link`: the profile's host link as measured in a step (its own), as
    benchmarked (no in-step derating), or with fresh pinned allocations per copy."""
    from workbench.cost.profiles import get_profile

    profile = get_profile(name)
    if link == "benchmark":
        return dataclasses.replace(profile, host_in_step_factor=1.0)
    if link == "fresh-pinned":
        return dataclasses.replace(profile, host_pinned_reused=False)
    return profile


def cmd_floor(args: argparse.Namespace) -> Floor:
    """The lowest peak the solver reaches at eager's step time, with and without offload,
    and the floor (see `workbench.search.floor.floor_search`)."""
    from workbench.cost.calibrate import time_basis
    from workbench.cost.estimate import Estimator
    from workbench.search.floor import floor_search

    options = solve_options_from_args(args)
    check_int("--tolerance-bytes", args.tolerance_bytes, 1, INT64_MAX, "int64")
    cost = cost_options_from_args(args)
    profile = _profile_with_host_link(args.profile, args.host_link)
    options = dataclasses.replace(options, profile=profile)
    graph, trace_seconds = trace_from_args(args)
    start = time.perf_counter()
    estimator = Estimator(graph, (profile,), args.optimizer, **cost)
    result = floor_search(graph, estimator, options, tolerance_bytes=args.tolerance_bytes)
    return Floor(
        {
            **result,
            "time_basis": time_basis(estimator.profiles, estimator.calibration),
            "host_link": args.host_link,
            "host_bytes_per_s": profile.host_rate(),
            "seconds": round(time.perf_counter() - start, 3),
            "trace_seconds": round(trace_seconds, 3),
            "cpu_count": os.cpu_count(),
        }
    )
