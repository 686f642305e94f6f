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

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cli.benchmarks import bench_toolkit, bench_toolkit_rank
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.interop.toolkit import (
    apply_sac,
    apply_sac_decisions,
    apply_sac_pass,
    apply_sac_pass_decisions,
    eager_sac_decisions,
    measure_toolkit_step,
    toolkit_decisions,
    track_toolkit_rank,
)

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


def test_apply_sac_pass_tags_getitems_and_waits_as_their_op(small: Workload) -> None:
    """Graph trainer's pass of PR #2570: the same matmul count as apply_sac, over the whole
    joint graph (backward's ops tagged too), and every getitem tagged as the op it reads."""
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, small.model, tuple(small.inputs))
        gm = apply_sac_pass(joint.graph_module)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all("recompute" in n.meta and n.meta["ac_graph_id"] == 0 for n in calls)
    mms = [n.meta["recompute"] for n in calls if n.target is MM]
    forward = [
        CheckpointPolicy.PREFER_RECOMPUTE if i % 2 else CheckpointPolicy.MUST_SAVE
        for i in range(15)
    ]
    assert mms[:15] == forward
    items = [n for n in calls if n.target is operator.getitem]
    assert items and all(n.meta["recompute"] == n.args[0].meta["recompute"] for n in items)


def test_apply_sac_pass_decisions_follow_the_pass(titan_graph: JointGraph) -> None:
    """On a sharded rank: each getitem and collective wait as the node it reads (flex
    attention's outputs saved: the pass's save list holds it), the loss untouched."""
    decisions = apply_sac_pass_decisions(titan_graph)
    nodes, gm = titan_graph.nodes, titan_graph.gm
    forward = [n for n in gm.graph.nodes if nodes[n.name].phase == "forward"]
    followers = [
        n
        for n in forward
        if n.op == "call_function"
        and nodes[n.name].op in ("getitem", "_c10d_functional.wait_tensor.default")
        and not decisions[n.name].forced
    ]
    assert any(nodes[n.name].op == "getitem" for n in followers)
    assert any(nodes[n.name].op != "getitem" for n in followers)
    for node in followers:
        assert decisions[node.name].policy == decisions[node.args[0].name].policy, node.name
    flex = [n for n in forward if nodes[n.name].op == "flex_attention"]
    assert flex and all(not decisions[u.name].recompute for n in flex for u in n.users)
    assert {decisions[n.name].detail for n in forward if n.op == "call_function"} <= {
        "apply_sac_pass",
        *(t.detail for t in decisions.values() if t.forced),
    }


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


@pytest.fixture(scope="module")
def titan_graph(titan_rank: Workload) -> JointGraph:
    return trace(titan_rank, "fake", Parallel(fsdp=2, tp=2), kernels="b200")


def test_a_sharded_toolkit_rank_equals_its_estimate(
    titan_rank: Workload, titan_graph: JointGraph
) -> None:
    """One rank of graph trainer's Llama3 at FSDP 2 x TP 2, traced for a B200, run as the
    toolkit ran it on fake tensors under torch's MemTracker: with its backward holding its
    inputs, no AC, apply_sac, apply_sac_pass and torchtitan's eager SAC wrappers (read as the
    default partitioner reads them) peak at the estimate within 128 bytes. Freeing them, the
    measured peak is above the estimate by the logits' gradient and under 8 KB more:
    AOTAutograd frees its local tensor from the argument list, but the DTensor autograd holds
    keeps it."""
    result = bench_toolkit_rank(titan_rank, titan_graph, Parallel(fsdp=2, tp=2))
    rows = {(r["tags"], r["backward_inputs"]): r for r in result["rows"]}
    assert result["tracker"] == "MemTracker" and result["workspace_bytes"] == 64 << 20
    for tags in ("none", "apply_sac", "apply_sac_pass", "eager_sac"):
        assert abs(rows[(tags, "held")]["difference_bytes"]) <= 128, tags
        gradient = 1 * 256 * 1024 * 4  # batch x seq x vocab / tp, fp32
        assert 0 <= rows[(tags, "freed")]["difference_bytes"] - gradient <= 8192, tags
    held = {tags: rows[(tags, "held")]["measured_peak_bytes"] for tags in ("none", "apply_sac")}
    assert held["apply_sac"] < held["none"]
    assert rows[("eager_sac", "held")]["measured_peak_bytes"] < held["none"]


