"""The command line's parser: every command, its flags, and the function that runs it (the
parsed arguments' `run`, one of the command groups' `cmd_*`).

Entry points: `build_parser()`; `CommandParser`, argparse reporting bad input in one line; the
flag groups several commands share (`add_model_args`, `add_policy_arg`, ...).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

from workbench.capture.models import DTYPES
from workbench.cli.args import FSDP_CHOICES
from workbench.cli.bench import (
    cmd_bench_click,
    cmd_bench_gpu,
    cmd_bench_render,
    cmd_bench_toolkit,
    cmd_bench_trace,
    cmd_bench_whatif,
)
from workbench.cli.estimate import (
    cmd_compare_snapshot,
    cmd_estimate,
    cmd_measure,
    with_baselines,
)
from workbench.cli.plan import cmd_plan
from workbench.cli.policy import cmd_policy_explain
from workbench.cli.render import cmd_activations, cmd_render
from workbench.cli.solve import cmd_floor, cmd_pareto, cmd_solve
from workbench.cli.stages import (
    cmd_bench_click_stages,
    cmd_bench_trace_stages,
    cmd_estimate_stages,
    cmd_solve_stages,
    cmd_trace_stages,
    pipelined,
)
from workbench.cli.trace import cmd_export, cmd_trace, cmd_verify
from workbench.cli.validate import cmd_validate
from workbench.decide.presets import PRESETS
from workbench.interop.published import PUBLISHED_RUNS

__all__ = [
    "EXIT_USAGE",
    "CommandParser",
    "add_cost_args",
    "add_model_args",
    "add_optimizer_arg",
    "add_passes_arg",
    "add_pipeline_args",
    "add_policy_arg",
    "add_solve_args",
    "build_parser",
]

EXIT_USAGE = 2

DESCRIPTION = """Command line: `python -m workbench COMMAND ... [--json]`.

