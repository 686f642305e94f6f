"""The per-activation table (graph trainer's activation-memory log) for any policy."""

from __future__ import annotations

import doctest
import json

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.cli import main
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.interop import activations
from workbench.interop.activations import activation_log, activation_rows, totals
from workbench.rewrite.index import graph_index


@pytest.mark.parametrize("preset", ["default", "titan-eager"])
def test_rows_are_the_values_backward_reads_with_their_tags(
    small_graphs: dict[str, tuple[Workload, JointGraph]], preset: str
) -> None:
    _, graph = small_graphs["llama3-debug"]
    rows = activation_rows(graph, preset)
    index = graph_index(graph)
    assert {r.node for r in rows} == index.read_directly(index.identity())
    tags = decide(graph, Policy(preset))
    recompute = {r.node for r in rows if r.policy.startswith("RECOMPUTE")}
    assert recompute == {r.node for r in rows if tags[r.node].recompute}
    # summed per node, views at their own size, as graph trainer sums them (not by storage)
    assert totals(rows)["bytes"] == sum(graph.nodes[r.node].bytes for r in rows)
    layers = {r.layer for r in rows}
    assert layers == {-1, 0, 1}
    assert {r.module for r in rows if r.layer == -1} >= {"tok_embeddings", "loss"}


def test_log_folds_identical_layers_and_totals(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    _, graph = small_graphs["dsv3-debug"]
    rows = activation_rows(graph, "titan-full")
    text = activation_log(rows)
    summary = totals(rows)
    assert f"Total: {summary['activations']} activations, " in text
    assert "[non-layer]" in text and "[layer 0]" in text and "[layer 1]" in text  # dense, MoE
    untagged = [r for r in rows if r.policy == "SAVE*"]
    assert untagged and {r.module.split(".")[0] for r in untagged} <= {"lm_head", "output", "loss"}
    assert doctest.testmod(activations).failed == 0


def test_activations_command(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["activations", "--model", "llama3-debug", "--layers", "2", "--seq", "32"]
    assert main([*common, "--policy", "full", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["total"]["activations"] == len(result["rows"]) > 0
    row = result["rows"][0]
    assert set(row) == {
        "layer",
        "node",
        "bytes",
        "dtype",
        "policy",
        "shape",
        "module",
        "op",
        "source",
        "traced_op",
    }
    assert main([*common, "--policy", "eager"]) == 0
    out = capsys.readouterr().out
    assert "Total: " in out and "SubModule" in out
