"""Command line: `python -m workbench COMMAND ... [--json]`.

Entry point: `main(argv)`. With `--json` every command prints exactly one JSON object on
stdout; errors print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from workbench.errors import WorkbenchError
from workbench.models import DTYPES, load_workload
from workbench.trace import timed_trace

EXIT_USAGE = 2


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="reference model (llama3-debug, llama3-1b, llama3-3b, llama3-8b, dsv3-debug) "
        "or package.module:callable",
    )
    parser.add_argument("--mode", choices=("real", "fake"), default="real")
    parser.add_argument("--layers", type=int, help="number of transformer blocks")
    parser.add_argument("--seq", type=int, help="sequence length")
    parser.add_argument("--batch", type=int, help="batch size")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _trace_from_args(args: argparse.Namespace) -> tuple[Any, float]:
    device = "meta" if args.mode == "fake" else "cpu"
    workload = load_workload(
        args.model,
        layers=args.layers,
        seq=args.seq,
        batch=args.batch,
        dtype=args.dtype,
        device=device if ":" not in args.model else "cpu",
    )
    return timed_trace(workload, args.mode)


def cmd_trace(args: argparse.Namespace) -> dict[str, Any]:
    graph, seconds = _trace_from_args(args)
    return {**graph.summary(), "seconds": round(seconds, 3)}


def cmd_bench_trace(args: argparse.Namespace) -> dict[str, Any]:
    if args.repeat < 1:
        raise WorkbenchError(f"--repeat must be a positive integer, got {args.repeat}")
    times, summary = [], {}
    for _ in range(args.repeat):
        graph, seconds = _trace_from_args(args)
        times.append(seconds)
        summary = graph.summary()
    return {
        "model": summary["model"],
        "mode": summary["mode"],
        "nodes": summary["nodes"],
        "seconds": round(statistics.median(times), 3),
        "all_seconds": [round(t, 3) for t in times],
        "cpu_count": os.cpu_count(),
    }


def _print_human(result: dict[str, Any]) -> None:
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    trace = commands.add_parser("trace", help="trace a train step and summarise the graph")
    _add_model_args(trace)
    trace.set_defaults(run=cmd_trace)

    bench = commands.add_parser("bench", help="benchmarks that print measured figures")
    benches = bench.add_subparsers(dest="bench", required=True)
    bench_trace = benches.add_parser("trace", help="time tracing (median of --repeat runs)")
    _add_model_args(bench_trace)
    bench_trace.add_argument("--repeat", type=int, default=1)
    bench_trace.set_defaults(run=cmd_bench_trace)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], dict[str, Any]] = args.run
    try:
        result = run(args)
    except WorkbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result))
    else:
        _print_human(result)
    return 0
