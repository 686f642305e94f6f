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
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from workbench.baseline_commands import with_baselines
from workbench.capture.models import DTYPES
from workbench.commands import (
    FSDP_CHOICES,
    check_common_args,
    cmd_activations,
    cmd_bench_offload,
    cmd_bench_render,
    cmd_bench_trace,
    cmd_bench_whatif,
    cmd_estimate,
    cmd_export,
    cmd_floor,
    cmd_measure,
    cmd_pareto,
    cmd_policy_explain,
    cmd_render,
    cmd_solve,
    cmd_trace,
    cmd_verify,
)
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError, torch_logs_held
from workbench.plan_command import cmd_plan, plan_table
from workbench.snapshot_commands import cmd_bench_gpu, cmd_compare_snapshot
from workbench.stage_commands import (
    add_pipeline_args,
    cmd_bench_trace_stages,
    cmd_estimate_stages,
    cmd_solve_stages,
    cmd_trace_stages,
    pipelined,
)
from workbench.units import format_value
from workbench.validate_command import add_validate_parser, validate_table

if TYPE_CHECKING:
    pass


EXIT_USAGE = 2


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
        help="reference model (llama3-debug, llama3-1b, llama3-3b, llama3-8b, llama3-70b, "
        "llama3-405b, dsv3-debug, dsv3-16b), torchtitan:FAMILY/FLAVOR (e.g. "
        "torchtitan:llama3/debugmodel) "
        "or package.module:callable",
    )
    parser.add_argument("--mode", choices=("real", "fake"), default="real")
    parser.add_argument(
        "--kernels",
        help="fake mode: the kernels traced, those of a GPU (h100, h200, b200: attention as "
        "torch's CUDA SDPA selection picks it there; default: the --profile's GPU, else h100) "
        "or cpu (this CPU's kernels); real mode always runs the model's device's own",
    )
    parser.add_argument("--layers", type=int, help="number of transformer blocks")
    parser.add_argument("--seq", type=int, help="sequence length")
    parser.add_argument("--batch", type=int, help="batch size")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP degree: trace one rank")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree (torchtitan MoE models)"
    )
    parser.add_argument(
        "--cp", type=int, default=1, help="context-parallel degree (torchtitan models)"
    )
    parser.add_argument(
        "--ep-imbalance",
        type=float,
        default=1.0,
        help="tokens this rank's experts receive, as a multiple of the balanced count "
        "(fake tensors cannot route; default 1: balanced)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_policy_arg(parser: argparse.ArgumentParser, default: str | None = "default") -> None:
    parser.add_argument(
        "--policy",
        default=default,
        help=f"preset ({', '.join(PRESETS)}) or policy.json; `policy explain` says what it does",
    )


def _add_passes_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--passes",
        default="workbench",
        help="pass pipeline the graph goes through: workbench (torch's remat pass, the "
        "workbench's offload pass; default) or graph-trainer (torchtitan graph trainer's "
        "compile-time passes in its order: cleanup, tagging, its offload and remat passes)",
    )
    parser.add_argument(
        "--ep-overlap",
        action="store_true",
        help="with --passes graph-trainer on an expert-parallel graph: also run graph "
        "trainer's opt-in EP-overlap passes (each reported as ran or skipped, and why)",
    )


def _add_optimizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "sgd", "none"),
        default="adamw",
        help="optimizer state held the whole step: adamw two fp32 moments per parameter "
        "(shard), sgd one momentum buffer, none (default: adamw)",
    )


def _add_cost_args(parser: argparse.ArgumentParser, calibrate: bool = False) -> None:
    """What the GPU will see: the caching allocator's settings and the streams' options."""
    group = parser.add_argument_group("allocator and streams")
    group.add_argument(
        "--expandable-segments",
        action="store_true",
        help="model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    group.add_argument(
        "--max-split-size-mb", type=int, help="model max_split_size_mb (above 20; default none)"
    )
    group.add_argument(
        "--prefetch", type=int, default=0, help="FSDP all-gather buckets issued ahead (default 0)"
    )
    group.add_argument(
        "--bucket-layers", action="store_true", help="one FSDP collective per layer and kind"
    )
    group.add_argument(
        "--sink-waits", action="store_true", help="collective waits at their first real reader"
    )
    group.add_argument("--max-copies-in-flight", type=int, help="cap on host copies queued")
    if calibrate:
        group.add_argument(
            "--calibrate",
            metavar="TRACE.json",
            help="measured op times (torch.profiler Chrome trace or table) replace the first "
            "profile's roofline where op and shapes match",
        )


