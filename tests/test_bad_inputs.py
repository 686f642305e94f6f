"""Bad inputs on every path: each ends in exit code 2 with one line naming the problem, or
leaves the user's file untouched; nothing hangs, nothing prints a raw traceback.

Add a case here for every new input path (issue 17).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import multiprocessing
import os
import pickle
import random
import re
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from workbench.capture.ops import module_matches
from workbench.cli import args as cli_args
from workbench.cli import main
from workbench.decide import policy as policy_module
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.files import check_writable

HEAD = '{"schema": "sac-workbench/policy", '
MLP = ["--model", "user_models:mlp"]


def fails(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> str:
    """The command exits 2, prints nothing on stdout and one `error:` line matching."""
    assert main([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ") and re.search(message, lines[0]), lines[0]
    return lines[0]


# --- policy files ---------------------------------------------------------------------

POLICY_FILES: list[tuple[str, bytes, str]] = [
    ("not utf-8", b'\xff\xfe{"schema": 1}', r"is not UTF-8 text \(byte 0xff at offset 0\)"),
    ("nested too deep", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("number too long", HEAD.encode() + b'"version": 1' + b"0" * 5000 + b"}", "not a readable"),
    ("empty", b"", "is not valid JSON"),
    ("a list", b"[]", "a policy is a JSON object, got list"),
    ("version 0", HEAD.encode() + b'"version": 0}', r"from 1 to 3, got 0 \(int\)"),
    ("version -1", HEAD.encode() + b'"version": -1}', r"got -1 \(int\)"),
    ("version true", HEAD.encode() + b'"version": true}', r"got True \(bool\)"),
    ("version string", HEAD.encode() + b'"version": "1"}', r"got '1' \(str\)"),
    ("version float", HEAD.encode() + b'"version": 1.0}', r"got 1.0 \(float\)"),
    ("version NaN", HEAD.encode() + b'"version": NaN}', r"got nan \(float\)"),
    ("version missing", HEAD.encode() + b'"preset": "full"}', r"got None"),
    ("version newer", HEAD.encode() + b'"version": 4}', "version 4 is newer"),
    (
        "offload budget 0",
        HEAD.encode() + b'"version": 3, "offload": {"budget_bytes": 0}}',
        "budget_bytes 0 would offload nothing",
    ),
    (
        "offload in version 2",
        HEAD.encode() + b'"version": 2, "preset": "offload"}',
        "offload needs policy version 3",
    ),
    (
        "offload options not an object",
        HEAD.encode() + b'"version": 3, "offload": [1, 2]}',
        "offload must be an object with the fields budget_bytes",
    ),
    (
        "offload prefetch negative",
        HEAD.encode() + b'"version": 3, "offload": {"prefetch_layers": -1}}',
        "offload prefetch_layers -1 must be a whole number of layers >= 0",
    ),
    (
        "offload defer not a number",
        HEAD.encode() + b'"version": 3, "offload": {"defer_layers": "x"}}',
        "offload defer_layers 'x' must be a whole number of layers >= 0",
    ),
    ("preset int", HEAD.encode() + b'"version": 1, "preset": 3}', "preset 3 must be a string"),
    ("preset null", HEAD.encode() + b'"version": 1, "preset": null}', "preset None must be"),
    ("selectors str", HEAD.encode() + b'"version": 1, "selectors": "abc"}', "got str"),
    (
        "select int",
        HEAD.encode() + b'"version": 1, "selectors": [{"select": 3, "action": "save"}]}',
        "select must be a string",
    ),
    (
        "selector field missing",
        HEAD.encode() + b'"version": 1, "selectors": [{"select": "a::b"}]}',
        "exactly the fields 'select' and 'action'",
    ),
    (
        "selector extra field",
        HEAD.encode()
        + b'"version": 1, "selectors": [{"select": "a::b", "action": "save", "x": 1}]}',
        "exactly the fields",
    ),
    (
        "action list",
        HEAD.encode() + b'"version": 1, "selectors": [{"select": "a::b", "action": ["save"]}]}',
        r"action \['save'\] must be one of",
    ),
    (
        "selector too long",
        HEAD.encode()
        + b'"version": 1, "selectors": [{"select": "'
        + b"a" * 1000
        + b'::b", "action": "save"}]}',
        "a selector has at most 1000",
    ),
    (
        "too many selectors",
        HEAD.encode()
        + b'"version": 1, "selectors": ['
        + b", ".join([b'{"select": "a::b", "action": "save"}'] * 1001)
        + b"]}",
        "1001 selectors: a policy has at most 1000",
    ),
    ("overrides str", HEAD.encode() + b'"version": 1, "overrides": "ab"}', "got str"),
    ("overrides list", HEAD.encode() + b'"version": 1, "overrides": [1]}', "got list"),
    ("override int", HEAD.encode() + b'"version": 1, "overrides": {"k": 1}}', "1 must be one of"),
    (
        "fsdp_reshard in version 1",
        HEAD.encode() + b'"version": 1, "fsdp_reshard": false}',
        r"unknown policy fields \['fsdp_reshard'\]",
    ),
    (
        "fsdp_reshard string",
        HEAD.encode() + b'"version": 2, "fsdp_reshard": "no"}',
        "fsdp_reshard 'no' must be true",
    ),
]


@pytest.mark.parametrize(
    ("content", "message"), [c[1:] for c in POLICY_FILES], ids=[c[0] for c in POLICY_FILES]
)
def test_bad_policy_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "policy.json"
    path.write_bytes(content)
    line = fails(capsys, ["estimate", *MLP, "--mode", "fake", "--policy", str(path)], message)
    assert str(path) in line  # names the file
    assert path.read_bytes() == content


def test_policy_file_that_is_a_folder_or_too_big(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "policy.json"
    folder.mkdir()
    fails(capsys, ["estimate", *MLP, "--policy", str(folder)], "cannot read policy file")
    big = tmp_path / "big.json"
    big.write_text(json.dumps(Policy("full").to_json()))
    monkeypatch.setattr(policy_module, "MAX_POLICY_FILE_BYTES", 16)
    fails(capsys, ["estimate", *MLP, "--policy", str(big)], "is larger than 16 bytes")


def test_library_errors_blame_the_right_field() -> None:
    with pytest.raises(WorkbenchError, match="^preset 3 must be a string"):
        Policy(preset=3)  # type: ignore[arg-type]
    with pytest.raises(WorkbenchError, match="^override key 1 must be a string"):
        Policy(overrides={1: "save"})  # type: ignore[dict-item]


def test_keep_layers_names_the_missing_layers() -> None:
    from workbench.capture.models import load_workload
    from workbench.capture.stamp import keep_layers

    workload = load_workload("llama3-debug", layers=2, seq=16, batch=1, device="meta")
    with pytest.raises(
        WorkbenchError, match=r"^model 'llama3-debug' has no layers \['5'\] to keep"
    ):
        keep_layers(workload, [0, 5])


def test_picture_arguments_name_the_bad_value(small_graphs: dict[str, Any], tmp_path: Path) -> None:
    """How a picture is arranged or cropped (issue 27): each bad value a one-line error."""
    from workbench.decide.decider import decide
    from workbench.show.viz import diff, render_view
    from workbench.show.widgets import ExplorerModel

    graph = small_graphs["llama3-debug"][1]
    cases: list[tuple[Any, str]] = [
        (lambda: render_view(graph, None, "overview", aspect=0), "panel aspect .* must lie in"),
        (lambda: render_view(graph, None, "overview", aspect=float("nan")), "must lie in"),
        (lambda: render_view(graph, None, "layer:0", arrangement="up"), "unknown arrangement"),
        (lambda: render_view(graph, None, "overview", arrangement="TB/2"), "the overview is"),
    ]
    changed = diff(graph, decide(graph, Policy("default")), {}, ("a", "b"))
    cases += [
        (lambda: changed.render(graph, "layer:0", context=-1), "context must be 0 or more"),
        (lambda: changed.render(graph, "overview", context=1), "crops a layer or module"),
    ]
    for call, message in cases:
        with pytest.raises(WorkbenchError, match=message):
            call()
    model = ExplorerModel(graph, "default", autosave=tmp_path / "policy.json")
    for aspect in (-1, 1e308, float("nan"), "1.6", None):
        with pytest.raises(WorkbenchError, match="panel aspect"):
            model.set_graph_aspect(aspect)  # type: ignore[arg-type]


# --- model specs and models --------------------------------------------------------------

MODEL_SPECS: list[Any] = [
    ("", "unknown model ''; choose one of"),
    (":", "model spec ':' must be package.module:callable"),
    (":mlp", "must be package.module:callable"),
    ("bad_models:", "must be package.module:callable"),
    ("no_such_module_xyz:make", "cannot load model factory .*No module named"),
    ("bad_models:NOT_CALLABLE", "'bad_models:NOT_CALLABLE' is a int, not a callable"),
    ("bad_models:raises", "'bad_models:raises' failed: RuntimeError: weights not found"),
    ("bad_models:exits", r"'bad_models:exits' failed: it called sys.exit\(3\)"),
    ("os.path:join", r"'os.path:join' failed: TypeError: join\(\) missing"),
    ("bad_models:data_dependent_shape", "data-dependent shapes: aten.index.Tensor .*bad_models"),
    ("user_models:data_dependent", "control flow depends on tensor values"),
    ("torchtitan:nope", "must be torchtitan:FAMILY/FLAVOR"),
    *(
        pytest.param(
            f"torchtitan:{family}/debugmodel",
            f"torchtitan:{family} cannot be traced here: ",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("torchtitan") is None, reason="torchtitan not installed"
            ),
        )
        for family in ("gpt_oss", "flux", "qwen3_5")
    ),
    pytest.param(
        "torchtitan:llama3/nope",
        "unknown torchtitan llama3 flavor 'nope'; choose one of",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("torchtitan") is None, reason="torchtitan not installed"
        ),
    ),
]
_NO_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
# Issue 37: Hugging Face models, --dtype for factories, measure --blocks.
HF_FLAGS: list[Any] = [
    pytest.param(
        ["trace", "--model", "hf:nope"],
        "unknown Hugging Face model 'hf:nope'; choose one of hf:llama",
        marks=_NO_TRANSFORMERS,
    ),
    pytest.param(
        ["trace", "--model", "hf:vit", "--seq", "15"],
        "hf:vit: --seq counts image patches .* must be a square number",
        marks=_NO_TRANSFORMERS,
    ),
    (
        ["trace", "--model", "user_models:mlp_float32", "--dtype", "bfloat16"],
        "--dtype bfloat16: model factory 'user_models:mlp_float32' built float32 parameters",
    ),
    (
        ["measure", "--model", "user_models:mlp", "--blocks", "blocks", "--repeat", "1"],
        "--blocks names what eager SAC wraps: it goes with --baselines",
    ),
    (
        [
            "measure",
            "--model",
            "user_models:mlp",
            "--baselines",
            "--blocks",
            "nope",
            "--repeat",
            "1",
            "--policy",
            "full",
        ],
        "TinyMLP has no container of blocks at 'nope'",
    ),
]


@pytest.mark.parametrize(("argv", "message"), HF_FLAGS)
def test_bad_own_model_flags(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    fails(capsys, argv, message)


RUNS: list[tuple[list[str], str]] = [
    (
        ["verify", "--model", "bad_models:wrong_input_dtype"],
        "the graph of 'bad_models:wrong_input_dtype' failed when run for real: RuntimeError: "
        "mat1 and mat2 must have the same dtype",
    ),
    (
        ["measure", "--model", "bad_models:wrong_input_dtype", "--repeat", "1"],
        r"graph SAC \(default\) failed when run for real: RuntimeError: mat1 and mat2",
    ),
]


@pytest.mark.parametrize(("spec", "message"), MODEL_SPECS)
def test_bad_model_spec(capsys: pytest.CaptureFixture[str], spec: str, message: str) -> None:
    fails(capsys, ["trace", "--model", spec], message)


@pytest.mark.parametrize(("argv", "message"), RUNS, ids=[a[0] for a, _ in RUNS])
def test_model_failing_on_real_data(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    fails(capsys, argv, message)


# Flags added with per-rank graphs and torchtitan: each value refused in one line.
FLAGS: list[tuple[list[str], str]] = [
    (["--fsdp", "0"], r"parallel fsdp must be a whole number from 1 .*, got 0 \(int\)"),
    (["--tp", "-2"], r"parallel tp must be a whole number from 1 .*, got -2 \(int\)"),
    (["--tp", "3"], "--tp 3 does not divide the heads"),
]


# Sharding a torchtitan model through graph trainer's parallelize (issue 24): refused before
# anything is parallelized or traced.
TITAN = ["--mode", "fake", "--layers", "2", "--seq", "32"]
TITAN_FLAGS: list[tuple[list[str], str]] = [
    (["--model", "torchtitan:llama3/debugmodel", "--fsdp", "2", "--ep", "2"], "is a dense model"),
    (
        ["--model", "torchtitan:deepseek_v3/debugmodel", "--fsdp", "3", "--ep", "3"],
        "--ep 3 does not divide the 8 experts",
    ),
    (["--model", "torchtitan:qwen3/debugmodel_moe", "--ep", "2"], r"--ep 2 must divide fsdp x cp"),
    (
        ["--model", "torchtitan:llama3/debugmodel", "--tp", "3"],
        "--tp 3 does not divide the 16 heads",
    ),
    (
        ["--model", "torchtitan:llama3/debugmodel", "--cp", "2", "--kernels", "cpu"],
        "--cp 2 with the CPU's kernels",
    ),
    (
        ["--model", "torchtitan:kimi_k2_7/debugmodel", "--fsdp", "2"],
        "torchtitan kimi_k2_7 has no graph trainer parallelize",
    ),
    (
        [
            "--model",
            "torchtitan:qwen3/debugmodel_moe",
            "--fsdp",
            "2",
            "--ep",
            "2",
            "--ep-imbalance",
            "0.5",
        ],
        "--ep-imbalance must be a number from 1",
    ),
    (["--model", "llama3-debug", "--fsdp", "2", "--cp", "2"], "runs through graph trainer's"),
]

# Expert parallelism of the reference MoE: a degree that does not divide the routed experts
# or the fsdp x cp x tp ranks it borrows, or a dense model, each one line naming what is valid.
REFERENCE_EP_FLAGS: list[tuple[list[str], str]] = [
    (
        ["--model", "dsv3-debug", "--fsdp", "3", "--ep", "3"],
        r"--ep 3 does not divide the 8 routed experts of 'dsv3-debug'; choose an ep dividing "
        r"both 8 and fsdp x cp x tp = 3: 1$",
    ),
    (
        ["--model", "dsv3-debug", "--fsdp", "2", "--tp", "2", "--ep", "8"],
        r"--ep 8 must divide fsdp x cp x tp = 4 .*: choose one of 1, 2, 4, or",
    ),
    (["--model", "llama3-debug", "--fsdp", "2", "--ep", "2"], "has no routed experts"),
    (
        ["--model", "dsv3-debug", "--fsdp", "3", "--tp", "2", "--ep", "2"],
        r"--ep 2 leaves expert FSDP over 3 ranks .* does not divide dimension 0 \(4\)",
    ),
    (  # efsdp 6 x ep 2 > 8 experts: torchtitan's FSDP splits the experts' next dimension
        ["--model", "dsv3-debug", "--fsdp", "3", "--tp", "4", "--ep", "2"],
        r"--ep 2 leaves expert FSDP over 6 ranks .* does not divide dimension 1 \(256\)",
    ),
]


@pytest.mark.parametrize(
    ("flags", "message"), REFERENCE_EP_FLAGS, ids=[" ".join(f[1:]) for f, _ in REFERENCE_EP_FLAGS]
)
def test_bad_reference_ep_flags(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    fails(capsys, ["trace", *TITAN, *flags], message)


def test_verify_refuses_reference_ep_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "--model", "dsv3-debug", "--mode", "real", "--fsdp", "2", "--ep", "2"]
    fails(capsys, [*argv, "--policy", "full"], "verify with --ep 2: the reference MoE's")


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="no torchtitan")
@pytest.mark.parametrize(
    ("flags", "message"), TITAN_FLAGS, ids=[" ".join(f[1:]) for f, _ in TITAN_FLAGS]
)
def test_bad_titan_parallel_flags(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    fails(capsys, ["trace", *TITAN, *flags], message)


@pytest.mark.parametrize("extra", [["--policy", "full"], ["--random", "2"]])
def test_verify_refuses_graph_trainer_ranks(
    capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    argv = ["verify", "--model", "torchtitan:llama3/debugmodel", "--mode", "real", "--fsdp", "2"]
    fails(capsys, [*argv, *extra], "the gloo ranks of verify do not run yet")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rows", "pr2377"], r"unknown row 'pr2377'; choose from pr3429-dsv3-16b-default, "),
        (["--layers", "0"], r"--layers must be"),
    ],
)
def test_bad_validate_flags(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """`validate`: an unknown row names every valid id; overrides are checked before work."""
    fails(capsys, ["validate", *flags], message)


@pytest.mark.parametrize(("flags", "message"), FLAGS, ids=[" ".join(f) for f, _ in FLAGS])
def test_bad_parallel_flags(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    small = ["--model", "llama3-debug", "--mode", "fake", "--layers", "1", "--seq", "8"]
    fails(capsys, ["trace", *small, *flags], message)


BASELINE_FLAGS: list[tuple[list[str], str]] = [
    (["--pp", "2"], "^error: --baselines with --pp: eager baselines run a whole model's step"),
    (["--fsdp", "2", "--ep", "2"], "--baselines with --ep/--cp: eager baselines shard with FSDP2"),
    (["--fsdp", "2", "--mode", "real"], "in --mode real: a sharded job's eager baselines run on"),
    (["--model", "torchtitan:llama3/debugmodel", "--fsdp", "2"], "sharded by graph trainer's"),
    (["--max-split-size-mb", "4"], "--max-split-size-mb must be a whole number from 21 to"),
]


@pytest.mark.parametrize(
    ("flags", "message"), BASELINE_FLAGS, ids=[" ".join(f) for f, _ in BASELINE_FLAGS]
)
def test_estimate_baselines_refuses_what_it_cannot_run(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """`estimate --baselines` refuses before anything is traced (`check_baseline_args`)."""
    small = ["--model", "dsv3-debug", "--mode", "fake", "--layers", "2", "--seq", "16"]
    fails(capsys, ["estimate", *small, *flags, "--baselines"], message)


def test_unknown_torchtitan_version(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "export",
        "--model",
        "llama3-debug",
        "--layers",
        "1",
        "--seq",
        "8",
        "--format",
        "torchtitan",
        "--torchtitan-version",
        "9.9",
    ]
    fails(capsys, argv, "unknown torchtitan version '9.9'; choose one of 0.3.0")


def test_factory_output_never_corrupts_json(capfd: pytest.CaptureFixture[str]) -> None:
    """A factory's prints (Python or native) go to stderr; its sys.exit(0) is a failure, not an
    empty success. capfd: file descriptors 1 and 2 are what a shell would see."""
    assert main(["trace", "--model", "bad_models:prints", "--json"]) == 0
    captured = capfd.readouterr()
    assert json.loads(captured.out)["model"] == "bad_models:prints"
    assert captured.out.count("\n") == 1
    assert "hello from the factory" in captured.err and "native write" in captured.err
    assert main(["trace", "--model", "bad_models:exits_zero", "--json"]) == 2
    captured = capfd.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "error: model factory 'bad_models:exits_zero' failed: it called sys.exit(0)"
    ]


# --- sizes: fail fast, never run out of memory ---------------------------------------------

SIZES: list[tuple[list[str], str]] = [
    (["trace", "--model", "llama3-debug", "--mode", "fake", "--layers", "100000"], "layers must"),
    (["trace", "--model", "llama3-8b", "--mode", "fake", "--seq", str(10**20)], "seq must be at"),
    (["trace", "--model", "llama3-debug", "--batch", "0"], "batch must be a positive integer"),
    (
        [
            "trace",
            "--model",
            "llama3-debug",
            "--mode",
            "fake",
            "--batch",
            str(2**21),
            "--seq",
            str(2**20),
        ],
        "batch × seq must be at most",
    ),
    (
        [
            "trace",
            "--model",
            "llama3-debug",
            "--layers",
            "1",
            "--batch",
            str(2**20),
            "--seq",
            str(2**19),
        ],
        "needs at least .* GiB on cpu for parameters, gradients and token ids",
    ),
    (
        ["verify", "--model", "llama3-debug", "--layers", "1", "--batch", "4000", "--seq", "8192"],
        "estimated to need .* GiB at its peak",
    ),
    (
        ["measure", "--model", "llama3-debug", "--layers", "1", "--batch", "4000", "--seq", "8192"],
        "estimated to need .* GiB at its peak",
    ),
    (["solve", *MLP, "--budget-bytes", str(10**27)], r"to 9,223,372,036,854,775,807 \(int64\)"),
    (["solve", *MLP, "--budget-bytes", "-5"], "--budget-bytes must be a whole number from 1"),
    (["solve", *MLP, "--budget-frac", "nan"], r"--budget-frac must be in \(0, 1\]"),
    (
        ["solve", *MLP, "--budget-bytes", "100000", "--host-budget-bytes", "-1"],
        "--host-budget-bytes must be a whole number from 0 to .* \\(0: no offload",
    ),
    (["pareto", *MLP, "--host-budget-bytes", str(10**27)], "--host-budget-bytes must be a whole"),
    (["bench", "whatif", *MLP, "--full-path", "-1"], "--full-path must be a whole number from 0"),
    (
        ["measure", *MLP, "--repeat", "0"],
        r"--repeat must .* 1,000 \(each one is a timed run\), got 0",
    ),
    (["measure", *MLP, "--warmup", "-1"], "--warmup must be a whole number from 0 to 1,000"),
    (["estimate", *MLP, "--profile", ","], "--profile ',' names no device profile"),
    (["estimate", *MLP, "--calibrate", "/nonexistent/trace.json"], "--calibrate .*: no such"),
    (
        ["estimate", *MLP, "--prefetch", "-2"],
        "--prefetch: prefetch must be a whole number from 0 to",
    ),
    (
        ["estimate", *MLP, "--max-split-size-mb", "20"],
        r"--max-split-size-mb must be .* \(above torch.s 20 MiB",
    ),
    (["bench", "gpu", *MLP, "--presets", "fast"], "--presets 'fast': unknown fast; choose"),
    (["bench", "toolkit", *MLP, "--tags", "fast"], "--tags 'fast': fast; name some of none,"),
    (["bench", "toolkit", *MLP, "--tags", "eager_sac"], "--tags eager_sac wraps graph trainer"),
]


@pytest.mark.parametrize(
    ("argv", "message"), SIZES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in SIZES]
)
def test_sizes_refused_before_building(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    fails(capsys, argv, message)


SOLVER_FLAGS = [
    ("--host-budget-bytes", "-1"),
    ("--profile", "h900"),
    ("--method", "simplex"),
    ("--prefetch", "-1"),
    ("--max-split-size-mb", "10"),
    ("--max-copies-in-flight", "0"),
]


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        *((["floor"], flag, value) for flag, value in SOLVER_FLAGS),
        (["floor"], "--tolerance-bytes", "0"),
        *((["solve", "--budget-frac", "0.5"], flag, value) for flag, value in SOLVER_FLAGS),
        (["solve", "--budget-frac", "0.5"], "--objective", "memory"),
        *((["pareto"], flag, value) for flag, value in SOLVER_FLAGS),
    ],
)
def test_solver_commands_refuse_a_bad_flag_before_tracing(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    flag: str,
    value: str,
) -> None:
    """One check (`cli.args.solve_options_from_args`, on the library's own tests) for every
    command that runs the solver: the error names the flag and what is valid."""

    def no_trace(*args: object) -> None:
        raise AssertionError("traced before checking the flags")

    monkeypatch.setattr(cli_args, "timed_trace", no_trace)
    message = fails(capsys, [*command, *MLP, flag, value], f"^error: {re.escape(flag)}")
    if flag in ("--method", "--profile", "--objective"):
        assert "choose one of" in message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--random", "0"],
            "--random must be a whole number from 1 to 10,000 (each policy is a remat and a "
            "real run), got 0 (int)",
        ),
        (
            ["--random", "-3"],
            "--random must be a whole number from 1 to 10,000 (each policy is a remat and a "
            "real run), got -3 (int)",
        ),
        (["--random", "3", "--policy", "full"], "give --policy or --random N, not both"),
        (["--random", "3", "--fsdp", "2", "--tp", "2", "--policy", "full"], "not both"),
        (["--random", "3", "--mode", "fake"], "verify runs the graph: use --mode real"),
    ],
)
def test_verify_random_refuses_a_bad_flag_before_tracing(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    """`verify --random N [--seed S]`: each bad value ends in one line before any trace."""

    def no_trace(*args: object) -> None:
        raise AssertionError("traced before checking the flags")

    monkeypatch.setattr(cli_args, "timed_trace", no_trace)
    fails(capsys, ["verify", *MLP, *flags], re.escape(message))


@pytest.mark.parametrize(
    ("flags", "flag", "value"),
    [(["--random", "many"], "--random", "many"), (["--random", "3", "--seed", "x"], "--seed", "x")],
)
def test_verify_random_flags_take_whole_numbers(
    capsys: pytest.CaptureFixture[str], flags: list[str], flag: str, value: str
) -> None:
    """argparse's own refusal, in its one-line form (`PROG: error: ...`, exit 2)."""
    with pytest.raises(SystemExit) as exited:
        main(["verify", *MLP, *flags, "--json"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.rstrip().endswith(f"argument {flag}: invalid int value: '{value}'")


# --- output files: never clobbered, never through a dangling link ------------------------


@pytest.mark.parametrize("command", ["render", "export"])
def test_out_never_clobbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    existing = tmp_path / "mine.svg"
    existing.write_text("user's work")
    link = tmp_path / "link.svg"
    link.symlink_to(tmp_path / "elsewhere.svg")
    base = [command, *MLP, "--mode", "fake"]
    fails(
        capsys,
        [*base, "--out", str(existing)],
        r"exists and was not written by the workbench .*: pass overwrite=True \(--overwrite",
    )
    fails(capsys, [*base, "--out", str(link)], "link.svg' exists")
    fails(capsys, [*base, "--out", str(tmp_path / "no" / "x.svg")], "folder .* is missing")
    (tmp_path / "dir.svg").mkdir()
    fails(capsys, [*base, "--out", str(tmp_path / "dir.svg")], "it is a folder")
    fails(capsys, [*base, "--out", str(tmp_path / ("a" * 300 + ".svg"))], "File name too long$")
    assert existing.read_text() == "user's work"
    assert os.readlink(link) == str(tmp_path / "elsewhere.svg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.svg", "link.svg", "mine.svg"]
    assert main([*base, "--out", str(existing), "--overwrite", "--json"]) == 0
    assert existing.read_text() != "user's work"  # replaced only when asked


@pytest.mark.parametrize(
    ("command", "out", "flags"),
    [
        ("render", "o.svg", []),
        ("render", "o.png", []),
        ("render", "o.pdf", []),
        ("render", "o.dot", []),
        ("export", "p.py", []),
        ("export", "p.py", ["--format", "graph_pass"]),
        ("export", "p.sh", ["--format", "torchtitan"]),
        ("export", "p.json", ["--format", "json"]),
    ],
)
def test_rerun_replaces_the_workbench_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, out: str, flags: list[str]
) -> None:
    """A README command run twice: the second replaces the first's file (it carries the
    workbench's mark); a file of the user's own at that name is refused."""
    from workbench.files import is_ours

    argv = [command, *MLP, "--mode", "fake", *flags, "--out", str(tmp_path / out), "--json"]
    assert main(argv) == 0
    first = (tmp_path / out).read_bytes()
    assert main(argv) == 0 and is_ours(tmp_path / out)
    capsys.readouterr()
    (tmp_path / out).write_bytes(first + b"\n")  # edited by hand: the user's now
    fails(capsys, argv[:-1], "was changed since the workbench wrote it.*--overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == [out]


@pytest.mark.parametrize("command", ["render", "export"])
def test_out_checked_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A bad --out fails first: this factory would raise if it were called."""
    existing = tmp_path / "mine.svg"
    existing.write_text("user's work")
    argv = [command, "--model", "bad_models:raises", "--out", str(existing)]
    fails(capsys, argv, "mine.svg' exists")
    with pytest.raises(WorkbenchError, match="it is a folder"):
        check_writable(tmp_path, overwrite=True)
    check_writable(existing, overwrite=True)  # replacing is allowed when asked


def test_overwrite_never_replaces_a_device_or_pipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--overwrite` onto a named pipe (or /dev/full) would replace the node with a file."""
    pipe = tmp_path / "pipe.svg"
    os.mkfifo(pipe)
    base = ["render", *MLP, "--mode", "fake", "--overwrite", "--out"]
    fails(capsys, [*base, str(pipe)], "pipe.svg': it is a device, pipe or socket, not a file")
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe.svg"]


def test_policy_save_never_clobbers(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("user's work")
    with pytest.raises(WorkbenchError, match="exists"):
        Policy("full").save(path)
    assert path.read_text() == "user's work"


def _save(args: tuple[str, str]) -> bool:
    path, preset = args
    try:
        Policy(preset).save(path)
    except WorkbenchError:
        return False
    return True


def test_concurrent_saves_leave_one_whole_file_threads(tmp_path: Path) -> None:
    """Racing saves replace each other's (the workbench's own) file or lose the race to the
    hard link; the file is always one whole policy and no temporary file is left."""
    path = tmp_path / "p.json"
    presets = ["none", "full", "default", "eager"] * 4
    barrier = threading.Barrier(len(presets))
    results: list[bool] = []

    def save(preset: str) -> None:
        barrier.wait()
        results.append(_save((str(path), preset)))

    threads = [threading.Thread(target=save, args=(p,)) for p in presets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert any(results)
    assert Policy.load(path).preset in presets
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp files left


def test_concurrent_saves_leave_one_whole_file_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "p.json")
    presets = ["none", "full", "default", "eager"]
    with multiprocessing.get_context("fork").Pool(len(presets)) as pool:
        results = pool.map(_save, [(path, p) for p in presets])
    assert any(results)
    assert Policy.load(path).preset in presets
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


# --- results that must not mislead ----------------------------------------------------------


def test_verify_with_dropout_is_bitwise_equal(capsys: pytest.CaptureFixture[str]) -> None:
    """Graph and eager run from one generator state: dropout draws the same masks; a NaN
    loss compares bitwise, not by value."""
    model = ["--model", "bad_models:dropout", "--json"]
    for argv in (
        ["verify", *model, "--policy", "none"],
        ["verify", *model, "--policy", "full"],
        ["measure", *model, "--policy", "full", "--repeat", "1", "--warmup", "0"],
        ["verify", "--model", "bad_models:nan_weights", "--json"],
    ):
        assert main(argv) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["bitwise_equal"] is True and result["mismatched"] == []


def test_whatif_p90_never_below_p50(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "whatif", *MLP, "--flips", "2", "--full-path", "0", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["whatif_p90_seconds"] >= result["whatif_p50_seconds"]
    assert result["full_path_runs"] == 0


# --- no combinatorial matching ----------------------------------------------------------------


def _backtracking(pattern: list[str], parts: list[str]) -> bool:
    """The obvious recursive definition, as the reference for small cases."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_backtracking(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return (
        bool(parts)
        and fnmatch.fnmatchcase(parts[0], pattern[0])
        and _backtracking(pattern[1:], parts[1:])
    )


def test_module_matches_agrees_with_backtracking() -> None:
    rng = random.Random(0)
    words = ["**", "*", "layers", "l*", "0", "[01]", "?", "attention"]
    names = ["layers", "0", "1", "attention", "wo", "lm"]
    for _ in range(3000):
        pattern = [rng.choice(words) for _ in range(rng.randint(0, 5))]
        parts = [rng.choice(names) for _ in range(rng.randint(0, 5))]
        expected = _backtracking(pattern, parts)
        assert module_matches(".".join(pattern), ".".join(parts)) == expected, (pattern, parts)


def test_many_double_stars_cost_at_most_pattern_times_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0
    real = fnmatch.fnmatchcase

    def counting(name: str, pattern: str) -> bool:
        nonlocal calls
        calls += 1
        return real(name, pattern)

    monkeypatch.setattr(fnmatch, "fnmatchcase", counting)
    pattern = ".".join(["**", "x"] * 100 + ["nomatch"])
    module = ".".join(["x"] * 30)
    assert not module_matches(pattern, module)
    assert 0 < calls <= 101 * 30


def test_policy_file_of_double_stars_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    select = ".".join(["**"] * 150 + ["nomatch"]) + "::aten.mm.default"
    path = tmp_path / "stars.json"
    path.write_text(
        json.dumps({**Policy().to_json(), "selectors": [{"select": select, "action": "save"}]})
    )
    fails(capsys, ["estimate", *MLP, "--policy", str(path)], "no module matches")


# --- the second probe (issue 27), by class ------------------------------------------------
# Each class: several cases, one line and exit 2 on the command line (or the named exception
# in Python), nothing traced where the check can come first, files left as they were.

BIG = [str(2**63), str(2**64)]


def _no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced before checking the input")

    monkeypatch.setattr(cli_args, "timed_trace", refuse)


EXTREME_FLAGS: list[tuple[list[str], str]] = [
    *((["solve", *MLP, "--budget-bytes", v], "--budget-bytes must be a whole number") for v in BIG),
    (["solve", *MLP, "--budget-bytes", "0"], r"from 1 to 9,223,372,036,854,775,807 \(int64\)"),
    (["solve", *MLP, "--budget-frac", "0.5", "--host-budget-bytes", BIG[1]], "--host-budget"),
    (["pareto", *MLP, "--points", "0"], "--points must be a whole number from 2 to 1,000"),
    (["pareto", *MLP, "--points", BIG[1]], r"each point is a solve\), got 1844"),
    (["floor", *MLP, "--tolerance-bytes", "0"], "--tolerance-bytes must be"),
    (["floor", *MLP, "--tolerance-bytes", BIG[1]], "--tolerance-bytes must be"),
    (["bench", "whatif", *MLP, "--flips", BIG[0]], "--flips must be a whole number from 1"),
    (["bench", "whatif", *MLP, "--full-path", BIG[1]], "--full-path must be"),
    (["bench", "whatif", *MLP, "--seed", "-1"], "--seed must be a whole number from 0"),
    (["bench", "click", *MLP, "--flips", BIG[0]], "--flips must be a whole number from 1"),
    (["bench", "click", *MLP, "--seed", BIG[1]], "--seed must be a whole number from 0"),
    (["bench", "click", *MLP, "--passes", "torch"], "--passes"),
    (["bench", "trace", *MLP, "--repeat", BIG[1]], "--repeat must be a whole number"),
    (["measure", *MLP, "--repeat", BIG[0]], "--repeat must be a whole number from 1 to 1,000"),
    (["measure", *MLP, "--warmup", BIG[1]], "--warmup must be a whole number from 0"),
    (["verify", *MLP, "--random", BIG[1]], "--random must be a whole number from 1 to 10,000"),
    (["verify", *MLP, "--random", "1", "--seed", BIG[1]], "--seed must be a whole number"),
    (["trace", *MLP, "--fsdp", BIG[0]], r"parallel fsdp must be a whole number from 1 to"),
    (["trace", *MLP, "--tp", BIG[1]], "parallel tp must be a whole number"),
    (["trace", *MLP, "--fsdp", "1024", "--tp", "2048"], r"world size \(fsdp x cp x tp\) must be"),
    (["estimate", *MLP, "--fsdp", "0"], "parallel fsdp must be a whole number from 1"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "message"), EXTREME_FLAGS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in EXTREME_FLAGS]
)
def test_extreme_integer_flags_refused_before_tracing(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    _no_trace(monkeypatch)
    fails(capsys, argv, message)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("budget", [2**63 - 1, 2**62])
def test_budget_at_the_top_of_int64_is_a_correct_result(
    capsys: pytest.CaptureFixture[str], budget: int
) -> None:
    """Far above no AC's peak: nothing needs recomputing (was a TypeError in the repair)."""
    assert main(["solve", *MLP, "--budget-bytes", str(budget), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["recompute_flops"] == 0


EXTREME_FIELDS: list[tuple[str, bytes, str]] = [
    ("budget 2**63", b'"offload": {"budget_bytes": 9223372036854775808}', "budget_bytes must be"),
    ("budget 2**64", b'"offload": {"budget_bytes": 18446744073709551616}', r"\(int64"),
    ("prefetch 2**64", b'"offload": {"prefetch_layers": 18446744073709551616}', "prefetch_layers"),
    ("defer 2**63", b'"offload": {"defer_layers": 9223372036854775808}', "from 0 to 1,024"),
]


@pytest.mark.parametrize(
    ("field", "message"), [c[1:] for c in EXTREME_FIELDS], ids=[c[0] for c in EXTREME_FIELDS]
)
def test_extreme_integer_policy_fields(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    field: bytes,
    message: str,
) -> None:
    _no_trace(monkeypatch)
    path = tmp_path / "p.json"
    content = HEAD.encode() + b'"version": 3, "preset": "offload", ' + field + b"}"
    path.write_bytes(content)
    fails(capsys, ["estimate", *MLP, "--policy", str(path)], message)
    assert path.read_bytes() == content


@pytest.fixture(scope="module")
def mlp_graph() -> Any:
    from workbench.capture.models import load_workload
    from workbench.capture.trace import trace

    return trace(load_workload("user_models:mlp"), "fake")


def _api_cases() -> list[tuple[str, Any, type[BaseException], str]]:
    from workbench.capture.parallel import Parallel
    from workbench.cost.estimate import Estimator
    from workbench.search.pareto import pareto
    from workbench.search.solve import SolveOptions, solve

    def estimator(g: Any) -> Any:
        return Estimator(g, ("h100",))

    return [
        ("solve 2**64", lambda g: solve(g, 2**64), WorkbenchError, "budget_bytes must be"),
        ("solve 0", lambda g: solve(g, 0), WorkbenchError, "from 1 to"),
        ("solve str", lambda g: solve(g, "100"), WorkbenchError, r"got '100' \(str\)"),
        ("solve None", lambda g: solve(g, None), WorkbenchError, r"got None"),
        ("solve options", lambda g: solve(g, 10**6, "greedy"), TypeError, "options must be"),
        ("host 2**64", lambda g: SolveOptions(host_budget_bytes=2**64), WorkbenchError, "host"),
        ("pareto 2**64", lambda g: pareto(g, points=2**64), WorkbenchError, "points must be"),
        ("pareto budgets", lambda g: pareto(g, [2**64]), WorkbenchError, "budgets must be"),
        ("fsdp 2**63", lambda g: Parallel(fsdp=2**63), WorkbenchError, "parallel fsdp"),
        ("tp 0", lambda g: Parallel(tp=0), WorkbenchError, "parallel tp"),
        ("tp true", lambda g: Parallel(tp=True), WorkbenchError, r"\(bool\)"),
        ("estimate str", lambda g: estimator(g).estimate("full"), TypeError, "policy must be"),
        ("estimate None", lambda g: estimator(g).estimate(None), TypeError, "policy must be"),
        ("granularity 0", lambda g: estimator(g).estimate(Policy(), 0), WorkbenchError, "granul"),
        ("load None", lambda g: Policy.load(None), TypeError, "path must be"),
        ("load 3", lambda g: Policy.load(3), TypeError, "path must be"),
    ]


def _trace_cases() -> list[tuple[str, Any, type[BaseException], str]]:
    from workbench.capture.models import load_workload
    from workbench.capture.trace import trace

    return [
        ("trace str", lambda g: trace("user_models:mlp"), TypeError, "workload must be"),
        (
            "parallel str",
            lambda g: trace(load_workload("user_models:mlp"), "fake", "fsdp=2"),
            TypeError,
            "parallel must be None or a Parallel",
        ),
        (
            "parallel int",
            lambda g: trace(load_workload("user_models:mlp"), "fake", 2),
            TypeError,
            "parallel must be",
        ),
    ]


API_CASES = [c[0] for c in _api_cases() + _trace_cases()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", API_CASES)
def test_python_api_names_the_bad_argument(mlp_graph: Any, name: str) -> None:
    _, call, kind, message = next(c for c in _api_cases() + _trace_cases() if c[0] == name)
    with pytest.raises(kind, match=message) as raised:
        call(mlp_graph)
    assert type(raised.value) is kind  # never an AttributeError from inside


def _explorer_model(graph: Any, tmp_path: Path, **kwargs: Any) -> Any:
    from workbench.show.widgets.model import ExplorerModel

    return ExplorerModel(graph, autosave=kwargs.pop("autosave", tmp_path / "a.json"), **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "kind", "message"),
    [
        ({"policy": 3}, TypeError, "policy must be a preset name"),
        ({"policy": None}, TypeError, "policy must be a preset name"),
        ({"policy": "nope"}, WorkbenchError, "unknown preset 'nope'"),
        ({"autosave": 3}, TypeError, "autosave must be a file path"),
        ({"autosave": "/dev/zero"}, WorkbenchError, "is not a regular file"),
        ({"autosave": b"a.json"}, TypeError, "autosave must be a file path"),
        ({"passes": "inductor"}, WorkbenchError, "unknown pass stack 'inductor'"),
        ({"budget_kind": "free"}, WorkbenchError, "unknown budget kind 'free'"),
    ],
    ids=[
        "preset int",
        "preset None",
        "preset unknown",
        "autosave int",
        "autosave device",
        "autosave bytes",
        "passes unknown",
        "budget kind unknown",
    ],
)
def test_explorer_arguments(
    mlp_graph: Any, tmp_path: Path, kwargs: dict[str, Any], kind: type, message: str
) -> None:
    with pytest.raises(kind, match=message):
        _explorer_model(mlp_graph, tmp_path, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("call", "kind", "message"),
    [
        (lambda m: m.suggest(0), WorkbenchError, "budget_bytes must be a whole number from 1"),
        (lambda m: m.suggest(2**64), WorkbenchError, r"\(int64\), got 1844"),
        (lambda m: m.suggest("1e6"), WorkbenchError, r"got '1e6' \(str\)"),
        (lambda m: m.suggest(float("nan")), WorkbenchError, r"\(float\)"),
        (lambda m: m.search(3), TypeError, "query must be text"),
        (lambda m: m.search(None), TypeError, "query must be text"),
        (lambda m: m.sweep(2**64), WorkbenchError, "points must be"),
        (lambda m: m.set_host_budget(2**64), WorkbenchError, "host budget must be"),
        (lambda m: m.set_host_budget(-1), WorkbenchError, "host budget must be"),
    ],
    ids=[
        "suggest 0",
        "suggest 2**64",
        "suggest str",
        "suggest nan",
        "search int",
        "search None",
        "sweep 2**64",
        "host 2**64",
        "host -1",
    ],
)
def test_explorer_actions(
    mlp_graph: Any, tmp_path: Path, call: Any, kind: type, message: str
) -> None:
    model = _explorer_model(mlp_graph, tmp_path)
    before = model.policy
    with pytest.raises(kind, match=message):
        call(model)
    assert model.policy == before


# special files given as inputs: refused before they are opened, never read without bound


def _special(tmp_path: Path, kind: str) -> str:
    if kind == "fifo":
        os.mkfifo(tmp_path / "p.json")
        return str(tmp_path / "p.json")
    if kind == "folder":
        (tmp_path / "d.json").mkdir()
        return str(tmp_path / "d.json")
    return {"zero": "/dev/zero", "stdin": "/dev/stdin", "null": "/dev/null"}[kind]


SPECIAL = ["fifo", "folder", "zero", "stdin"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", SPECIAL)
def test_special_file_as_policy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    _no_trace(monkeypatch)
    path = _special(tmp_path, kind)
    fails(capsys, ["estimate", *MLP, "--policy", path], r"cannot read policy file .*: it is a")
    with pytest.raises(WorkbenchError, match="not a regular file"):
        Policy.load(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "folder", "zero", "null"])
def test_special_file_as_autosave(mlp_graph: Any, tmp_path: Path, kind: str) -> None:
    path = _special(tmp_path, kind)
    with pytest.raises(WorkbenchError, match="is not a regular file"):
        _explorer_model(mlp_graph, tmp_path, autosave=path)
    assert kind != "fifo" or stat.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", SPECIAL)
def test_special_file_as_calibration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    _no_trace(monkeypatch)
    path = _special(tmp_path, kind)
    fails(capsys, ["estimate", *MLP, "--calibrate", path], r"--calibrate .*: it is a")


@pytest.mark.timeout(30)
def test_special_file_as_profile_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A pipe where the CPU profile cache should be: measured again, the pipe left alone."""
    from workbench.cost import profiles

    os.mkfifo(tmp_path / "cache.json")
    monkeypatch.setattr(profiles, "_cache_path", lambda: tmp_path / "cache.json")
    monkeypatch.setattr(profiles, "measure_cpu_profile", lambda: profiles.get_profile("h100"))
    assert profiles.cpu_profile().name == "h100"
    assert stat.S_ISFIFO(os.lstat(tmp_path / "cache.json").st_mode)


def test_read_file_bounds_the_read(tmp_path: Path) -> None:
    from workbench.files import read_file

    path = tmp_path / "big"
    path.write_bytes(b"x" * 100)
    assert read_file(path, "it", 100) == b"x" * 100
    with pytest.raises(WorkbenchError, match="^it is larger than 99 bytes"):
        read_file(path, "it", 99)


# sharded verify: checked as trace checks, for fit and rank count, before any rank starts


def _no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.cost import ranks

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("spawned ranks before checking")

    monkeypatch.setattr(ranks, "check_ranks", refuse)


LLAMA = ["--model", "llama3-debug", "--layers", "1", "--seq", "8"]
RANK_CASES: list[tuple[list[str], str]] = [
    (["--fsdp", "1000"], r"1000 ranks \(fsdp 1000 x tp 1\) would be 1000 processes"),
    (["--fsdp", "64", "--tp", "64"], "the bitwise check runs at most 4 per core"),
    (["--fsdp", "2", "--tp", "3"], "--tp 3 does not divide the heads of 'llama3-debug'"),
    (["--tp", "5"], "--tp 5 does not divide"),
    (["--fsdp", "2", "--batch", "100000", "--seq", "8192"], "estimated to need .* GiB at its peak"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("flags", "message"), RANK_CASES, ids=[" ".join(f) for f, _ in RANK_CASES])
def test_sharded_verify_refuses_before_spawning(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    _no_ranks(monkeypatch)
    fails(capsys, ["verify", *LLAMA, *flags], message)


def test_sharded_verify_fit_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank is a process: their peaks add up against the machine's free memory."""
    from workbench.cost import measure

    _no_ranks(monkeypatch)
    monkeypatch.setattr(measure, "available_bytes", lambda device: 2**20)
    fails(capsys, ["verify", *LLAMA, "--fsdp", "2"], r"on 2 ranks \(each its own process\)")


def test_a_rank_error_is_one_line() -> None:
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from workbench.cost.ranks import _rank_error

    trace = "Traceback (most recent call last):\n  File x\nRuntimeError: boom in rank\n"
    assert _rank_error(ProcessRaisedException(trace, 1, 123)) == "RuntimeError: boom in rank"
    wrapped = "Traceback:\nworkbench.errors.WorkbenchError: the plan failed\n"
    assert _rank_error(ProcessRaisedException(wrapped, 0, 1)) == "the plan failed"
    exited = ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 2, 9)
    assert _rank_error(exited) == "process 1 terminated with signal SIGKILL"


# user factories


FACTORIES: list[tuple[list[str], str]] = [
    (["--model", "bad_models:tp_plan_wrong_type", "--tp", "2"], "plan of .* is a int: give a dict"),
    (
        ["--model", "bad_models:tp_plan_raises", "--tp", "2"],
        "failed: RuntimeError: plan ex",
    ),
    (
        ["--model", "bad_models:tp_plan_missing_module", "--tp", "2"],
        "names 'nope', which is no",
    ),
    (["--model", "bad_models:no_inputs"], "inputs must be the model's input tensors"),
    (["--model", "bad_models:interrupts"], r"interrupted \(KeyboardInterrupt\)"),
    (["--model", "bad_models:logs_then_fails"], "failed: RuntimeError: the model failed"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"), FACTORIES, ids=[f[1].split(":")[1] for f, _ in FACTORIES]
)
@pytest.mark.parametrize("command", ["trace", "verify"])
def test_bad_factories(
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    command: str,
    flags: list[str],
    message: str,
) -> None:
    """File descriptor 2 as a shell sees it: torch's own loggers (which hold the real stderr)
    print nothing before the one line; verify refuses before spawning its ranks."""
    _no_ranks(monkeypatch)
    assert main([command, *flags, "--mode", "real", "--json"]) == 2
    captured = capfd.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), captured.err


def test_broken_torchtitan_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    real = importlib.import_module

    def broken(name: str, *args: Any) -> Any:
        if name.startswith("torchtitan"):
            raise ImportError("No module named 'triton'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", broken)
    fails(
        capsys,
        ["trace", "--model", "torchtitan:llama3/debugmodel"],
        r"torchtitan models need torchtitan \(No module named 'triton'\)",
    )


def test_torch_logs_held_back_on_error_and_replayed_on_success(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import logging

    from workbench.errors import torch_logs_held

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    monkeypatch.setattr(logger, "handlers", [handler])
    with pytest.raises(RuntimeError), torch_logs_held():
        logger.error("dropped")
        raise RuntimeError
    with torch_logs_held():
        logger.error("kept")
        assert seen == []  # held while the block runs
    assert seen == ["kept"]
    assert logger.handlers == [handler]


# flags that were silently ignored


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["policy", "explain", "--policy", "full", "--fsdp", "2"], "--fsdp describe a model's"),
        (["policy", "explain", "--policy", "full", "--tp", "2"], "give --model too"),
        (["policy", "explain", "--policy", "full", "--layers", "2"], "--layers describe"),
        (["policy", "explain", "--policy", "full", "--mode", "fake"], "--mode describe"),
        (["activations", *LLAMA, "--mode", "fake", "--tp", "3"], "--tp 3 does not divide"),
        (["activations", *LLAMA, "--mode", "fake", "--fsdp", "0"], "parallel fsdp must be"),
    ],
)
def test_flags_not_ignored(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    fails(capsys, argv, message)


@pytest.mark.timeout(120)
def test_activations_honours_parallel_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["activations", *LLAMA, "--mode", "fake", "--json"]
    assert main(base) == 0
    single = json.loads(capsys.readouterr().out)["total"]
    assert main([*base, "--tp", "2"]) == 0
    rank = json.loads(capsys.readouterr().out)["total"]
    assert rank != single  # one rank's activations, not the whole model's


# results that misled


@pytest.mark.parametrize(
    ("content", "key"),
    [
        (HEAD + '"version": 1, "preset": "full", "preset": "none"}', "preset"),
        (HEAD + '"version": 1, "overrides": {"a": "save", "a": "recompute"}}', "a"),
        (HEAD + '"version": 3, "offload": {"defer_layers": 1, "defer_layers": 2}}', "defer_layers"),
    ],
    ids=["top level", "overrides", "offload"],
)
def test_duplicate_json_keys(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    key: str,
) -> None:
    _no_trace(monkeypatch)
    path = tmp_path / "dup.json"
    path.write_text(content)
    fails(capsys, ["estimate", *MLP, "--policy", str(path)], f"has the key '{key}' twice")


@pytest.mark.parametrize("budget", [1, 1000, 2**20 + 1, 5 * 2**30 + 3])
def test_torchtitan_export_keeps_a_small_offload_budget(budget: int) -> None:
    """Not rounded to 0 (torchtitan's "no limit"): its `budget_gb * 1024**3` is the budget."""
    from workbench.decide.offloadable import OffloadOptions
    from workbench.interop.torchtitan_options import _offload_options

    policy = Policy("offload", offload=OffloadOptions(budget_bytes=budget))
    flag = next(o for o in _offload_options(policy) if "budget_gb" in o)
    assert float(flag.split()[-1]) * 1024**3 == budget


def test_export_out_empty(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_trace(monkeypatch)
    fails(capsys, ["export", *MLP, "--out", ""], "the output path is empty")


@pytest.mark.timeout(120)
def test_verify_names_a_parameter_the_model_writes(capsys: pytest.CaptureFixture[str]) -> None:
    fails(
        capsys,
        ["verify", "--model", "bad_models:mutates_parameter"],
        "writes into lin.weight during the step .* cannot judge the policy",
    )


@pytest.mark.timeout(60)
def test_workload_name_with_a_slash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A model's name (`torchtitan:llama3/8B`, a user's `team/mlp`) names files in one folder:
    the autosave and export files stay beside each other, never in a missing sub-folder."""
    import torch

    from workbench.capture.models import Workload
    from workbench.capture.trace import trace
    from workbench.show.widgets.model import ExplorerModel

    monkeypatch.setenv("SAC_WORKBENCH_AUTOSAVE_DIR", str(tmp_path))
    workload = Workload(
        torch.nn.Linear(4, 2), torch.randn(3, 4), torch.randint(0, 2, (3,)), name="team/../mlp"
    )
    model = ExplorerModel(trace(workload, "fake"), "full")
    assert model.autosave.path.parent == tmp_path == model.exports.path.parent
    assert "/" not in model.autosave.path.name and "/" not in model.exports.path.name
    assert model.save_export(None).parent == tmp_path
    with pytest.raises(WorkbenchError, match="workload name must be a non-empty string"):
        Workload(torch.nn.Linear(4, 2), torch.randn(3, 4), name="")


@pytest.mark.timeout(180)
def test_an_error_inside_the_ranks_is_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    """Past the checks before spawning, a rank fails: one line on file descriptor 2 (no
    traceback, no torch "Terminating process" lines, from the parent or the ranks)."""
    assert main(["verify", "--model", "bad_models:fails_in_ranks", "--fsdp", "2", "--json"]) == 2
    captured = capfd.readouterr()
    assert captured.out == ""
    one_line = r"error: rank \d failed: model factory .* failed: RuntimeError: only in a rank\n"
    assert re.fullmatch(one_line, captured.err), captured.err


# `--passes`: an unknown pass stack, graph trainer's without torchtitan (both before tracing),
# and a pass failing inside graph trainer (named).
PASSES_ARGV = ["--model", "llama3-debug", "--layers", "1", "--seq", "8"]


@pytest.mark.parametrize(
    "command", [["activations"], ["estimate"], ["solve", "--budget-frac", "0.5"]], ids=str
)
def test_unknown_pass_stack(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    fails(
        capsys,
        [*command, *PASSES_ARGV, "--passes", "inductor"],
        "--passes: unknown pass stack 'inductor'; choose one of workbench, graph-trainer",
    )


def test_graph_trainer_passes_without_torchtitan(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torchtitan.experiments.graph_trainer.memory_policy", None)
    fails(
        capsys,
        ["estimate", *PASSES_ARGV, "--passes", "graph-trainer"],
        r"--passes: --passes graph-trainer runs torchtitan's graph trainer passes .* "
        r"pip install -e '\.\[torchtitan\]'",
    )


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="torchtitan not installed"
)
def test_a_pass_failing_inside_graph_trainer_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graph trainer's remat pass raising (as it does on a random op tagged for recompute):
    one line naming the pass and its first line."""
    remat = importlib.import_module(
        "torchtitan.experiments.graph_trainer.selective_activation_remat"
    )

    def refuses(gm: Any, example_inputs: Any = None) -> Any:
        raise RuntimeError("Activation checkpoint rematerialization does not support RNG ops\nmore")

    monkeypatch.setattr(remat, "selective_activation_remat_pass", refuses)
    fails(
        capsys,
        ["activations", *PASSES_ARGV, "--passes", "graph-trainer"],
        "graph trainer's selective_activation_remat_pass failed: Activation checkpoint "
        "rematerialization does not support RNG ops$",
    )


# `--ep-overlap`: graph trainer's EP-overlap passes run only in its pass stack (refused before
# tracing otherwise) and only on a graph with EP all-to-alls.
def test_ep_overlap_without_graph_trainers_pass_stack(capsys: pytest.CaptureFixture[str]) -> None:
    fails(
        capsys,
        ["estimate", *PASSES_ARGV, "--ep-overlap"],
        "--ep-overlap runs graph trainer's EP-overlap passes, which --passes workbench does "
        "not run: add --passes graph-trainer$",
    )


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="torchtitan not installed"
)
@pytest.mark.parametrize("command", ["activations", "estimate"])
def test_ep_overlap_on_a_graph_without_expert_parallelism(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    fails(
        capsys,
        [command, *PASSES_ARGV, "--passes", "graph-trainer", "--ep-overlap"],
        "EP overlap needs graph trainer's EP all-to-alls, and llama3-debug has none: trace an "
        "MoE torchtitan model with --ep 2 or more$",
    )


# --- pipeline schedules (issue 25) -----------------------------------------------------


def _schedule_cases() -> list[tuple[str, Any, str]]:
    from workbench.capture import pipeline as pl
    from workbench.cost.schedule import PhaseCost, StageCost, simulate

    names = "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble"
    phase = PhaseCost(1.0, 0, 10)
    one_backward = {"F": phase, "B": PhaseCost(1.0, 0, 0)}

    def costs(n: int, phases: dict[str, Any] = one_backward) -> dict[int, Any]:
        return {s: StageCost(s, 0, 0, phases) for s in range(n)}

    return [
        ("unknown schedule", lambda: pl.action_order("ZBV", 2, 4), f"schedules are {names}"),
        ("close schedule", lambda: pl.schedule_class("gpip"), "did you mean 'GPipe'"),
        ("schedule None", lambda: pl.schedule_class(None), "must be a name, one of GPipe"),
        ("1F1B too few", lambda: pl.check_microbatches("1F1B", 4, 2), r"number of stages \(4\)"),
        ("DualPipeV too few", lambda: pl.check_microbatches("DualPipeV", 2, 3), "at least as"),
        ("rounds", lambda: pl.check_microbatches("Interleaved1F1B", 2, 5), r"rounds \(2\)"),
        ("pp 0", lambda: pl.action_order("1F1B", 0, 4), "pp must be a whole number from 1"),
        ("pp True", lambda: pl.action_order("1F1B", True, 4), r"\(bool\)"),
        ("microbatches 0", lambda: pl.action_order("GPipe", 2, 0), "microbatches must be"),
        ("microbatches 2**64", lambda: pl.action_order("GPipe", 2, 2**64), "to 1,024"),
        ("rank out of range", lambda: pl.rank_stages("1F1B", 4, 4), r"from 0 to 3 \(pp is 4\)"),
        ("action text", lambda: pl.Action.from_str("4X3"), "not STAGE KIND MICROBATCH"),
        ("action comm", lambda: pl.Action.from_str("0SEND_F1"), "not a compute action"),
        (
            "no stage cost",
            lambda: simulate(pl.action_order("1F1B", 2, 2), costs(1)),
            r"no StageCost for stage 1 \(costs cover \[0\]\)",
        ),
        (
            "I on a B-only stage",
            lambda: simulate(pl.action_order("ZBVZeroBubble", 1, 1), costs(2)),
            "needs the backward split into I and W",
        ),
        ("phase bytes -1", lambda: PhaseCost(1.0, -1, 0), "peak_bytes must be a whole number"),
        ("phase seconds nan", lambda: PhaseCost(float("nan"), 0, 0), "seconds >= 0"),
        ("phase seconds inf", lambda: PhaseCost(float("inf"), 0, 0), "must be finite"),
        ("no backward", lambda: StageCost(0, 0, 0, {"F": phase}), "give F and B, or F, I and W"),
        ("B residue", lambda: StageCost(0, 0, 0, {"F": phase, "B": phase}), "leaves residue"),
        (
            "bandwidth 0",
            lambda: simulate(pl.action_order("1F1B", 2, 2), costs(2), 0.0),
            "bandwidth must be > 0",
        ),
        (
            "latency -1",
            lambda: simulate(pl.action_order("1F1B", 2, 2), costs(2), None, -1.0),
            "p2p latency must be",
        ),
        ("empty order", lambda: simulate({0: []}, costs(1)), "order holds no actions"),
        (
            "cost of another stage",
            lambda: simulate(pl.action_order("GPipe", 2, 1), {0: costs(2)[1], 1: costs(2)[1]}),
            r"costs\[0\] is the StageCost of stage 1",
        ),
        (
            "order with a gap",
            lambda: simulate(
                {0: [pl.Action.from_str(a) for a in ("0F0", "0B0", "0F2", "0B2")]}, costs(1)
            ),
            "stage 0 microbatch 1 runs nothing",
        ),
        (
            "order that hangs",
            lambda: simulate(
                {
                    0: [pl.Action.from_str(a) for a in ("0F0", "0B0", "0F1", "0B1")],
                    1: [pl.Action.from_str(a) for a in ("1F0", "1F1", "1B0", "1B1")],
                },
                costs(2),
            ),
            "deadlocks: rank 0 at 0B0, rank 1 at 1F1 wait forever",
        ),
    ]


SCHEDULE_CASES = [c[0] for c in _schedule_cases()]


@pytest.mark.parametrize("name", SCHEDULE_CASES)
def test_pipeline_schedule_inputs(name: str) -> None:
    _, call, message = next(c for c in _schedule_cases() if c[0] == name)
    with pytest.raises(WorkbenchError, match=message) as raised:
        call()
    assert "\n" not in str(raised.value)


# --- pipeline parallelism on the command line (--pp) ---------------------------------------

PP = ["estimate", "--model", "llama3-debug", "--layers", "4", "--seq", "32", "--mode", "fake"]
PIPELINE_FLAGS: list[tuple[list[str], str]] = [
    (["--pp", "0"], r"parallel pp must be a whole number from 1"),
    (["--pp", "8"], r"8 pipeline stages cannot split 4 layers .*at most 6 stages"),
    (["--pp", "4", "--layers-per-stage", "2"], r"3 virtual stages .*--pp 4 does not divide"),
    (["--pp", "3", "--layers-per-stage", "2", "--pp-schedule", "Interleaved1F1B"], "runs 2"),
    (["--pp", "2", "--pp-schedule", "Zigzag"], r"unknown pipeline schedule 'Zigzag'.*1F1B"),
    (["--pp", "2", "--microbatches", "1"], r"microbatches"),
    (["--pp", "2", "--microbatches", "2", "--batch", "3"], r"does not divide the batch of 3"),
    (["--pp", "2", "--stage", "2"], r"--stage must be .*0.*1"),
]


@pytest.mark.parametrize(
    ("flags", "message"), PIPELINE_FLAGS, ids=[" ".join(f) for f, _ in PIPELINE_FLAGS]
)
def test_bad_pipeline_flags(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    command = ["trace", *PP[1:]] if "--stage" in flags else PP
    fails(capsys, [*command, *flags], message)


def test_pipeline_of_torchtitan_models_takes_graph_pps_schedules(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """torchtitan models pipeline as graph trainer's graph_pp does: the default 1F1B, which it
    refuses, is refused in its words, with the schedules it runs."""
    fails(
        capsys,
        ["trace", "--model", "torchtitan:llama3/debugmodel", "--mode", "fake", "--pp", "2"],
        r"--pp-schedule 1F1B on torchtitan:llama3/debugmodel: graph trainer's graph_pp "
        r"refuses it .*choose Interleaved1F1B",
    )


# The explorer on a pipelined job (`StagesModel`, `PolicyExplorer.pipeline`): a stage out of
# range, a policy list of the wrong length, a bad budget or preset, a source and split that do
# not go together; each refused with one line, the stages' policies as they were.
@pytest.fixture(scope="module")
def pp_job() -> Any:
    from workbench.capture.models import load_workload
    from workbench.capture.stages import Pipeline, trace_stages

    pipeline = Pipeline(pp=2, microbatches=2)
    workload = load_workload("llama3-debug", layers=2, batch=2, seq=32, device="meta")
    return workload, pipeline, trace_stages(workload, "fake", None, pipeline)


def _pipeline_explorer(*args: Any) -> Any:
    from workbench.show.widgets import PolicyExplorer

    return PolicyExplorer.pipeline(*args)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("call", "kind", "message"),
    [
        (lambda m, job: m.open(2), WorkbenchError, r"--stage must be .* 0 to 1 .*, got 2"),
        (lambda m, job: m.open("1"), WorkbenchError, r"--stage must be .*got '1' \(str\)"),
        (lambda m, job: m.set_policy(0, "nope"), WorkbenchError, "unknown preset 'nope'"),
        (lambda m, job: m.set_policy(0, 3), TypeError, "policy must be a preset name"),
        (lambda m, job: m.set_budget(0), WorkbenchError, r"budget must be .* from 1"),
        (lambda m, job: m.flip(1, "no_such_op"), WorkbenchError, "no_such_op"),
        (
            lambda m, job: type(m)(job[2], m.layout, ["full"] * 3),
            WorkbenchError,
            r"one per stage \(2 stages\); got 3",
        ),
        (
            lambda m, job: type(m)(job[2][:1], m.layout),
            WorkbenchError,
            "a pipeline of 2 stages needs a graph per stage, got 1",
        ),
        (
            lambda m, job: _pipeline_explorer(job[0], m.layout),
            WorkbenchError,
            r"a workload is split by a Pipeline\(pp=...\), not a layout",
        ),
        (
            lambda m, job: _pipeline_explorer(job[2], job[1]),
            WorkbenchError,
            r"stage graphs come with their StageLayout",
        ),
    ],
    ids=[
        "stage out of range",
        "stage str",
        "preset unknown",
        "policy int",
        "budget 0",
        "op unknown",
        "policies 3 of 2",
        "graphs 1 of 2",
        "workload with a layout",
        "graphs with a pipeline",
    ],
)
def test_pipeline_explorer(
    pp_job: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    call: Any,
    kind: type,
    message: str,
) -> None:
    from workbench.show.widgets.stages import StagesModel

    monkeypatch.setenv("SAC_WORKBENCH_AUTOSAVE_DIR", str(tmp_path))
    workload, pipeline, graphs = pp_job
    model = StagesModel(graphs, pipeline.layout(2))
    before = list(model.policies)
    with pytest.raises(kind, match=message):
        call(model, pp_job)
    assert model.policies == before


# --- plan -------------------------------------------------------------------------------

PLAN = ["plan", "--model", "llama3-debug", "--layers", "2", "--seq", "32"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "0"], r"--gpus must be a whole number from 1"),
        (["--gpus", "-4"], r"--gpus must be a whole number from 1"),
        (["--gpus", "2", "--gpu", "a100"], r"unknown device profile 'a100'; choose one of"),
        (["--gpus", "2", "--gpu", "cpu"], r"--gpu cpu has no fixed memory size; give --memory-gib"),
        (["--gpus", "2", "--memory-gib", "0"], r"--memory-gib must be a positive number"),
        (["--gpus", "2", "--memory-gib", "-1"], r"--memory-gib must be a positive number"),
        (["--gpus", "2", "--memory-gib", "nan"], r"--memory-gib must be a positive number"),
        (["--gpus", "2", "--memory-gib", "inf"], r"--memory-gib must be a positive number"),
        (
            ["--gpus", "2", "--schedules", "Bogus"],
            r"unknown pipeline schedule 'Bogus'; torch's schedules are",
        ),
        (["--gpus", "2", "--schedules", ""], r"--schedules names none"),
        (["--gpus", "2", "--seq", "0"], r"--seq must be a whole number from 1"),
        (["--gpus", "2", "--microbatch-multiples", "0"], r"--microbatch-multiples must be"),
        (["--gpus", "2", "--microbatch-multiples", "a"], r"--microbatch-multiples takes whole"),
        (["--gpus", "2", "--microbatch-multiples", ","], r"--microbatch-multiples names none"),
        (["--gpus", "2", "--global-batch", "0"], r"--global-batch must be a whole number"),
        (["--gpus", "2", "--jobs", "0"], r"--jobs must be a whole number from 1 to 256"),
        (["--gpus", "2", "--memory-gib", "1e-6"], r"no layout of llama3-debug on 2 GPUs fits"),
        (
            # above the 16 bytes per parameter the bound counts, below every policy's peak
            ["--gpus", "1", "--memory-gib", "0.0285", "--layers", "1", "--seq", "8"],
            r"fits 0.0285 GiB; the lowest peak is [\d.]+ GiB \(fsdp 1 x tp 1 x pp 1, \w+\)",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_plan_bad_inputs(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    fails(capsys, [*PLAN, *flags], message)


@pytest.mark.parametrize(
    ("flag", "value"), [("--gpus", "two"), ("--global-batch", "1.5"), ("--jobs", "two")]
)
def test_plan_counts_are_whole_numbers(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """argparse's own refusal, in its one-line form (`PROG: error: ...`, exit 2)."""
    flags = [flag, value] if flag == "--gpus" else ["--gpus", "2", flag, value]
    with pytest.raises(SystemExit) as exited:
        main([*PLAN, *flags, "--json"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.rstrip().endswith(f"argument {flag}: invalid int value: '{value}'")


def test_plan_in_workers_from_a_script_without_a_main_guard(tmp_path: Path) -> None:
    """Spawned workers import the calling script again: one without `if __name__ ==
    '__main__':` gets one line saying so, not a pool's traceback."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from workbench.search.planner import PlanOptions, plan\n"
        "from workbench.errors import WorkbenchError\n"
        "try:\n"
        "    plan(PlanOptions(model='llama3-debug', gpus=2, layers=2, seq=32, jobs=2))\n"
        "except WorkbenchError as err:\n"
        "    print('REFUSED', err)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    refused = [line for line in done.stdout.splitlines() if line.startswith("REFUSED")]
    assert refused and "must call plan under `if __name__ == '__main__':`" in refused[0]
    assert "or plan with jobs=1" in refused[0]


def test_plan_needs_a_model_laid_out_as_torchtitans(capsys: pytest.CaptureFixture[str]) -> None:
    fails(
        capsys,
        ["plan", *MLP, "--gpus", "2"],
        r"plan splits reference models and torchtitan's.*'user_models:mlp' is neither: "
        r"choose one of "
        r"dsv3-16b, dsv3-debug",
    )


def test_plan_keeps_an_existing_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "plan.svg"
    plot.write_text("mine")
    fails(capsys, [*PLAN, "--gpus", "1", "--plot", str(plot)], r"exists")
    assert plot.read_text() == "mine"


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([{}], r"holds 1 stage policies; this pipeline has 2 stages"),
        ({"5": {}}, r"names stage '5'; stages are 0-1 \(or 'default'\)"),
        ("full", r"'stages' must be a list or an object keyed by stage"),
    ],
)
def test_bad_stage_policy_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, stages: Any, message: str
) -> None:
    path = tmp_path / "stages.json"
    path.write_text(json.dumps({"stages": stages}))
    fails(capsys, [*PP, "--pp", "2", "--policy", str(path)], message)


# --- memory snapshots (issue 36) ------------------------------------------------------------

SNAP = ["--model", "llama3-debug", "--layers", "1", "--seq", "16", "--mode", "fake"]


def _snapshot_file(tmp_path: Path, data: bytes | None = None) -> str:
    path = tmp_path / "run.pickle"
    path.write_bytes(data if data is not None else pickle.dumps({"segments": []}))
    return str(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare-snapshot", "{tmp}/missing.pickle", *SNAP], r"missing\.pickle: no such file"),
        (["compare-snapshot", "{tmp}", *SNAP], "it is a folder, not a regular file"),
        (["compare-snapshot", "{bad}", *SNAP], r"is not a snapshot: it names builtins\.print"),
        (["compare-snapshot", "{ok}", *SNAP, "--top", "-1"], r"--top must be a whole number"),
        (["compare-snapshot", "{ok}", *SNAP, "--device", "3"], r"holds no device 3"),
        (["compare-snapshot", "{ok}", *SNAP, "--policy", "nope"], "unknown preset"),
        (["estimate", *SNAP, "--snapshot", "{tmp}/no/such/x.pickle"], "folder .* is missing"),
        (["estimate", *SNAP, "--snapshot", "{mine}"], "exists and was not written by"),
        (["estimate", *SNAP, "--snapshot", "{tmp}/x.pickle", "--pp", "2"], "drop --pp"),
        (["estimate", *SNAP, "--backward-inputs", "held", "--pp", "2"], "one graph's backward"),
        (["estimate", *SNAP, "--policy", '{"preset": "none"'], "--policy JSON is not valid"),
        (["bench", "gpu", *SNAP, "--out", "{mine}"], "is not a folder"),
        (["bench", "gpu", *SNAP, "--out", "{tmp}/a/b"], "parent folder .* is missing"),
        (["bench", "gpu", *SNAP, "--presets", "fast"], "unknown fast; choose from"),
        (["bench", "gpu", *SNAP, "--warmup", "-1"], "--warmup must be a whole number"),
    ],
)
def test_snapshot_bad_inputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    """Each bad flag or file is one line before anything is traced or run."""
    mine = tmp_path / "mine.pickle"
    mine.write_bytes(b"a user's file")
    names = {
        "{tmp}": str(tmp_path),
        "{ok}": _snapshot_file(tmp_path),
        "{bad}": str(tmp_path / "bad.pickle"),
        "{mine}": str(mine),
    }
    (tmp_path / "bad.pickle").write_bytes(pickle.dumps(print))
    for key, value in names.items():
        argv = [a.replace(key, value) for a in argv]
    fails(capsys, argv, message)
    assert mine.read_bytes() == b"a user's file"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare-snapshot", *SNAP], "the following arguments are required: snapshot"),
        (["compare-snapshot", "x.pickle", *SNAP, "--top", "many"], "--top: invalid int value"),
        (["estimate", *SNAP, "--backward-inputs", "kept"], "invalid choice: 'kept' (choose"),
        (
            ["compare-snapshot", "x.pickle", *SNAP, "--backward-inputs", "kept"],
            "invalid choice: 'kept' (choose",
        ),
    ],
)
def test_snapshot_bad_cli_syntax_is_argparses_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and message in err


# --- issue 35, item 9: inputs that ended in a traceback -------------------------------------


def _no_stage_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.cli import stages as cli_stages

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced the stages before checking the input")

    monkeypatch.setattr(cli_stages, "trace_stages", refuse)


PP_POLICY_FILES = [c for c in POLICY_FILES if c[0] in ("not utf-8", "nested too deep", "empty")]
PP_POLICY_FILES.append(("key twice", b'{"stages": [], "stages": []}', "has the key 'stages' twice"))


@pytest.mark.parametrize(
    ("content", "message"), [c[1:] for c in PP_POLICY_FILES], ids=[c[0] for c in PP_POLICY_FILES]
)
def test_bad_policy_file_under_pp(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    content: bytes,
    message: str,
) -> None:
    """A pipeline's policy file gets the checks a policy file gets, before the trace."""
    _no_stage_trace(monkeypatch)
    path = tmp_path / "stages.json"
    path.write_bytes(content)
    line = fails(capsys, [*PP, "--pp", "2", "--policy", str(path)], message)
    assert str(path) in line


@pytest.mark.parametrize("frac", ["nan", "inf", "0", "-1", "1.5"])
def test_solve_pp_budget_frac(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, frac: str
) -> None:
    _no_stage_trace(monkeypatch)
    solve = ["solve", *PP[1:], "--pp", "2", "--budget-frac", frac]
    fails(capsys, solve, r"--budget-frac must be in \(0, 1\], got")


def _op(**fields: Any) -> dict[str, Any]:
    event = {"cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 5}
    event["args"] = {"Input Dims": [[4, 4], [4, 4]], "External id": 7}
    return {**event, **fields}


def _kernel(**fields: Any) -> dict[str, Any]:
    event = {"cat": "kernel", "name": "gemm", "tid": 9, "ts": 1, "dur": 3}
    return {**event, "args": {"External id": 7}, **fields}


CALIBRATION_TRACES: list[tuple[str, list[Any], str]] = [
    ("ts missing", [_op(ts=None)], r"event 0 \(cpu_op\) ts must be a finite number"),
    ("ts string", [_op(), _op(ts="12")], r"event 1 \(cpu_op\) ts must be .*got '12'"),
    ("dur null", [_op(dur=None)], r"event 0 \(cpu_op\) dur must be a finite number >= 0"),
    ("args list", [_op(args=[1])], r"event 0 \(cpu_op\) args must be an object, got \[1\]"),
    ("tid list", [_op(tid=[1])], r"event 0 \(cpu_op\) tid must be int or str"),
    ("kernel dur string", [_op(), _kernel(dur="3")], r"event 1 \(kernel\) dur must be"),
    ("dims int", [_op(args={"Input Dims": 3})], r"event 0 \(cpu_op\) args 'Input Dims' must be"),
    ("external id list", [_kernel(args={"External id": [1]})], "'External id' must be int or"),
]


@pytest.mark.parametrize(
    ("events", "message"),
    [c[1:] for c in CALIBRATION_TRACES],
    ids=[c[0] for c in CALIBRATION_TRACES],
)
def test_malformed_calibration_trace(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    events: list[Any],
    message: str,
) -> None:
    """Each event is checked once where the trace is read: one line naming its index and
    field, before anything is traced."""
    _no_trace(monkeypatch)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    fails(capsys, ["estimate", *MLP, "--calibrate", str(path)], message)


def test_calibration_trace_with_mixed_thread_ids(tmp_path: Path) -> None:
    """Thread ids of both kinds (numbers and strings) are threads apart, not a TypeError."""
    from workbench.cost.calibrate import load_calibration

    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_op(), _op(tid="main", dur=7)]}))
    seconds = load_calibration(path).seconds[("aten::mm", ((4, 4), (4, 4)))]
    assert seconds == pytest.approx(6e-6)


@pytest.mark.parametrize("plot", ["plan.txt", "plan", ""])
def test_plan_plot_suffix_checked_before_the_plan(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    plot: str,
) -> None:
    from workbench.search import planner

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned before checking --plot")

    monkeypatch.setattr(planner, "plan", refuse)
    path = str(tmp_path / plot) if plot else ""
    fails(capsys, [*PLAN, "--gpus", "1", "--plot", path], r"--plot .*one of .*\.png.*\.svg")


def _api_type_cases() -> list[tuple[str, Any, type[BaseException], str]]:
    from workbench.capture.models import load_workload
    from workbench.capture.stages import Pipeline, trace_stages
    from workbench.cost.calibrate import load_calibration
    from workbench.search.layouts import PlanOptions
    from workbench.search.planner import plan

    def workload() -> Any:
        return load_workload("llama3-debug", layers=2, seq=16, batch=2, device="meta")

    options = {"model": "llama3-debug", "gpus": 2}
    return [
        ("plan dict", lambda: plan(options), TypeError, r"options must be a PlanOptions"),
        ("model int", lambda: PlanOptions(model=3, gpus=2), TypeError, "model must be"),
        ("gpu int", lambda: PlanOptions(**options, gpu=3), TypeError, "gpu must be a device"),
        (
            "schedules str",
            lambda: PlanOptions(**options, schedules="1F1B"),
            TypeError,
            r"schedules must be a tuple, got '1F1B' \(str\)",
        ),
        (
            "multiples int",
            lambda: PlanOptions(**options, microbatch_multiples=2),
            TypeError,
            "microbatch_multiples must be a tuple",
        ),
        ("layers str", lambda: PlanOptions(**options, layers="2"), WorkbenchError, "--layers"),
        ("layout str", lambda: Pipeline(pp=2).layout("4"), WorkbenchError, "n_layers must be"),
        (
            "workload str",
            lambda: trace_stages("llama3-debug", "fake", None, Pipeline(pp=2)),
            TypeError,
            "workload must be a Workload",
        ),
        (
            "pipeline int",
            lambda: trace_stages(workload(), "fake", None, 2),
            TypeError,
            r"pipeline must be a Pipeline\(pp=...\), got 2 \(int\)",
        ),
        (
            "parallel int",
            lambda: trace_stages(workload(), "fake", 2, Pipeline(pp=2)),
            TypeError,
            "parallel must be a Parallel or None",
        ),
        ("calibration int", lambda: load_calibration(3), TypeError, "path must be a str"),
    ]


API_TYPE_CASES = [c[0] for c in _api_type_cases()]


@pytest.mark.parametrize("name", API_TYPE_CASES)
def test_public_entry_points_name_a_wrong_type(name: str) -> None:
    _, call, kind, message = next(c for c in _api_type_cases() if c[0] == name)
    with pytest.raises(kind, match=message) as raised:
        call()
    assert "\n" not in str(raised.value)


def test_pipeline_model_takes_stage_graphs_in_stage_order(pp_job: Any) -> None:
    from workbench.cost.stages import PipelineModel

    _, pipeline, graphs = pp_job
    layout = pipeline.layout(2)
    with pytest.raises(WorkbenchError, match=r"graphs\[0\] is the graph of stage 1: give"):
        PipelineModel(graphs[::-1], layout)
    with pytest.raises(TypeError, match="layout must be a StageLayout"):
        PipelineModel(graphs, pipeline)  # type: ignore[arg-type]


def test_an_alike_stages_graph_stands_for_it() -> None:
    """The planner traces alike middle stages once and passes that graph for each: taken;
    a graph of another role in a stage's place is still refused."""
    from workbench.capture.models import load_workload
    from workbench.capture.stages import Pipeline, trace_stages
    from workbench.cost.stages import PipelineModel

    pipeline = Pipeline(pp=4, microbatches=4)
    workload = load_workload("llama3-debug", layers=6, batch=4, seq=32, device="meta")
    layout = pipeline.layout(6)
    assert len(layout.layers[1]) == len(layout.layers[2])
    first, middle, _, last = trace_stages(workload, "fake", None, pipeline)
    PipelineModel([first, middle, middle, last], layout)
    with pytest.raises(WorkbenchError, match=r"graphs\[2\] is the graph of stage 3: give"):
        PipelineModel([first, middle, last, last], layout)


# --- issue 35, item 10: results that misled -------------------------------------------------

NAN_CALIBRATIONS: list[tuple[str, str, str]] = [
    ("table NaN", '[{"op": "aten::mm", "input_shapes": [[2]], "seconds": NaN}]', "got nan"),
    ("table inf", '[{"op": "aten::mm", "input_shapes": [[2]], "seconds": Infinity}]', "got inf"),
    ("table -1", '[{"op": "aten::mm", "input_shapes": [[2]], "seconds": -1}]', "got -1"),
    ("trace dur -5", json.dumps({"traceEvents": [_op(dur=-5)]}), r"event 0 \(cpu_op\) dur"),
    ("trace dur NaN", '{"traceEvents": [{"cat": "kernel", "ts": 0, "dur": NaN}]}', "got nan"),
]


@pytest.mark.parametrize(
    ("text", "message"), [c[1:] for c in NAN_CALIBRATIONS], ids=[c[0] for c in NAN_CALIBRATIONS]
)
def test_calibration_with_a_time_that_is_no_duration(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    message: str,
) -> None:
    """A negative, NaN or infinite time would give a negative or NaN step time (and JSON
    with NaN in it): refused where the file is read."""
    _no_trace(monkeypatch)
    path = tmp_path / "calibration.json"
    path.write_text(text)
    line = fails(capsys, ["estimate", *MLP, "--calibrate", str(path)], message)
    assert "must be a finite number >= 0" in line


def test_plan_options_plan_a_repeated_name_once() -> None:
    from workbench.search.layouts import PlanOptions

    options = PlanOptions(
        model="llama3-debug",
        gpus=2,
        schedules=("1F1B", "ZBVZeroBubble", "1F1B", "ScheduleZBVZeroBubble"),
        microbatch_multiples=(2, 1, 2),
    )
    assert options.schedules == ("1F1B", "ZBVZeroBubble")
    assert options.microbatch_multiples == (2, 1)


def _record_cases() -> list[tuple[str, Any, type[BaseException], str]]:
    from workbench.cost.allocator import AllocatorConfig
    from workbench.cost.overlap import OverlapOptions
    from workbench.search.layouts import PlanOptions

    return [
        (
            "expandable 'no'",
            lambda: AllocatorConfig(expandable_segments="no"),
            TypeError,
            r"expandable_segments must be True or False, got 'no' \(str\)",
        ),
        (
            "split 2 TiB",
            lambda: AllocatorConfig(max_split_size=2**41),
            WorkbenchError,
            r"max_split_size must be a whole number from 1 to 1,099,511,627,776",
        ),
        (
            "sink_waits 'yes'",
            lambda: OverlapOptions(sink_waits="yes"),
            TypeError,
            "sink_waits must be True or False",
        ),
        (
            "bucket_layers 1",
            lambda: OverlapOptions(bucket_layers=1),
            TypeError,
            r"bucket_layers must be True or False, got 1 \(int\)",
        ),
        (
            "prefetch 1e6",
            lambda: OverlapOptions(prefetch=10**6),
            WorkbenchError,
            "prefetch must be a whole number from 0 to 10,000",
        ),
        (
            "copies 0",
            lambda: OverlapOptions(max_copies_in_flight=0),
            WorkbenchError,
            "max_copies_in_flight must be a whole number from 1 to 100,000",
        ),
        (
            "plan layers 0",
            lambda: PlanOptions(model="llama3-debug", gpus=2, layers=0),
            WorkbenchError,
            "--layers must be a whole number from 1",
        ),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _record_cases()])
def test_records_check_their_fields(name: str) -> None:
    _, call, kind, message = next(c for c in _record_cases() if c[0] == name)
    with pytest.raises(kind, match=message):
        call()


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available(),
    reason="with CUDA these run the benchmark",
)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "nope"], "unknown model 'nope'; choose one of"),
        (["--model", "llama3-debug", "--layers", "0"], "layers must be a positive integer"),
        (["--model", "llama3-debug", "--seq", str(2**40)], "seq must be at most 2147483647"),
        (["--model", "llama3-debug", "--warmup", str(10**8)], "--warmup must be a whole number"),
    ],
)
def test_bench_gpu_checks_its_flags_without_cuda(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], message: str
) -> None:
    fails(capsys, ["bench", "gpu", *flags, "--out", str(tmp_path / "out")], message)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-split-size-mb", str(2**21)], r"--max-split-size-mb must be .* 21 to 1,048,576"),
        (["--max-split-size-mb", "20"], r"--max-split-size-mb must be .* 21 to"),
        (["--prefetch", str(10**6)], r"--prefetch: prefetch must be .* 0 to 10,000"),
        (["--max-copies-in-flight", str(10**7)], r"--max-copies-in-flight: .* 1 to 100,000"),
    ],
)
def test_stream_and_allocator_flags_have_an_upper_bound(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    message: str,
) -> None:
    _no_trace(monkeypatch)
    fails(capsys, ["estimate", *MLP, "--mode", "fake", *flags], message)