Entry point: `main(argv)`. With `--json` every command prints exactly one JSON object on
stdout; errors print one line on stderr and exit with status 2.
"""


class CommandParser(argparse.ArgumentParser):
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
        if self.get_default("run") is not None:  # what `refuse_unused_flags` compares with
            namespace.flag_defaults = {
                a.dest: a.default for a in self._actions if a.dest != argparse.SUPPRESS
            }
        if extra and self.get_default("run") is not None:
            flags = [a.split("=")[0] for a in extra if a.startswith("-")]
            close = {m for f in flags for m in difflib.get_close_matches(f, self._flags(), 3)}
            hint = f" (close matches: {', '.join(sorted(close))})" if close else ""
            self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return namespace, extra

    def _flags(self) -> list[str]:
        return [flag for action in self._actions for flag in action.option_strings]


# --- flags several commands share --------------------------------------------------------


def add_model_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
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
    add_json_arg(parser)


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_policy_arg(parser: argparse.ArgumentParser, default: str | None = "default") -> None:
    parser.add_argument(
        "--policy",
        default=default,
        help=f"preset ({', '.join(PRESETS)}) or policy.json; `policy explain` says what it does",
    )


def add_passes_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--passes",
        default="workbench",
        help="pass stack the graph goes through: workbench (torch's remat pass, the "
        "workbench's offload pass; default) or graph-trainer (torchtitan graph trainer's "
        "compile-time passes in its order: cleanup, tagging, its offload and remat passes)",
    )
    parser.add_argument(
        "--ep-overlap",
        action="store_true",
        help="with --passes graph-trainer on an expert-parallel graph: also run graph "
        "trainer's opt-in EP-overlap passes (each reported as ran or skipped, and why)",
    )


def add_optimizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "sgd", "none"),
        default="adamw",
        help="optimizer state held the whole step: adamw two fp32 moments per parameter "
        "(shard), sgd one momentum buffer, none (default: adamw)",
    )


def add_backward_inputs_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backward-inputs",
        choices=("freed", "held"),  # cost.estimate.BACKWARD_INPUTS, without its imports
        default="freed",
        help="what the backward does with what forward saved and the loss's gradient: freed "
        "after each one's last use (eager autograd, inductor; default) or held until it "
        "returns (an FX GraphModule backward called as f(*args): torchtitan's compiler "
        "toolkit)",
    )


def add_cost_args(parser: argparse.ArgumentParser, calibrate: bool = False) -> None:
    """What the GPU will see: the caching allocator's settings and the streams' options."""
    group = parser.add_argument_group("allocator and streams")
    group.add_argument(
        "--expandable-segments",
        action="store_true",
        help="model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    group.add_argument(
        "--max-split-size-mb",
        type=int,
        help="model max_split_size_mb (above 20, at most 1,048,576: 1 TiB; default none)",
    )
    group.add_argument(
        "--prefetch",
        type=int,
        default=0,
        help="FSDP all-gather buckets issued ahead (default 0, at most 10,000)",
    )
    group.add_argument(
        "--bucket-layers", action="store_true", help="one FSDP collective per layer and kind"
    )
    group.add_argument(
        "--sink-waits", action="store_true", help="collective waits at their first real reader"
    )
    group.add_argument(
        "--max-copies-in-flight",
        type=int,
        help="cap on host copies queued (1 to 100,000; default: no cap)",
    )
    if calibrate:
        group.add_argument(
            "--calibrate",
            metavar="TRACE.json",
            help="measured op times (torch.profiler Chrome trace or table) replace the first "
            "profile's roofline where op and shapes match",
        )


def add_solve_args(parser: argparse.ArgumentParser) -> None:
    add_optimizer_arg(parser)
    add_cost_args(parser)
    parser.add_argument(
        "--budget-kind",
        choices=("allocated", "reserved"),
        default="allocated",
        help="hold the budget against allocated bytes (default) or the caching allocator's "
        "reserved bytes",
    )
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


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pipeline parallelism")
    group.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (ranks)")
    group.add_argument(
        "--pp-schedule",
        default="1F1B",
        help="torch.distributed.pipelining schedule: 1F1B (default), GPipe, Interleaved1F1B, "
        "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV",
    )
    group.add_argument(
        "--microbatches", type=int, help="microbatches per step (default: one per stage)"
    )
    group.add_argument("--stage", type=int, help="only this stage's graph (default: all)")
    group.add_argument(
        "--layers-per-stage", type=int, help="torchtitan's pipeline_parallel_layers_per_stage"
    )


# --- the commands, in the order `--help` lists them -----------------------------------------

Commands = Any  # what `add_subparsers` returns (argparse's private `_SubParsersAction`)


def _add_trace(commands: Commands) -> None:
    trace = commands.add_parser("trace", help="trace a train step and summarise the graph")
    add_model_args(trace)
    add_pipeline_args(trace)
    trace.set_defaults(run=pipelined(cmd_trace, cmd_trace_stages))


def _add_verify(commands: Commands) -> None:
    verify = commands.add_parser("verify", help="remat a policy and check numerics bitwise")
    add_model_args(verify)
    add_policy_arg(verify, default=None)  # None: not given (`--random` takes its place)
    verify.add_argument(
        "--random",
        type=int,
        metavar="N",
        help="instead of --policy: N random policies of the model (presets, selectors, "
        "overrides, offload), each checked bitwise",
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the --random policies")
    verify.set_defaults(run=cmd_verify)


def _add_export(commands: Commands) -> None:
    export = commands.add_parser("export", help="export a policy as code")
    add_model_args(export)
    add_policy_arg(export)
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


def _add_activations(commands: Commands) -> None:
    activations = commands.add_parser(
        "activations", help="graph trainer's per-activation table (layer, bytes, tag, op, ...)"
    )
    add_model_args(activations)
    add_policy_arg(activations)
    add_passes_arg(activations)
    activations.set_defaults(run=cmd_activations)


def _add_policy(commands: Commands) -> None:
    policy = commands.add_parser("policy", help="what a policy does")
    policies = policy.add_subparsers(dest="subcommand", required=True)
    explain = policies.add_parser(
        "explain",
        help="a policy's rules in words, where it differs from graph trainer's, and (with "
        "--model) its decisions by reason and mismatches with graph trainer's tagging",
    )
    add_model_args(explain, required=False)
    add_policy_arg(explain)
    explain.set_defaults(run=cmd_policy_explain)
    policy.commands = tuple(policies.choices or ())


def _add_estimate(commands: Commands) -> None:
    estimate = commands.add_parser("estimate", help="estimate peak memory and step time")
    add_model_args(estimate)
    add_policy_arg(estimate)
    estimate.add_argument(
        "--profile", default="h100,h200,cpu", help="device profiles, comma-separated"
    )
    estimate.add_argument("--timeline", action="store_true", help="include the memory timeline")
    estimate.add_argument(
        "--snapshot", metavar="OUT.pickle", help="write the estimate as a memory snapshot"
    )
    estimate.add_argument("--overwrite", action="store_true", help="replace an existing file")
    add_optimizer_arg(estimate)
    add_passes_arg(estimate)
    add_cost_args(estimate, calibrate=True)
    add_backward_inputs_arg(estimate)
    add_pipeline_args(estimate)
    estimate.add_argument(
        "--baselines",
        action="store_true",
        help="also run no AC, eager SAC and eager full AC as eager runs them (FSDP2/TP where "
        "sharded) under torch's memory trackers: their peaks beside the graph's",
    )
    estimate.set_defaults(run=with_baselines(pipelined(cmd_estimate, cmd_estimate_stages)))


def _add_compare_snapshot(commands: Commands) -> None:
    compare = commands.add_parser(
        "compare-snapshot", help="a measured memory snapshot against the estimate, op by op"
    )
    compare.add_argument("snapshot", help="torch.cuda.memory._dump_snapshot's pickle")
    add_model_args(compare)
    add_policy_arg(compare)
    add_optimizer_arg(compare)
    add_cost_args(compare)
    add_backward_inputs_arg(compare)
    compare.add_argument("--device", type=int, help="the snapshot's device (default: its one)")
    compare.add_argument("--top", type=int, default=20, help="nodes differing most (20)")
    compare.set_defaults(run=cmd_compare_snapshot, mode="fake")  # nothing runs


def _add_measure(commands: Commands) -> None:
    measure = commands.add_parser("measure", help="run remat'd graph for real: peak, step time")
    add_model_args(measure)
    add_policy_arg(measure)
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


def _add_solve(commands: Commands) -> None:
    solve = commands.add_parser("solve", help="search the cheapest policy within a budget")
    add_model_args(solve)
    add_solve_args(solve)
    budget = solve.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-bytes", type=int, help="estimated peak must fit this")
    budget.add_argument("--budget-frac", type=float, help="fraction of the no-AC peak")
    add_passes_arg(solve)
    add_pipeline_args(solve)
    solve.set_defaults(run=pipelined(cmd_solve, cmd_solve_stages))


def _add_pareto(commands: Commands) -> None:
    pareto = commands.add_parser("pareto", help="memory-vs-recompute front and the presets")
    add_model_args(pareto)
    add_solve_args(pareto)
    pareto.add_argument("--points", type=int, default=20, help="budgets in the sweep")
    pareto.add_argument(
        "--plot", help="draw peak memory vs step time, the front and presets (.svg, .png)"
    )
    pareto.add_argument("--overwrite", action="store_true", help="replace an existing --plot")
    pareto.set_defaults(run=cmd_pareto)


def _add_bench(commands: Commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print measured figures")
    benches = bench.add_subparsers(dest="subcommand", required=True)
    bench_trace = benches.add_parser("trace", help="time tracing (median of --repeat runs)")
    add_model_args(bench_trace)
    bench_trace.add_argument("--repeat", type=int, default=1)
    add_pipeline_args(bench_trace)
    bench_trace.set_defaults(run=pipelined(cmd_bench_trace, cmd_bench_trace_stages))

    bench_whatif = benches.add_parser("whatif", help="time what-if flips against the full path")
    add_model_args(bench_whatif)
    add_policy_arg(bench_whatif)
    bench_whatif.add_argument("--flips", type=int, default=50)
    bench_whatif.add_argument(
        "--full-path",
        type=int,
        default=3,
        help="flips also run through the pass stack's own passes (torch's remat pass, or graph "
        "trainer's with --passes graph-trainer)",
    )
    bench_whatif.add_argument("--seed", type=int, default=0)
    bench_whatif.add_argument(
        "--passes",
        default="workbench",
        help="pass stack whose what-if is timed: workbench (default) or graph-trainer "
        "(graph trainer's passes replayed on indices; the full path runs them)",
    )
    bench_whatif.set_defaults(run=cmd_bench_whatif, mode="fake")

    bench_click = benches.add_parser(
        "click", help="time clicks through the explorer (flip, estimate, view)"
    )
    add_model_args(bench_click)
    add_policy_arg(bench_click)
    bench_click.add_argument("--flips", type=int, default=30, help="clicks timed")
    bench_click.add_argument("--seed", type=int, default=0)
    bench_click.add_argument(
        "--passes",
        default="workbench",
        help="pass stack the explorer estimates under: workbench (default) or graph-trainer "
        "(graph trainer's passes replayed on indices)",
    )
    add_pipeline_args(bench_click)
    bench_click.set_defaults(run=pipelined(cmd_bench_click, cmd_bench_click_stages), mode="fake")

    bench_gpu = benches.add_parser(
        "gpu", help="per preset on CUDA: peaks, step time, snapshot, trace, vs the estimate"
    )
    add_model_args(bench_gpu)
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

    bench_toolkit = benches.add_parser(
        "toolkit",
        help="a compiler-toolkit step (AOT export, default partitioner, FX backward) measured "
        "beside the estimate: no AC and apply_sac, backward inputs held or freed; on this CPU, "
        "or with --mode fake one rank of a torchtitan: model under --fsdp/--tp on fake tensors "
        "(torch's MemTracker), where graph trainer's apply_sac_pass and torchtitan's eager SAC "
        "wrappers are measured too",
    )
    add_model_args(bench_toolkit)
    bench_toolkit.add_argument(
        "--tags",
        help="the taggings to run, comma-separated, of none, apply_sac (the toolkit's pass of "
        "2026-02), apply_sac_pass (graph trainer's of 2026-03) and eager_sac (torchtitan's "
        "wrappers, --mode fake only); default none,apply_sac on this CPU, all with --mode fake",
    )
    bench_toolkit.set_defaults(run=cmd_bench_toolkit)

    bench_render = benches.add_parser("render", help="time the overview and a layer view")
    add_model_args(bench_render)
    add_policy_arg(bench_render)
    bench_render.add_argument("--repeat", type=int, default=3)
    bench_render.set_defaults(run=cmd_bench_render, mode="fake")
    bench.commands = tuple(benches.choices or ())


def _add_render(commands: Commands) -> None:
    render = commands.add_parser("render", help="draw the graph coloured by a policy")
    add_model_args(render)
    add_policy_arg(render)
    render.add_argument(
        "--view",
        default="overview",
        help="overview, layer:N, module:PATH, diff:OTHER_POLICY or graph (every op)",
    )
    render.add_argument("--out", required=True, help="file to write: .svg, .png, .pdf or .dot")
    render.add_argument("--force", action="store_true", help="lay out huge views anyway")
    render.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    add_passes_arg(render)
    render.set_defaults(run=cmd_render)


def _add_floor(commands: Commands) -> None:
    """`floor`: fake mode by default; the solver's other flags as it fixes them."""
    floor = commands.add_parser(
        "floor", help="lowest peak at eager's step time, with and without offload; the floor"
    )
    add_model_args(floor)
    add_optimizer_arg(floor)
    floor.add_argument("--profile", default="h100", help="device profile (default h100)")
    floor.add_argument(
        "--host-budget-bytes",
        type=int,
        default=64 * 2**30,
        help="host memory offloaded activations may take (default 64 GiB); 0: no offload",
    )
    floor.add_argument(
        "--tolerance-bytes",
        type=int,
        default=2**20,
        help="bisection over the device budget stops within this many bytes (default 1 MiB)",
    )
    floor.add_argument("--method", default="greedy", help="solve's: greedy, knapsack or exact")
    floor.add_argument(
        "--host-link",
        choices=("in-step", "benchmark", "fresh-pinned"),
        default="in-step",
        help="host link rate: as measured in a step from a reused pinned pool (default), as "
        "benchmarked, or with fresh pinned allocations",
    )
    add_cost_args(floor)
    # what the solver's other flags would say: step time decides, both FSDP settings tried
    floor.set_defaults(
        mode="fake",
        objective="recompute_time",
        fsdp_choice="search",
        budget_kind="allocated",
        run=cmd_floor,
    )


