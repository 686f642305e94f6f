"""`validate`: the published runs as data (every field, a source, a preset and a profile that
exist), the command's JSON on one cheap row and its agreement with `estimate` for the same
flags, refused input, and the B200 profile the published B200 rows use."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest

from workbench.capture.models import model_names
from workbench.cli import build_parser, main
from workbench.cost.profiles import PROFILES, get_profile
from workbench.decide.policy import parse_policy
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.interop.published import PUBLISHED_RUNS, PublishedRun, select_runs
from workbench.interop.validate import RowResult, eager_kind, row_estimator, trace_run

GIB = 2**30
CHEAP = "pr2570-8b-fsdp4-tp2-default"  # one rank of Llama3-8B, cut to 2 layers and 128 tokens
QUICK = ["--layers", "2", "--seq", "128"]
OPTIONAL = {"pp_schedule", "microbatches", "device_memory_gib", "published_pct", "selectors"}
TOOLKIT = "pr2377-8b-tp2-fsdp2-none"  # the compiler toolkit's step: a policy as JSON, held


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("run", PUBLISHED_RUNS.values(), ids=list(PUBLISHED_RUNS))
def test_every_row_has_every_field_and_a_source(run: PublishedRun) -> None:
    for f in dataclasses.fields(run):
        value = getattr(run, f.name)
        if f.name not in OPTIONAL:
            assert value not in (None, "", ()), f"{run.id}: {f.name} is empty"
    assert re.fullmatch(r"https://github\.com/pytorch/torchtitan/\S+", run.source)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run.date)
    assert re.fullmatch(r"[a-z0-9-]+", run.id)
    assert run.policy in PRESETS and run.profile in PROFILES
    assert run.model in model_names() or run.model.startswith("torchtitan:")
    # the GPUs are the product of the degrees (EP borrows FSDP x TP ranks, as torchtitan)
    assert run.gpus == run.fsdp * run.tp * run.pp * run.cp
    assert (run.pp > 1) == (run.pp_schedule is not None) == (run.microbatches is not None)
    assert run.published_gib > 0 and run.quantity == "max_memory_reserved"
    if run.published_pct is not None:  # the percentage is of the device memory stated,
        assert run.device_memory_gib is not None  # within the rounding of both figures
        rounding = 0.005 / run.published_pct + 0.005 / run.published_gib
        assert run.published_gib / (run.published_pct / 100) == pytest.approx(
            run.device_memory_gib, rel=rounding
        )


@pytest.mark.parametrize("run", PUBLISHED_RUNS.values(), ids=list(PUBLISHED_RUNS))
def test_each_row_is_an_estimate_command(run: PublishedRun) -> None:
    """A row's flags are ones `estimate` takes, naming the row's shape."""
    args = build_parser().parse_args(["estimate", *run.estimate_argv()])
    assert (args.model, args.profile) == (run.model, run.profile)
    assert parse_policy(args.policy) == run.workbench_policy
    assert parse_policy(args.policy).preset == run.policy
    assert args.backward_inputs == run.backward_inputs
    assert (args.fsdp, args.tp, args.ep, args.pp) == (run.fsdp, run.tp, run.ep, run.pp)
    assert (args.batch, args.seq) == (run.local_batch, run.seq)


def test_rows_with_one_figure_each() -> None:
    figures = [(r.source, r.source_detail) for r in PUBLISHED_RUNS.values()]
    assert len(set(figures)) == len(figures)
    assert list(PUBLISHED_RUNS) == [r.id for r in select_runs(None)]
    assert [r.id for r in select_runs(f" {CHEAP} ,")] == [CHEAP]


def test_validate_json_on_a_cheap_row(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_cli(capsys, ["validate", "--rows", CHEAP, *QUICK])
    assert set(result) == {"rows", "layers", "seq", "seconds", "cpu_count"}
    (row,) = result["rows"]
    assert {
        "id",
        "policy",
        "profile",
        "allocated_peak_bytes",
        "reserved_peak_bytes",
        "outside_allocator_bytes",
        "published_bytes",
        "published_gib",
        "published_quantity",
        "compared",
        "comparable",
        "difference_bytes",
        "difference_pct",
        "peak_at",
        "reserved_by_stream",
        "breakdown",
        "saved_at_peak_by_op",
        "differences",
        "command",
        "trace_seconds",
        "estimate_seconds",
        "trace_reused",
        "seconds",
        "source",
        "config",
    } <= set(row)
    assert row["id"] == CHEAP and row["compared"] == "reserved"
    assert row["reserved_peak_bytes"] >= row["allocated_peak_bytes"] > 0
    assert row["reserved_by_stream"] == {}  # a graph's estimate: one stream
    assert sum(row["breakdown"].values()) == row["allocated_peak_bytes"]
    assert set(row["outside_allocator_bytes"]) == {"cuda_context_bytes", "nccl_buffer_bytes"}
    # cut to one layer, the row is no longer the published run: no difference
    assert row["comparable"] is False and row["difference_bytes"] is None
    assert row["config"]["id"] == CHEAP and row["seconds"] >= row["estimate_seconds"]


@pytest.mark.parametrize("row_id", [CHEAP, TOOLKIT])
def test_validate_gives_what_estimate_gives(
    capsys: pytest.CaptureFixture[str], row_id: str
) -> None:
    """One truth: a row's figures are `estimate`'s for the row's command, a policy given as
    JSON and a backward holding its inputs included."""
    run = PUBLISHED_RUNS[row_id]
    row = run_cli(capsys, ["validate", "--rows", row_id, *QUICK])["rows"][0]
    python, m, workbench, *argv = shlex.split(row["command"])
    assert (python, m, workbench) == ("python", "-m", "workbench")
    assert argv == ["estimate", *run.estimate_argv(2, 128)]
    est = run_cli(capsys, argv)
    assert est["peak_bytes"] == row["allocated_peak_bytes"]
    assert est["reserved_peak_bytes"] == row["reserved_peak_bytes"]
    assert est["peak_breakdown"] == row["breakdown"]
    assert est["outside_allocator_bytes"][run.profile] == row["outside_allocator_bytes"]


def test_the_toolkits_rows_hold_backwards_inputs_and_no_ac_keeps_gathered_weights(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """PR #2377 ran in the compiler toolkit: its rows are graph runs whose backward holds what
    forward saved (higher than a freeing backward), no AC keeping the gathered weights."""
    run = PUBLISHED_RUNS[TOOLKIT]
    assert run.ran == "graph" and run.backward_inputs == "held" and not run.fsdp_reshard
    argv = ["estimate", *run.estimate_argv(2, 128)]
    assert argv[-2:] == ["--backward-inputs", "held"]
    held, freed = run_cli(capsys, argv), run_cli(capsys, argv[:-2])
    assert (held["backward_inputs"], freed["backward_inputs"]) == ("held", "freed")
    assert held["peak_bytes"] > freed["peak_bytes"]
    assert held["peak_breakdown"]["gathered"] > 0
    graph_sac = PUBLISHED_RUNS["pr2377-8b-tp2-fsdp2-default"].workbench_policy
    assert len(graph_sac.selectors) == 7 and graph_sac.preset == "eager"


def test_list_estimates_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_cli(capsys, ["validate", "--list"])["rows"]
    assert [r["id"] for r in rows] == list(PUBLISHED_RUNS)
    assert all(r["source"] and r["differences"] is not None for r in rows)
    assert main(["validate", "--list"]) == 0
    assert CHEAP in capsys.readouterr().out


def test_difference_is_the_estimate_minus_the_published_figure() -> None:
    run = PUBLISHED_RUNS[CHEAP]
    row = RowResult(run, 20 * GIB, 30 * GIB, {}, {}, "x")
    assert row.compared == "reserved"
    assert row.difference_bytes == 30 * GIB - run.published_bytes
    assert row.difference_pct == round(100 * (30 * GIB / run.published_bytes - 1), 2)
    pipelined = RowResult(run, 20 * GIB, None, {}, {}, "x")  # no reserved model: allocated
    assert pipelined.compared == "allocated" and pipelined.estimate_bytes == 20 * GIB


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rows", "nope"], r"--rows 'nope': unknown row 'nope'; choose from pr3429-dsv3-"),
        (["--rows", ","], r"unknown row \(none given\); choose from .*405b-pp8-interleaved$"),
        (["--rows", CHEAP, "--layers", "1"], r"--layers must be a whole number from 2 to"),
        (["--rows", CHEAP, "--seq", "-3"], r"--seq must be"),
    ],
)
def test_bad_input_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["validate", *argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("error: ") and re.search(message, line), line


def test_unknown_rows_name_every_valid_id() -> None:
    with pytest.raises(WorkbenchError) as err:
        select_runs("pr2377-8b")
    assert all(run_id in str(err.value) for run_id in PUBLISHED_RUNS)


def test_b200_profile() -> None:
    b200 = get_profile("b200")
    assert b200.matmul_rate("bfloat16") == 2.25e15 and b200.matmul_rate("float32") == 75e12
    assert b200.bytes_per_s == 7.7e12 and b200.intra_node_bytes_per_s == 900e9
    assert b200.memory_bytes == 183_359 * 2**20  # nvidia-smi's memory.total
    assert b200.outside_allocator_bytes(3) == {
        "cuda_context_bytes": 287_047_680,
        "nccl_buffer_bytes": 3 * 32 * 4 * 2**20,  # 32 channels of 4 MiB per communicator
    }
    # the published B200 rows: their percentages imply the memory torch reports (178.35 GiB)
    for run in PUBLISHED_RUNS.values():
        if run.profile == "b200":
            assert run.device_memory_gib == pytest.approx(178.35, abs=0.05)
    assert (
        "b200"
        in build_parser().parse_args(["estimate", "--model", "x", "--profile", "b200"]).profile
    )


def test_a_pipelined_row_compares_its_allocated_peak(capsys: pytest.CaptureFixture[str]) -> None:
    """No reserved model over a schedule: the allocated peak is what the row compares, and
    it is `estimate --pp`'s for the same flags."""
    run = PUBLISHED_RUNS["bench2412-405b-pp8-1f1b"]
    row = run_cli(capsys, ["validate", "--rows", run.id, "--layers", "6", "--seq", "64"])
    (row,) = row["rows"]
    assert row["compared"] == "allocated" and row["reserved_peak_bytes"] is None
    assert sum(row["breakdown"].values()) == row["allocated_peak_bytes"]
    assert row["peak_at"].startswith("rank ")
    est = run_cli(capsys, ["estimate", *run.estimate_argv(6, 64)])
    assert est["peak_bytes"] == row["allocated_peak_bytes"]