@pytest.mark.parametrize(
    "argv",
    [
        ["measure", "--model", "llama3-debug", "--cp", "2"],
        ["bench", "gpu", "--model", "llama3-debug", "--cp", "2"],
    ],
)
def test_unsharded_commands_name_the_parallel_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    fails(capsys, argv, r"runs one unsharded process: drop --cp 2")


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="no torchtitan")
def test_torchtitan_seq_past_rope_and_families(capsys: pytest.CaptureFixture[str]) -> None:
    titan = ["trace", "--model", "torchtitan:llama3/debugmodel", "--mode", "fake", "--layers", "1"]
    fails(capsys, [*titan, "--seq", "200000"], r"--seq 200000: .*RoPE covers \d+ positions; give")
    line = fails(capsys, ["trace", "--model", "torchtitan:nope/x"], "choose one of .*llama3")
    assert "common" not in line


@pytest.mark.parametrize(
    ("out", "flags"),
    [("p.json", ["--format", "torchtitan"]), ("p.md", []), ("p.md", ["--format", "torchtitan"])],
)
def test_rerun_replaces_output_without_a_place_for_a_mark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str, flags: list[str]
) -> None:
    """Text the workbench cannot mark inside (Markdown, torchtitan's options named .json)
    carries its mark beside it: a re-run replaces it, an edited one is kept."""
    argv = ["export", *MLP, "--mode", "fake", *flags, "--out", str(tmp_path / out), "--json"]
    assert main(argv) == 0
    assert main(argv) == 0
    capsys.readouterr()
    (tmp_path / out).write_text("the user's edit")
    fails(capsys, argv[:-1], "was changed since the workbench wrote it.*--overwrite")
    assert (tmp_path / out).read_text() == "the user's edit"


