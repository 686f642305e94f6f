"""The compiler toolkit's step (`workbench.interop.toolkit`): apply_sac's tags on AOTAutograd's
joint graph and on the workbench's, and the step measured on the CPU beside its estimate
(`bench toolkit`): exact for no AC and for a freeing backward."""

from __future__ import annotations

import contextlib
import json
import operator

import pytest
import torch
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.models import Workload, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cli.benchmarks import bench_toolkit, bench_toolkit_rank
from workbench.errors import WorkbenchError
from workbench.interop.toolkit import apply_sac, apply_sac_decisions, track_toolkit_rank

MM = torch.ops.aten.mm.default


@pytest.fixture(scope="module")
def small() -> Workload:
    return load_workload("llama3-debug", layers=2, seq=64, batch=2)


def test_apply_sac_counts_matmuls_over_the_whole_forward(small: Workload) -> None:
    """Every second matmul of the step recomputed (7 per layer: the count runs on across
    layers), the logits' matmul the last one tagged, nothing after it."""
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, small.model, tuple(small.inputs))
        gm = apply_sac(joint.graph_module)
    nodes = list(gm.graph.nodes)
    logits = nodes[-1].all_input_nodes[0]
    forward = nodes[: nodes.index(logits) + 1]
    mms = [n.meta["recompute"] for n in forward if n.target is MM]
    assert len(mms) == 2 * 7 + 1
    saved = CheckpointPolicy.MUST_SAVE
    assert mms == [saved if i % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE for i in range(15)]
    assert all("recompute" not in n.meta for n in nodes[nodes.index(logits) + 1 :])
    assert {n.meta["ac_graph_id"] for n in forward if "recompute" in n.meta} == {0}


def test_apply_sac_decisions_are_its_rule_on_the_workbench_graph(small: Workload) -> None:
    graph = trace(small, "real")
    decisions = apply_sac_decisions(graph)
    forward = [n for n in graph.gm.graph.nodes if graph.nodes[n.name].phase == "forward"]
    mms = [decisions[n.name].recompute for n in forward if n.target is MM]
    assert mms == [i % 2 == 1 for i in range(15)]
    # the loss keeps what autograd keeps; forced tags (random ops, in-place writes) stay
    loss = [n.name for n in graph.gm.graph.nodes if graph.nodes[n.name].phase == "loss"]
    assert loss and not any(decisions[name].recompute for name in loss)
    tagged = [
        decisions[n.name]
        for n in forward
        if n.op == "call_function" and n.target is not operator.getitem
    ]
    assert all(t.detail in ("apply_sac", "default partitioner") or t.forced for t in tagged)
    assert {decisions[name].detail for name in loss} == {"none"}


def test_a_toolkit_step_is_measured_beside_its_estimate(small: Workload) -> None:
    """On the CPU: no AC with its backward holding or freeing its inputs, and apply_sac
    freeing them, peak at the estimate within the allocator's bytes. apply_sac holding them
    is measured above the estimate: the default partitioner recomputes the CPU's attention
    kernel (torch marks it seeded, and tags it recompute), which the remat pass the estimate
    replays cannot, so the estimate saves its outputs instead of the tensors its recompute
    reads."""
    result = bench_toolkit(small, trace(small, "real"))
    rows = {(r["tags"], r["backward_inputs"]): r for r in result["rows"]}
    assert set(rows) == {(t, b) for t in ("none", "apply_sac") for b in ("held", "freed")}
    for key in [("none", "held"), ("none", "freed"), ("apply_sac", "freed")]:
        assert abs(rows[key]["difference_bytes"]) <= 8192, key
    held, freed = rows[("none", "held")], rows[("none", "freed")]
    assert held["measured_peak_bytes"] - freed["measured_peak_bytes"] > 1 << 20
    assert 0 < abs(rows[("apply_sac", "held")]["difference_pct"]) < 10


def test_default_partition_reading_of_apply_sac(small: Workload) -> None:
    """A multi-output op the tags leave recomputable is recomputed, its getitems saved only
    where a backward node reads them directly; forced tags (the CPU's seeded attention
    kernel) are kept."""
    graph = trace(small, "real")
    decisions = apply_sac_decisions(graph)
    phase = {name: info.phase for name, info in graph.nodes.items()}
    multi = [
        n
        for n in graph.gm.graph.nodes
        if phase[n.name] == "forward"
        and n.op == "call_function"
        and n.users
        and all(u.target is operator.getitem for u in n.users)
    ]
    assert multi
    read = [n for n in multi if not decisions[n.name].forced]
    assert read and all(decisions[n.name].recompute for n in read)
    for node in read:
        for item in node.users:
            direct = any(phase[u.name] != "forward" for u in item.users)
            assert decisions[item.name].recompute is not direct, item.name
            assert decisions[item.name].detail == "default partitioner"
    forced = [n for n in multi if decisions[n.name].forced]
    assert forced and all(not decisions[n.name].recompute for n in forced)


@pytest.fixture(scope="module")
def titan_rank() -> Workload:
    return load_workload("torchtitan:llama3/debugmodel", layers=2, seq=256, batch=1, device="meta")


def test_a_sharded_toolkit_rank_equals_its_estimate(titan_rank: Workload) -> None:
    """One rank of graph trainer's Llama3 at FSDP 2 x TP 2, traced for a B200, run as the
    toolkit ran it on fake tensors under torch's MemTracker: with its backward holding its
    inputs, no AC and apply_sac (read as the default partitioner reads it) peak at the
    estimate within 128 bytes. Freeing them, the measured peak is above the estimate by the
    logits' gradient and under 8 KB more: AOTAutograd frees its local tensor from the argument
    list, but the DTensor autograd holds keeps it."""
    parallel = Parallel(fsdp=2, tp=2)
    graph = trace(titan_rank, "fake", parallel, kernels="b200")
    result = bench_toolkit_rank(titan_rank, graph, parallel)
    rows = {(r["tags"], r["backward_inputs"]): r for r in result["rows"]}
    assert result["tracker"] == "MemTracker" and result["workspace_bytes"] == 64 << 20
    for tags in ("none", "apply_sac"):
        assert abs(rows[(tags, "held")]["difference_bytes"]) <= 128, tags
        gradient = 1 * 256 * 1024 * 4  # batch x seq x vocab / tp, fp32
        assert 0 <= rows[(tags, "freed")]["difference_bytes"] - gradient <= 8192, tags
    assert (
        rows[("apply_sac", "held")]["measured_peak_bytes"]
        < rows[("none", "held")]["measured_peak_bytes"]
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mode", "fake"], "give a torchtitan: model and --fsdp/--tp"),
        (["--fsdp", "2"], "drop --fsdp 2"),
        (["--mode", "fake", "--fsdp", "2"], "give a torchtitan: model"),
    ],
)
def test_bench_toolkit_refuses_what_it_cannot_run(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    argv = ["bench", "toolkit", "--model", "llama3-debug", "--layers", "2", *flags, "--json"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert message in line


def test_bench_toolkit_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "toolkit", "--model", "llama3-debug", "--layers", "2", "--seq", "32"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "cpu" and len(result["rows"]) == 4


def test_track_toolkit_rank_refuses_a_workbench_model(small: Workload) -> None:
    with pytest.raises(WorkbenchError, match="give a torchtitan: model"):
        track_toolkit_rank(small, Parallel(fsdp=2))
