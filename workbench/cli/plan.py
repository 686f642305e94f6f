"""The `plan` command: every parallel layout of a model over N GPUs, ranked by estimated
tokens/s per GPU under the GPU's memory (`workbench.search.planner`).

Entry points: `cmd_plan(args)` (its result, a `Planned`) and `plan_table(result)` (what a
person reads of the plan's JSON, stored or fresh).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from workbench.cli.report import Report
from workbench.errors import WorkbenchError
from workbench.files import check_writable

__all__ = ["Planned", "cmd_plan", "plan_table"]

GIB = 2**30
CLEAR_LINE = "\r\033[K"  # back to the line's start and erase it
MAX_MEMORY_GIB = 2**20  # far above any GPU's memory


def _memory_bytes(gib: float | None) -> int | None:
    if gib is None:
        return None
    if not math.isfinite(gib) or not 0 < gib <= MAX_MEMORY_GIB:
        raise WorkbenchError(
            f"--memory-gib must be a positive number of GiB up to {MAX_MEMORY_GIB:,}, got {gib}"
        )
    return int(gib * GIB)


def _names(schedules: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in schedules.split(",") if name.strip())


def _multiples(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise WorkbenchError(
            f"--microbatch-multiples takes whole numbers separated by commas (e.g. 1,2,4), "
            f"got {text!r}"
        ) from None


class Planned(Report):
    """The plan's JSON (`Plan.to_json`, with `plot` when drawn); a person reads `plan_table`."""

    def __str__(self) -> str:
        return plan_table(self.data)


def cmd_plan(args: argparse.Namespace) -> Planned:
    """Enumerate, prune, trace and solve every layout (`planner.plan`); `--plot` draws the
    layouts' memory against tokens/s per GPU with the feasible front."""
    from workbench.search.planner import (
        MICROBATCH_MULTIPLES,
        PLAN_SCHEDULES,
        PlannedConfig,
        PlanOptions,
        default_jobs,
        plan,
    )

    options = PlanOptions(
        model=args.model,
        gpus=args.gpus,
        gpu=args.gpu,
        memory_bytes=_memory_bytes(args.memory_gib),
        seq=args.seq,
        global_batch=args.global_batch,
        layers=args.layers,
        schedules=PLAN_SCHEDULES if args.schedules is None else _names(args.schedules),
        microbatch_multiples=MICROBATCH_MULTIPLES
        if args.microbatch_multiples is None
        else _multiples(args.microbatch_multiples),
        jobs=default_jobs() if args.jobs is None else args.jobs,
    )
    if args.plot is not None:
        from workbench.show.viz.plots import figure_format

        figure_format(args.plot, "--plot")
        check_writable(args.plot, overwrite=args.overwrite)
    start = time.perf_counter()
    # On a terminal, one progress line rewritten in place and cleared at the end, so an
    # error is still the one line left; elsewhere (a pipe, a log, tests) none.
    terminal = sys.stderr.isatty()

    def progress(done: int, total: int, config: PlannedConfig) -> None:
        c = config.candidate
        sys.stderr.write(
            f"{CLEAR_LINE}[{done}/{total}] {c.describe()} {c.schedule or '-'} "
            f"{c.microbatches}x{c.microbatch_size}: peak {config.peak_bytes / GIB:.1f} GiB, "
            f"{config.tokens_per_second_per_gpu:,.0f} tokens/s/GPU "
            f"({time.perf_counter() - start:.1f} s)"
        )
        sys.stderr.flush()

    try:
        result = plan(options, progress if terminal else None).to_json()
    finally:
        if terminal:
            sys.stderr.write(CLEAR_LINE)
    if args.plot is not None:
        from workbench.show.viz.plots import plot_plan, save_figure

        figure = plot_plan(result["configs"], result["memory_bytes"])
        result["plot"] = str(save_figure(figure, args.plot, overwrite=args.overwrite))
    return Planned(result)


def plan_table(result: dict[str, Any], rows: int = 20) -> str:
    """The ranked layouts (best first, the first `rows`), then the pruned count and time;
    a layout with expert parallelism ends `ep E`."""
    head = (
        f"{'#':>3}  {'fsdp x tp x pp':<21} {'schedule':<16} {'mb':>8}  "
        f"{'peak GiB (min)':>15}  {'tok/s/GPU':>10}  fits  policy"
    )
    lines = [
        f"{result['model']} on {result['gpus']} x {result['gpu']} "
        f"({result['memory_bytes'] / GIB:.1f} GiB each), seq {result['seq']}, "
        f"global batch {result['global_batch']}",
        head,
    ]
    for i, c in enumerate(result["configs"][:rows], start=1):
        layout = f"{c['fsdp']} x {c['tp']} x {c['pp']}"
        if c.get("ep", 1) > 1:
            layout += f" ep {c['ep']}"
        micro = f"{c['microbatches']}x{c['microbatch_size']}"
        peaks = f"{c['peak_bytes'] / GIB:.1f}"
        if len(c["stage_peaks"]) > 1:
            peaks += f" ({min(c['stage_peaks']) / GIB:.1f})"
        lines.append(
            f"{i:>3}  {layout:<21} {c['schedule'] or '-':<16} {micro:>8}  {peaks:>15}  "
            f"{c['est_tokens_per_second_per_gpu']:>10,.0f}  {'yes' if c['feasible'] else 'no':<4}  "
            f"{c['policy_summary']}"
        )
    more = len(result["configs"]) - rows
    if more > 0:
        lines.append(f"     ... {more} more (--json lists all)")
    reasons: dict[str, int] = {}
    for p in result["pruned"]:
        reasons[p["reason"]] = reasons.get(p["reason"], 0) + 1
    lines.append(f"tokens/s per GPU (the ranking): {result['time_basis']}")
    lines.append(f"pruned before tracing: {len(result['pruned'])}")
    lines += [f"  {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda r: -r[1])]
    lines += result["notes"]
    if "plot" in result:
        lines.append(f"plot: {result['plot']}")
    lines.append(
        f"{result['seconds']:.1f} s on {result['jobs']} worker(s) ({result['traces']} stage "
        f"graphs traced in {result['trace_seconds']:.1f} s summed over them, "
        f"{result['traces_reused']} reused)"
    )
    return "\n".join(lines)
