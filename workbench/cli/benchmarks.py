"""Benchmarks: measured figures for tracing, the what-if, the explorer's click, rendering and a
GPU's memory.

Entry points: `bench_trace`, `bench_whatif`, `bench_click`, `bench_render`, `bench_toolkit`
and `bench_gpu` (with `bench_gpu_paths`, the files it writes); `python -m workbench bench ...`
prints them
(`workbench.cli.bench`; what offload buys is a search: `workbench.search.floor`).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import trace
from workbench.cost.attribution import compare_snapshot
from workbench.cost.calibrate import measured_basis
from workbench.cost.estimate import BackwardInputs, Estimate, Estimator, estimate_remat
from workbench.cost.measure import Recording, device_of
from workbench.cost.pass_stacks import PassStackEstimator, estimator_for
from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY
from workbench.cost.snapshot import parse_snapshot, write_snapshot
from workbench.decide.decider import Decisions, decide, flip
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.files import file_stem, write_file
from workbench.rewrite.remat import remat

if TYPE_CHECKING:
    from workbench.interop.toolkit import Tags
    from workbench.show.widgets.explorer import PolicyExplorer

__all__ = [
    "bench_toolkit",
    "bench_toolkit_rank",
    "bench_click",
    "bench_gpu",
    "bench_gpu_paths",
    "bench_render",
    "bench_trace",
    "bench_whatif",
    "percentile",
]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, so p90 is never below p50.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile([1.0, 2.0, 3.0, 4.0], 0.9)
    (2.0, 4.0)
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _load_average() -> float | None:
    """The one-minute load average at this moment (None where the OS has none), rounded."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def bench_trace(trace_once: Callable[[], tuple[JointGraph, float]], repeat: int) -> dict[str, Any]:
    """Median of `repeat` traces (each returns the graph and its seconds)."""
    times, summary = [], {}
    for _ in range(repeat):
        graph, seconds = trace_once()
        times.append(seconds)
        summary = graph.summary()
    return {
        "model": summary["model"],
        "mode": summary["mode"],
        "nodes": summary["nodes"],
        "world_size": summary["world_size"],
        "collectives": summary["collectives"],
        "seconds": round(statistics.median(times), 3),
        "all_seconds": [round(t, 3) for t in times],
        "cpu_count": os.cpu_count(),
    }


def bench_whatif(
    graph: JointGraph,
    policy: Policy,
    *,
    flips: int,
    full_path: int,
    seed: int,
    passes: str = "workbench",
) -> dict[str, Any]:
    """Random flips (save -> recompute -> offload where allowed) under a pass stack
    (`cost.pass_stacks.estimator_for`): the what-if's time per flip (flip, decide, the replay
    of the pass stack's passes, simulate) against the full path, and whether both gave equal
    figures. The full path: `workbench`, tag, torch's remat pass, simulate; `graph-trainer`,
    graph trainer's own passes run and their graph simulated (the what-if before it replayed
    them). Also the median time of each what-if stage, to say where the time goes, the flips
    whose node order ran the passes in place of the replay and the load average."""
    estimator = estimator_for(graph, passes)
    graph = estimator.graph  # graph-trainer: its cleaned graph
    decisions = decide(graph, policy)
    candidates = sorted(n for n, d in decisions.items() if not d.forced)
    rng = random.Random(seed)
    whatif, full, exact, fallbacks = [], [], True, 0
    stages: dict[str, list[float]] = {"decide": [], "replay": [], "simulate": []}
    load = _load_average()
    k = 0
    while k < flips:
        if not candidates:
            raise WorkbenchError(f"no node of {graph.model_name} can flip under this policy")
        node = rng.choice(candidates)
        start = time.perf_counter()
        try:
            policy = flip(graph, policy, node, all_layers=rng.random() < 0.5, decisions=decisions)
        except WorkbenchError:  # a save the rules keep (written in place): not a flip
            candidates.remove(node)
            continue
        decisions = decide(graph, policy)
        replayed = time.perf_counter()
        order = estimator.order_for(decisions, policy.offload)
        simulated = time.perf_counter()
        fast = estimator.simulate(order)
        end = time.perf_counter()
        whatif.append(end - start)
        stages["decide"].append(replayed - start)
        stages["replay"].append(simulated - replayed)
        stages["simulate"].append(end - simulated)
        fallbacks += isinstance(estimator, PassStackEstimator) and estimator.fallback is not None
        if k < full_path:
            start = time.perf_counter()
            slow = _full_path(estimator, decisions, policy)
            full.append(time.perf_counter() - start)
            exact = exact and fast == slow
        k += 1
    return {
        "model": graph.model_name,
        "passes": passes,
        "nodes": len(graph.gm.graph.nodes),
        "flips": flips,
        "whatif_p50_seconds": round(statistics.median(whatif), 4),
        "whatif_p90_seconds": round(percentile(whatif, 0.9), 4),
        "stage_p50_seconds": {k: round(statistics.median(v), 4) for k, v in stages.items()},
        "full_path_seconds": round(statistics.median(full), 3) if full else None,
        "full_path_runs": len(full),
        "equal_to_full_path": exact,
        "replay_fallbacks": fallbacks,
        "cpu_count": os.cpu_count(),
        "load_average": load,
    }


