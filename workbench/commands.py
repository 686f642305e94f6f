"""What each command does with the library: `cmd_NAME(args) -> dict`, the one JSON object
the command prints (`workbench.cli` parses the arguments and prints the result).

Entry points: the `cmd_*` functions; `check_common_args`, `workload_from_args`,
`parallel_from_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, is_user_factory, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import timed_trace
from workbench.decide.policy import Policy, parse_policy
from workbench.errors import INT64_MAX, WorkbenchError, check_int
from workbench.files import check_writable
from workbench.preflight import (
    MAX_FLIPS,
    MAX_FULL_PATH,
    MAX_RANDOM,
    MAX_RUNS,
    SEED_MAX,
    check_budget,
    check_host_budget,
    check_passes,
    check_positive,
    flag,
    refuse_graph_flags_without_model,
    refuse_unfit_ranks,
)

if TYPE_CHECKING:
    from workbench.cost.estimate import Estimator
    from workbench.search.solve import SolveOptions


def _workload_from_args(args: argparse.Namespace, mode: str, device: str = "cpu") -> Workload:
    """Built-in and torchtitan models in fake mode are built on meta: no memory at all."""
    device = "meta" if mode == "fake" and not is_user_factory(args.model) else device
    return load_workload(
        args.model,
        layers=args.layers,
        seq=args.seq,
        batch=args.batch,
        dtype=args.dtype,
        device=device,
    )


def kernels_from_args(args: argparse.Namespace, mode: str) -> str | None:
    """The kernels a `mode` trace carries: `--kernels`, else in fake mode the GPU of the first
    `--profile` (the CPU's for `cpu`), else the default (`workbench.capture.kernels`)."""
    from workbench.capture.kernels import CPU, KERNEL_TARGETS, check_kernels

    kernels = getattr(args, "kernels", None)
    if kernels is not None:
        return check_kernels(kernels) if mode == "fake" else kernels
    profile = str(getattr(args, "profile", None) or "").split(",")[0]
    if mode == "fake" and (profile in KERNEL_TARGETS or profile == CPU):
        return profile
    return None


def _parallel_from_args(args: argparse.Namespace) -> Parallel | None:
    """None unless --fsdp, --tp, --ep or --cp asks for more than one rank."""
    degrees: dict[str, int] = {k: getattr(args, k, 1) for k in ("fsdp", "tp", "ep", "cp")}
    if set(degrees.values()) == {1}:
        return None
    return Parallel(
        fsdp=degrees["fsdp"],
        tp=degrees["tp"],
        ep=degrees["ep"],
        cp=degrees["cp"],
        ep_imbalance=getattr(args, "ep_imbalance", 1.0),
    )


def _refuse_titan_ranks(args: argparse.Namespace, parallel: Parallel | None) -> None:
    """verify's ranks run on gloo with the workbench's own sharding; a torchtitan model's
    rank is graph trainer's (`titan_rank`), which no gloo run reproduces yet."""
    if parallel is not None and args.model.startswith("torchtitan:"):
        raise WorkbenchError(
            f"verify with --fsdp/--tp/--ep: {args.model}'s rank is sharded by graph trainer's "
            "parallelize, which the gloo ranks of verify do not run yet; verify it on one "
            "device (no --fsdp/--tp/--ep) or estimate the rank"
        )


def check_common_args(args: argparse.Namespace) -> None:
    """Before any command starts its work: the parallel degrees (`Parallel`'s checks)."""
    if hasattr(args, "fsdp"):
        _parallel_from_args(args)


def _trace_from_args(args: argparse.Namespace) -> tuple[JointGraph, float]:
    return timed_trace(
        _workload_from_args(args, args.mode),
        args.mode,
        _parallel_from_args(args),
        kernels_from_args(args, args.mode),
    )


def _pipeline_json(
    args: argparse.Namespace,
    graph: JointGraph,
    policy: Policy,
    estimator: Estimator | None = None,
) -> dict[str, Any]:
    """What the chosen pipeline did for `policy`: for graph-trainer each of its passes, run,
    replaced or skipped (and why), and with the `estimator` that estimated it how its
    what-if made the schedule (`PipelineEstimator.whatif_note`); `graph` is the prepared
    graph (`prepare`)."""
    if args.passes == "workbench":
        return {"passes": {"pipeline": "workbench"}}
    from workbench.cost.pipelines import PipelineEstimator
    from workbench.rewrite.graph_trainer import run_pipeline

    report = run_pipeline(graph, policy, ep_overlap=args.ep_overlap).to_json()
    if isinstance(estimator, PipelineEstimator):
        report["whatif"] = estimator.whatif_note()
    return {"passes": report}


def _prepared_from_args(args: argparse.Namespace) -> tuple[JointGraph, float]:
    """The traced graph as the chosen pipeline analyses it (`rewrite.graph_trainer.prepare`)."""
    from workbench.rewrite.graph_trainer import prepare

    check_passes(args)
    graph, seconds = _trace_from_args(args)
    return prepare(graph, args.passes, args.ep_overlap), seconds


def cmd_trace(args: argparse.Namespace) -> dict[str, Any]:
    graph, seconds = _trace_from_args(args)
    return {**graph.summary(), "seconds": round(seconds, 3)}


def cmd_bench_trace(args: argparse.Namespace) -> dict[str, Any]:
    from workbench.bench import bench_trace

    check_positive("--repeat", args.repeat)
    return bench_trace(lambda: _trace_from_args(args), args.repeat)


def cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    """Remat with torch's pass, run under no_grad, compare loss and grads bitwise with the
    traced graph's (all from one generator state, so dropout draws alike); before that, the
    traced graph against eager and eager against itself (`cost.reference`), so a mismatch
    says whose it is; refuses what cannot fit."""
    from workbench.cost.reference import policy_mismatches, reference_run
    from workbench.rewrite.remat import remat

    if args.mode != "real":
        raise WorkbenchError("verify runs the graph: use --mode real")
    if args.random is not None:
        return _verify_random(args)
    args.policy = args.policy or "default"
    policy = parse_policy(args.policy)
    parallel = _parallel_from_args(args)
    _refuse_titan_ranks(args, parallel)
    if parallel is not None:
        return _verify_ranks(args, parallel)
    _refuse_unfit(args, policy, "cpu")
    workload = _workload_from_args(args, "real")
    graph, _ = timed_trace(workload, "real")
    result = remat(graph, policy)
    reference = reference_run(graph, workload)
    mismatched = policy_mismatches(graph, result.gm, reference)
    return {
        "model": graph.model_name,
        "policy": policy.to_json(),
        "bitwise_equal": not mismatched,  # the policy's verdict: graph against graph
        "mismatched": mismatched,
        "before_policy": reference.to_json(),
        **result.report.to_json(),
        # what no request can change, and why: node -> reason
        "forced": {n: result.decisions[n].explanation for n in result.report.forced},
    }


def _verify_random(args: argparse.Namespace) -> dict[str, Any]:
    """`--random N`: N seeded random policies of the model (`workbench.search.soundness`), each
    checked bitwise; the failures are listed with their policies, to reproduce one."""
    from workbench.search.soundness import run_soundness

    check_positive("--random", args.random, MAX_RANDOM, "each policy is a remat and a real run")
    check_int("--seed", args.seed, 0, SEED_MAX)
    if args.policy is not None:
        raise WorkbenchError("verify: give --policy or --random N, not both")
    parallel = _parallel_from_args(args)
    _refuse_titan_ranks(args, parallel)
    shape = {"layers": args.layers, "seq": args.seq, "batch": args.batch, "dtype": args.dtype}
    if parallel is None:
        _refuse_unfit(args, Policy("none"), "cpu")
        workload = _workload_from_args(args, "real")
        graph, _ = timed_trace(workload, "real")
    else:  # the policies' node keys from one rank in fake mode: every rank has its graph
        workload = _workload_from_args(args, "fake")
        graph, _ = timed_trace(workload, "fake", parallel, kernels="cpu")  # gloo runs on CPUs
    report = run_soundness(workload, graph, args.random, args.seed, parallel, shape)
    return report.to_json()


def _verify_ranks(args: argparse.Namespace, parallel: Parallel) -> dict[str, Any]:
    """One gloo process per rank: each rank's remat'd graph against its eager step."""
    from workbench.cost.ranks import check_ranks

    policy = parse_policy(args.policy)
    refuse_unfit_ranks(_workload_from_args(args, "fake"), parallel, policy)
    shape = {"layers": args.layers, "seq": args.seq, "batch": args.batch, "dtype": args.dtype}
    checks = check_ranks(args.model, parallel, [args.policy], **shape)
    errors = sorted({c.error for c in checks if c.error})
    if errors and all(c.error for c in checks):  # nothing was compared: say why in one line
        raise WorkbenchError(f"every rank failed: {errors[0]}")
    return {
        "model": args.model,
        "policy": parse_policy(args.policy).to_json(),
        **parallel.to_json(),
        "bitwise_equal": all(c.bitwise_equal for c in checks),
        "mismatched": {str(c.rank): list(c.mismatched) for c in checks if c.mismatched},
    }


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    from workbench.interop.export import FORMATS, export, torchtitan_options, write_export

    if args.format not in FORMATS:
        raise WorkbenchError(f"unknown format {args.format!r}; choose one of {', '.join(FORMATS)}")
    if args.torchtitan_version is not None and args.format != "torchtitan":
        raise WorkbenchError("--torchtitan-version goes with --format torchtitan only")
    policy = parse_policy(args.policy)
    if args.out is not None:
        check_writable(args.out, overwrite=args.overwrite)  # fail before tracing
    graph, _ = timed_trace(
        _workload_from_args(args, "fake"),
        "fake",
        _parallel_from_args(args),
        kernels_from_args(args, "fake"),
    )
    if args.format == "torchtitan":
        text = torchtitan_options(policy, graph, args.torchtitan_version)
    else:
        text = export(policy, args.format, graph=graph)
    result: dict[str, Any] = {"format": args.format, "code": text}
    if args.out is not None:
        result["path"] = str(write_export(text, args.out, overwrite=args.overwrite))
    return result


def cmd_activations(args: argparse.Namespace) -> dict[str, Any]:
    """graph trainer's activation-memory table for the policy: rows, totals and the log text."""
    from workbench.interop.activations import activation_log, activation_rows, totals
    from workbench.rewrite.graph_trainer import prepare

    policy = parse_policy(args.policy)
    check_passes(args)
    graph, _ = _trace_from_args(args)  # one rank's graph under --fsdp/--tp
    graph = prepare(graph, args.passes, args.ep_overlap)
    rows = activation_rows(graph, policy)
    return {
        "model": graph.model_name,
        "policy": policy.to_json(),
        **_pipeline_json(args, graph, policy),
        "total": totals(rows),
        "rows": [row.to_json() for row in rows],
        "table": activation_log(rows),
    }


def cmd_policy_explain(args: argparse.Namespace) -> dict[str, Any]:
    """The policy's rules in words and where it differs from graph trainer's; with --model,
    its decisions by reason and mismatches with graph trainer's tagging of that graph."""
    from workbench.show.explain import explain

    policy = parse_policy(args.policy)
    refuse_graph_flags_without_model(args)
    graph = _trace_from_args(args)[0] if args.model is not None else None
    return explain(policy, graph)


def _profiles_from_args(args: argparse.Namespace) -> list[str]:
    from workbench.cost.profiles import get_profile

    names = [p.strip() for p in args.profile.split(",") if p.strip()]
    if not names:
        raise WorkbenchError(f"--profile {args.profile!r} names no device profile, e.g. h100,cpu")
    for name in names:
        get_profile(name)  # raises with the list of profiles
    return names


def cmd_estimate(args: argparse.Namespace) -> dict[str, Any]:
    """Memory peak, saved activations, recompute FLOPs and step time without running; with
    --snapshot, the estimate as a memory snapshot memory_viz opens."""
    from workbench.cost.calibrate import time_basis
    from workbench.cost.estimated_snapshot import write_estimated_snapshot
    from workbench.cost.pipelines import estimator_for

    policy = parse_policy(args.policy)
    profiles = _profiles_from_args(args)
    options = _cost_options_from_args(args)
    if args.snapshot is not None:
        check_writable(args.snapshot, overwrite=args.overwrite)  # before tracing
    graph, seconds = _prepared_from_args(args)
    estimator = estimator_for(graph, args.passes, profiles, args.optimizer, **options)
    est = estimator.estimate(policy)
    calibration = {"calibration": estimator.calibration} if estimator.calibration else {}
    written: dict[str, str] = {}
    if args.snapshot is not None:
        title = f"{graph.model_name} · policy {args.policy} (estimate)"
        path = write_estimated_snapshot(args.snapshot, estimator, est, title, args.overwrite)
        written["snapshot"] = str(path)
    return {
        "model": graph.model_name,
        "mode": graph.mode,
        "policy": policy.to_json(),
        **_pipeline_json(args, graph, policy, estimator),
        "trace_seconds": round(seconds, 3),
        **est.to_json(timeline=args.timeline),
        "time_basis": time_basis(estimator.profiles, estimator.calibration),
        **calibration,
        **written,
        **({"notes": graph.notes} if graph.notes else {}),
    }


def _cost_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The allocator, stream and calibration flags as `Estimator` keywords, each checked
    before anything is traced, the error naming the flag."""
    from workbench.cost.allocator import AllocatorConfig
    from workbench.cost.calibrate import load_calibration
    from workbench.cost.overlap import OverlapOptions

    split = args.max_split_size_mb
    with flag("--max-split-size-mb"):
        allocator = AllocatorConfig(
            expandable_segments=args.expandable_segments,
            max_split_size=None if split is None else split * 2**20,
        )
    with flag("--prefetch"):
        OverlapOptions(prefetch=args.prefetch)
    with flag("--max-copies-in-flight"):
        OverlapOptions(max_copies_in_flight=args.max_copies_in_flight)
    overlap = OverlapOptions(
        prefetch=args.prefetch,
        bucket_layers=args.bucket_layers,
        sink_waits=args.sink_waits,
        max_copies_in_flight=args.max_copies_in_flight,
    )
    path = getattr(args, "calibrate", None)
    calibration = load_calibration(path) if path else None
    return {"allocator": allocator, "overlap": overlap, "calibration": calibration}


def _profile_with_host_link(name: str, link: str) -> Any:
    """`floor --host-link`: the profile's host link as measured in a step (its own), as
    benchmarked (no in-step derating), or with fresh pinned allocations per copy."""
    from dataclasses import replace

    from workbench.cost.profiles import get_profile

    profile = get_profile(name)
    if link == "benchmark":
        return replace(profile, host_in_step_factor=1.0)
    if link == "fresh-pinned":
        return replace(profile, host_pinned_reused=False)
    return profile


def _refuse_unfit(args: argparse.Namespace, policy: Policy, device: str) -> None:
    """Before anything runs for real: estimate on fake tensors both the policy's graph and
    the eager step it is compared with (no AC), and refuse a peak the device cannot hold."""
    import torch

    from workbench.capture.trace import trace
    from workbench.cost.estimate import Estimator
    from workbench.cost.measure import check_fits
    from workbench.cost.profiles import allocation_granularity

    # the real run's graph, on fake tensors: this CPU's kernels
    kernels = "cpu" if device == "cpu" else None
    fake = trace(_workload_from_args(args, "fake"), "fake", kernels=kernels)
    estimator = Estimator(fake, profiles=(), optimizer="none")  # the run holds no optimizer
    granularity = allocation_granularity(device)
    peak = max(estimator.estimate(p, granularity).peak_bytes for p in (policy, Policy("none")))
    check_fits(peak, 0, torch.device(device), fake.model_name)


def cmd_measure(args: argparse.Namespace) -> dict[str, Any]:
    """Estimate on fake tensors first (refusing what cannot fit), then run for real."""
    import torch

    from workbench.interop.baselines import measure_policy

    check_positive("--repeat", args.repeat)
    check_int("--warmup", args.warmup, 0, MAX_RUNS, "each one is a run of the step")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise WorkbenchError("--device cuda: no CUDA GPU is available here; use --device cpu")
    if _parallel_from_args(args) is not None:
        raise WorkbenchError(
            "measure runs one unsharded process; for --fsdp/--tp use estimate (one rank's "
            "memory) or verify (every rank on gloo)"
        )
    policy = parse_policy(args.policy)
    _refuse_unfit(args, policy, args.device)
    workload = _workload_from_args(args, "real", device=args.device)
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
    return {"model": workload.name, "policy": policy.to_json(), **result.to_json()}


def cmd_bench_whatif(args: argparse.Namespace) -> dict[str, Any]:
    """Random flips: what-if time per flip vs the full path (see `workbench.bench`)."""
    from workbench.bench import bench_whatif

    check_positive("--flips", args.flips, MAX_FLIPS, "each flip is one what-if")
    check_int("--full-path", args.full_path, 0, MAX_FULL_PATH, "each runs torch's remat pass")
    check_int("--seed", args.seed, 0, SEED_MAX)
    check_passes(args)
    graph, trace_seconds = _trace_from_args(args)
    result = bench_whatif(
        graph,
        parse_policy(args.policy),
        flips=args.flips,
        full_path=args.full_path,
        seed=args.seed,
        passes=args.passes,
    )
    return {**result, "trace_seconds": round(trace_seconds, 3)}


def cmd_render(args: argparse.Namespace) -> dict[str, Any]:
    """Draw one view of the policy's decisions to --out (.svg, .png, .pdf or .dot)."""
    from workbench.decide.decider import decide
    from workbench.show.viz import parse_view, render_view

    parse_view(args.view)  # fail before tracing
    check_writable(args.out, overwrite=args.overwrite)
    policy = parse_policy(args.policy)
    graph, _ = _prepared_from_args(args)
    start = time.perf_counter()
    decisions = decide(graph, policy)
    view = render_view(graph, decisions, args.view, policy_name=args.policy, force=args.force)
    path = view.write(args.out, overwrite=args.overwrite)
    return {
        **_pipeline_json(args, graph, policy),
        "path": str(path),
        "view": args.view,
        "nodes": view.nodes,
        "edges": view.edges,
        "seconds": round(time.perf_counter() - start, 3),
    }


def cmd_bench_render(args: argparse.Namespace) -> dict[str, Any]:
    """Time the overview and one layer's view (see `workbench.bench`)."""
    from workbench.bench import bench_render

    check_positive("--repeat", args.repeat)
    graph, trace_seconds = _trace_from_args(args)
    result = bench_render(graph, parse_policy(args.policy), args.repeat)
    return {**result, "trace_seconds": round(trace_seconds, 3)}


def cmd_floor(args: argparse.Namespace) -> dict[str, Any]:
    """The lowest peak the solver reaches at eager's step time, with and without offload,
    and the floor (see `workbench.search.floor.floor_search`)."""
    from workbench.cost.calibrate import time_basis
    from workbench.cost.estimate import Estimator
    from workbench.search.floor import floor_search

    options = _solve_options_from_args(args)
    check_int("--tolerance-bytes", args.tolerance_bytes, 1, INT64_MAX, "int64")
    cost = _cost_options_from_args(args)
    profile = _profile_with_host_link(args.profile, args.host_link)
    options = dataclasses.replace(options, profile=profile)
    graph, trace_seconds = _trace_from_args(args)
    start = time.perf_counter()
    estimator = Estimator(graph, (profile,), args.optimizer, **cost)
    result = floor_search(graph, estimator, options, tolerance_bytes=args.tolerance_bytes)
    return {
        **result,
        "time_basis": time_basis(estimator.profiles, estimator.calibration),
        "host_link": args.host_link,
        "host_bytes_per_s": profile.host_rate(),
        "seconds": round(time.perf_counter() - start, 3),
        "trace_seconds": round(trace_seconds, 3),
        "cpu_count": os.cpu_count(),
    }


def cmd_bench_offload(args: argparse.Namespace) -> dict[str, Any]:
    """`bench offload`, the old name of `floor` (for one release): says so on stderr once it
    ran (a refused flag keeps its one error line)."""
    result = cmd_floor(args)
    print(
        "warning: `bench offload` is deprecated and goes in the next release: use "
        "`python -m workbench floor` (same flags)",
        file=sys.stderr,
    )
    return result


def _solve_options_from_args(args: argparse.Namespace) -> SolveOptions:
    """The solver's flags as `SolveOptions`, each checked before anything is traced by the
    library's own checks (`SolveOptions`, `get_profile`), the error naming the flag:
    --method, --objective, --profile, --host-budget-bytes, --fsdp-choice."""
    from workbench.cost.profiles import get_profile
    from workbench.search.solve import SolveOptions

    check_host_budget(args)
    with flag("--method"):
        SolveOptions(method=args.method)
    with flag("--objective"):
        SolveOptions(objective=args.objective)
    with flag("--profile"):
        get_profile(args.profile)
    return SolveOptions(
        method=args.method,
        objective=args.objective,
        profile=args.profile,
        fsdp_reshard=FSDP_CHOICES[args.fsdp_choice],
        host_budget_bytes=args.host_budget_bytes,
        budget_kind=args.budget_kind,
    )


def _budget_from_args(args: argparse.Namespace, estimator: Estimator) -> int:
    if args.budget_bytes is not None:
        return int(args.budget_bytes)
    peak = estimator.estimate(Policy("none")).budget_bytes(args.budget_kind)
    return max(1, int(args.budget_frac * peak))


def cmd_solve(args: argparse.Namespace) -> dict[str, Any]:
    """The cheapest policy (recompute time or FLOPs) whose estimated peak fits a budget."""
    from workbench.cost.calibrate import time_basis
    from workbench.cost.pipelines import estimator_for
    from workbench.search.solve import solve

    options = _solve_options_from_args(args)
    check_budget(args)
    cost = _cost_options_from_args(args)
    graph, trace_seconds = _prepared_from_args(args)
    estimator = estimator_for(graph, args.passes, (args.profile,), args.optimizer, **cost)
    budget = _budget_from_args(args, estimator)
    solution = solve(graph, budget, options, estimator=estimator)
    return {
        "model": graph.model_name,
        "trace_seconds": round(trace_seconds, 3),
        **solution.to_json(),
        "time_basis": time_basis(estimator.profiles, estimator.calibration),
        **_pipeline_json(args, graph, solution.policy),
    }


def cmd_pareto(args: argparse.Namespace) -> dict[str, Any]:
    """Solutions from full recompute to no AC, presets beside them; a line per budget on
    stderr."""
    from workbench.cost.calibrate import time_basis
    from workbench.cost.estimate import Estimator
    from workbench.search.pareto import MAX_POINTS, pareto
    from workbench.search.solve import Solution, fsdp_choices, preset_points

    options = _solve_options_from_args(args)
    check_int("--points", args.points, 2, MAX_POINTS, "each point is a solve")
    cost = _cost_options_from_args(args)
    graph, trace_seconds = _trace_from_args(args)
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
    return {
        "model": graph.model_name,
        "points": [p.to_json() for p in points],
        **offload,
        "presets": presets(True),
        "time_basis": time_basis(estimator.profiles, estimator.calibration),
        **other,
        "seconds": round(seconds, 3),
        "trace_seconds": round(trace_seconds, 3),
        "cpu_count": os.cpu_count(),
    }


# --fsdp-choice -> the solver's `fsdp_reshard` (None: a decision the search makes)
FSDP_CHOICES: dict[str, bool | None] = {"search": None, "reshard": True, "keep": False}
