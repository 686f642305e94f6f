"""`python -m workbench`: JSON output that scripts can read, one-line errors, exit codes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.cost.measure import PEAK_COUNTS
from workbench.cost.profiles import get_profile

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
        capsys,
        "bench",
        "trace",
        "--model",
        "llama3-8b",
        "--mode",
        "fake",
        "--layers",
        "1",
        "--seq",
        "512",
        "--repeat",
        "2",
        "--json",
    )
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


ARGPARSE_ERRORS = [
    (
        ["trace", "--model", "llama3-debug", "--mode", "symbolic"],
        "trace: error: argument --mode: invalid choice: 'symbolic' (choose from 'real', 'fake')",
    ),
    (
        ["measure", "--model", "llama3-debug", "--device", "tpu"],
        "argument --device: invalid choice: 'tpu'",
    ),
    (
        ["estimate", "--model", "llama3-debug", "--optimizer", "adam"],
        "argument --optimizer: invalid choice: 'adam' (choose from 'adamw', 'sgd', 'none')",
    ),
    (
        ["solve", "--model", "llama3-debug", "--budget-frac", "0.5", "--budget-kind", "free"],
        "argument --budget-kind: invalid choice: 'free' (choose from 'allocated', 'reserved')",
    ),
    (
        ["floor", "--model", "llama3-debug", "--host-link", "fast"],
        "argument --host-link: invalid choice: 'fast' (choose from 'in-step', 'benchmark',",
    ),
    (["estimate"], "estimate: error: the following arguments are required: --model"),
    (["solve", "--model", "llama3-debug"], "one of the arguments --budget-bytes --budget-frac"),
    (
        ["estimate", "--model", "llama3-debug", "--polcy", "full"],
        "estimate: error: unrecognized arguments: --polcy full (close matches: --policy",
    ),
    (
        ["bench", "whatif", "--model", "llama3-debug", "--flips", "x"],
        "bench whatif: error: argument --flips: invalid int value: 'x'",
    ),
    (
        ["bench", "render", "--model", "llama3-debug", "--bogus"],
        "bench render: error: unrecognized arguments: --bogus",
    ),
    (["policy"], "required: subcommand (choose from explain)"),
    ([], "required: command (choose from trace, verify, export,"),
    (["nope"], "argument command: invalid choice: 'nope' (choose from 'trace'"),
]


@pytest.mark.parametrize(
    ("argv", "message"),
    ARGPARSE_ERRORS,
    ids=[" ".join(x for x in a if "llama3" not in x) or "-" for a, _ in ARGPARSE_ERRORS],
)
def test_argparse_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """What argparse refuses (a bad choice or value, a missing or unknown flag, no command)
    is one line on stderr naming it and what is valid, exit status 2, no usage block."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--json"] if argv else argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("python -m workbench")
    assert message in captured.err, captured.err