def bench_click(explorer: PolicyExplorer, flips: int, seed: int) -> dict[str, Any]:
    """Random clicks on the open graph's forward ops that may flip, through
    `PolicyExplorer.flip` (what the front end's click calls: decide, estimate, the view and
    figures it sends back): the time per click, p50 and p90, and the load average. A flip
    the rules refuse (a save they keep) is drawn again."""
    candidates = sorted(n for n, d in explorer.decisions.items() if not d.forced)
    rng = random.Random(seed)
    load = _load_average()
    clicks: list[float] = []
    while len(clicks) < flips:
        if not candidates:
            raise WorkbenchError(f"no node of {explorer.graph.model_name} can flip")
        name = rng.choice(candidates)
        start = time.perf_counter()
        try:
            explorer.flip(name)
        except WorkbenchError:  # a save the rules keep (written in place): not a click
            candidates.remove(name)
            continue
        clicks.append(time.perf_counter() - start)
    return {
        "model": explorer.graph.model_name,
        "stage": explorer.stage if explorer.stage >= 0 else None,
        "nodes": len(explorer.graph.gm.graph.nodes),
        "passes": explorer.model.passes,
        "flips": flips,
        "click_p50_seconds": round(statistics.median(clicks), 4),
        "click_p90_seconds": round(percentile(clicks, 0.9), 4),
        "cpu_count": os.cpu_count(),
        "load_average": load,
    }


def _full_path(estimator: Estimator, decisions: Decisions, policy: Policy) -> Estimate:
    """The figures of the graph the pass stack's own passes make: torch's remat pass and the
    workbench's offload pass, or graph trainer's passes (`PassStackEstimator`)."""
    if isinstance(estimator, PassStackEstimator):
        return estimator.simulate(estimator.passes_order(decisions, policy.offload))
    graph = estimator.graph
    return estimate_remat(graph, remat(graph, decisions, policy.offload), estimator)


def bench_render(graph: JointGraph, policy: Policy, repeat: int) -> dict[str, Any]:
    """Time the overview and one layer's view (build + `dot` layout to SVG), median of
    `repeat` runs; deciding is timed apart."""
    from workbench.show.viz import render_view

    start = time.perf_counter()
    decisions = decide(graph, policy)
    decide_seconds = time.perf_counter() - start
    layers = sorted({i.layer for i in graph.ops() if i.layer is not None})
    layer_view = f"layer:{layers[len(layers) // 2]}" if layers else "overview"
    result: dict[str, Any] = {"model": graph.model_name, "mode": graph.mode}
    for key, view_name in (("overview", "overview"), ("layer", layer_view)):
        times = []
        for _ in range(repeat):
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
        "decide_seconds": round(decide_seconds, 3),
        "cpu_count": os.cpu_count(),
    }


