"""Command line: `python -m workbench COMMAND ... [--json]`.

Entry point: `main(argv)`. With `--json` every command prints exactly one JSON object on
stdout; errors print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from workbench.capture.graph import JointGraph
from workbench.capture.models import DTYPES, Workload, is_user_factory, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import timed_trace
from workbench.decide.policy import Policy, parse_policy
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.files import check_writable
from workbench.units import format_value

if TYPE_CHECKING:
    from workbench.cost.estimate import Estimator

EXIT_USAGE = 2
INT64_MAX = 2**63 - 1


class _Parser(argparse.ArgumentParser):
    """argparse reporting bad input as every command does: one line, `PROG: error: MESSAGE`
    naming the flag and what is valid, exit status 2, instead of a usage block. A command
    (a parser with a `run`) refuses flags it does not know itself, with close matches; a
    parser of commands (`commands`) lists them when none is given."""

    commands: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        if self.commands and message.startswith("the following arguments are required"):
            message += f" (choose from {', '.join(self.commands)})"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        namespace, extra = super().parse_known_args(args, namespace)
        if extra and self.get_default("run") is not None:
            flags = [a.split("=")[0] for a in extra if a.startswith("-")]
            close = {m for f in flags for m in difflib.get_close_matches(f, self._flags(), 3)}
            hint = f" (close matches: {', '.join(sorted(close))})" if close else ""
            self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return namespace, extra

    def _flags(self) -> list[str]:
        return [flag for action in self._actions for flag in action.option_strings]


def _add_model_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--model",
        required=required,
        help="reference model (llama3-debug, llama3-1b, llama3-3b, llama3-8b, dsv3-debug), "
        "torchtitan:FAMILY/FLAVOR (e.g. torchtitan:llama3/debugmodel) or package.module:callable",
    )
    parser.add_argument("--mode", choices=("real", "fake"), default="real")
    parser.add_argument("--layers", type=int, help="number of transformer blocks")
    parser.add_argument("--seq", type=int, help="sequence length")
    parser.add_argument("--batch", type=int, help="batch size")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP degree: trace one rank")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise WorkbenchError(f"{flag} must be a positive integer, got {value}")


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


def _trace_from_args(args: argparse.Namespace) -> tuple[JointGraph, float]:
    return timed_trace(_workload_from_args(args, args.mode), args.mode, _parallel_from_args(args))


def cmd_trace(args: argparse.Namespace) -> dict[str, Any]:
    graph, seconds = _trace_from_args(args)
    return {**graph.summary(), "seconds": round(seconds, 3)}


def cmd_bench_trace(args: argparse.Namespace) -> dict[str, Any]:
    from workbench.bench import bench_trace

    _check_positive("--repeat", args.repeat)
    return bench_trace(lambda: _trace_from_args(args), args.repeat)


def _add_policy_arg(parser: argparse.ArgumentParser, default: str | None = "default") -> None:
    parser.add_argument(
        "--policy",
        default=default,
        help=f"preset ({', '.join(PRESETS)}) or policy.json; `policy explain` says what it does",
    )


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

    _check_positive("--random", args.random)
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

    shape = {"layers": args.layers, "seq": args.seq, "batch": args.batch, "dtype": args.dtype}
    checks = check_ranks(args.model, parallel, [args.policy], **shape)
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
    if args.out:
        check_writable(args.out, overwrite=args.overwrite)  # fail before tracing
    graph, _ = timed_trace(_workload_from_args(args, "fake"), "fake", _parallel_from_args(args))
    if args.format == "torchtitan":
        text = torchtitan_options(policy, graph, args.torchtitan_version)
    else:
        text = export(policy, args.format, graph=graph)
    result: dict[str, Any] = {"format": args.format, "code": text}
    if args.out:
        result["path"] = str(write_export(text, args.out, overwrite=args.overwrite))
    return result


def cmd_activations(args: argparse.Namespace) -> dict[str, Any]:
    """graph trainer's activation-memory table for the policy: rows, totals and the log text."""
    from workbench.interop.activations import activation_log, activation_rows, totals

    policy = parse_policy(args.policy)
    graph, _ = timed_trace(_workload_from_args(args, args.mode), args.mode)
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
    if args.warmup < 0:
        raise WorkbenchError(f"--warmup must be 0 or more runs, got {args.warmup}")
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

    _check_positive("--flips", args.flips)
    if args.full_path < 0:
        raise WorkbenchError(f"--full-path must be 0 or more flips, got {args.full_path}")
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


