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
from workbench.graph import JointGraph
from workbench.models import DTYPES, Workload, load_workload
from workbench.policy import parse_policy
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


def _workload_from_args(args: argparse.Namespace, mode: str) -> Workload:
    """Reference models in fake mode are built on the meta device: no memory at all."""
    device = "meta" if mode == "fake" and ":" not in args.model else "cpu"
    return load_workload(
        args.model,
        layers=args.layers,
        seq=args.seq,
        batch=args.batch,
        dtype=args.dtype,
        device=device,
    )


def _trace_from_args(args: argparse.Namespace) -> tuple[JointGraph, float]:
    return timed_trace(_workload_from_args(args, args.mode), args.mode)


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


def _add_policy_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy", default="default", help="preset (none, full, default, eager) or policy.json"
    )


def cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    """Remat with torch's pass, run under no_grad, compare loss and grads bitwise to eager."""
    import torch

    from workbench.eager import eager_step
    from workbench.remat import remat

    if args.mode != "real":
        raise WorkbenchError("verify runs the graph: use --mode real")
    policy = parse_policy(args.policy)
    workload = _workload_from_args(args, "real")
    graph, _ = timed_trace(workload, "real")
    result = remat(graph, policy)
    assert graph.example_inputs is not None
    traced = result.run(graph.example_inputs)
    eager = eager_step(workload)
    mismatched = [
        name
        for name, a, b in zip(["loss", *graph.param_names], traced, eager, strict=True)
        if not torch.equal(a, b)
    ]
    return {
        "model": graph.model_name,
        "policy": policy.to_json(),
        "bitwise_equal": not mismatched,
        "mismatched": mismatched,
        **result.report.to_json(),
    }


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    from workbench.export import FORMATS, export, write_export

    if args.format not in FORMATS:
        raise WorkbenchError(f"unknown format {args.format!r}; choose one of {', '.join(FORMATS)}")
    policy = parse_policy(args.policy)
    graph, _ = timed_trace(_workload_from_args(args, "fake"), "fake")
    text = export(policy, args.format, graph=graph)
    result: dict[str, Any] = {"format": args.format, "code": text}
    if args.out:
        result["path"] = str(write_export(text, args.out, overwrite=args.overwrite))
    return result


def cmd_render(args: argparse.Namespace) -> dict[str, Any]:
    """Draw one view of the policy's decisions to --out (.svg, .png, .pdf or .dot)."""
    import time

    from workbench.policy import decide
    from workbench.viz import parse_view, render_view

    parse_view(args.view)  # fail before tracing
    graph, _ = _trace_from_args(args)
    start = time.perf_counter()
    decisions = decide(graph, parse_policy(args.policy))
    view = render_view(graph, decisions, args.view, policy_name=args.policy, force=args.force)
    path = view.write(args.out)
    return {
        "path": str(path),
        "view": args.view,
        "nodes": view.nodes,
        "edges": view.edges,
        "seconds": round(time.perf_counter() - start, 3),
    }


def cmd_bench_render(args: argparse.Namespace) -> dict[str, Any]:
    """Time the overview and one layer's view (build + `dot` layout to SVG), median of
    --repeat runs; tracing and deciding are timed apart."""
    import time

    from workbench.policy import decide
    from workbench.viz import render_view

    if args.repeat < 1:
        raise WorkbenchError(f"--repeat must be a positive integer, got {args.repeat}")
    graph, trace_seconds = _trace_from_args(args)
    start = time.perf_counter()
    decisions = decide(graph, parse_policy(args.policy))
    decide_seconds = time.perf_counter() - start
    layers = sorted({i.layer for i in graph.ops() if i.layer is not None})
    layer_view = f"layer:{layers[len(layers) // 2]}" if layers else "overview"
    result: dict[str, Any] = {"model": graph.model_name, "mode": graph.mode}
    for key, view_name in (("overview", "overview"), ("layer", layer_view)):
        times = []
        for _ in range(args.repeat):
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
        "trace_seconds": round(trace_seconds, 3),
        "decide_seconds": round(decide_seconds, 3),
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

    verify = commands.add_parser("verify", help="remat a policy and check numerics bitwise")
    _add_model_args(verify)
    _add_policy_arg(verify)
    verify.set_defaults(run=cmd_verify)

    export = commands.add_parser("export", help="export a policy as code")
    _add_model_args(export)
    _add_policy_arg(export)
    export.add_argument(
        "--format", default="policy_fn", help="policy_fn, graph_pass, torchtitan or json"
    )
    export.add_argument("--out", help="write the code to this file")
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    export.set_defaults(run=cmd_export)

    bench = commands.add_parser("bench", help="benchmarks that print measured figures")
    benches = bench.add_subparsers(dest="bench", required=True)
    bench_trace = benches.add_parser("trace", help="time tracing (median of --repeat runs)")
    _add_model_args(bench_trace)
    bench_trace.add_argument("--repeat", type=int, default=1)
    bench_trace.set_defaults(run=cmd_bench_trace)

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
    render.set_defaults(run=cmd_render)

    bench_render = benches.add_parser("render", help="time the overview and a layer view")
    _add_model_args(bench_render)
    _add_policy_arg(bench_render)
    bench_render.add_argument("--repeat", type=int, default=3)
    bench_render.set_defaults(run=cmd_bench_render, mode="fake")
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
    elif args.command == "export" and not args.out:
        print(result["code"])
    else:
        _print_human(result)
    return 0