def test_python_dash_m_entry_point() -> None:
    """The real command line: a subprocess, as a script would call it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    ok = subprocess.run(
        [sys.executable, "-m", "workbench", "trace", "--model", "user_models:mlp", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["model"] == "user_models:mlp"
    bad = subprocess.run(
        [sys.executable, "-m", "workbench", "trace", "--model", "nope", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]


@pytest.mark.parametrize("policy", ["none", "eager", "full"])
def test_verify_json(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys,
        "verify",
        "--model",
        "llama3-debug",
        "--layers",
        "2",
        "--seq",
        "32",
        "--policy",
        policy,
        "--json",
    )
    assert {"bitwise_equal", "tagged_save", "tagged_recompute", "recomputed_nodes"} <= set(result)
    assert result["bitwise_equal"] is True and result["mismatched"] == []
    assert (result["recomputed_nodes"] > 0) == (policy != "none")
    assert result["policy"]["preset"] == policy


def test_verify_policy_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from workbench.decide.policy import Policy, Selector

    policy = Policy("default", [Selector("layers.*.feed_forward.w2::aten.mm.default", "recompute")])
    saved = policy.save(tmp_path / "p.json")
    result = run_json(
        capsys,
        "verify",
        "--model",
        "dsv3-debug",
        "--layers",
        "2",
        "--seq",
        "32",
        "--policy",
        str(saved),
        "--json",
    )
    assert result["bitwise_equal"] is True
    assert result["policy"]["selectors"][0]["action"] == "recompute"


@pytest.mark.parametrize("fmt", ["policy_fn", "graph_pass", "torchtitan", "json"])
def test_export_json(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys,
        "export",
        "--model",
        "llama3-debug",
        "--layers",
        "2",
        "--policy",
        "eager",
        "--format",
        fmt,
        "--json",
    )
    assert result["format"] == fmt and result["code"].strip()


def test_export_writes_a_file_and_never_overwrites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "policy_fn.py"
    argv = [
        "export",
        "--model",
        "llama3-debug",
        "--layers",
        "1",
        "--policy",
        "full",
        "--format",
        "policy_fn",
        "--out",
        str(out),
        "--json",
    ]
    result = run_json(capsys, *argv)
    # the file is the code after the workbench's mark, which lets a rerun replace it
    assert result["path"] == str(out) and out.read_text().endswith("\n" + result["code"])
    assert out.read_text().startswith("# written by sac-workbench")
    out.write_text("# my edits")
    assert main(argv) == 2
    assert out.read_text() == "# my edits"
    assert "exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "--model", "llama3-debug", "--policy", "fll"], "did you mean 'full'"),
        (["verify", "--model", "llama3-debug", "--policy", "nope.json"], "cannot read policy file"),
        (["verify", "--model", "llama3-debug", "--mode", "fake"], "use --mode real"),
        (["export", "--model", "llama3-debug", "--format", "yaml"], "unknown format 'yaml'"),
    ],
)
def test_policy_command_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_estimate_json(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys,
        "estimate",
        "--model",
        "llama3-debug",
        "--layers",
        "2",
        "--mode",
        "fake",
        "--policy",
        "eager",
        "--profile",
        "h100,h200",
        "--json",
    )
    assert {"peak_bytes", "peak_node", "saved_activation_bytes", "recompute_flops"} <= set(result)
    assert set(result["est_step_seconds"]) == {"h100", "h200"}
    assert result["recompute_flops"] > 0 and result["peak_bytes"] > 0
    assert "timeline" not in result


def test_estimate_json_with_offload(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys,
        "estimate",
        "--model",
        "llama3-debug",
        "--layers",
        "2",
        "--mode",
        "fake",
        "--policy",
        "offload",
        "--profile",
        "h100",
        "--json",
    )
    assert result["host_peak_bytes"] > 0 and result["offloaded_bytes"] >= result["host_peak_bytes"]
    rate = get_profile("h100").host_rate()  # the host link as measured in a step
    assert result["transfer_seconds"]["h100"] == pytest.approx(2 * result["offloaded_bytes"] / rate)
    assert 0 <= result["exposed_transfer_seconds"]["h100"] <= result["transfer_seconds"]["h100"]


def test_estimate_baselines_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`estimate --baselines`: the eager baselines beside the graph estimate, each with its
    allocated and reserved peak, the tracker's categories and the module at the peak."""
    result = run_json(
        capsys,
        "estimate",
        "--model",
        "llama3-debug",
        "--layers",
        "2",
        "--seq",
        "512",
        "--mode",
        "fake",
        "--fsdp",
        "2",
        "--tp",
        "2",
        "--profile",
        "h100",
        "--baselines",
        "--expandable-segments",
        "--json",
    )
    baselines = result["baselines"]
    assert [b["name"] for b in baselines] == ["no AC", "eager SAC", "eager full AC"]
    keys = {"peak_bytes", "reserved_peak_bytes", "peak_breakdown", "peak_module", "peak_phase"}
    for b in baselines:
        assert keys <= set(b) and b["tracker"] == "FSDPMemTracker" and b["kernels"] == "h100"
        # the tracker's categories, and cuBLAS's workspaces beside them on a GPU
        held = sum(b["peak_breakdown"].values()) + b["workspace_bytes"]
        assert held == b["peak_bytes"] <= b["reserved_peak_bytes"]
        assert b["module_peaks"] and b["allocator"]["segments"] >= 1
    assert baselines[2]["peak_bytes"] < baselines[1]["peak_bytes"] < baselines[0]["peak_bytes"]
    assert any("cudnn_attention" in n for n in result["notes"])