def cmd_bench_offload(args: argparse.Namespace) -> dict[str, Any]:
    """The lowest peak the solver reaches at eager's step time, with and without offload,
    and the floor (see `workbench.bench.bench_offload`)."""
    from workbench.bench import bench_offload
    from workbench.cost.estimate import Estimator
    from workbench.cost.profiles import PROFILES
    from workbench.search.solve import METHODS

    _check_host_budget(args)
    _check_positive("--tolerance-bytes", args.tolerance_bytes)
    if args.method not in METHODS:
        raise WorkbenchError(f"--method {args.method!r}: choose one of {', '.join(METHODS)}")
    if args.profile not in PROFILES:
        raise WorkbenchError(
            f"--profile {args.profile!r} is not a device profile; choose one of "
            f"{', '.join(PROFILES)}"
        )
    graph, trace_seconds = _trace_from_args(args)
    start = time.perf_counter()
    estimator = Estimator(graph, (args.profile,), args.optimizer)
    result = bench_offload(
        graph,
        estimator,
        args.profile,
        args.host_budget_bytes,
        tolerance_bytes=args.tolerance_bytes,
        method=args.method,
    )
    return {
        **result,
        "seconds": round(time.perf_counter() - start, 3),
        "trace_seconds": round(trace_seconds, 3),
        "cpu_count": os.cpu_count(),
    }


def _check_host_budget(args: argparse.Namespace) -> None:
    """Before tracing: a bad host budget is refused at once, not after a whole front."""
    if not 0 <= args.host_budget_bytes <= INT64_MAX:
        raise WorkbenchError(
            f"--host-budget-bytes must be from 0 (no offload) to {INT64_MAX} (int64), "
            f"got {args.host_budget_bytes}"
        )


def _budget_from_args(args: argparse.Namespace, estimator: Estimator) -> int:
    if args.budget_bytes is not None:
        if not 0 < args.budget_bytes <= INT64_MAX:
            raise WorkbenchError(
                f"--budget-bytes must be from 1 to {INT64_MAX} (int64), got {args.budget_bytes}"
            )
        return int(args.budget_bytes)
    if not 0 < args.budget_frac <= 1:
        raise WorkbenchError(f"--budget-frac must be in (0, 1], got {args.budget_frac}")
    return int(args.budget_frac * estimator.estimate(Policy("none")).peak_bytes)


def cmd_solve(args: argparse.Namespace) -> dict[str, Any]:
    """The cheapest policy (recompute time or FLOPs) whose estimated peak fits a budget."""
    from workbench.cost.estimate import Estimator
    from workbench.search.solve import solve

    _check_host_budget(args)
    graph, trace_seconds = _trace_from_args(args)
    estimator = Estimator(graph, (args.profile,), args.optimizer)
    budget = _budget_from_args(args, estimator)
    solution = solve(
        graph,
        budget,
        objective=args.objective,
        method=args.method,
        profile=args.profile,
        estimator=estimator,
        fsdp_reshard=FSDP_CHOICES[args.fsdp_choice],
        host_budget_bytes=args.host_budget_bytes,
    )
    return {
        "model": graph.model_name,
        "trace_seconds": round(trace_seconds, 3),
        **solution.to_json(),
    }


def cmd_pareto(args: argparse.Namespace) -> dict[str, Any]:
    """Solutions from full recompute to no AC, presets beside them; a line per budget on
    stderr."""
    from workbench.cost.estimate import Estimator
    from workbench.search.solve import Solution, fsdp_choices, pareto, preset_points

    _check_host_budget(args)
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
        return pareto(
            graph,
            n=args.points,
            method=args.method,
            profile=args.profile,
            objective=args.objective,
            progress=progress,
            estimator=estimator,
            fsdp_reshard=FSDP_CHOICES[args.fsdp_choice],
            host_budget_bytes=host_budget,
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


def _add_optimizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "sgd", "none"),
        default="adamw",
        help="optimizer state held the whole step: adamw two fp32 moments per parameter "
        "(shard), sgd one momentum buffer, none (default: adamw)",
    )


def _add_solve_args(parser: argparse.ArgumentParser) -> None:
    _add_optimizer_arg(parser)
    parser.add_argument(
        "--host-budget-bytes",
        type=int,
        default=0,
        help="host memory offloaded activations may take; 0 (default): no offload",
    )
    parser.add_argument("--method", default="greedy", help="greedy, knapsack or exact")
    parser.add_argument("--profile", default="h100", help="device profile for recompute time")
    parser.add_argument(
        "--objective", default="recompute_time", help="recompute_time or recompute_flops"
    )
    parser.add_argument(
        "--fsdp-choice",
        choices=tuple(FSDP_CHOICES),
        default="search",
        help="on --fsdp graphs: search both FSDP settings and keep the better (default), or "
        "fix reshard after forward / keep unsharded",
    )


# --fsdp-choice -> the solver's `fsdp_reshard` (None: a decision the search makes)
FSDP_CHOICES: dict[str, bool | None] = {"search": None, "reshard": True, "keep": False}


