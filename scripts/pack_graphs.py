"""Pack the GPU-shaped graphs of a model, one per preset, for a GPU whose torch cannot trace
them (the lent device runs an older torch than the workbench's): each preset's
rematerialized graph as its generated code, with what the estimate says of it. On the GPU,
`scripts/run_graphs.py` runs each code as is and records the step; here,
`python -m workbench compare-snapshot` reads each snapshot against the same estimate.

    python scripts/pack_graphs.py MODEL DTYPE KERNELS PRESETS OUT_DIR [LAYERS]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch

from workbench.capture.models import load_workload
from workbench.capture.trace import trace
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY
from workbench.decide.policy import Policy
from workbench.rewrite.remat import remat


def main(model: str, dtype: str, kernels: str, presets: str, out: str, layers: str = "") -> None:
    n = int(layers) if layers else None
    graph = trace(
        load_workload(model, dtype=dtype, device="meta", layers=n), "fake", kernels=kernels
    )
    estimator = Estimator(graph, (), "none")  # a graph run holds no optimizer state
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in presets.split(","):
        result = remat(graph, Policy(name))
        est = estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)
        (folder / f"{name}.py").write_text(result.gm.code)
        rows[name] = {
            "est_peak_bytes": est.peak_bytes,
            "est_allocated_bytes": est.allocator().allocated_peak_bytes,
            "est_reserved_bytes": est.reserved_peak_bytes,
        }
    ops = Counter(
        (i.op, json.dumps([list(s) for s in i.shapes]), i.dtype)
        for i in graph.ops()
        if i.phase != "output"
    )
    meta = {
        "model": model,
        "dtype": dtype,
        "layers": n,
        "kernels": kernels,
        "torch": torch.__version__,
        "inputs": [[s.kind, s.fqn] for s in graph.inputs],
        "summary": {k: v for k, v in graph.summary().items() if k != "notes"},
        "presets": rows,
        "ops": [[op, shapes, dt, count] for (op, shapes, dt), count in sorted(ops.items())],
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