def _add_plan(commands: Commands) -> None:
    plan = commands.add_parser(
        "plan", help="rank the parallel layouts of a job on N GPUs by tokens/s per GPU"
    )
    plan.add_argument(
        "--model", required=True, help="reference (llama3-*, dsv3-*) or torchtitan:F/V model"
    )
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
    add_json_arg(plan)
    plan.set_defaults(run=cmd_plan)


def _add_validate(commands: Commands) -> None:
    validate = commands.add_parser(
        "validate", help="published per-GPU memory of real runs beside the estimate of each"
    )
    validate.add_argument(
        "--rows", help=f"comma-separated row ids (default: all): {', '.join(PUBLISHED_RUNS)}"
    )
    validate.add_argument(
        "--list", action="store_true", help="list the rows with their sources; estimate none"
    )
    validate.add_argument(
        "--layers",
        type=int,
        help="override every row's layer count, at least 2 (a quick check: no longer comparable)",
    )
    validate.add_argument(
        "--seq", type=int, help="override every row's sequence length (no longer comparable)"
    )
    add_json_arg(validate)
    validate.set_defaults(run=cmd_validate)


def build_parser() -> CommandParser:
    """Every command, in the order `--help` lists them; each parsed command's `run` is the
    function that runs it (`args -> Result`)."""
    parser = CommandParser(prog="python -m workbench", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_trace(commands)
    _add_verify(commands)
    _add_export(commands)
    _add_activations(commands)
    _add_policy(commands)
    _add_estimate(commands)
    _add_compare_snapshot(commands)
    _add_measure(commands)
    _add_solve(commands)
    _add_pareto(commands)
    _add_bench(commands)
    _add_render(commands)
    _add_floor(commands)
    _add_plan(commands)
    _add_validate(commands)
    parser.commands = tuple(commands.choices or ())
    return parser