def _toolkit_rows(
    graph: JointGraph,
    tagged: dict[Any, Decisions],
    measure: Callable[[Any, BackwardInputs], tuple[int, dict[str, Any]]],
) -> list[dict[str, Any]]:
    """Per tags and backward (holding its inputs, as the toolkit did, or freeing them: FX's
    boxed codegen) the step `measure` runs, its peak beside the estimate of the same decisions
    on `graph`; `measure` returns the peak and the row's fields of its own."""
    calls: tuple[BackwardInputs, ...] = ("held", "freed")
    rows = []
    for tags, decisions in tagged.items():
        for backward_inputs in calls:
            start = time.perf_counter()
            measured, more = measure(tags, backward_inputs)
            estimator = Estimator(graph, (), optimizer="none", backward_inputs=backward_inputs)
            estimated = estimator.estimate(decisions).peak_bytes
            rows.append(
                {
                    "tags": tags,
                    "backward_inputs": backward_inputs,
                    "measured_peak_bytes": measured,
                    "estimated_peak_bytes": estimated,
                    "difference_bytes": measured - estimated,
                    "difference_pct": round(100 * (measured / estimated - 1), 3),
                    **more,
                    "seconds": round(time.perf_counter() - start, 2),
                }
            )
    return rows


def bench_toolkit(
    workload: Workload, graph: JointGraph, tags: Sequence[Tags] | None = None
) -> dict[str, Any]:
    """A compiler-toolkit step measured on the CPU beside the workbench's estimate of it
    (`workbench.interop.toolkit`): per tagging in `tags` (None: no AC and apply_sac's),
    the backward holding its inputs (as the toolkit ran it) or freeing them (FX's boxed
    codegen). `graph` is the workload's real-mode trace, whose joint graph the estimate
    walks."""
    from workbench.interop.toolkit import measure_toolkit_step, toolkit_decisions

    tagged = {name: toolkit_decisions(graph, name) for name in tags or ("none", "apply_sac")}

    def measure(tags: Tags, backward_inputs: BackwardInputs) -> tuple[int, dict[str, Any]]:
        return measure_toolkit_step(workload, tags, backward_inputs).peak_bytes, {}

    rows = _toolkit_rows(graph, tagged, measure)
    return {"model": graph.model_name, "device": "cpu", "rows": rows}


def bench_toolkit_rank(
    workload: Workload,
    graph: JointGraph,
    parallel: Parallel,
    tags: Sequence[Tags] | None = None,
) -> dict[str, Any]:
    """One rank of a sharded torchtitan job's compiler-toolkit step, run on fake tensors under
    torch's `MemTracker` (`workbench.interop.toolkit.track_toolkit_rank`: graph trainer's
    SimpleFSDP and TP, AOTAutograd's export, the default partitioner), beside the workbench's
    estimate of the same tags on `graph`, the workbench's trace of that rank for the same
    kernels. Per tagging in `tags` (None: all of them, no AC, keeping gathered weights as the
    toolkit's views kept them, the toolkit's apply_sac of 2026-02, graph trainer's
    apply_sac_pass of 2026-03 and torchtitan's eager SAC wrappers, as the default partitioner
    reads them), the backward holding or freeing its inputs. The measured peak adds cuBLAS's
    workspaces, which the estimate holds and no tensor does."""
    from workbench.cost.workspaces import gpu_workspaces
    from workbench.interop.toolkit import TOOLKIT_TAGS, toolkit_decisions, track_toolkit_rank

    kernels = str(graph.config["kernels"])
    tagged = {name: toolkit_decisions(graph, name) for name in tags or TOOLKIT_TAGS}
    workspaces = sum(gpu_workspaces(kernels))

    def measure(tags: Tags, backward_inputs: BackwardInputs) -> tuple[int, dict[str, Any]]:
        tracked = track_toolkit_rank(workload, parallel, tags, backward_inputs, kernels)
        return tracked.peak_bytes + workspaces, {"measured_phase": tracked.peak_phase}

    return {
        "model": graph.model_name,
        "device": "fake",
        "kernels": kernels,
        "parallel": parallel.to_json(),
        "tracker": "MemTracker",
        "workspace_bytes": workspaces,
        "rows": _toolkit_rows(graph, tagged, measure),
    }


