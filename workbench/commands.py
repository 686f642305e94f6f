"""What each command does with the library: `cmd_NAME(args) -> dict`, the one JSON object
the command prints (`workbench.cli` parses the arguments and prints the result).

Entry points: the `cmd_*` functions; `check_common_args`, `workload_from_args`,
`parallel_from_args`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, is_user_factory, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import timed_trace
from workbench.decide.policy import Policy, parse_policy
from workbench.errors import INT64_MAX, WorkbenchError, check_int
from workbench.files import check_writable

if TYPE_CHECKING:
    from workbench.cost.estimate import Estimator
    from workbench.search.solve import SolveOptions


# Bounds on counts of work a flag asks for, each far above what a study needs and low enough
# that a typo cannot ask for days of work (the reason is said in the error).
MAX_RUNS = 1000  # --repeat, --warmup: each is a whole train step
MAX_FLIPS = 100_000  # bench whatif --flips: each flip is one what-if
MAX_FULL_PATH = 1000  # each runs torch's remat pass and a full estimate
MAX_RANDOM = 10_000  # verify --random: each policy is a remat and a real run
SEED_MAX = 2**64 - 1  # what torch.manual_seed takes


def _check_positive(flag: str, value: int, high: int = MAX_RUNS, why: str = "") -> None:
    check_int(flag, value, 1, high, why or "each one is a timed run")


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


def _parallel_from_args(args: argparse.Namespace) -> Parallel | None:
    """None unless --fsdp or --tp asks for more than one rank."""
    if args.fsdp == 1 and args.tp == 1:
        return None
    return Parallel(fsdp=args.fsdp, tp=args.tp)


def check_common_args(args: argparse.Namespace) -> None:
    """Flags every model command shares, checked before any command starts its work: the
    parallel degrees (`Parallel`'s own checks)."""
    if hasattr(args, "fsdp"):
        _parallel_from_args(args)


def _trace_from_args(args: argparse.Namespace) -> tuple[JointGraph, float]:
    return timed_trace(_workload_from_args(args, args.mode), args.mode, _parallel_from_args(args))


def cmd_trace(args: argparse.Namespace) -> dict[str, Any]:
    graph, seconds = _trace_from_args(args)
    return {**graph.summary(), "seconds": round(seconds, 3)}


def cmd_bench_trace(args: argparse.Namespace) -> dict[str, Any]:
    from workbench.bench import bench_trace

    _check_positive("--repeat", args.repeat)
    return bench_trace(lambda: _trace_from_args(args), args.repeat)


def cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    """Remat with torch's pass, run under no_grad, compare loss and grads bitwise to eager
    (both from one generator state, so dropout draws alike); refuses what cannot fit."""
    from workbench.cost.measure import bitwise_mismatches
    from workbench.rewrite.remat import remat

    if args.mode != "real":
        raise WorkbenchError("verify runs the graph: use --mode real")
    if args.random is not None:
        return _verify_random(args)
    args.policy = args.policy or "default"
    policy = parse_policy(args.policy)
    parallel = _parallel_from_args(args)
    if parallel is not None:
        return _verify_ranks(args, parallel)
    _refuse_unfit(args, policy, "cpu")
    workload = _workload_from_args(args, "real")
    graph, _ = timed_trace(workload, "real")
    result = remat(graph, policy)
    mismatched = bitwise_mismatches(graph, result.gm, workload)
    return {
        "model": graph.model_name,
        "policy": policy.to_json(),
        "bitwise_equal": not mismatched,
        "mismatched": mismatched,
        **result.report.to_json(),
        # what no request can change, and why: node -> reason
        "forced": {n: result.decisions[n].explanation for n in result.report.forced},
    }


def _verify_random(args: argparse.Namespace) -> dict[str, Any]:
    """`--random N`: N seeded random policies of the model (`workbench.search.soundness`), each
    checked bitwise; the failures are listed with their policies, to reproduce one."""
    from workbench.search.soundness import run_soundness

    _check_positive("--random", args.random, MAX_RANDOM, "each policy is a remat and a real run")
    check_int("--seed", args.seed, 0, SEED_MAX)
    if args.policy is not None:
        raise WorkbenchError("verify: give --policy or --random N, not both")
    parallel = _parallel_from_args(args)
    shape = {"layers": args.layers, "seq": args.seq, "batch": args.batch, "dtype": args.dtype}
    if parallel is None:
        _refuse_unfit(args, Policy("none"), "cpu")
        workload = _workload_from_args(args, "real")
        graph, _ = timed_trace(workload, "real")
    else:  # the policies' node keys from one rank in fake mode: every rank has its graph
        workload = _workload_from_args(args, "fake")
        graph, _ = timed_trace(workload, "fake", parallel)
    report = run_soundness(workload, graph, args.random, args.seed, parallel, shape)
    return report.to_json()


def _verify_ranks(args: argparse.Namespace, parallel: Parallel) -> dict[str, Any]:
    """One gloo process per rank: each rank's remat'd graph against its eager step."""
    from workbench.cost.ranks import check_ranks

    policy = parse_policy(args.policy)
    _refuse_unfit_ranks(args, parallel, policy)
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


def _refuse_unfit_ranks(args: argparse.Namespace, parallel: Parallel, policy: Policy) -> None:
    """Before spawning: as many ranks as this machine can run (`check_rank_count`), then one
    rank traced in fake mode (the checks `trace` makes: degrees that divide the model, the
    factory's TP plan), its estimated peak times the ranks against free memory."""
    import torch

    from workbench.cost.estimate import Estimator
    from workbench.cost.measure import check_fits
    from workbench.cost.ranks import check_rank_count

    check_rank_count(parallel)
    rank, _ = timed_trace(_workload_from_args(args, "fake"), "fake", parallel)
    estimator = Estimator(rank, profiles=(), optimizer="none")
    peak = max(estimator.estimate(p).peak_bytes for p in (policy, Policy("none")))
    what = f"{rank.model_name!r} on {parallel.world_size} ranks (each its own process)"
    check_fits(peak * parallel.world_size, 0, torch.device("cpu"), what)


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    from workbench.interop.export import FORMATS, export, torchtitan_options, write_export

    if args.format not in FORMATS:
        raise WorkbenchError(f"unknown format {args.format!r}; choose one of {', '.join(FORMATS)}")
    if args.torchtitan_version is not None and args.format != "torchtitan":
        raise WorkbenchError("--torchtitan-version goes with --format torchtitan only")
    policy = parse_policy(args.policy)
    if args.out is not None:
        check_writable(args.out, overwrite=args.overwrite)  # fail before tracing
    graph, _ = timed_trace(_workload_from_args(args, "fake"), "fake", _parallel_from_args(args))
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

    policy = parse_policy(args.policy)
    graph, _ = _trace_from_args(args)  # one rank's graph under --fsdp/--tp
    rows = activation_rows(graph, policy)
    return {
        "model": graph.model_name,
        "policy": policy.to_json(),
        "total": totals(rows),
        "rows": [row.to_json() for row in rows],
        "table": activation_log(rows),
    }


def cmd_policy_explain(args: argparse.Namespace) -> dict[str, Any]:
    """The policy's rules in words and where it differs from graph trainer's; with --model,
    its decisions by reason and mismatches with graph trainer's tagging of that graph."""
    from workbench.show.explain import explain

    policy = parse_policy(args.policy)
    if args.model is None:
        given = [f"--{n}" for n in ("layers", "seq", "batch") if getattr(args, n) is not None]
        given += [f"--{name}" for name in ("fsdp", "tp") if getattr(args, name) != 1]
        given += ["--mode"] if args.mode != "real" else []
        given += ["--dtype"] if args.dtype != "float32" else []
        if given:
            raise WorkbenchError(
                f"policy explain: {', '.join(given)} describe a model's graph: give --model "
                "too, or leave them out for the policy's rules alone"
            )
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
    """Memory peak, saved activations, recompute FLOPs and step time without running."""
    from workbench.cost.estimate import Estimator

    policy = parse_policy(args.policy)
    profiles = _profiles_from_args(args)
    graph, seconds = _trace_from_args(args)
    est = Estimator(graph, profiles, args.optimizer).estimate(policy)
    return {
        "model": graph.model_name,
        "mode": graph.mode,
        "policy": policy.to_json(),
        "trace_seconds": round(seconds, 3),
        **est.to_json(timeline=args.timeline),
    }


def _refuse_unfit(args: argparse.Namespace, policy: Policy, device: str) -> None:
    """Before anything runs for real: estimate on fake tensors both the policy's graph and
    the eager step it is compared with (no AC), and refuse a peak the device cannot hold."""
    import torch

    from workbench.capture.trace import trace
    from workbench.cost.estimate import Estimator
    from workbench.cost.measure import check_fits
    from workbench.cost.profiles import allocation_granularity

    fake = trace(_workload_from_args(args, "fake"), "fake")
    estimator = Estimator(fake, profiles=(), optimizer="none")  # the run holds no optimizer
    granularity = allocation_granularity(device)
    peak = max(estimator.estimate(p, granularity).peak_bytes for p in (policy, Policy("none")))
    check_fits(peak, 0, torch.device(device), fake.model_name)


def cmd_measure(args: argparse.Namespace) -> dict[str, Any]:
    """Estimate on fake tensors first (refusing what cannot fit), then run for real."""
    import torch

    from workbench.interop.baselines import measure_policy

    _check_positive("--repeat", args.repeat)
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
    result = measure_policy(
        workload, policy, baselines=args.baselines, warmup=args.warmup, repeats=args.repeat
    )
    return {"model": workload.name, "policy": policy.to_json(), **result.to_json()}


def cmd_bench_whatif(args: argparse.Namespace) -> dict[str, Any]:
    """Random flips: what-if time per flip vs the full path (see `workbench.bench`)."""
    from workbench.bench import bench_whatif

    _check_positive("--flips", args.flips, MAX_FLIPS, "each flip is one what-if")
    check_int("--full-path", args.full_path, 0, MAX_FULL_PATH, "each runs torch's remat pass")
    check_int("--seed", args.seed, 0, SEED_MAX)
    graph, trace_seconds = _trace_from_args(args)
    result = bench_whatif(
        graph, parse_policy(args.policy), flips=args.flips, full_path=args.full_path, seed=args.seed
    )
    return {**result, "trace_seconds": round(trace_seconds, 3)}


def cmd_render(args: argparse.Namespace) -> dict[str, Any]:
    """Draw one view of the policy's decisions to --out (.svg, .png, .pdf or .dot)."""
    from workbench.decide.decider import decide
    from workbench.show.viz import parse_view, render_view

    parse_view(args.view)  # fail before tracing
    check_writable(args.out, overwrite=args.overwrite)
    graph, _ = _trace_from_args(args)
    start = time.perf_counter()
    decisions = decide(graph, parse_policy(args.policy))
    view = render_view(graph, decisions, args.view, policy_name=args.policy, force=args.force)
    path = view.write(args.out, overwrite=args.overwrite)
    return {
        "path": str(path),
        "view": args.view,
        "nodes": view.nodes,
        "edges": view.edges,
        "seconds": round(time.perf_counter() - start, 3),
    }


def cmd_bench_render(args: argparse.Namespace) -> dict[str, Any]:
    """Time the overview and one layer's view (see `workbench.bench`)."""
    from workbench.bench import bench_render

    _check_positive("--repeat", args.repeat)
    graph, trace_seconds = _trace_from_args(args)
    result = bench_render(graph, parse_policy(args.policy), args.repeat)
    return {**result, "trace_seconds": round(trace_seconds, 3)}


def cmd_floor(args: argparse.Namespace) -> dict[str, Any]:
    """The lowest peak the solver reaches at eager's step time, with and without offload,
    and the floor (see `workbench.search.floor.floor_search`)."""
    from workbench.cost.estimate import Estimator
    from workbench.search.floor import floor_search

    options = _solve_options_from_args(args)
    check_int("--tolerance-bytes", args.tolerance_bytes, 1, INT64_MAX, "int64")
    graph, trace_seconds = _trace_from_args(args)
    start = time.perf_counter()
    estimator = Estimator(graph, (args.profile,), args.optimizer)
    result = floor_search(graph, estimator, options, tolerance_bytes=args.tolerance_bytes)
    return {
        **result,
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


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    """A WorkbenchError raised inside names the flag whose value caused it."""
    try:
        yield
    except WorkbenchError as err:
        raise WorkbenchError(f"{name}: {err}") from None


def _solve_options_from_args(args: argparse.Namespace) -> SolveOptions:
    """The solver's flags as `SolveOptions`, each checked before anything is traced by the
    library's own checks (`SolveOptions`, `get_profile`), the error naming the flag:
    --method, --objective, --profile, --host-budget-bytes, --fsdp-choice."""
    from workbench.cost.profiles import get_profile
    from workbench.search.solve import SolveOptions

    _check_host_budget(args)
    with _flag("--method"):
        SolveOptions(method=args.method)
    with _flag("--objective"):
        SolveOptions(objective=args.objective)
    with _flag("--profile"):
        get_profile(args.profile)
    return SolveOptions(
        method=args.method,
        objective=args.objective,
        profile=args.profile,
        fsdp_reshard=FSDP_CHOICES[args.fsdp_choice],
        host_budget_bytes=args.host_budget_bytes,
    )


def _check_host_budget(args: argparse.Namespace) -> None:
    """Before tracing: a bad host budget is refused at once, not after a whole front."""
    check_int("--host-budget-bytes", args.host_budget_bytes, 0, INT64_MAX, "0: no offload; int64")


def _check_budget(args: argparse.Namespace) -> None:
    """Before tracing: --budget-bytes or --budget-frac in range."""
    if args.budget_bytes is not None:
        check_int("--budget-bytes", args.budget_bytes, 1, INT64_MAX, "int64")
    elif not 0 < args.budget_frac <= 1:
        raise WorkbenchError(f"--budget-frac must be in (0, 1], got {args.budget_frac}")


def _budget_from_args(args: argparse.Namespace, estimator: Estimator) -> int:
    if args.budget_bytes is not None:
        return int(args.budget_bytes)
    return max(1, int(args.budget_frac * estimator.estimate(Policy("none")).peak_bytes))


def cmd_solve(args: argparse.Namespace) -> dict[str, Any]:
    """The cheapest policy (recompute time or FLOPs) whose estimated peak fits a budget."""
    from workbench.cost.estimate import Estimator
    from workbench.search.solve import solve

    options = _solve_options_from_args(args)
    _check_budget(args)
    graph, trace_seconds = _trace_from_args(args)
    estimator = Estimator(graph, (args.profile,), args.optimizer)
    budget = _budget_from_args(args, estimator)
    solution = solve(graph, budget, options, estimator=estimator)
    return {
        "model": graph.model_name,
        "trace_seconds": round(trace_seconds, 3),
        **solution.to_json(),
    }


def cmd_pareto(args: argparse.Namespace) -> dict[str, Any]:
    """Solutions from full recompute to no AC, presets beside them; a line per budget on
    stderr."""
    from workbench.cost.estimate import Estimator
    from workbench.search.pareto import MAX_POINTS, pareto
    from workbench.search.solve import Solution, fsdp_choices, preset_points

    options = _solve_options_from_args(args)
    check_int("--points", args.points, 2, MAX_POINTS, "each point is a solve")
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

    estimator = Estimator(graph, (args.profile,), args.optimizer)

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
        **other,
        "seconds": round(seconds, 3),
        "trace_seconds": round(trace_seconds, 3),
        "cpu_count": os.cpu_count(),
    }


# --fsdp-choice -> the solver's `fsdp_reshard` (None: a decision the search makes)
FSDP_CHOICES: dict[str, bool | None] = {"search": None, "reshard": True, "keep": False}
