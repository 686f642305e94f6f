"""Benchmarks: measured figures for tracing, the what-if, rendering and a GPU's memory.

Entry points: `bench_trace`, `bench_whatif`, `bench_render` and `bench_gpu`; `python -m
workbench bench ...` prints them (what offload buys is a search: `workbench.search.floor`).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.trace import trace
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.decide.decider import decide, flip
from workbench.decide.policy import Policy
from workbench.rewrite.remat import remat

__all__ = ["bench_gpu", "bench_render", "bench_trace", "bench_whatif", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, so p90 is never below p50.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile([1.0, 2.0, 3.0, 4.0], 0.9)
    (2.0, 4.0)
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


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
    graph: JointGraph, policy: Policy, *, flips: int, full_path: int, seed: int
) -> dict[str, Any]:
    """Random flips (save -> recompute -> offload where allowed): the what-if's time per
    flip (flip, decide, replay with the offload steps, simulate) against
    the full path (tag, torch's remat pass, simulate), and whether both gave equal figures.
    Also the median time of each what-if stage, to say where the time goes."""
    estimator = Estimator(graph)
    decisions = decide(graph, policy)
    candidates = sorted(n for n, d in decisions.items() if not d.forced)
    rng = random.Random(seed)
    whatif, full, exact = [], [], True
    stages: dict[str, list[float]] = {"decide": [], "replay": [], "simulate": []}
    for k in range(flips):
        node = rng.choice(candidates)
        start = time.perf_counter()
        policy = flip(graph, policy, node, all_layers=rng.random() < 0.5, decisions=decisions)
        decisions = decide(graph, policy)
        replayed = time.perf_counter()
        schedule = estimator.schedule_for(decisions, policy.offload)
        simulated = time.perf_counter()
        fast = estimator.simulate(schedule)
        end = time.perf_counter()
        whatif.append(end - start)
        stages["decide"].append(replayed - start)
        stages["replay"].append(simulated - replayed)
        stages["simulate"].append(end - simulated)
        if k < full_path:
            start = time.perf_counter()
            slow = estimate_remat(graph, remat(graph, decisions, policy.offload), estimator)
            full.append(time.perf_counter() - start)
            exact = exact and fast == slow
    return {
        "model": graph.model_name,
        "nodes": len(graph.gm.graph.nodes),
        "flips": flips,
        "whatif_p50_seconds": round(statistics.median(whatif), 4),
        "whatif_p90_seconds": round(percentile(whatif, 0.9), 4),
        "stage_p50_seconds": {k: round(statistics.median(v), 4) for k, v in stages.items()},
        "full_path_seconds": round(statistics.median(full), 3) if full else None,
        "full_path_runs": len(full),
        "equal_to_full_path": exact,
        "cpu_count": os.cpu_count(),
    }


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


def bench_gpu(
    load: Callable[[], Workload], presets: list[str], *, warmup: int, repeats: int
) -> dict[str, Any]:
    """Per preset on a CUDA device: the estimate (allocated at torch's 512-byte rounding, and
    the caching allocator model's reserved bytes) beside `torch.cuda.max_memory_allocated`
    and `max_memory_reserved` of the rematerialized graph's step, its tokens/s and whether
    loss and gradients match an eager step bitwise. Without CUDA: says so and runs nothing.
    `load` builds the workload on the GPU (called once, after the check)."""
    import torch

    from workbench.cost.measure import bitwise_mismatches, measure_graph
    from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device here: bench gpu measures on one", "presets": []}
    workload = load()
    graph = trace(workload, mode="real")
    estimator = Estimator(graph, profiles=(), optimizer="none")  # a graph run holds none
    rows = []
    for name in presets:
        result = remat(graph, Policy(name))
        est = estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)
        torch.cuda.empty_cache()  # each preset starts from the inputs' segments alone
        measured = measure_graph(graph, result.gm, name=name, warmup=warmup, repeats=repeats)
        reserved = torch.cuda.max_memory_reserved()  # since measure_run's peak reset
        mismatched = bitwise_mismatches(graph, result.gm, workload)
        rows.append({
            "preset": name,
            "est_peak_bytes": est.peak_bytes,  # the graph's tensors at 512-byte rounding
            # torch counts a block whole, with a remainder too small to split off
            "est_allocated_bytes": est.allocator().allocated_peak_bytes,
            "max_memory_allocated": measured.peak_bytes,
            "est_reserved_bytes": est.reserved_peak_bytes,
            "max_memory_reserved": reserved,
            "tokens_per_second": measured.tokens_per_second,
            "bitwise_equal": not mismatched,
            "mismatched": mismatched,
        })  # fmt: skip
    return {
        "model": graph.model_name,
        "device": torch.cuda.get_device_name(),
        "presets": rows,
    }
