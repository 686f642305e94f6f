"""Run a model's eager baselines (no AC, eager SAC, eager full AC: `workbench.interop.
eager_runs`, as torchtitan wraps a job) for real on a device and write what
`measure_baseline` measures (`measure`), as JSON on stdout: the figures the workbench's
tracker estimates of the same steps (`estimate --baselines` in fake mode) are checked
against. Needs no tracer, so it runs on a GPU whose torch is older than the workbench's.

    python scripts/run_baselines.py MODEL DTYPE [--device cuda] [--layers N] > OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from workbench.capture.models import load_workload
from workbench.cost.measure import _cpu_peak, _cuda_peak, allocation_granularity, held_bytes
from workbench.interop.eager_runs import BASELINE_KINDS, BaselineOptions, eager_run


def measure(workload: Any, kind: str, device: str, warmup: int = 1) -> dict[str, Any]:
    """`measure_baseline`'s figure (the held inputs and what the step adds to the allocated
    peak, `workbench.cost.measure`), without its host buffer pool, whose offload ops an older
    torch lacks (the baselines offload nothing)."""
    options = BaselineOptions(mode="real", optimizer="none")
    with eager_run(workload, kind, options) as run:  # type: ignore[arg-type]
        for _ in range(warmup):
            run.step()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            extra, _ = _cuda_peak(run.step, torch.device("cuda"))
        else:
            extra, _ = _cpu_peak(run.step)
        held = held_bytes(run.held(), allocation_granularity(torch.device(device)))
        reserved = torch.cuda.max_memory_reserved() if device == "cuda" else None
    return {
        "name": run.name,
        "peak_bytes": held + extra,
        "held_bytes": held,
        "max_memory_reserved": reserved,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("dtype")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int)
    a = parser.parse_args(argv)
    workload = load_workload(a.model, dtype=a.dtype, device=a.device, layers=a.layers)
    rows = {}
    for kind in BASELINE_KINDS:
        rows[kind] = measure(workload, kind, a.device)
        print(kind, json.dumps(rows[kind]), file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    result = {"model": a.model, "dtype": a.dtype, "device": device, "torch": torch.__version__}
    json.dump({**result, "baselines": rows}, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
