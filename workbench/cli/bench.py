"""`bench trace`, `bench whatif`, `bench click`, `bench render` and `bench gpu`: benchmarks that
print measured figures (the functions that measure are `workbench.cli.benchmarks`'). `bench
trace` and `bench click` of a pipelined job (`--pp`) are `workbench.cli.stages`'.

Entry points: `cmd_bench_trace`, `cmd_bench_whatif`, `cmd_bench_click`, `cmd_bench_render` and
`cmd_bench_gpu` (each `args -> Result`), and `scratch_autosaves`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.cli.args import (
    MAX_FLIPS,
    MAX_FULL_PATH,
    MAX_RUNS,
    SEED_MAX,
    check_passes,
    check_positive,
    kernels_from_args,
    parallel_flags,
    parallel_from_args,
    trace_from_args,
    trace_workload,
    workload_from_args,
)
from workbench.cli.report import Report
from workbench.decide.policy import parse_policy
from workbench.errors import WorkbenchError, check_int
from workbench.files import check_writable

if TYPE_CHECKING:
    from workbench.interop.toolkit import Tags

__all__ = [
    "cmd_bench_click",
    "cmd_bench_gpu",
    "cmd_bench_render",
    "cmd_bench_trace",
    "cmd_bench_whatif",
    "scratch_autosaves",
]


def cmd_bench_trace(args: argparse.Namespace) -> Report:
    """Median of --repeat traces (see `workbench.cli.benchmarks.bench_trace`)."""
    from workbench.cli.benchmarks import bench_trace

    check_positive("--repeat", args.repeat)
    return Report(bench_trace(lambda: trace_from_args(args), args.repeat))


def cmd_bench_whatif(args: argparse.Namespace) -> Report:
    """Random flips: what-if time per flip vs the full path (see `workbench.cli.benchmarks`)."""
    from workbench.cli.benchmarks import bench_whatif

    check_positive("--flips", args.flips, MAX_FLIPS, "each flip is one what-if")
    check_int("--full-path", args.full_path, 0, MAX_FULL_PATH, "each runs torch's remat pass")
    check_int("--seed", args.seed, 0, SEED_MAX)
    check_passes(args)
    graph, trace_seconds = trace_from_args(args)
    result = bench_whatif(
        graph,
        parse_policy(args.policy),
        flips=args.flips,
        full_path=args.full_path,
        seed=args.seed,
        passes=args.passes,
    )
    return Report({**result, "trace_seconds": round(trace_seconds, 3)})


def cmd_bench_click(args: argparse.Namespace) -> Report:
    """Random clicks through the explorer of one graph (`workbench.cli.benchmarks.bench_click`)."""
    from workbench.cli.benchmarks import bench_click
    from workbench.show.widgets.explorer import PolicyExplorer

    check_click_args(args)
    check_passes(args)
    graph, trace_seconds = trace_from_args(args)
    with scratch_autosaves():
        explorer = PolicyExplorer(graph, parse_policy(args.policy), passes=args.passes)
        result = bench_click(explorer, args.flips, args.seed)
    return Report({**result, "trace_seconds": round(trace_seconds, 3)})


def check_click_args(args: argparse.Namespace) -> None:
    check_positive("--flips", args.flips, MAX_FLIPS, "each flip is one click")
    check_int("--seed", args.seed, 0, SEED_MAX)


@contextlib.contextmanager
def scratch_autosaves() -> Iterator[None]:
    """The explorer autosaves into a folder of its own for the benchmark's clicks: they
    start from the given policy, not a file left in the working folder, and leave none
    there."""
    key = "SAC_WORKBENCH_AUTOSAVE_DIR"
    before = os.environ.get(key)
    with tempfile.TemporaryDirectory(prefix="sac-bench-") as folder:
        os.environ[key] = folder
        try:
            yield
        finally:
            if before is None:
                del os.environ[key]
            else:
                os.environ[key] = before


def cmd_bench_render(args: argparse.Namespace) -> Report:
    """Time the overview and one layer's view (see `workbench.cli.benchmarks`)."""
    from workbench.cli.benchmarks import bench_render

    check_positive("--repeat", args.repeat)
    graph, trace_seconds = trace_from_args(args)
    result = bench_render(graph, parse_policy(args.policy), args.repeat)
    return Report({**result, "trace_seconds": round(trace_seconds, 3)})