def bench_gpu(
    load: Callable[[], Workload],
    presets: list[str],
    *,
    warmup: int,
    repeats: int,
    out: Path | None = None,
    overwrite: bool = False,
    record: Callable[[Callable[[], Any], Sequence[Any]], Recording] | None = None,
    files_named: str | None = None,
) -> dict[str, Any]:
    """Per preset on a CUDA device: the rematerialized graph's step timed (`measure_graph`:
    step time, tokens/s), run once more recording its memory (`record`, by default
    `record_cuda_step`: a memory snapshot, `max_memory_allocated` / `max_memory_reserved`,
    a torch.profiler Chrome trace), its loss and gradients checked bitwise against an eager
    step, and its snapshot compared with the estimate op by op (`compare_snapshot`). With
    `out`, each preset's snapshot and trace are written there (`bench_gpu_paths`, named
    after `files_named`, by default the model's name). Without CUDA (and no
    `record`): says so and runs nothing. `load` builds the workload on the device (called
    once, after the check); `record` replaces the GPU's recording (tests on the CPU)."""
    import torch

    from workbench.cost.measure import record_cuda_step

    if record is None and not torch.cuda.is_available():
        return {"skipped": "no CUDA device here: bench gpu measures on one", "presets": []}
    workload = load()
    graph = trace(workload, mode="real")
    estimator = Estimator(graph, profiles=(), optimizer="none")  # a graph run holds none
    rows = [
        _bench_preset(
            graph,
            workload,
            estimator,
            name,
            record or record_cuda_step,
            _Runs(warmup, repeats, out, overwrite, files_named or graph.model_name),
        )
        for name in presets
    ]
    device = device_of(graph.example_inputs or [])
    return {
        "model": graph.model_name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "presets": rows,
    }


class _Runs(NamedTuple):
    warmup: int
    repeats: int
    out: Path | None
    overwrite: bool
    name: str


def bench_gpu_paths(out: Path, model: str, preset: str) -> dict[str, Path]:
    """Where `bench gpu` writes a preset's memory snapshot and Chrome trace in `out`.

    >>> sorted(str(p) for p in bench_gpu_paths(Path("o"), "torchtitan:llama3/8B", "full").values())
    ['o/torchtitan:llama3_8B.full.snapshot.pickle', 'o/torchtitan:llama3_8B.full.trace.json']
    """
    stem = f"{file_stem(model)}.{preset}"
    return {"snapshot": out / f"{stem}.snapshot.pickle", "trace": out / f"{stem}.trace.json"}


def _bench_preset(
    graph: JointGraph,
    workload: Workload,
    estimator: Estimator,
    name: str,
    record: Callable[[Callable[[], Any], Sequence[Any]], Recording],
    runs: _Runs,
) -> dict[str, Any]:
    import torch

    from workbench.cost.measure import bitwise_mismatches, measure_graph

    result = remat(graph, Policy(name))
    est = estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)
    inputs = graph.example_inputs or []
    if device_of(inputs).type == "cuda":
        torch.cuda.empty_cache()  # each preset starts from the inputs' segments alone
    measured = measure_graph(graph, result.gm, name=name, warmup=runs.warmup, repeats=runs.repeats)
    measured.outputs = []  # its last run's loss and gradients: not held through the recording

    def run() -> list[Any]:
        with torch.no_grad():
            return list(result.gm(*inputs))

    recording = record(run, inputs)
    mismatched = bitwise_mismatches(graph, result.gm, workload)
    snapshot = parse_snapshot(recording.snapshot, f"the snapshot of {name}")
    comparison = compare_snapshot(snapshot, estimator, est, gm=result.gm).to_json()
    written = {}
    if runs.out is not None:
        paths = bench_gpu_paths(runs.out, runs.name, name)
        written["snapshot"] = str(
            write_snapshot(paths["snapshot"], recording.snapshot, overwrite=runs.overwrite)
        )
        written["trace"] = str(
            write_file(paths["trace"], recording.chrome_trace, overwrite=runs.overwrite)
        )
    return {
        "preset": name,
        "est_peak_bytes": est.peak_bytes,  # the graph's tensors at 512-byte rounding
        # torch counts a block whole, with a remainder too small to split off
        "est_allocated_bytes": est.allocator().allocated_peak_bytes,
        "max_memory_allocated": recording.max_allocated,
        "est_reserved_bytes": est.reserved_peak_bytes,
        "max_memory_reserved": recording.max_reserved,
        "step_seconds": measured.step_seconds,
        "tokens_per_second": measured.tokens_per_second,
        "time_basis": measured_basis(measured.device, len(measured.all_seconds)),
        "bitwise_equal": not mismatched,
        "mismatched": mismatched,
        **written,
        "snapshot_comparison": {k: v for k, v in comparison.items() if k != "snapshot"},
    }
