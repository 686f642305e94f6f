"""Benchmarks as functions: they report measured figures and check the what-if is exact."""

from __future__ import annotations

import doctest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import timed_trace
from workbench.cli import benchmarks as bench
from workbench.cli.benchmarks import bench_render, bench_trace, bench_whatif, percentile
from workbench.decide.policy import Policy


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 0.5) == 3.0 and percentile(values, 0.9) == 5.0
    assert percentile(values, 0.9) >= percentile(values, 0.5)
    assert doctest.testmod(bench).failed == 0


def test_bench_whatif_is_exact_and_splits_its_time(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    _, graph = small_graphs["llama3-debug"]
    result = bench_whatif(graph, Policy("eager"), flips=4, full_path=2, seed=1)
    assert result["equal_to_full_path"] is True and result["full_path_runs"] == 2
    assert result["whatif_p90_seconds"] >= result["whatif_p50_seconds"] > 0
    assert set(result["stage_p50_seconds"]) == {"decide", "replay", "simulate"}


def test_bench_trace_and_render() -> None:
    workload = load_workload("llama3-debug", layers=1, seq=16)
    traced = bench_trace(lambda: timed_trace(workload, "fake"), repeat=2)
    assert traced["nodes"] > 0 and len(traced["all_seconds"]) == 2
    graph, _ = timed_trace(workload, "fake")
    drawn = bench_render(graph, Policy("default"), repeat=1)
    assert drawn["overview_nodes"] > 0 and drawn["layer_view"] == "layer:0"
