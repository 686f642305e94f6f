"""`python -m workbench`: JSON output that scripts can read, one-line errors, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli import main

TRACE_KEYS = {"model", "nodes", "forward_nodes", "backward_nodes", "seconds"}


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, "exactly one JSON object on stdout"
    return json.loads(out)


def test_trace_json(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "trace", "--model", "llama3-debug", "--layers", "2", "--json")
    assert TRACE_KEYS <= set(result)
    assert result["model"] == "llama3-debug" and result["mode"] == "real"
    assert result["layers"] == 2 and result["seconds"] > 0
    assert result["nodes"] > result["forward_nodes"] + result["backward_nodes"]


def test_trace_fake_bf16_with_shape_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys,
        "trace",
        "--model",
        "llama3-1b",
        "--mode",
        "fake",
        "--layers",
        "1",
        "--seq",
        "256",
        "--batch",
        "1",
        "--dtype",
        "bfloat16",
        "--json",
    )
    assert (result["mode"], result["seq"], result["batch"], result["dtype"]) == (
        "fake",
        256,
        1,
        "bfloat16",
    )
    assert result["tokens"] == 256


def test_trace_user_factory(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "trace", "--model", "user_models:mlp", "--layers", "3", "--json")
    assert result["model"] == "user_models:mlp"
    assert result["params"] == 2 * 3 + 2  # weight and bias of three blocks and the head


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--model", "user_models:mlp"]) == 0
    out = capsys.readouterr().out
    assert "backward_nodes" in out and not out.startswith("{")


def test_bench_trace_json(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys, "bench", "trace", "--model", "llama3-8b", "--mode", "fake", "--layers", "1",
        "--seq", "512", "--repeat", "2", "--json",
    )  # fmt: skip
    assert {"nodes", "seconds"} <= set(result)
    assert len(result["all_seconds"]) == 2 and result["seconds"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "--model", "gpt5"], "unknown model 'gpt5'"),
        (["trace", "--model", "llama3-debug", "--seq", "-4"], "seq must be a positive integer"),
        (["trace", "--model", "llama3-8b"], "trace it with --mode fake"),
        (["trace", "--model", "user_models:data_dependent"], "control flow depends on tensor"),
        (["trace", "--model", "nosuchpkg.mod:make"], "cannot load model factory"),
        (["bench", "trace", "--model", "user_models:mlp", "--repeat", "0"], "repeat must be"),
    ],
)
def test_errors_are_one_line_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert message in captured.err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "--model", "llama3-debug", "--mode", "symbolic"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'symbolic'" in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    """The real command line: a subprocess, as a script would call it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    ok = subprocess.run(
        [sys.executable, "-m", "workbench", "trace", "--model", "user_models:mlp", "--json"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["model"] == "user_models:mlp"
    bad = subprocess.run(
        [sys.executable, "-m", "workbench", "trace", "--model", "nope", "--json"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]
