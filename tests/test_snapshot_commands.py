"""Snapshots on the command line and around the GPU: `estimate --snapshot` read back by
`compare-snapshot` with zero differences, `bench gpu` everywhere but the GPU's recording
(which a CPU recorder stands in for), the explorer's measured line, and the basis every
step time states."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from snapshot_fixtures import cpu_recording, record_snapshot

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cli.benchmarks import bench_gpu, bench_gpu_paths
from workbench.cost.calibrate import measured_basis, time_basis
from workbench.cost.estimate import Estimator
from workbench.cost.measure import measure_graph
from workbench.cost.profiles import H100, H200
from workbench.cost.snapshot import META_KEY, load_snapshot
from workbench.decide.policy import Policy
from workbench.files import is_ours
from workbench.rewrite.remat import remat
from workbench.show.widgets import PolicyExplorer
from workbench.show.widgets.panels import metrics_panel

SMALL = ["--model", "llama3-debug", "--layers", "2", "--seq", "128"]


@pytest.fixture(scope="module")
def small() -> tuple[Workload, JointGraph]:
    workload = load_workload("llama3-debug", layers=2, seq=128)
    return workload, trace(workload, mode="real")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_estimate_snapshot_reads_back_through_compare_snapshot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "est.pickle"
    est = run_json(
        capsys, "estimate", *SMALL, "--policy", "full", "--profile", "h100", "--snapshot", str(out)
    )
    assert est["snapshot"] == str(out) and is_ours(out)
    assert est["time_basis"] == {"h100": time_basis([H100])["h100"]}
    # the run was traced in real mode on this CPU: its kernels are the CPU's
    report = run_json(
        capsys, "compare-snapshot", str(out), *SMALL, "--policy", "full", "--kernels", "cpu"
    )
    assert report["difference"] == {"allocated_peak_bytes": 0, "reserved_peak_bytes": 0}
    assert report["nodes_differing"] == 0 and report["snapshot"] == str(out)
    assert report["measured"]["allocated_peak_node"] == report["estimated"]["allocated_peak_node"]
    assert report["optimizer"] == "adamw" and report["policy"]["preset"] == "full"
    # without --kernels: the kernels the estimate's snapshot says its graph was traced with
    same = run_json(capsys, "compare-snapshot", str(out), *SMALL, "--policy", "full")
    assert same["kernels"] == "cpu" and same["nodes_differing"] == 0
    assert same["difference"] == {"allocated_peak_bytes": 0, "reserved_peak_bytes": 0}
    # metadata naming kernels that are none: one line naming the snapshot, not a trace
    data = pickle.loads(out.read_bytes())
    for bad in ("tpu", 5):
        data[META_KEY]["kernels"] = bad
        odd = tmp_path / f"odd-{bad}.pickle"
        odd.write_bytes(pickle.dumps(data))
        assert main(["compare-snapshot", str(odd), *SMALL, "--policy", "full"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.splitlines()) == 1
        assert f"snapshot {odd}: " in captured.err and "unknown kernel target" in captured.err
    # run again: the workbench's own file is replaced without --overwrite
    again = run_json(
        capsys, "estimate", *SMALL, "--policy", "full", "--profile", "h100", "--snapshot", str(out)
    )
    assert again["snapshot"] == str(out)
    # read as a person reads it
    argv = ["compare-snapshot", str(out), *SMALL, "--policy", "full", "--kernels", "cpu"]
    assert main([*argv, "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "allocated_peak_bytes" in text and "at_peak_bytes:" in text


def test_compare_snapshot_of_a_recorded_run_names_the_nodes_that_differ(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, small: tuple[Workload, JointGraph]
) -> None:
    """A run recorded under one policy, compared with the estimate of another: the peak and
    the nodes differ, and the largest differences come first."""
    _, graph = small
    data, _ = record_snapshot(remat(graph, Policy("none")).gm, graph.example_inputs or [])
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps(data))
    same = run_json(
        capsys,
        "compare-snapshot",
        str(path),
        *SMALL,
        "--policy",
        "none",
        "--optimizer",
        "none",
        "--kernels",
        "cpu",
    )
    assert same["nodes_differing"] == 0 and same["difference"]["allocated_peak_bytes"] == 0
    other = run_json(
        capsys,
        "compare-snapshot",
        str(path),
        *SMALL,
        "--policy",
        "full",
        "--optimizer",
        "none",
        "--top",
        "2",
        "--kernels",
        "cpu",
    )
    rows = other["node_differences"]
    assert other["nodes_differing"] > 2 and len(rows) == 2
    assert abs(rows[0]["difference_bytes"]) >= abs(rows[1]["difference_bytes"]) > 0
    assert other["difference"]["allocated_peak_bytes"] > 0  # the run kept every activation
    # traced with a GPU's kernels (fake mode's default), not the CPU's that ran: the frames'
    # lines name other nodes, so size and order match instead, and the note says why
    gpu = run_json(
        capsys, "compare-snapshot", str(path), *SMALL, "--policy", "none", "--optimizer", "none"
    )
    assert gpu["attribution"]["methods"]["generated_code"]["allocations"] == 0
    assert any("the graph that ran differs" in note for note in gpu["notes"])
    assert gpu["attribution"]["peak_fraction_attributed_to_nodes"] >= 0.95


def test_bench_gpu_records_compares_and_writes_each_preset(
    small: tuple[Workload, JointGraph], tmp_path: Path
) -> None:
    """Everything `bench gpu` does but the GPU's own recording, on the CPU."""
    workload, _ = small
    result = bench_gpu(
        lambda: workload,
        ["default", "full"],
        warmup=0,
        repeats=1,
        out=tmp_path,
        record=cpu_recording,
    )
    assert result["model"] == "llama3-debug" and result["device"] == "cpu"
    for row in result["presets"]:
        assert row["bitwise_equal"] is True
        assert row["time_basis"] == measured_basis("cpu", 1)
        assert row["step_seconds"] > 0 and row["tokens_per_second"] > 0
        paths = bench_gpu_paths(tmp_path, "llama3-debug", row["preset"])
        assert row["snapshot"] == str(paths["snapshot"]) and row["trace"] == str(paths["trace"])
        assert load_snapshot(paths["snapshot"]).trace(0) and is_ours(paths["trace"])
        comparison = row["snapshot_comparison"]
        assert comparison["difference"]["allocated_peak_bytes"] == 0
        assert comparison["nodes_differing"] == 0
        assert comparison["attribution"]["peak_fraction_attributed_to_nodes"] >= 0.95
    # again into the same folder: its own files are replaced
    again = bench_gpu(
        lambda: workload, ["default"], warmup=0, repeats=1, out=tmp_path, record=cpu_recording
    )
    assert again["presets"][0]["snapshot"] == result["presets"][0]["snapshot"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_gpu_without_cuda_checks_its_flags_then_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = run_json(capsys, "bench", "gpu", *SMALL, "--out", str(out))
    assert result["skipped"].startswith("no CUDA device") and result["presets"] == []
    assert not out.exists()  # nothing ran, nothing written
    assert bench_gpu(lambda: pytest.fail("loaded"), ["full"], warmup=0, repeats=1)["skipped"]


def test_the_explorer_draws_a_loaded_snapshot_beside_the_estimate(
    small: tuple[Workload, JointGraph], tmp_path: Path
) -> None:
    workload, graph = small
    explorer = PolicyExplorer(graph, "default", workload=workload, autosave=tmp_path / "p.json")
    data, _ = record_snapshot(remat(graph, Policy("default")).gm, graph.example_inputs or [])
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps(data))
    report = explorer.load_snapshot(path)
    assert report["nodes_differing"] == 0
    timeline = explorer.timeline
    assert len(timeline["measured"]) == len(timeline["values"])
    assert timeline["max"] >= max(timeline["measured"])
    assert "run.pickle" in timeline["measured_label"]
    assert "measured: run.pickle (default)" in explorer.message and " at " in explorer.message
    explorer.set_preset("full")  # the line stays, labelled with the policy it measured
    assert explorer.timeline["measured_label"] == timeline["measured_label"]
    assert explorer.metrics["time_basis"] == time_basis([H100])["h100"]


