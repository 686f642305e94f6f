"""The CLI with --pp: per-stage JSON from trace, estimate and solve; stage policy files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.decide.policy import Policy

DEBUG = ["--model", "llama3-debug", "--layers", "4", "--seq", "32", "--mode", "fake"]


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_reports_each_stage(capsys: pytest.CaptureFixture[str]) -> None:
    result = run(capsys, ["estimate", *DEBUG, "--pp", "2", "--pp-schedule", "Interleaved1F1B"])
    stages = result["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    assert all({"stage", "peak_bytes", "inflight_microbatches"} <= set(s) for s in stages)
    assert result["peak_bytes"] == max(s["peak_bytes"] for s in stages)
    assert result["pipeline"]["stage_ranks"] == [0, 1, 0, 1]
    assert result["pipeline"]["microbatches"] == 4  # one per stage by default
    assert result["time_basis"]["h100"].startswith("roofline at NVIDIA H100")


def test_trace_one_stage_or_all(capsys: pytest.CaptureFixture[str]) -> None:
    whole = run(capsys, ["trace", *DEBUG, "--pp", "2"])
    one = run(capsys, ["trace", *DEBUG, "--pp", "2", "--stage", "1"])
    assert [s["stage"]["stage"] for s in whole["stages"]] == [0, 1]
    assert one["stages"] == whole["stages"][1:]


def test_stage_policy_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A stages file gives each stage its own policy: recomputing everything on stage 1 only
    lowers stage 1's rank and leaves stage 0's figures as with no AC."""
    path = tmp_path / "stages.json"
    stages = {"1": Policy("full").to_json(), "default": Policy("none").to_json()}
    path.write_text(json.dumps({"stages": stages}))
    mixed = run(capsys, ["estimate", *DEBUG, "--pp", "2", "--policy", str(path)])
    none = run(capsys, ["estimate", *DEBUG, "--pp", "2", "--policy", "none"])
    full = run(capsys, ["estimate", *DEBUG, "--pp", "2", "--policy", "full"])
    own = ("peak_bytes", "inflight_microbatches", "microbatch_bytes", "recompute_flops")
    assert [mixed["stages"][0][k] for k in own] == [none["stages"][0][k] for k in own]
    assert mixed["stages"][1]["peak_bytes"] == full["stages"][1]["peak_bytes"]


def test_solve_per_stage_beside_one_policy(capsys: pytest.CaptureFixture[str]) -> None:
    # a fraction of the peak above the fixed bytes (cuBLAS's 64 MiB workspaces lead them here)
    result = run(capsys, ["solve", *DEBUG, "--pp", "2", "--budget-frac", "0.99"])
    assert result["feasible"] and result["peak_bytes"] <= result["budget_bytes"]
    assert len(result["policies"]) == 2
    one = result["one_policy"]
    assert result["est_tokens_per_second_per_gpu"] >= one["est_tokens_per_second_per_gpu"]
    assert result["time_basis"]["h100"].startswith("roofline at NVIDIA H100")