@pytest.mark.parametrize("command", ["export", "render"])
def test_out_ending_in_a_separator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    fails(capsys, [command, *MLP, "--out", f"{tmp_path}/"], r"ends in '/', a folder's name")
    assert list(tmp_path.iterdir()) == []


# --- issue 35, item 13: a copy of an export is the user's file -------------------------------


@pytest.mark.parametrize("out", ["model_sac_policy_fn.py", "policy.json"])
def test_a_copy_of_an_export_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str
) -> None:
    """The mark binds a file to the path it was written to: a copy kept under another name
    (`cp model_sac_policy_fn.py keep_eager.py`) is the user's, never replaced."""
    fmt = ["--format", "json"] if out.endswith(".json") else []
    export = ["export", *MLP, "--mode", "fake", *fmt]
    assert main([*export, "--out", str(tmp_path / out), "--json"]) == 0
    kept = tmp_path / f"keep{Path(out).suffix}"
    kept.write_bytes((tmp_path / out).read_bytes())
    capsys.readouterr()
    fails(capsys, [*export, "--out", str(kept)], "or is a copy of a file it wrote elsewhere")
    assert kept.read_bytes() == (tmp_path / out).read_bytes()
    assert main([*export, "--out", str(tmp_path / out), "--json"]) == 0  # the original: ours