def _add_budget_kind_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget-kind",
        choices=("allocated", "reserved"),
        default="allocated",
        help="hold the budget against allocated bytes (default) or the caching allocator's "
        "reserved bytes",
    )


def _add_solve_args(parser: argparse.ArgumentParser) -> None:
    _add_optimizer_arg(parser)
    _add_cost_args(parser)
    _add_budget_kind_arg(parser)
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


def _add_floor_args(parser: argparse.ArgumentParser) -> None:
    """`floor`'s flags (and those of `bench offload`, its old name); fake mode by default."""
    _add_model_args(parser)
    _add_optimizer_arg(parser)
    parser.add_argument("--profile", default="h100", help="device profile (default h100)")
    parser.add_argument(
        "--host-budget-bytes",
        type=int,
        default=64 * 2**30,
        help="host memory offloaded activations may take (default 64 GiB); 0: no offload",
    )
    parser.add_argument(
        "--tolerance-bytes",
        type=int,
        default=2**20,
        help="bisection over the device budget stops within this many bytes (default 1 MiB)",
    )
    parser.add_argument("--method", default="greedy", help="solve's: greedy, knapsack or exact")
    parser.add_argument(
        "--host-link",
        choices=("in-step", "benchmark", "fresh-pinned"),
        default="in-step",
        help="host link rate: as measured in a step from a reused pinned pool (default), as "
        "benchmarked, or with fresh pinned allocations",
    )
    _add_cost_args(parser)
    # what the solver's other flags would say: step time decides, both FSDP settings tried
    parser.set_defaults(
        mode="fake", objective="recompute_time", fsdp_choice="search", budget_kind="allocated"
    )


_LONG_TEXT = 100  # characters: longer values print as their start and a note


_LIST_ROWS = 12  # rows of a list shown before "… N more"
_WHOLE_TEXT = frozenset({"verdict"})  # sentences a person needs whole (verify's before_policy)


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
    if len(text) > _LONG_TEXT and key not in _WHOLE_TEXT:
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


_CELL_ENTRIES = 3  # entries of a map shown in one table cell, largest first


def _cell(column: str, value: Any) -> str:
    """A table cell: a map of figures as its largest entries with their units (`Activation
    32.2 GiB, OptState 15.0 GiB, …`), other maps and lists by their length."""
    if isinstance(value, dict) and value:
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
            return f"{len(value)} entries"
        top = sorted(value.items(), key=lambda kv: -kv[1])[:_CELL_ENTRIES]
        more = ", …" if len(value) > _CELL_ENTRIES else ""
        return ", ".join(f"{k} {_human_value(k, v, column)}" for k, v in top) + more
    if isinstance(value, list) and value and any(isinstance(v, dict | list) for v in value):
        return f"{len(value)} items"
    return _human_value(column, value)