_LONG_TEXT = 100  # characters: longer values print as their start and a note
_LIST_ROWS = 12  # rows of a list shown before "… N more"


def _human_value(key: str, value: Any, parent: str = "") -> str:
    """One value with the unit its key names (`workbench.units.unit_of`)."""
    if isinstance(value, bool) or value is None:
        return "yes" if value is True else "no" if value is False else "-"
    if isinstance(value, int | float):
        formatted = format_value(key, value, parent)
        if formatted is not None:
            return formatted
        return f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"
    if value in ({}, [], ""):
        return "none"
    text = str(value)
    if len(text) > _LONG_TEXT:
        return f"{text[:_LONG_TEXT]}… ({len(text):,} characters; --json prints all)"
    return text


def _human_lines(result: dict[str, Any], indent: str = "") -> list[str]:
    """Aligned `key  value` lines; nested objects indented, lists of objects as tables."""
    lines: list[str] = []
    width = max((len(k) for k in result), default=0)
    for key, value in result.items():
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            if all(not isinstance(v, dict | list) for v in value.values()):
                inner = {k: _human_value(k, v, key) for k, v in value.items()}
                lines += _human_lines(inner, indent + "  ")
            else:
                lines += _human_lines(value, indent + "  ")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(f"{indent}{key}: {len(value)} rows")
            lines += _table(value[:_LIST_ROWS], indent + "  ")
            if len(value) > _LIST_ROWS:
                lines.append(f"{indent}  … {len(value) - _LIST_ROWS} more (--json prints all)")
        elif isinstance(value, list) and value:
            shown = ", ".join(_human_value(key, v) for v in value[:_LIST_ROWS])
            more = f", … {len(value) - _LIST_ROWS} more" if len(value) > _LIST_ROWS else ""
            lines.append(f"{indent}{key:<{width}}  {_human_value('', shown + more)}")
        else:
            lines.append(f"{indent}{key:<{width}}  {_human_value(key, value)}")
    return lines


def _table(rows: list[dict[str, Any]], indent: str) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_human_value(c, row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = [indent + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    return line + [indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True))
                   for r in cells]  # fmt: skip


