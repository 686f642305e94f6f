"""`estimate --baselines`: the eager baselines (no AC, eager SAC, eager full AC) run as eager
runs them under torch's memory trackers, beside the graph estimate.

Entry points: `with_baselines(run)` (wraps the estimate command: refuses what the baselines
cannot run before anything is traced, then adds the `baselines` key) and
`baselines_for_args(args)`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workbench.commands import (
    _cost_options_from_args,
    _parallel_from_args,
    _workload_from_args,
    kernels_from_args,
)
from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    from workbench.interop.eager_runs import EagerBaseline

__all__ = ["baselines_for_args", "check_baseline_args", "with_baselines"]

Command = Callable[[argparse.Namespace], dict[str, Any]]


def check_baseline_args(args: argparse.Namespace) -> None:
    """What `--baselines` cannot run, refused in one line before anything is traced: the eager
    step of a pipelined job, of EP or CP, of a torchtitan model's graph-trainer rank, and a
    sharded job for real."""
    if getattr(args, "pp", 1) > 1:
        raise WorkbenchError(
            "--baselines with --pp: eager baselines run a whole model's step, not a pipeline "
            "stage's; drop --pp (or --baselines)"
        )
    parallel = _parallel_from_args(args)
    if parallel is None:
        return
    if parallel.ep > 1 or parallel.cp > 1:
        raise WorkbenchError(
            "--baselines with --ep/--cp: eager baselines shard with FSDP2 and TP only; drop "
            "--ep/--cp (or --baselines)"
        )
    if args.mode == "real":
        raise WorkbenchError(
            "--baselines with --fsdp/--tp in --mode real: a sharded job's eager baselines run "
            "on fake tensors; use --mode fake"
        )
    if args.model.startswith("torchtitan:"):
        raise WorkbenchError(
            f"--baselines with --fsdp/--tp: {args.model}'s rank is sharded by graph trainer's "
            "parallelize; its eager baselines run on one device only (drop --fsdp/--tp)"
        )


def baselines_for_args(args: argparse.Namespace) -> list[EagerBaseline]:
    """The baselines (`workbench.interop.eager_runs.estimate_baselines`) of the job the
    arguments describe: its mode, sharding, kernels, optimizer and allocator."""
    from workbench.interop.eager_runs import BaselineOptions, estimate_baselines

    options = BaselineOptions(
        mode=args.mode,
        parallel=_parallel_from_args(args),
        kernels=kernels_from_args(args, args.mode),
        optimizer=args.optimizer,
        allocator=_cost_options_from_args(args)["allocator"],
    )
    workload = _workload_from_args(args, args.mode)
    return estimate_baselines(workload, options)


def with_baselines(run: Command) -> Command:
    """`run` (the estimate command) with `--baselines`: checked first, added last."""

    def estimate(args: argparse.Namespace) -> dict[str, Any]:
        if not getattr(args, "baselines", False):
            return run(args)
        check_baseline_args(args)
        _cost_options_from_args(args)  # the allocator flags, checked before the trace
        result = run(args)
        baselines = baselines_for_args(args)
        result["baselines"] = [b.to_json() for b in baselines]
        notes = [*result.get("notes", []), *(n for b in baselines for n in b.notes)]
        if notes:
            result["notes"] = list(dict.fromkeys(notes))
        return result

    estimate.__doc__ = run.__doc__
    return estimate