# --- issue 35, item 12: inputs that ran for minutes ------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--pp", "256", "--microbatches", "1024", "--pp-schedule", "ZBVZeroBubble"],
            r"--pp 256 x --microbatches 1024 x 2 stages per rank \(ZBVZeroBubble\) is 524,288 "
            r"stage-microbatches; .*at most 131,072",
        ),
        (
            ["--pp", "256", "--microbatches", "1024", "--pp-schedule", "Interleaved1F1B"],
            r"is 524,288 stage-microbatches",
        ),
        (
            ["--pp", "128", "--microbatches", "128", "--pp-schedule", "Interleaved1F1B"],
            r"256 pipeline stages would trace 600 layers in full .*past the 256 .*--stage",
        ),
    ],
    ids=["ZBV schedule", "interleaved schedule", "stages traced"],
)
def test_pipelines_that_would_run_for_minutes(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    message: str,
) -> None:
    from workbench.capture import trace as capture_trace

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced a stage before checking the pipeline's size")

    monkeypatch.setattr(capture_trace, "trace", refuse)
    model = ["--model", "llama3-debug", "--layers", "600", "--seq", "8", "--mode", "fake"]
    fails(capsys, ["trace", *model, *flags], message)


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="no torchtitan")
def test_torchtitan_world_size_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    fails(
        capsys,
        ["trace", "--model", "torchtitan:llama3/debugmodel", "--mode", "fake", "--fsdp", "65536"],
        r"the world size \(fsdp x cp x tp ranks\) must be a whole number from 1 to 4,096 "
        r"\(tracing one torchtitan rank builds a fake group of every rank",
    )


