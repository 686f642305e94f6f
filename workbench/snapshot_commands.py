"""Memory snapshots on the command line: `compare-snapshot` (a measured snapshot against the
estimate, op by op) and `bench gpu` (per preset on a GPU: a snapshot, a Chrome trace, peaks,
step time, the bitwise check and the comparison). `estimate --snapshot` is `cmd_estimate`'s.

Entry points: `cmd_compare_snapshot` and `cmd_bench_gpu`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from workbench.commands import (
    _cost_options_from_args,
    _parallel_from_args,
    _trace_from_args,
    _workload_from_args,
)
from workbench.decide.policy import parse_policy
from workbench.errors import WorkbenchError, check_int
from workbench.files import check_writable
from workbench.preflight import MAX_RUNS, check_positive

__all__ = ["MAX_TOP", "cmd_bench_gpu", "cmd_compare_snapshot"]

MAX_TOP = 100_000  # --top: rows of per-node differences printed


def cmd_compare_snapshot(args: argparse.Namespace) -> dict[str, Any]:
    """A memory snapshot of a run of the policy's rematerialized graph against the estimate
    of that graph (`workbench.cost.attribution.compare_snapshot`): the snapshot is read and
    checked before anything is traced."""
    from workbench.cost.attribution import compare_snapshot
    from workbench.cost.estimate import Estimator, estimate_remat
    from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY
    from workbench.cost.snapshot import load_snapshot
    from workbench.rewrite.remat import remat

    check_int("--top", args.top, 0, MAX_TOP)
    if args.device is not None:
        check_int("--device", args.device, 0, 2**16)
    policy = parse_policy(args.policy)
    cost = _cost_options_from_args(args)
    snapshot = load_snapshot(args.snapshot)
    device = snapshot.device(args.device)
    graph, seconds = _trace_from_args(args)
    estimator = Estimator(graph, (), args.optimizer, allocator=cost["allocator"])
    result = remat(graph, policy)
    est = estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)
    comparison = compare_snapshot(snapshot, estimator, est, result.gm, device, args.top)
    return {
        "model": graph.model_name,
        "policy": policy.to_json(),
        "optimizer": args.optimizer,
        **comparison.to_json(),
        "trace_seconds": round(seconds, 3),
    }


def _out_folder(args: argparse.Namespace, model: str, presets: list[str]) -> Path:
    """`bench gpu --out`: a folder (made if missing, in an existing one) whose files for
    each preset may be written."""
    from workbench.bench import bench_gpu_paths

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


def cmd_bench_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """Per preset on CUDA: measured peaks, step time, a memory snapshot and a Chrome trace
    written to --out, the bitwise check and the snapshot against the estimate (see
    `workbench.bench.bench_gpu`); every flag is checked first, and without CUDA it says so
    and exits 0."""
    import torch

    from workbench.bench import bench_gpu
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
    if _parallel_from_args(args) is not None:
        raise WorkbenchError("bench gpu runs one unsharded process: drop --fsdp/--tp")
    out = _out_folder(args, args.model, presets)
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device here: bench gpu measures on one", "presets": []}
    out.mkdir(exist_ok=True)
    return bench_gpu(
        lambda: _workload_from_args(args, "real", device="cuda"),
        presets,
        warmup=args.warmup,
        repeats=args.repeat,
        out=out,
        overwrite=args.overwrite,
        files_named=args.model,
    )