def test_the_notebooks_stored_table_is_of_todays_rows() -> None:
    """notebooks/validate.json (`validate --json`, shown by validate.ipynb) holds every row
    as the data now states it: re-run `validate --json` when a row changes."""
    stored = json.loads((Path(__file__).parents[1] / "notebooks" / "validate.json").read_text())
    assert [row["id"] for row in stored["rows"]] == list(PUBLISHED_RUNS)
    for row in stored["rows"]:
        assert row["config"] == PUBLISHED_RUNS[row["id"]].to_json(), row["id"]
        assert row["comparable"] and row["difference_bytes"] is not None


def test_eager_runs_are_estimated_as_eager_runs_them(capsys: pytest.CaptureFixture[str]) -> None:
    """A row that ran eagerly gets its eager baseline under torch's trackers, the graph
    preset's figures beside; graph runs, pipelines and torchtitan ranks keep the graph's."""
    kinds = {run_id: eager_kind(run) for run_id, run in PUBLISHED_RUNS.items()}
    assert kinds["bench2412-8b-fsdp8-sac"] == "sac"
    assert kinds["bench2412-70b-fsdp32-tp8-full"] == "full"
    for toolkit in ("pr2377-8b-tp2-fsdp2", "pr2570-8b-fsdp4-tp2"):  # traced, eager SAC too
        assert [kinds[f"{toolkit}-{ac}"] for ac in ("none", "eager", "default")] == [None] * 3
    assert kinds["bench2412-405b-pp8-1f1b"] is None  # a pipeline: no eager baseline
    assert kinds["pr3429-dsv3-16b-full"] is None  # graph trainer's rank
    row = run_cli(capsys, ["validate", "--rows", "bench2412-8b-fsdp8-sac", *QUICK])["rows"][0]
    assert row["ran"] == row["estimated_by"] == "eager"
    graph = row["graph_estimate"]
    assert graph["policy"] == "eager" and graph["allocated_peak_bytes"] > 0
    assert row["reserved_peak_bytes"] >= row["allocated_peak_bytes"] > 0
    assert row["peak_at"].endswith(("(forward)", "(backward)"))
    # FSDP2's side streams keep pools of their own, part of the reserved figure
    streams = row["reserved_by_stream"]
    assert set(streams) == {"default", "all_gather_copy_in", "reduce_scatter"}
    assert sum(streams.values()) == row["reserved_peak_bytes"]


