"""The `validate` command: published per-GPU memory of real runs beside the workbench's
estimate of each (`workbench.interop.published`, `workbench.interop.validate`).

Entry points: `cmd_validate(args)` (its result, a `Validation`) and `validate_table(result)`
(what a person reads of the table's JSON, stored as `notebooks/validate.json` or fresh).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from workbench.cli.report import Report
from workbench.errors import check_int
from workbench.interop.published import select_runs

__all__ = ["Validation", "cmd_validate", "validate_table"]

GIB = 2**30
MAX_LAYERS = 1024  # an override above any model's depth
MAX_SEQ = 2**20


class Validation(Report):
    """The rows' JSON (with `--list`, the rows alone); a person reads `validate_table`."""

    def __str__(self) -> str:
        return validate_table(self.data)


def cmd_validate(args: argparse.Namespace) -> Validation:
    """Every chosen row traced and estimated, with a progress line per row on stderr."""
    runs = select_runs(args.rows)
    if args.list:
        return Validation({"rows": [run.to_json() for run in runs]})
    if args.layers is not None:
        # two at least: the compiler toolkit's rows name odd layers (apply_sac's matmul count)
        check_int("--layers", args.layers, 2, MAX_LAYERS, "transformer blocks")
    if args.seq is not None:
        check_int("--seq", args.seq, 1, MAX_SEQ, "tokens")
    from workbench.interop.validate import validate

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    results = validate(runs, layers=args.layers, seq=args.seq, progress=progress)
    return Validation(
        {
            "rows": [r.to_json() for r in results],
            "layers": args.layers,
            "seq": args.seq,
            "seconds": round(time.perf_counter() - start, 3),
            "cpu_count": os.cpu_count(),
        }
    )


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _list_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'id':<34} {'published':>9}  title / source"]
    for row in rows:
        lines.append(f"{row['id']:<34} {row['published_gib']:>9.2f}  {row['title']}")
        lines.append(f"{'':<34} {'':>9}  {row['source']}")
    return "\n".join(lines)


def _itemised(row: dict[str, Any]) -> list[str]:
    parts = ", ".join(
        f"{k.removesuffix('_bytes')} {v / GIB:.2f}" for k, v in row["breakdown"].items() if v
    )
    lines = [f"  {row['id']}: peak at {row['peak_at']}: {parts} GiB"]
    if row["saved_at_peak_by_op"]:
        ops = ", ".join(f"{op} {b / GIB:.2f}" for op, b in row["saved_at_peak_by_op"].items())
        lines.append(f"    saved at the peak by op: {ops} GiB")
    streams = row["reserved_by_stream"]
    if len(streams) > 1:
        pools = ", ".join(f"{name} {size / GIB:.2f}" for name, size in streams.items())
        lines.append(f"    reserved by stream: {pools} GiB")
    graph = row.get("graph_estimate")
    if graph is not None:
        lines.append(
            f"    the graph preset {graph['policy']!r} beside it: allocated "
            f"{_gib(graph['allocated_peak_bytes'])}, reserved "
            f"{_gib(graph['reserved_peak_bytes'])} GiB (peak at {graph['peak_at']})"
        )
    outside = row["outside_allocator_bytes"]
    lines.append(
        f"    outside the allocator (not in the published figure): CUDA context "
        f"{outside['cuda_context_bytes'] / GIB:.2f}, NCCL buffers "
        f"{outside['nccl_buffer_bytes'] / GIB:.2f} GiB"
    )
    lines += [f"    - {d}" for d in row["differences"]]
    return lines


def _policy_cell(row: dict[str, Any]) -> str:
    """The row's preset, marked `+` where the row adds to it what `--policy` JSON or
    `--backward-inputs` carries."""
    config = row["config"]
    added = (
        config["selectors"] or not config["fsdp_reshard"] or config["backward_inputs"] != "freed"
    )
    return f"{row['policy']}{'+' if added else ''}"


def validate_table(result: dict[str, Any], itemised: bool = True) -> str:
    """The rows side by side (GiB per GPU), then (`itemised`) each row's peak by category
    and what the run does that the workbench does not model."""
    rows = result["rows"]
    if "seconds" not in result:
        return _list_table(rows)
    head = (
        f"{'id':<34} {'policy':<13} {'by':<5} {'alloc':>6} {'reserv':>6} {'+outs':>5} "
        f"{'publ':>6} {'diff':>7} {'diff%':>7} {'s':>5}"
    )
    lines = [head]
    for row in rows:
        reserved = row["reserved_peak_bytes"]
        outside = sum(row["outside_allocator_bytes"].values())
        diff, pct = row["difference_bytes"], row["difference_pct"]
        mark = "*" if row["compared"] == "allocated" else " "
        lines.append(
            f"{row['id']:<34} {_policy_cell(row):<13} {row['estimated_by']:<5} "
            f"{_gib(row['allocated_peak_bytes']):>6} "
            f"{_gib(reserved):>6} {outside / GIB:>5.2f} {row['published_gib']:>6.2f} "
            f"{'-' if diff is None else f'{diff / GIB:+.2f}':>7}{mark}"
            f"{'-' if pct is None else f'{pct:+.1f}':>7} {row['seconds']:>5.1f}"
        )
    lines.append(
        "GiB per GPU. policy: the preset (+: with the row's selectors, FSDP choice or a "
        "backward holding its inputs; its command says which). "
        "by: graph (the preset on the workbench's graph) or eager (the run's AC "
        "as eager runs it, under torch's memory trackers: the published run was eager). publ: "
        "torchtitan's max_memory_reserved; diff = reserved estimate - published (* allocated: "
        "no reserved model over a pipeline schedule); +outs: CUDA context and NCCL buffers, "
        "outside the allocator and the published figure"
    )
    if result["layers"] is not None or result["seq"] is not None:
        lines.append(
            f"overridden (layers {result['layers'] or 'as published'}, seq "
            f"{result['seq'] or 'as published'}): not comparable, no difference shown"
        )
    if itemised:
        lines.append("itemised:")
        for row in rows:
            lines += _itemised(row)
    lines.append(f"{result['seconds']:.1f} s on {result['cpu_count']} CPUs")
    return "\n".join(lines)