def _print_human(result: dict[str, Any]) -> None:
    """What a person reads without --json: units, tables, long values shortened."""
    if "code" in result and "path" in result:  # export --out: say where, not the whole file
        lines = result["code"].count("\n") + 1
        print(f"wrote the {result['format']} export ({lines} lines) to {result['path']}")
        return
    print("\n".join(_human_lines(result)))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m workbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    trace = commands.add_parser("trace", help="trace a train step and summarise the graph")
    _add_model_args(trace)
    trace.set_defaults(run=cmd_trace)

    verify = commands.add_parser("verify", help="remat a policy and check numerics bitwise")
    _add_model_args(verify)
    _add_policy_arg(verify, default=None)  # None: not given (`--random` takes its place)
    verify.add_argument(
        "--random",
        type=int,
        metavar="N",
        help="instead of --policy: N random policies of the model (presets, selectors, "
        "overrides, offload), each checked bitwise",
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the --random policies")
    verify.set_defaults(run=cmd_verify)

    export = commands.add_parser("export", help="export a policy as code")
    _add_model_args(export)
    _add_policy_arg(export)
    export.add_argument(
        "--format", default="policy_fn", help="policy_fn, graph_pass, torchtitan or json"
    )
    export.add_argument(
        "--torchtitan-version",
        help="torchtitan version the options are for (0.3.0, main; default: the installed "
        "one, else the newest release known)",
    )
    export.add_argument("--out", help="write the code to this file")
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    export.set_defaults(run=cmd_export)

    activations = commands.add_parser(
        "activations", help="graph trainer's per-activation table (layer, bytes, tag, op, ...)"
    )
    _add_model_args(activations)
    _add_policy_arg(activations)
    activations.set_defaults(run=cmd_activations)

    policy = commands.add_parser("policy", help="what a policy does")
    policies = policy.add_subparsers(dest="subcommand", required=True)
    explain = policies.add_parser(
        "explain",
        help="a policy's rules in words, where it differs from graph trainer's, and (with "
        "--model) its decisions by reason and mismatches with graph trainer's tagging",
    )
    _add_model_args(explain, required=False)
    _add_policy_arg(explain)
    explain.set_defaults(run=cmd_policy_explain)

    estimate = commands.add_parser("estimate", help="estimate peak memory and step time")
    _add_model_args(estimate)
    _add_policy_arg(estimate)
    estimate.add_argument(
        "--profile", default="h100,h200,cpu", help="device profiles, comma-separated"
    )
    estimate.add_argument("--timeline", action="store_true", help="include the memory timeline")
    _add_optimizer_arg(estimate)
    estimate.set_defaults(run=cmd_estimate)

    measure = commands.add_parser("measure", help="run remat'd graph for real: peak, step time")
    _add_model_args(measure)
    _add_policy_arg(measure)
    measure.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    measure.add_argument("--repeat", type=int, default=5, help="timed runs (median reported)")
    measure.add_argument("--warmup", type=int, default=1)
    measure.add_argument(
        "--baselines", action="store_true", help="also measure no AC and eager SAC"
    )
    measure.set_defaults(run=cmd_measure)

    solve = commands.add_parser("solve", help="search the cheapest policy within a budget")
    _add_model_args(solve)
    _add_solve_args(solve)
    budget = solve.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-bytes", type=int, help="estimated peak must fit this")
    budget.add_argument("--budget-frac", type=float, help="fraction of the no-AC peak")
    solve.set_defaults(run=cmd_solve)

    pareto = commands.add_parser("pareto", help="memory-vs-recompute front and the presets")
    _add_model_args(pareto)
    _add_solve_args(pareto)
    pareto.add_argument("--points", type=int, default=20, help="budgets in the sweep")
    pareto.set_defaults(run=cmd_pareto)

    bench = commands.add_parser("bench", help="benchmarks that print measured figures")
    benches = bench.add_subparsers(dest="subcommand", required=True)
    bench_trace = benches.add_parser("trace", help="time tracing (median of --repeat runs)")
    _add_model_args(bench_trace)
    bench_trace.add_argument("--repeat", type=int, default=1)
    bench_trace.set_defaults(run=cmd_bench_trace)
    bench_whatif = benches.add_parser("whatif", help="time what-if flips against the full path")
    _add_model_args(bench_whatif)
    _add_policy_arg(bench_whatif)
    bench_whatif.add_argument("--flips", type=int, default=50)
    bench_whatif.add_argument(
        "--full-path", type=int, default=3, help="flips also run through torch's pass"
    )
    bench_whatif.add_argument("--seed", type=int, default=0)
    bench_whatif.set_defaults(run=cmd_bench_whatif, mode="fake")

    render = commands.add_parser("render", help="draw the graph coloured by a policy")
    _add_model_args(render)
    _add_policy_arg(render)
    render.add_argument(
        "--view",
        default="overview",
        help="overview, layer:N, module:PATH, diff:OTHER_POLICY or graph (every op)",
    )
    render.add_argument("--out", required=True, help="file to write: .svg, .png, .pdf or .dot")
    render.add_argument("--force", action="store_true", help="lay out huge views anyway")
    render.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    render.set_defaults(run=cmd_render)

    bench_render = benches.add_parser("render", help="time the overview and a layer view")
    _add_model_args(bench_render)
    _add_policy_arg(bench_render)
    bench_render.add_argument("--repeat", type=int, default=3)
    bench_render.set_defaults(run=cmd_bench_render, mode="fake")

    bench_offload = benches.add_parser(
        "offload", help="lowest peak at eager's step time, with and without offload"
    )
    _add_model_args(bench_offload)
    _add_optimizer_arg(bench_offload)
    bench_offload.add_argument("--profile", default="h100", help="device profile (default h100)")
    bench_offload.add_argument(
        "--host-budget-bytes",
        type=int,
        default=64 * 2**30,
        help="host memory offloaded activations may take (default 64 GiB); 0: no offload",
    )
    bench_offload.add_argument(
        "--tolerance-bytes",
        type=int,
        default=2**20,
        help="bisection over the device budget stops within this many bytes (default 1 MiB)",
    )
    bench_offload.add_argument(
        "--method", default="greedy", help="solve's: greedy, knapsack or exact"
    )
    bench_offload.set_defaults(run=cmd_bench_offload, mode="fake")
    for owner, choices in ((parser, commands), (policy, policies), (bench, benches)):
        owner.commands = tuple(choices.choices or ())
    return parser


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While a `--json` command runs, whatever it prints (a user factory's print, a native
    library writing to file descriptor 1) goes to stderr: stdout holds only the JSON."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1: Python-level redirection is all there is
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], dict[str, Any]] = args.run
    try:
        with _stdout_to_stderr() if args.json else contextlib.nullcontext():
            result = run(args)
    except WorkbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as err:  # user code (a factory, a loss) called sys.exit mid-command
        print(
            f"error: {args.command} stopped: code it ran called sys.exit({err.code!r})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result))
    elif args.command == "export" and not args.out:
        print(result["code"])
    elif args.command == "activations":
        print(result["table"])
    elif args.command == "bench" and args.subcommand == "offload":
        from workbench.bench import offload_table

        print(offload_table(result))
        print(f"{result['seconds']:.1f} s (trace {result['trace_seconds']:.1f} s)")
    elif args.command == "policy":
        from workbench.show.explain import explain_text

        print(explain_text(result))
    else:
        _print_human(result)
    return 0