@pytest.mark.parametrize("run_id", ["pr2377-8b-tp2-fsdp2-eager", "pr2570-8b-fsdp4-tp2-eager"])
def test_the_eager_trainers_figures_cited_for_traced_eager_sac(run_id: str) -> None:
    """Each toolkit job's eager SAC row cites what the eager trainer would hold for the same
    job (its eager baseline: allocated, and reserved with each stream's pools); recomputed at
    the row's full shape (about 10 s each)."""
    from workbench.cost.allocator import AllocatorConfig
    from workbench.interop.eager_runs import BaselineOptions, estimate_baselines
    from workbench.interop.validate import _parallel, _workload

    run = PUBLISHED_RUNS[run_id]
    cited = [re.search(r"([\d.]+) GiB allocated, ([\d.]+) reserved", d) for d in run.differences]
    [(allocated, reserved)] = [m.groups() for m in cited if m is not None]
    options = BaselineOptions(
        parallel=_parallel(run),
        kernels=run.profile,
        optimizer=run.optimizer,
        allocator=AllocatorConfig(expandable_segments=run.expandable_segments),
        kinds=("sac",),
    )
    [baseline] = estimate_baselines(_workload(run, None, None), options)
    assert f"{baseline.peak_bytes / 2**30:.2f}" == allocated
    assert f"{baseline.reserved_peak_bytes / 2**30:.2f}" == reserved  # type: ignore[operator]


