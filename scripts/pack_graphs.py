"""Pack the GPU-shaped graphs of a model, one per preset, for a GPU whose torch cannot trace
them (the lent device runs an older torch than the workbench's): each preset's
rematerialized graph as its generated code, with what the estimate says of it. On the GPU,
`scripts/run_graphs.py` runs each code as is and records the step; here,
`python -m workbench compare-snapshot` reads each snapshot against the same estimate.

    python scripts/pack_graphs.py MODEL DTYPE KERNELS PRESETS OUT_DIR [LAYERS]
    python scripts/pack_graphs.py --refresh RESULT.json ...

`--refresh` rewrites the `est_*` figures of recorded runs (`run_graphs.py`'s result.json) with
today's estimates of the same graphs, leaving every measured figure as recorded: what a
change that is meant to move the estimate does to the GPU fixtures, without a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.trace import trace
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY
from workbench.decide.policy import Policy
from workbench.rewrite.remat import RematResult, remat


def gpu_graph(model: str, dtype: str, kernels: str, layers: int | None) -> JointGraph:
    workload = load_workload(model, dtype=dtype, device="meta", layers=layers)
    return trace(workload, "fake", kernels=kernels)


def estimates(graph: JointGraph, presets: list[str]) -> dict[str, tuple[RematResult, dict]]:
    """Per preset its rematerialized graph and the estimate's figures of a run of it (no
    optimizer state: a graph run holds none)."""
    estimator = Estimator(graph, (), "none")
    rows = {}
    for name in presets:
        result = remat(graph, Policy(name))
        est = estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)
        rows[name] = (
            result,
            {
                "est_peak_bytes": est.peak_bytes,
                "est_allocated_bytes": est.allocator().allocated_peak_bytes,
                "est_reserved_bytes": est.reserved_peak_bytes,
            },
        )
    return rows


def pack(model: str, dtype: str, kernels: str, presets: str, out: str, layers: str = "") -> None:
    n = int(layers) if layers else None
    graph = gpu_graph(model, dtype, kernels, n)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, (result, figures) in estimates(graph, presets.split(",")).items():
        (folder / f"{name}.py").write_text(result.gm.code)
        rows[name] = figures
    meta = {
        "model": model,
        "dtype": dtype,
        "layers": n,
        "kernels": kernels,
        "torch": torch.__version__,
        "inputs": [[s.kind, s.fqn] for s in graph.inputs],
        "summary": {k: v for k, v in graph.summary().items() if k != "notes"},
        "presets": rows,
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def refresh(path: Path) -> None:
    """Today's estimates into a recorded run's result.json (its `pack`: model, dtype,
    kernels, layers)."""
    result: dict[str, Any] = json.loads(path.read_text())
    packed = result["pack"]
    graph = gpu_graph(packed["model"], packed["dtype"], packed["kernels"], packed["layers"])
    for name, (_, figures) in estimates(graph, list(result["presets"])).items():
        result["presets"][name].update(figures)
    path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--refresh"]:
        for recorded in sys.argv[2:]:
            refresh(Path(recorded))
    else:
        pack(*sys.argv[1:])