# --- issue 35, item 8: flags a path does not use are refused, never dropped -------------------

ONE = ["--model", "llama3-debug", "--layers", "2", "--seq", "8", "--mode", "fake"]
UNUSED_FLAGS: list[tuple[list[str], str]] = [
    *(
        (["trace", *ONE, *flags], rf"{flags[-2]} is not used without --pp 2 or more")
        for flags in (
            ["--stage", "1"],
            ["--microbatches", "2"],
            ["--layers-per-stage", "1"],
            ["--pp-schedule", "bogus"],
            ["--pp", "1", "--pp-schedule", "Interleaved1F1B"],
        )
    ),
    *(
        (["estimate", *ONE, "--pp", "2", *flags], rf"{flags[0]} is not used with --pp \(per-stage")
        for flags in (
            ["--passes", "graph-trainer"],
            ["--calibrate", "trace.json"],
            ["--calibrate", ""],
            ["--expandable-segments"],
            ["--max-split-size-mb", "64"],
            ["--prefetch", "1"],
            ["--bucket-layers"],
            ["--sink-waits"],
            ["--timeline"],
        )
    ),
    *(
        (["solve", *ONE, "--pp", "2", "--budget-frac", "0.5", *flags], rf"{flags[0]} is not used")
        for flags in (
            ["--budget-kind", "reserved"],
            ["--host-budget-bytes", "1000"],
            ["--passes", "graph-trainer"],
        )
    ),
    (["estimate", *ONE, "--ep-imbalance", "2"], r"--ep-imbalance .* without --ep 2 or more"),
    (["estimate", *ONE, "--pp", "2", "--batch", "0"], "batch must be a positive integer, got 0"),
]