def test_step_times_state_their_basis(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, small: tuple[Workload, JointGraph]
) -> None:
    _, graph = small
    assert time_basis([H100, H200]) == {
        "h100": f"roofline at {H100.description}",
        "h200": f"roofline at {H200.description}",
    }
    # calibrated: the share of the roofline's op time measured, on the profile it replaces
    table = tmp_path / "times.json"
    mm = next(n for n in graph.gm.graph.nodes if "mm" in str(n.target))
    from workbench.cost.calibrate import node_key

    op, shapes = node_key(mm)  # type: ignore[misc]
    table.write_text(json.dumps([{"op": op, "input_shapes": shapes, "seconds": 1e-3}]))
    est = run_json(capsys, "estimate", *SMALL, "--profile", "h100,h200", "--calibrate", str(table))
    assert est["time_basis"]["h100"].startswith("calibrated: measured op times (")
    assert est["time_basis"]["h200"].startswith("roofline at NVIDIA H200")
    estimator = Estimator(graph, profiles=("h100",))
    metrics = metrics_panel(estimator.estimate(Policy("default")), "h100", estimator)
    assert metrics["time_basis"] == time_basis([H100])["h100"]
    measured = measure_graph(graph, repeats=2, warmup=0).to_json()
    assert measured["time_basis"] == "measured: median of 2 timed runs on cpu"
    solved = run_json(capsys, "solve", *SMALL, "--mode", "fake", "--budget-frac", "0.99")
    assert solved["time_basis"] == {"h100": time_basis([H100])["h100"]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_gpu_on_a_gpu(tmp_path: Path) -> None:
    """The GPU's own recording (`record_cuda_step`): a snapshot torch wrote, attributed by
    its generated-code frames. What the GPU holds beside the graph's tensors (cuBLAS's
    workspace, made in the first run) shows as unattributed: the figures are for a person
    to read, the test holds what must be."""
    workload = load_workload("llama3-debug", layers=2, seq=128, device="cuda")
    result = bench_gpu(lambda: workload, ["default"], warmup=1, repeats=2, out=tmp_path)
    (row,) = result["presets"]
    assert row["bitwise_equal"] and row["max_memory_allocated"] > 0
    assert json.loads(Path(row["trace"]).read_text())["traceEvents"]
    comparison = row["snapshot_comparison"]
    assert comparison["attribution"]["methods"]["generated_code"]["allocations"] > 100
    measured = comparison["measured"]["allocated_peak_bytes"]
    assert measured >= 0.9 * comparison["estimated"]["allocated_peak_bytes"]
    assert load_snapshot(row["snapshot"]).trace(torch.cuda.current_device())