def cmd_bench_toolkit(args: argparse.Namespace) -> Report:
    """A compiler-toolkit step measured beside the estimate of it: for real on this CPU, one
    unsharded process (`workbench.cli.benchmarks.bench_toolkit`), or with --mode fake one rank
    of a torchtitan model sharded by --fsdp/--tp on fake tensors under torch's tracker
    (`bench_toolkit_rank`)."""
    from workbench.cli.benchmarks import bench_toolkit, bench_toolkit_rank

    parallel = parallel_from_args(args)
    tags = _toolkit_tags(args.tags, args.mode)
    if args.mode == "fake":
        if parallel is None or not args.model.startswith("torchtitan:"):
            raise WorkbenchError(
                "bench toolkit --mode fake measures one rank of a sharded torchtitan job: give "
                "a torchtitan: model and --fsdp/--tp (or drop --mode fake to run a step on this "
                "CPU)"
            )
        workload = workload_from_args(args, "fake")
        kernels = kernels_from_args(args, "fake")
        graph, _ = trace_workload(workload, "fake", parallel, kernels)
        return Report(bench_toolkit_rank(workload, graph, parallel, tags))
    if parallel is not None:
        raise WorkbenchError(
            f"bench toolkit runs one unsharded process on this CPU: drop {parallel_flags(args)}, "
            "or measure one rank of a torchtitan: model with --mode fake"
        )
    workload = workload_from_args(args, "real")
    graph, _ = trace_workload(workload, "real", None, kernels_from_args(args, "real"))
    return Report(bench_toolkit(workload, graph, tags))


def _toolkit_tags(value: str | None, mode: str) -> list[Tags] | None:
    """`--tags`: the taggings named, each known, eager SAC on a fake rank only (its wrappers
    would change a real workload's model); None when not given (each mode's default)."""
    from workbench.interop.toolkit import TOOLKIT_TAGS

    if value is None:
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in TOOLKIT_TAGS]
    if unknown or not names:
        raise WorkbenchError(
            f"--tags {value!r}: {', '.join(unknown) or 'nothing named'}; name some of "
            f"{', '.join(TOOLKIT_TAGS)}, comma-separated"
        )
    if "eager_sac" in names and mode != "fake":
        raise WorkbenchError(
            "--tags eager_sac wraps graph trainer's blocks in torchtitan's SelectiveAC: add "
            "--mode fake with a torchtitan: model and --fsdp/--tp"
        )
    return [name for name in TOOLKIT_TAGS if name in names]


def _out_folder(args: argparse.Namespace, model: str, presets: list[str]) -> Path:
    """`bench gpu --out`: a folder (made if missing, in an existing one) whose files for
    each preset may be written."""
    from workbench.cli.benchmarks import bench_gpu_paths

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise WorkbenchError(f"--out {out}: is not a folder; name a folder for the files")
    if not out.exists() and not out.parent.is_dir():
        raise WorkbenchError(f"--out {out}: its parent folder {str(out.parent)!r} is missing")
    if out.is_dir():
        for preset in presets:
            for path in bench_gpu_paths(out, model, preset).values():
                check_writable(path, overwrite=args.overwrite)
    return out


def cmd_bench_gpu(args: argparse.Namespace) -> Report:
    """Per preset on CUDA: measured peaks, step time, a memory snapshot and a Chrome trace
    written to --out, the bitwise check and the snapshot against the estimate (see
    `workbench.cli.benchmarks.bench_gpu`); every flag is checked first, and without CUDA it
    says so and exits 0."""
    import torch

    from workbench.cli.benchmarks import bench_gpu
    from workbench.decide.presets import PRESETS

    check_positive("--repeat", args.repeat)
    check_int("--warmup", args.warmup, 0, MAX_RUNS, "each one is a run of the step")
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        raise WorkbenchError(
            f"--presets {args.presets!r}: unknown {', '.join(unknown) or 'none given'}; "
            f"choose from {', '.join(PRESETS)}"
        )
    if parallel_from_args(args) is not None:
        raise WorkbenchError(f"bench gpu runs one unsharded process: drop {parallel_flags(args)}")
    out = _out_folder(args, args.model, presets)
    if not torch.cuda.is_available():
        workload_from_args(args, "fake")  # the model and its shape flags, checked on meta
        return Report({"skipped": "no CUDA device here: bench gpu measures on one", "presets": []})
    out.mkdir(exist_ok=True)
    result = bench_gpu(
        lambda: workload_from_args(args, "real", device="cuda"),
        presets,
        warmup=args.warmup,
        repeats=args.repeat,
        out=out,
        overwrite=args.overwrite,
        files_named=args.model,
    )
    return Report(result)