def test_eager_sac_decisions_read_the_wrappers_as_the_partitioner_does(
    titan_graph: JointGraph,
) -> None:
    """Inside the blocks the `eager` preset's tags with flex attention saved (the wrappers'
    save list); outside them the partitioner's reading of untagged nodes: the output
    projection's (lm_head's) gathered weight kept, which the `eager` preset reshards."""
    decisions = eager_sac_decisions(titan_graph)
    eager = decide(titan_graph, Policy("eager"))
    nodes = titan_graph.nodes
    flex = [name for name, info in nodes.items() if info.op == "flex_attention"]
    assert len(flex) == 2 and all(not decisions[name].recompute for name in flex)
    assert all(eager[name].recompute for name in flex)
    inside = [name for name in eager if nodes[name].layer is not None]
    changed = [name for name in inside if decisions[name].policy != eager[name].policy]
    flex_outputs = {
        user.name for node in titan_graph.gm.graph.nodes if node.name in flex for user in node.users
    }
    assert set(changed) <= {*flex, *flex_outputs}
    resharded = [
        name
        for name in eager
        if nodes[name].layer is None and eager[name].policy is CheckpointPolicy.MUST_RECOMPUTE
    ]
    assert any(nodes[name].module == "lm_head" for name in resharded)
    assert all(not decisions[name].recompute for name in resharded)


def test_toolkit_decisions_name_each_reading(titan_graph: JointGraph) -> None:
    """No AC keeps FSDP's gathered weights (what the toolkit's views kept); the other
    taggings are their readings."""
    none = toolkit_decisions(titan_graph, "none")
    gathered = [
        name
        for name in none
        if titan_graph.nodes[name].op == "_c10d_functional.all_gather_into_tensor.default"
    ]
    assert gathered and all(not none[name].recompute for name in gathered)
    assert decide(titan_graph, Policy("none")) != none  # resharding would recompute them
    assert toolkit_decisions(titan_graph, "apply_sac") == apply_sac_decisions(titan_graph)
    pass_reading = apply_sac_pass_decisions(titan_graph)
    assert toolkit_decisions(titan_graph, "apply_sac_pass") == pass_reading
    assert toolkit_decisions(titan_graph, "eager_sac") == eager_sac_decisions(titan_graph)


def test_measure_toolkit_step_refuses_eager_sac_on_a_workbench_model(small: Workload) -> None:
    with pytest.raises(WorkbenchError, match="measure it on a sharded torchtitan rank"):
        measure_toolkit_step(small, "eager_sac")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mode", "fake"], "give a torchtitan: model and --fsdp/--tp"),
        (["--fsdp", "2"], "drop --fsdp 2"),
        (["--mode", "fake", "--fsdp", "2"], "give a torchtitan: model"),
        (["--tags", "apply_sac,bogus"], "--tags 'apply_sac,bogus': bogus; name some of none,"),
        (["--tags", ","], "nothing named"),
        (["--tags", "eager_sac"], "--tags eager_sac wraps graph trainer's blocks"),
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


def test_bench_toolkit_runs_the_tags_named(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "toolkit", "--model", "llama3-debug", "--layers", "2", "--seq", "32"]
    assert main([*argv, "--tags", "apply_sac_pass", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["tags"], r["backward_inputs"]) for r in rows] == [
        ("apply_sac_pass", "held"),
        ("apply_sac_pass", "freed"),
    ]
    assert all(r["measured_peak_bytes"] > 0 and r["estimated_peak_bytes"] > 0 for r in rows)


def test_track_toolkit_rank_refuses_a_workbench_model(small: Workload) -> None:
    with pytest.raises(WorkbenchError, match="give a torchtitan: model"):
        track_toolkit_rank(small, Parallel(fsdp=2))