def _table(rows: list[dict[str, Any]], indent: str) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(c, row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = [indent + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    return line + [
        indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells
    ]


def _print_human(result: dict[str, Any]) -> None:
    """What a person reads without --json: units, tables, long values shortened."""
    if "code" in result and "path" in result:  # export --out: say where, not the whole file
        lines = result["code"].count("\n") + 1
        print(f"wrote the {result['format']} export ({lines} lines) to {result['path']}")
        return
    print("\n".join(_human_lines(result)))


def build_parser() -> argparse.ArgumentParser:  # noqa: PLR0915 (one parser, one statement a flag)
    parser = _Parser(prog="python -m workbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    trace = commands.add_parser("trace", help="trace a train step and summarise the graph")
    _add_model_args(trace)
    add_pipeline_args(trace)
    trace.set_defaults(run=pipelined(cmd_trace, cmd_trace_stages))

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
        help="torchtitan version the options are for (0.3.0, main: its 2026-08-21 snapshot, "
        "b5bcd76c; default: the installed one, else the newest release known)",
    )
    export.add_argument("--out", help="write the code to this file")
    export.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    export.set_defaults(run=cmd_export)

    activations = commands.add_parser(
        "activations", help="graph trainer's per-activation table (layer, bytes, tag, op, ...)"
    )
    _add_model_args(activations)
    _add_policy_arg(activations)
    _add_passes_arg(activations)
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
    estimate.add_argument(
        "--snapshot", metavar="OUT.pickle", help="write the estimate as a memory snapshot"
    )
    estimate.add_argument("--overwrite", action="store_true", help="replace an existing file")
    _add_optimizer_arg(estimate)
    _add_passes_arg(estimate)
    _add_cost_args(estimate, calibrate=True)
    add_pipeline_args(estimate)
    estimate.add_argument(
        "--baselines",
        action="store_true",
        help="also run no AC, eager SAC and eager full AC as eager runs them (FSDP2/TP where "
        "sharded) under torch's memory trackers: their peaks beside the graph's",
    )
    estimate.set_defaults(run=with_baselines(pipelined(cmd_estimate, cmd_estimate_stages)))

    compare = commands.add_parser(
        "compare-snapshot", help="a measured memory snapshot against the estimate, op by op"
    )
    compare.add_argument("snapshot", help="torch.cuda.memory._dump_snapshot's pickle")
    _add_model_args(compare)
    _add_policy_arg(compare)
    _add_optimizer_arg(compare)
    _add_cost_args(compare)
    compare.add_argument("--device", type=int, help="the snapshot's device (default: its one)")
    compare.add_argument("--top", type=int, default=20, help="nodes differing most (20)")
    compare.set_defaults(run=cmd_compare_snapshot, mode="fake")  # nothing runs

    measure = commands.add_parser("measure", help="run remat'd graph for real: peak, step time")
    _add_model_args(measure)
    _add_policy_arg(measure)
    measure.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    measure.add_argument("--repeat", type=int, default=5, help="timed runs (median reported)")
    measure.add_argument("--warmup", type=int, default=1)
    measure.add_argument(
        "--baselines", action="store_true", help="also measure no AC and eager SAC"
    )
    measure.add_argument(
        "--blocks",
        help="module path of the blocks eager SAC wraps (default: the traced graph's, e.g. "
        "model.layers, transformer.h)",
    )
    measure.set_defaults(run=cmd_measure)

    solve = commands.add_parser("solve", help="search the cheapest policy within a budget")
    _add_model_args(solve)
    _add_solve_args(solve)
    budget = solve.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-bytes", type=int, help="estimated peak must fit this")
    budget.add_argument("--budget-frac", type=float, help="fraction of the no-AC peak")
    _add_passes_arg(solve)
    add_pipeline_args(solve)
    solve.set_defaults(run=pipelined(cmd_solve, cmd_solve_stages))

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
    add_pipeline_args(bench_trace)
    bench_trace.set_defaults(run=pipelined(cmd_bench_trace, cmd_bench_trace_stages))
    bench_whatif = benches.add_parser("whatif", help="time what-if flips against the full path")
    _add_model_args(bench_whatif)
    _add_policy_arg(bench_whatif)
    bench_whatif.add_argument("--flips", type=int, default=50)
    bench_whatif.add_argument(
        "--full-path",
        type=int,
        default=3,
        help="flips also run through the pipeline's own passes (torch's remat pass, or graph "
        "trainer's with --passes graph-trainer)",
    )
    bench_whatif.add_argument("--seed", type=int, default=0)
    bench_whatif.add_argument(
        "--passes",
        default="workbench",
        help="pass pipeline whose what-if is timed: workbench (default) or graph-trainer "
        "(graph trainer's passes replayed on indices; the full path runs them)",
    )
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
    _add_passes_arg(render)
    render.set_defaults(run=cmd_render)

    bench_gpu = benches.add_parser(
        "gpu", help="per preset on CUDA: peaks, step time, snapshot, trace, vs the estimate"
    )
    _add_model_args(bench_gpu)
    bench_gpu.add_argument(
        "--presets", default="none,default,eager,full,offload", help="presets, comma-separated"
    )
    bench_gpu.add_argument("--repeat", type=int, default=5, help="timed runs (median)")
    bench_gpu.add_argument("--warmup", type=int, default=1)
    bench_gpu.add_argument(
        "--out", default="bench-gpu", help="folder for each preset's snapshot and trace"
    )
    bench_gpu.add_argument("--overwrite", action="store_true", help="replace existing files")
    bench_gpu.set_defaults(run=cmd_bench_gpu)

    bench_render = benches.add_parser("render", help="time the overview and a layer view")
    _add_model_args(bench_render)
    _add_policy_arg(bench_render)
    bench_render.add_argument("--repeat", type=int, default=3)
    bench_render.set_defaults(run=cmd_bench_render, mode="fake")

    floor = commands.add_parser(
        "floor", help="lowest peak at eager's step time, with and without offload; the floor"
    )
    _add_floor_args(floor)
    floor.set_defaults(run=cmd_floor)
    bench_offload = benches.add_parser("offload", help="deprecated: the old name of `floor`")
    _add_floor_args(bench_offload)
    bench_offload.set_defaults(run=cmd_bench_offload)
    _add_plan_parser(commands)
    add_validate_parser(commands)
    for owner, choices in ((parser, commands), (policy, policies), (bench, benches)):
        owner.commands = tuple(choices.choices or ())
    return parser


def _add_plan_parser(commands: Any) -> None:
    plan = commands.add_parser(
        "plan", help="rank the parallel layouts of a job on N GPUs by tokens/s per GPU"
    )
    plan.add_argument("--model", required=True, help="reference model (llama3-*, dsv3-*)")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    plan.add_argument("--gpu", default="h100", help="device profile (h100, h200)")
    plan.add_argument(
        "--memory-gib", type=float, help="memory per GPU in GiB (default: the profile's)"
    )
    plan.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    plan.add_argument(
        "--global-batch", type=int, help="sequences per step over all ranks (default 2 per GPU)"
    )
    plan.add_argument("--layers", type=int, help="override the model's number of layers")
    plan.add_argument(
        "--schedules",
        help="comma-separated pipeline schedules (default 1F1B,Interleaved1F1B,ZBVZeroBubble)",
    )
    plan.add_argument(
        "--microbatch-multiples", help="microbatches tried, as multiples of the stages (1,2,4)"
    )
    plan.add_argument(
        "--jobs",
        type=int,
        help="worker processes evaluating layouts side by side (default: one per CPU)",
    )
    plan.add_argument("--plot", help="draw memory vs tokens/s per GPU to this file (.svg, .png)")
    plan.add_argument("--overwrite", action="store_true", help="replace an existing --plot")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=cmd_plan)


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
        with _stdout_to_stderr() if args.json else contextlib.nullcontext(), torch_logs_held():
            check_common_args(args)
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
    except KeyboardInterrupt:  # Ctrl-C, or user code raising it: one line, not a traceback
        print(f"error: {args.command} interrupted (KeyboardInterrupt)", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result))
    elif args.command == "export" and not args.out:
        print(result["code"])
    elif args.command == "activations":
        print(result["table"])
    elif args.command == "floor" or args.command == "bench" and args.subcommand == "offload":
        from workbench.search.floor import floor_table

        print(floor_table(result))
        print(f"{result['seconds']:.1f} s (trace {result['trace_seconds']:.1f} s)")
    elif args.command == "plan":
        print(plan_table(result))
    elif args.command == "validate":
        print(validate_table(result))
    elif args.command == "policy":
        from workbench.show.explain import explain_text

        print(explain_text(result))
    else:
        _print_human(result)
    return 0
