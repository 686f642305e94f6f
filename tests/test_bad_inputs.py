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
import random
import re
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from workbench import commands
from workbench.capture.ops import module_matches
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
    fails(capsys, ["estimate", *MLP, "--policy", str(big)], "larger than 0 MiB: not a policy")


def test_library_errors_blame_the_right_field() -> None:
    with pytest.raises(WorkbenchError, match="^preset 3 must be a string"):
        Policy(preset=3)  # type: ignore[arg-type]
    with pytest.raises(WorkbenchError, match="^override key 1 must be a string"):
        Policy(overrides={1: "save"})  # type: ignore[dict-item]


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
    (["--fsdp", "0"], "parallel fsdp must be a positive integer, got 0"),
    (["--tp", "-2"], "parallel tp must be a positive integer, got -2"),
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
    (["--model", "torchtitan:llama3/debugmodel", "--cp", "2"], "ring attention"),
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
    ),  # fmt: skip
    (["--model", "llama3-debug", "--fsdp", "2", "--ep", "2"], "run through graph trainer's"),
]


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


@pytest.mark.parametrize(("flags", "message"), FLAGS, ids=[" ".join(f) for f, _ in FLAGS])
def test_bad_parallel_flags(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    small = ["--model", "llama3-debug", "--mode", "fake", "--layers", "1", "--seq", "8"]
    fails(capsys, ["trace", *small, *flags], message)


def test_unknown_torchtitan_version(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["export", "--model", "llama3-debug", "--layers", "1", "--seq", "8",
            "--format", "torchtitan", "--torchtitan-version", "9.9"]  # fmt: skip
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
    ),  # fmt: skip
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
    ),  # fmt: skip
    (
        ["verify", "--model", "llama3-debug", "--layers", "1", "--batch", "4000", "--seq", "8192"],
        "estimated to need .* GiB at its peak",
    ),
    (
        ["measure", "--model", "llama3-debug", "--layers", "1", "--batch", "4000", "--seq", "8192"],
        "estimated to need .* GiB at its peak",
    ),
    (["solve", *MLP, "--budget-bytes", str(10**27)], r"from 1 to 9223372036854775807 \(int64\)"),
    (["solve", *MLP, "--budget-bytes", "-5"], "--budget-bytes must be from 1"),
    (["solve", *MLP, "--budget-frac", "nan"], r"--budget-frac must be in \(0, 1\]"),
    (
        ["solve", *MLP, "--budget-bytes", "100000", "--host-budget-bytes", "-1"],
        "--host-budget-bytes must be from 0 \\(no offload\\)",
    ),
    (["pareto", *MLP, "--host-budget-bytes", str(10**27)], "--host-budget-bytes must be from 0"),
    (["bench", "whatif", *MLP, "--full-path", "-1"], "--full-path must be 0 or more"),
    (["measure", *MLP, "--repeat", "0"], "--repeat must be a positive integer, got 0"),
    (["measure", *MLP, "--warmup", "-1"], "--warmup must be 0 or more runs, got -1"),
    (["estimate", *MLP, "--profile", ","], "--profile ',' names no device profile"),
    (["estimate", *MLP, "--calibrate", "/nonexistent/trace.json"], "--calibrate .*: no such"),
    (["estimate", *MLP, "--prefetch", "-2"], "--prefetch: prefetch must be 0 or more"),
    (["estimate", *MLP, "--max-split-size-mb", "20"], "--max-split-size-mb: .* above"),
    (["bench", "gpu", *MLP, "--presets", "fast"], "--presets 'fast': unknown fast; choose"),
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
        (["bench", "offload"], "--method", "simplex"),  # floor's old name
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
    """One check (`commands._solve_options_from_args`, on the library's own tests) for every
    command that runs the solver: the error names the flag and what is valid."""

    def no_trace(args: object) -> None:
        raise AssertionError("traced before checking the flags")

    monkeypatch.setattr(commands, "_trace_from_args", no_trace)
    message = fails(capsys, [*command, *MLP, flag, value], f"^error: {re.escape(flag)}")
    if flag in ("--method", "--profile", "--objective"):
        assert "choose one of" in message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--random", "0"], "--random must be a positive integer, got 0"),
        (["--random", "-3"], "--random must be a positive integer, got -3"),
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

    monkeypatch.setattr(commands, "timed_trace", no_trace)
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
    fails(capsys, [*base, "--out", str(existing)], "exists; pass overwrite=True .*--overwrite")
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


def test_concurrent_saves_exactly_one_wins_threads(tmp_path: Path) -> None:
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
    assert sorted(results) == [False] * (len(presets) - 1) + [True]
    assert Policy.load(path).preset in presets
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp files left


def test_concurrent_saves_exactly_one_wins_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "p.json")
    presets = ["none", "full", "default", "eager"]
    with multiprocessing.get_context("fork").Pool(len(presets)) as pool:
        results = pool.map(_save, [(path, p) for p in presets])
    assert sorted(results) == [False, False, False, True]
    assert Policy.load(path) == Policy(presets[results.index(True)])


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


# `--passes`: an unknown pipeline, graph trainer's without torchtitan (both before tracing),
# and a pass failing inside graph trainer (named).
PASSES_ARGV = ["--model", "llama3-debug", "--layers", "1", "--seq", "8"]


@pytest.mark.parametrize(
    "command", [["activations"], ["estimate"], ["solve", "--budget-frac", "0.5"]], ids=str
)
def test_unknown_pass_pipeline(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    fails(
        capsys,
        [*command, *PASSES_ARGV, "--passes", "inductor"],
        "--passes: unknown pass pipeline 'inductor'; choose one of workbench, graph-trainer",
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
