"""Pack one rank's graph of a published run (`python -m workbench validate`'s rows) for a GPU
whose torch cannot trace it: the row's rematerialized graph as generated code, twice (as
it runs, and with the model's backward inputs returned, so that they are held until the
step ends, as `backward_inputs="held"` estimates), its inputs' shapes, its constants, and
the estimate's figures of each way the GPU will run it. `scripts/run_rank_graph.py` runs
it on one GPU, its collectives replaced by allocations of their outputs: the allocator's
own peaks for the row's very graph, beside the model's.

    python scripts/pack_rank_graph.py ROW OUT_DIR [--layers N] [--seq S] [--kernels cpu]
        [--expandable-segments row|on|off]
    python scripts/pack_rank_graph.py --refresh RECORDED.json ...

`--refresh` rewrites the estimate's figures in recorded GPU runs with today's, as
`scripts/pack_graphs.py --refresh` does for the model graphs' runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import fx

from workbench.capture.graph import JointGraph
from workbench.cost.allocator import AllocatorConfig
from workbench.cost.estimate import BackwardInputs, Estimator, OptimizerName, estimate_remat
from workbench.interop.published import PublishedRun, select_runs
from workbench.interop.validate import row_estimator, trace_run
from workbench.rewrite.remat import remat, returning

# how the GPU runs the packed code, each estimated the same way: the graph alone as its
# code frees values; its backward inputs held to the step's end; and with the optimizer's
# state allocated before the step (validate's own setting for a graph trainer's row)
VARIANTS: dict[str, tuple[BackwardInputs, OptimizerName]] = {
    "freed": ("freed", "none"),
    "held": ("held", "none"),
    "held-adamw": ("held", "adamw"),
}


def _inputs(gm: fx.GraphModule) -> list[dict[str, Any] | None]:
    """Each placeholder's tensor (shape, stride, dtype); None for one that is not a tensor
    (the device mesh a graph trainer's rank takes)."""
    specs: list[dict[str, Any] | None] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            specs.append(None)
            continue
        dtype = str(val.dtype).removeprefix("torch.")
        specs.append({"shape": list(val.shape), "stride": list(val.stride()), "dtype": dtype})
    return specs


def _constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensors the code reads as `self.NAME` (constants the trace lifted), real ones."""
    found = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, str(node.target))
        if isinstance(value, torch.Tensor):
            found[str(node.target)] = value.detach().clone()
    return found


def pack(
    run: PublishedRun,
    out: Path,
    layers: int | None,
    seq: int | None,
    kernels: str | None,
    expandable: bool | None = None,
) -> dict[str, Any]:
    """The row's graph packed into `out` (see the module's docstring); its meta.json. The
    GPU's allocator runs as the row's did unless `expandable` says otherwise; the variants'
    estimates follow it, `validate`'s figure is the row's own."""
    expandable = run.expandable_segments if expandable is None else expandable
    graph: JointGraph = trace_run(run, layers, seq, kernels)
    result = remat(graph, run.workbench_policy)
    allocator = AllocatorConfig(expandable_segments=expandable)
    figures: dict[str, dict[str, int]] = {}
    held: list[str] = []
    for variant, (backward_inputs, optimizer) in VARIANTS.items():
        estimator = Estimator(
            graph, [], optimizer, allocator=allocator, backward_inputs=backward_inputs
        )
        est = estimate_remat(graph, result, estimator)
        figures[variant] = {
            "est_allocated_bytes": est.allocator().allocated_peak_bytes,
            "est_reserved_bytes": est.reserved_peak_bytes,
            "est_optimizer_bytes": estimator.optimizer_bytes,
        }
        if backward_inputs == "held":
            held = estimator.backward_input_nodes(result.gm)
    validate_est = row_estimator(run, graph).estimate(run.workbench_policy)
    out.mkdir(parents=True, exist_ok=True)
    (out / "freed.py").write_text(result.gm.code)
    (out / "held.py").write_text(returning(result.gm, held).code)
    torch.save(_constants(result.gm), out / "constants.pt")
    meta = {
        "row": run.id,
        "layers": layers,
        "seq": seq or run.seq,
        "kernels": kernels or run.profile,
        "torch": torch.__version__,
        "expandable_segments": expandable,
        "published_gib": run.published_gib,
        "validate": {
            "allocated_bytes": validate_est.peak_bytes,
            "reserved_bytes": validate_est.reserved_peak_bytes,
            "backward_inputs": run.backward_inputs,
            "optimizer": run.optimizer,
        },
        "inputs": _inputs(result.gm),
        "param_inputs": [i for i, s in enumerate(graph.inputs) if s.kind == "param"],
        "held_outputs": len(held),
        "variants": figures,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def refresh(path: Path) -> None:
    """Today's estimates into a recorded run (`run_rank_graph.py`'s JSON) of the same row,
    shape and kernels, every measured figure left as recorded."""
    recorded: dict[str, Any] = json.loads(path.read_text())
    [run] = select_runs(recorded["row"])
    with tempfile.TemporaryDirectory() as folder:
        meta = pack(
            run,
            Path(folder),
            recorded["layers"],
            recorded["seq"],
            recorded["kernels"],
            recorded["expandable_segments"],
        )
    recorded["validate"] = meta["validate"]
    for row in recorded["variants"].values():
        row.update(meta["variants"][row["estimate_of"]])
    path.write_text(json.dumps(recorded, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--refresh"]:
        for recorded in sys.argv[2:]:
            refresh(Path(recorded))
        sys.exit()
    parser = argparse.ArgumentParser()
    parser.add_argument("row")
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--kernels", help="the kernels traced (default: the row's GPU's)")
    parser.add_argument(
        "--expandable-segments",
        choices=("row", "on", "off"),
        default="row",
        help="the GPU allocator's expandable segments (default: as the row ran)",
    )
    a = parser.parse_args()
    [row] = select_runs(a.row)
    expandable = {"row": None, "on": True, "off": False}[a.expandable_segments]
    pack(row, a.out, a.layers, a.seq, a.kernels, expandable)
