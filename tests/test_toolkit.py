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
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cli.benchmarks import bench_toolkit
from workbench.interop.toolkit import apply_sac, apply_sac_decisions

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
    assert all(t.detail == "apply_sac" or t.forced for t in tagged)
    assert {decisions[name].detail for name in loss} == {"none"}


def test_a_toolkit_step_is_measured_beside_its_estimate(small: Workload) -> None:
    """On the CPU: no AC with its backward holding or freeing its inputs, and apply_sac
    freeing them, peak at the estimate within the allocator's bytes; apply_sac holding them
    differs by the partition (the default partitioner recomputes the attention kernel its
    untagged getitems leave, torch's remat pass saves it) and stays within 5 %."""
    result = bench_toolkit(small, trace(small, "real"))
    rows = {(r["tags"], r["backward_inputs"]): r for r in result["rows"]}
    assert set(rows) == {(t, b) for t in ("none", "apply_sac") for b in ("held", "freed")}
    for key in [("none", "held"), ("none", "freed"), ("apply_sac", "freed")]:
        assert abs(rows[key]["difference_bytes"]) <= 8192, key
    held, freed = rows[("none", "held")], rows[("none", "freed")]
    assert held["measured_peak_bytes"] - freed["measured_peak_bytes"] > 1 << 20
    assert abs(rows[("apply_sac", "held")]["difference_pct"]) < 5


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--mode", "fake"], "drop --mode fake"), (["--fsdp", "2"], "drop --fsdp 2")],
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