@pytest.mark.parametrize(
    ("run_id", "reading"),
    [
        ("pr2377-8b-tp2-fsdp2-default", "apply_sac_decisions"),
        ("pr2570-8b-fsdp4-tp2-default", "apply_sac_pass_decisions"),
    ],
)
def test_the_default_partitioners_reading_cited_for_graph_sac(run_id: str, reading: str) -> None:
    """The figure each toolkit job's graph SAC row cites for its pass's tags as the default
    partitioner reads them is that estimate of the row's full graph (fake, about 3 s)."""
    from workbench.capture.models import load_workload
    from workbench.capture.parallel import Parallel
    from workbench.capture.trace import trace
    from workbench.interop import toolkit

    run = PUBLISHED_RUNS[run_id]
    workload = load_workload(run.model, seq=run.seq, batch=run.local_batch, device="meta")
    graph = trace(workload, "fake", Parallel(fsdp=run.fsdp, tp=run.tp), kernels=run.profile)
    est = row_estimator(run, graph).estimate(getattr(toolkit, reading)(graph))
    assert est.reserved_peak_bytes is not None
    pct = 100 * (est.reserved_peak_bytes / (run.published_gib * GIB) - 1)
    cited = (
        f"{est.peak_bytes / GIB:.2f} GiB allocated, {est.reserved_peak_bytes / GIB:.2f} "
        f"reserved ({pct:.1f} %)".replace("-", "−")
    )
    assert any(cited in text for text in run.differences), cited


def test_the_toolkit_eager_rows_selector_is_the_wrappers_reading() -> None:
    """The eager SAC rows' selector (the output projection's gathered weight kept) gives the
    estimate of `eager_sac_decisions` (torchtitan's wrappers as the toolkit traced them and the
    default partitioner read them) within 8 KB, as the rows say."""
    from workbench.capture.models import load_workload
    from workbench.capture.parallel import Parallel
    from workbench.capture.trace import trace
    from workbench.cost.estimate import Estimator
    from workbench.decide.decider import decide
    from workbench.interop.toolkit import eager_sac_decisions

    run = PUBLISHED_RUNS["pr2377-8b-tp2-fsdp2-eager"]
    workload = load_workload(run.model, seq=run.seq, batch=run.local_batch, device="meta")
    graph = trace(workload, "fake", Parallel(fsdp=run.fsdp, tp=run.tp), kernels=run.profile)
    estimator = Estimator(graph, [run.profile], run.optimizer, backward_inputs="held")
    row = estimator.estimate(decide(graph, run.workbench_policy)).peak_bytes
    reading = estimator.estimate(eager_sac_decisions(graph)).peak_bytes
    preset = estimator.estimate(
        decide(graph, dataclasses.replace(run.workbench_policy, selectors=[]))
    )
    assert abs(row - reading) <= 8192
    assert row - preset.peak_bytes > 128256 * 4096 // 2 * 2 * 0.99  # the gathered bf16 weight


def test_trace_run_takes_the_rows_gpus_kernels_unless_told() -> None:
    """A row's graph carries its GPU's attention (cuDNN on the H100 row), or this CPU's when
    `kernels="cpu"` asks for a graph this CPU runs (scripts/pack_rank_graph.py --kernels)."""
    run = PUBLISHED_RUNS["pr2570-8b-fsdp4-tp2-default"]
    gpu, cpu = trace_run(run, 2, 64), trace_run(run, 2, 64, kernels="cpu")
    assert gpu.config["kernels"] == run.profile == "h100"
    assert gpu.attention_counts() == {"aten._scaled_dot_product_cudnn_attention.default": 2}
    assert cpu.attention_counts() == {"aten._scaled_dot_product_flash_attention_for_cpu.default": 2}


def test_row_estimator_is_the_row_as_it_ran() -> None:
    """What `validate` estimates a graph row with: the row's profile, optimizer, allocator
    setting and backward (the toolkit rows: expandable segments, backward inputs held)."""
    run = PUBLISHED_RUNS["pr2570-8b-fsdp4-tp2-default"]
    estimator = row_estimator(run, trace_run(run, 2, 64))
    assert [p.name for p in estimator.profiles] == [run.profile]
    assert estimator.optimizer == run.optimizer == "adamw"
    assert estimator.allocator.expandable_segments is run.expandable_segments is True
    assert estimator.backward_inputs == run.backward_inputs == "held"