def test_estimate_baselines_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json the baselines are rows of the printed output, maps by their largest
    entries."""
    argv = [
        "estimate",
        "--model",
        "llama3-debug",
        "--layers",
        "1",
        "--seq",
        "64",
        "--mode",
        "fake",
        "--profile",
        "h100",
        "--baselines",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("baselines: 3 rows") :].splitlines()
    assert table[1].split()[:4] == ["name", "peak_bytes", "reserved_peak_bytes", "peak_module"]
    assert table[2].startswith("  no AC") and "MiB" in table[2] and "{" not in table[2]


def test_measure_json(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys,
        "measure",
        "--model",
        "llama3-debug",
        "--layers",
        "1",
        "--seq",
        "16",
        "--policy",
        "full",
        "--repeat",
        "1",
        "--baselines",
        "--json",
    )
    assert {"peak_bytes", "estimated_peak_bytes", "step_seconds", "tokens_per_second"} <= set(
        result
    )
    assert result["bitwise_equal"] is True and result["device"] == "cpu"
    assert [b["name"] for b in result["baselines"]] == ["no AC", "eager SAC (full)"]
    for b in result["baselines"]:  # torch's tracker beside each measured eager peak
        assert 0 < b["tracker_peak_bytes"] <= b["peak_bytes"] and b["tracker_peak_phase"]


def test_measure_says_what_its_two_peaks_count(capsys: pytest.CaptureFixture[str]) -> None:
    """Measured and estimated peak are the same bytes (on the CPU, device + host copies),
    in --json and in the text a person reads."""
    argv = [
        "measure",
        "--model",
        "llama3-debug",
        "--layers",
        "2",
        "--seq",
        "128",
        "--policy",
        "offload",
        "--repeat",
        "1",
        "--warmup",
        "0",
    ]
    result = run_json(capsys, *argv, "--json")
    assert result["peak_counts"] == PEAK_COUNTS["cpu"]
    device, host = result["estimated_device_peak_bytes"], result["estimated_host_peak_bytes"]
    assert host > 0 and device <= result["estimated_peak_bytes"] <= device + host
    assert abs(result["peak_bytes"] - result["estimated_peak_bytes"]) <= 0.03 * result["peak_bytes"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "device + host copies, which share the CPU's allocator" in text
    assert "estimated_device_peak_bytes" in text and "estimated_host_peak_bytes" in text


def test_bench_whatif_json(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(
        capsys,
        "bench",
        "whatif",
        "--model",
        "llama3-debug",
        "--layers",
        "2",
        "--flips",
        "4",
        "--full-path",
        "2",
        "--json",
    )
    assert {"whatif_p50_seconds", "full_path_seconds", "flips"} <= set(result)
    assert result["flips"] == 4 and result["full_path_runs"] == 2
    assert result["equal_to_full_path"] is True


@pytest.mark.parametrize(
    "pipeline", [[], ["--pp", "2", "--stage", "1", "--seq", "64"]], ids=["graph", "stage"]
)
def test_bench_click_json(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    pipeline: list[str],
) -> None:
    """Clicks through the explorer of one graph or of a pipelined job's stage, timed; the
    explorer autosaves into a folder of the benchmark's own, not the working folder, and
    starts from the policy given, whatever an earlier autosave there holds."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SAC_WORKBENCH_AUTOSAVE_DIR", raising=False)
    argv = ["bench", "click", "--model", "llama3-debug", "--layers", "4", "--flips", "5"]
    result = run_json(capsys, *argv, *pipeline, "--json")
    assert result["flips"] == 5 and result["passes"] == "workbench"
    assert result["click_p90_seconds"] >= result["click_p50_seconds"] > 0
    assert result["stage"] == (1 if pipeline else None)
    assert ("pipeline" in result) == bool(pipeline)
    assert list(tmp_path.iterdir()) == []
    assert "SAC_WORKBENCH_AUTOSAVE_DIR" not in os.environ


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan not installed: pip install -e '.[torchtitan]'",
)
def test_bench_click_under_graph_trainers_passes(capsys: pytest.CaptureFixture[str]) -> None:
    """A click on the job's own pass stack: graph trainer's passes replayed on indices."""
    argv = ["bench", "click", "--model", "torchtitan:llama3/debugmodel", "--seq", "64"]
    result = run_json(capsys, *argv, "--passes", "graph-trainer", "--flips", "3", "--json")
    assert result["passes"] == "graph-trainer" and result["flips"] == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["estimate", "--model", "llama3-debug", "--profile", "a100"], "unknown device profile"),
        (["bench", "whatif", "--model", "llama3-debug", "--flips", "0"], "--flips must be"),
        (["bench", "click", "--model", "llama3-debug", "--flips", "0"], "--flips must be"),
        (["bench", "click", "--model", "llama3-debug", "--seed", "-1"], "--seed must be"),
        (["bench", "click", "--model", "llama3-debug", "--stage", "1"], "--stage is not used"),
    ],
)
def test_estimate_command_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU error")
def test_measure_cuda_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["measure", "--model", "llama3-debug", "--device", "cuda", "--json"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug"])
def test_estimate_and_verify_report_the_same_saved_bytes(
    capsys: pytest.CaptureFixture[str], model: str
) -> None:
    size = ["--layers", "2", "--seq", "32"]
    for preset in ("none", "default", "eager", "full"):
        est = run_json(capsys, "estimate", "--model", model, *size, "--policy", preset, "--json")
        ver = run_json(capsys, "verify", "--model", model, *size, "--policy", preset, "--json")
        assert ver["bitwise_equal"]
        assert est["saved_activation_bytes"] == ver["saved_activation_bytes"] > 0, preset


def test_human_output_has_units_tables_and_short_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["estimate", "--model", "llama3-debug", "--layers", "1", "--seq", "16"]
    assert main([*argv, "--policy", "eager"]) == 0
    out = capsys.readouterr().out
    assert not out.startswith("{") and "peak_bytes" in out
    assert "MiB" in out and ("µs" in out or " ms" in out) and "tokens/s" in out
    assert max(len(line) for line in out.splitlines()) <= 200


def test_export_out_says_where_instead_of_printing_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ac.py"
    argv = [
        "export",
        "--model",
        "llama3-debug",
        "--layers",
        "1",
        "--policy",
        "eager",
        "--format",
        "policy_fn",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and str(out) in printed and "policy_fn export" in printed
    assert "def policy_fn" in out.read_text()


def test_docs_solve_example_is_feasible(llama_debug: tuple[object, object]) -> None:
    import re

    from workbench.cost.estimate import Estimator
    from workbench.decide.policy import Policy

    cli_doc = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    frac = float(re.search(r"solve --model llama3-debug --budget-frac ([\d.]+)", cli_doc)[1])
    estimator = Estimator(llama_debug[1], ["h100"])  # type: ignore[arg-type]
    full, none = (estimator.estimate(Policy(p)).peak_bytes for p in ("full", "none"))
    assert frac * none >= full, f"cli.md's --budget-frac {frac} is below full's {full / none:.2f}"