@pytest.mark.parametrize(
    ("argv", "message"), UNUSED_FLAGS, ids=[" ".join(a[9:]) for a, _ in UNUSED_FLAGS]
)
def test_flags_a_path_does_not_use(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    _no_trace(monkeypatch)
    _no_stage_trace(monkeypatch)
    fails(capsys, argv, message)


# --- issue 35, item 11: refusals of what should work ----------------------------------------

SMALL = ["--layers", "2", "--seq", "8", "--mode", "fake", "--budget-frac", "1"]
SOLVES_THAT_WORK = [
    ["--model", "llama3-debug", "--passes", "graph-trainer"],
    ["--model", "llama3-debug", "--budget-kind", "reserved", "--expandable-segments"],
    ["--model", "dsv3-debug", "--fsdp", "2", "--ep", "2"],
    ["--model", "dsv3-debug", "--fsdp", "2", "--ep", "2", "--pp", "2"],
]


@pytest.mark.parametrize("flags", SOLVES_THAT_WORK, ids=" ".join)
def test_solve_under_these_flags_works(
    capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    assert main(["solve", *flags, *SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["peak_bytes"] <= result["budget_bytes"]
    if "--budget-kind" in flags:
        assert result["budget_kind"] == "reserved"
        assert result["reserved_peak_bytes"] <= result["budget_bytes"]


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--passes", "graph-trainer"], "graph trainer's pass stack is estimated on one whole"),
        (["--budget-kind", "reserved"], "no allocator to make reserved bytes of them"),
        (["--expandable-segments"], "with no allocator to replay the interleaved microbatches"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_solve_pp_says_why_a_flag_is_not_used(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    why: str,
) -> None:
    _no_stage_trace(monkeypatch)
    fails(capsys, ["solve", *ONE, "--pp", "2", "--budget-frac", "0.5", *flags], why)


def test_plan_prunes_an_fsdp_that_does_not_divide_the_parameters(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On 6 GPUs fsdp 3 and 6 split no embedding of 2048 rows: pruned with the reason, and
    the layouts over 3 pipeline stages (their alike stages traced once) are planned."""
    assert main([*PLAN, "--gpus", "6", "--jobs", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    reasons = {p["reason"] for p in result["pruned"]}
    assert "fsdp 6 does not divide parameter tok_embeddings.weight of 'llama3-debug' " in {
        r.split("(")[0] for r in reasons
    }
    assert {(c["tp"], c["pp"]) for c in result["configs"]} >= {(2, 3)}


def test_plan_with_no_layout_names_gpus_and_the_counts_that_have_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = fails(capsys, [*PLAN, "--gpus", "13", "--jobs", "1"], r"^error: --gpus 13: no layout")
    assert "--fsdp" not in line
    assert line.endswith("choose --gpus among 6, 8, 12, 16")


# --- issue 35, item 6: the missing-dependency case and pareto --plot -------------------------


def test_a_python_without_a_dependency_says_where_to_run() -> None:
    """`python -m workbench` from a Python lacking torch: one line, exit 2."""
    hide = (
        "import sys; sys.modules['torch'] = None; import runpy; "
        "runpy.run_module('workbench', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide, "trace", "--model", "llama3-debug"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "error: No module named 'torch': run the workbench from the set-up's environment "
        "(.venv/bin/python -m workbench, after make lab)\n"
    )


PARETO = ["pareto", "--model", "llama3-debug", "--layers", "1", "--seq", "16", "--mode", "fake"]


def test_pareto_plot_draws_the_front(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "front.svg"
    assert main([*PARETO, "--points", "3", "--plot", str(plot), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(plot)
    assert "Memory vs step time per policy" in plot.read_text()


@pytest.mark.parametrize("plot", ["front.txt", "front", ""])
def test_pareto_plot_suffix_checked_before_the_front(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    plot: str,
) -> None:
    _no_trace(monkeypatch)
    path = str(tmp_path / plot) if plot else ""
    fails(capsys, [*PARETO, "--plot", path], r"--plot .*one of .*\.png.*\.svg")


def test_pareto_keeps_an_existing_plot(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_trace(monkeypatch)
    plot = tmp_path / "front.svg"
    plot.write_text("mine")
    fails(capsys, [*PARETO, "--plot", str(plot)], r"exists")
    assert plot.read_text() == "mine"


# --- issue 35: what the previous items left: a dropped keyword, a dropped profile -----------


@pytest.mark.parametrize(
    ("keyword", "message"),
    [
        ({"passes": "graph-trainer"}, r"passes='graph-trainer' is not used .*own passes\)"),
        ({"budget_kind": "reserved"}, r"budget_kind='reserved' is not used .*allocated bytes\)"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_pipeline_explorer_refuses_a_setting_it_does_not_use(
    pp_job: Any, keyword: dict[str, str], message: str
) -> None:
    from workbench.show.widgets import PolicyExplorer

    workload, pipeline, _ = pp_job
    with pytest.raises(WorkbenchError, match=rf"^pipeline: {message}; leave it out$"):
        PolicyExplorer.pipeline(workload, pipeline, **keyword)


def test_estimate_pp_refuses_more_than_one_profile(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_stage_trace(monkeypatch)
    fails(
        capsys,
        ["estimate", *ONE, "--pp", "2", "--profile", "h100,cpu"],
        r"--profile h100,cpu names 2 profiles; --pp estimates one profile",
    )
