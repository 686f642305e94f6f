"""`estimate`, `measure` and `compare-snapshot`: a policy's memory and time estimated without
running (with `--baselines`, the eager baselines beside it; with `--snapshot`, as a memory
snapshot), measured in a real run, and a measured snapshot set against the estimate op by op.

Entry points: `cmd_estimate`, `cmd_measure`, `cmd_compare_snapshot` (each `args -> Result`),
`with_baselines(run)` (the estimate command with `--baselines`: refused before anything is
traced what the baselines cannot run, the `baselines` key added last), `check_baseline_args`
and `baselines_for_args`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from workbench.cli.args import (
    MAX_RUNS,
    check_positive,
    cost_options_from_args,
    degrees_from_args,
    kernels_from_args,
    parallel_flags,
    parallel_from_args,
    passes_json,
    prepared_from_args,
    profiles_from_args,
    trace_from_args,
    workload_from_args,
)
from workbench.cli.fits import refuse_unfit
from workbench.cli.report import Command, Report, Result
from workbench.decide.policy import parse_policy
from workbench.errors import WorkbenchError, check_int
from workbench.files import check_writable

if TYPE_CHECKING:
    from workbench.interop.eager_runs import EagerBaseline

__all__ = [
    "MAX_TOP",
    "baselines_for_args",
    "check_baseline_args",
    "cmd_compare_snapshot",
    "cmd_estimate",
    "cmd_measure",
    "with_baselines",
]

MAX_TOP = 100_000  # compare-snapshot --top: rows of per-node differences printed


def cmd_estimate(args: argparse.Namespace) -> Report:
    """Memory peak, saved activations, recompute FLOPs and step time without running; with
    --snapshot, the estimate as a memory snapshot memory_viz opens."""
    from workbench.cost.calibrate import time_basis
    from workbench.cost.estimated_snapshot import write_estimated_snapshot
    from workbench.cost.pass_stacks import estimator_for

    policy = parse_policy(args.policy)
    profiles = profiles_from_args(args)
    options = cost_options_from_args(args)
    if args.snapshot is not None:
        check_writable(args.snapshot, overwrite=args.overwrite)  # before tracing
    graph, seconds = prepared_from_args(args)
    estimator = estimator_for(graph, args.passes, profiles, args.optimizer, **options)
    est = estimator.estimate(policy)
    calibration = {"calibration": estimator.calibration} if estimator.calibration else {}
    written: dict[str, str] = {}
    if args.snapshot is not None:
        title = f"{graph.model_name} · policy {args.policy} (estimate)"
        path = write_estimated_snapshot(args.snapshot, estimator, est, title, args.overwrite)
        written["snapshot"] = str(path)
    return Report(
        {
            "model": graph.model_name,
            "mode": graph.mode,
            "policy": policy.to_json(),
            **passes_json(args, graph, policy, estimator),
            "backward_inputs": estimator.backward_inputs,
            "trace_seconds": round(seconds, 3),
            **est.to_json(timeline=args.timeline),
            "time_basis": time_basis(estimator.profiles, estimator.calibration),
            **calibration,
            **written,
            **({"notes": graph.notes} if graph.notes else {}),
        }
    )


def check_baseline_args(args: argparse.Namespace) -> None:
    """What `--baselines` cannot run, refused in one line before anything is traced: the eager
    step of a pipelined job, of EP or CP, of a torchtitan model's graph-trainer rank, and a
    sharded job for real."""
    if degrees_from_args(args).pp > 1:
        raise WorkbenchError(
            "--baselines with --pp: eager baselines run a whole model's step, not a pipeline "
            "stage's; drop --pp (or --baselines)"
        )
    parallel = parallel_from_args(args)
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
        parallel=parallel_from_args(args),
        kernels=kernels_from_args(args, args.mode),
        optimizer=args.optimizer,
        allocator=cost_options_from_args(args)["allocator"],
    )
    workload = workload_from_args(args, args.mode)
    return estimate_baselines(workload, options)


def with_baselines(run: Command) -> Command:
    """`run` (the estimate command) with `--baselines`: checked first, added last."""

    def estimate(args: argparse.Namespace) -> Result:
        if not getattr(args, "baselines", False):
            return run(args)
        check_baseline_args(args)
        cost_options_from_args(args)  # the allocator flags, checked before the trace
        result = run(args).to_json()
        baselines = baselines_for_args(args)
        notes = [*result.get("notes", []), *(n for b in baselines for n in b.notes)]
        kept = {"notes": list(dict.fromkeys(notes))} if notes else {}
        return Report({**result, "baselines": [b.to_json() for b in baselines], **kept})

    estimate.__doc__ = run.__doc__
    return estimate


def cmd_measure(args: argparse.Namespace) -> Report:
    """Estimate on fake tensors first (refusing what cannot fit), then run for real."""
    import torch

    from workbench.interop.baselines import measure_policy

    check_positive("--repeat", args.repeat)
    check_int("--warmup", args.warmup, 0, MAX_RUNS, "each one is a run of the step")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise WorkbenchError("--device cuda: no CUDA GPU is available here; use --device cpu")
    if parallel_from_args(args) is not None:
        raise WorkbenchError(
            f"measure runs one unsharded process: drop {parallel_flags(args)}, or use estimate "
            "(one rank's memory) or verify (every rank on gloo)"
        )
    policy = parse_policy(args.policy)
    refuse_unfit(args, policy, args.device)
    workload = workload_from_args(args, "real", device=args.device)
    if args.blocks is not None and not args.baselines:
        raise WorkbenchError("--blocks names what eager SAC wraps: it goes with --baselines")
    result = measure_policy(
        workload,
        policy,
        baselines=args.baselines,
        layers_attr=args.blocks,
        warmup=args.warmup,
        repeats=args.repeat,
    )
    return Report({"model": workload.name, "policy": policy.to_json(), **result.to_json()})


def cmd_compare_snapshot(args: argparse.Namespace) -> Report:
    """A memory snapshot of a run of the policy's rematerialized graph against the estimate
    of that graph (`workbench.cost.attribution.compare_snapshot`): the snapshot is read and
    checked before anything is traced. With `--backward-inputs held` the run is of the code
    that also returns what backward reads (scripts/run_rank_graph.py's `held`)."""
    from workbench.capture.kernels import check_kernels
    from workbench.cost.attribution import compare_snapshot
    from workbench.cost.estimate import Estimator, estimate_remat
    from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY
    from workbench.cost.snapshot import load_snapshot
    from workbench.rewrite.remat import remat, returning

    check_int("--top", args.top, 0, MAX_TOP)
    if args.device is not None:
        check_int("--device", args.device, 0, 2**16)
    policy = parse_policy(args.policy)
    cost = cost_options_from_args(args)
    snapshot = load_snapshot(args.snapshot)
    device = snapshot.device(args.device)
    recorded = snapshot.meta.get("kernels")
    if args.kernels is None and recorded is not None:  # an estimate's snapshot: its graph's
        try:
            args.kernels = check_kernels(recorded if isinstance(recorded, str) else repr(recorded))
        except WorkbenchError as err:
            raise WorkbenchError(
                f"snapshot {args.snapshot}: the workbench's metadata in it names {err}; "
                "or give --kernels"
            ) from None
    graph, seconds = trace_from_args(args)
    estimator = Estimator(
        graph,
        (),
        args.optimizer,
        allocator=cost["allocator"],
        backward_inputs=cost["backward_inputs"],
    )
    result = remat(graph, policy)
    est = estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)
    ran = result.gm  # the code whose lines the snapshot's frames name
    if estimator.backward_inputs == "held":  # a held run's code also returns what backward reads
        ran = returning(ran, estimator.backward_input_nodes(ran))
    comparison = compare_snapshot(snapshot, estimator, est, ran, device, args.top)
    return Report(
        {
            "model": graph.model_name,
            "policy": policy.to_json(),
            "optimizer": args.optimizer,
            "backward_inputs": estimator.backward_inputs,
            "kernels": graph.config.get("kernels"),
            **comparison.to_json(),
            "trace_seconds": round(seconds, 3),
        }
    )
