"""`policy explain`: rules in words, the one table of differences from graph trainer (the
tables in docs/torchtitan.md are that table), decisions by reason on a graph, and the CLI
around it.

The comparisons with graph trainer's own tagging of torchtitan's models are in test_titan.py.
"""

from __future__ import annotations

import doctest
import json
import sys
from pathlib import Path

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.cli import main
from workbench.decide.decider import decide
from workbench.decide.engine import STEPS, TITAN_STEPS
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.decide.presets import GRAPH_TRAINER, PRESETS
from workbench.interop import titan
from workbench.interop.titan import DIFFERENCES, differences_of, differences_table
from workbench.interop.titan_offload import (
    OFFLOAD_PLACEMENT,
    STEP_NAMES,
    offload_mismatches,
    offload_passes,
)
from workbench.show.explain import explain, explain_text

TITAN_DOC = Path(__file__).resolve().parents[1] / "docs" / "torchtitan.md"


def _doc_table(table: str | None = None) -> list[str]:
    """The rows of docs/torchtitan.md's table that starts with the header of `table`
    (default: the differences table's)."""
    lines = TITAN_DOC.read_text().splitlines()
    start = lines.index((table or differences_table()).splitlines()[0])
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_doc_tables_are_the_librarys() -> None:
    assert _doc_table() == differences_table().splitlines()
    assert len(_doc_table()) == 2 + len(DIFFERENCES)
    placement = differences_table(OFFLOAD_PLACEMENT, "graph trainer (`apply_cpu_offload_pass`)")
    assert _doc_table(placement) == placement.splitlines()
    assert len(placement.splitlines()) == 2 + len(OFFLOAD_PLACEMENT)


def test_titan_doctests() -> None:
    assert doctest.testmod(titan).failed == 0


@pytest.mark.parametrize("preset", ["default", "full", "eager"])
def test_workbench_presets_list_their_differences(preset: str) -> None:
    result = explain(preset)
    assert result["graph_trainer_counterpart"] == preset and result["kind"] == "workbench"
    assert [d["key"] for d in result["differences"]] == [d.key for d in differences_of(preset)]
    assert {"in-place", "lm_head/loss", "layer boundary"} <= {
        d["key"] for d in result["differences"]
    }
    text = explain_text(result)
    assert f"differs from graph trainer's `{preset}`" in text
    assert all(d.why in text for d in differences_of(preset))


def test_offload_is_compared_with_graph_trainers_sac_and_offload(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    result = explain("offload")
    assert result["graph_trainer_counterpart"] == "sac_and_offload"
    assert [d["key"] for d in result["differences"]] == [
        "in-place",
        "lm_head/loss",
        "layer boundary",
        "save list",
        "offload candidates",
    ]
    text = explain_text(result)
    assert "differs from graph trainer's `sac_and_offload` (`titan-sac_and_offload` here)" in text
    assert "no memory policy of this name" not in text
    placement = result["offload_placement"]
    assert placement["options"] == {"budget_bytes": None, "prefetch_layers": 1, "defer_layers": 0}
    assert [d["key"] for d in placement["differences"]] == [d.key for d in OFFLOAD_PLACEMENT]
    # without a graph nothing was compared, and nothing is claimed
    assert placement["checked"] is None
    assert "apply_cpu_offload_pass: not compared (give a model" in text
    assert "step for step" not in text
    assert all(d.why in text for d in OFFLOAD_PLACEMENT)
    assert explain("default")["offload_placement"] is None
    assert "offload steps" not in explain_text(explain("default"))
    pytest.importorskip("torchtitan.experiments.graph_trainer.memory_policy")
    _, graph = small_graphs["llama3-debug"]
    against = explain("offload", graph)["graph_trainer"]
    assert against["memory_policy"] == "sac_and_offload"
    # every mismatch has its row: w2's matmul, which only a residual add reads, is offloaded
    # there and not here
    assert "unexplained" not in against["by_difference"]
    offload_rows = [r for r in against["rows"] if r["difference"] == "offload candidates"]
    assert [(r["module"], r["graph_trainer"]) for r in offload_rows] == [
        ("layers.0.feed_forward.w2", "MUST_CPU_OFFLOAD")
    ]


def test_explain_reports_the_offload_comparison_it_ran(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    """With a graph, the placement lines say what was compared (both passes on the graph
    rematerialized by the policy, how many values and steps) and what was found: the steps
    placed apart and the offloaded sets of graph trainer's tagging, the decisions and the
    pass, where they differ (`offload`'s own candidates differ by a documented row)."""
    pytest.importorskip("torchtitan.experiments.graph_trainer.memory_policy")
    _, graph = small_graphs["llama3-debug"]
    policy = Policy("offload", offload=OffloadOptions(prefetch_layers=1, defer_layers=1))
    result = explain(policy, graph)
    checked = result["offload_placement"]["checked"]
    passes = offload_passes(graph, policy)
    assert checked["graph"] == "llama3-debug" and checked["steps"] == list(STEP_NAMES)
    assert checked["values_compared"] == len(passes.layers) > 0
    assert checked["steps_compared"] == 4 * len(passes.layers)
    assert checked["mismatches"] == len(offload_mismatches(passes)) == 0
    theirs = titan.graph_trainer_tags(graph, "sac_and_offload")
    tagged = {n for n, t in theirs.items() if t is CheckpointPolicy.MUST_CPU_OFFLOAD}
    assert checked["offloaded"]["graph_trainer_tagging"] == len(tagged)
    assert set(checked["only_graph_trainer"]) == tagged - set(passes.layers)
    assert checked["only_graph_trainer"]  # w2's matmul: the `offload candidates` row
    text = explain_text(result)
    assert f"{checked['steps_compared']} steps (copy, free, reload, wait), 0 placed apart" in text
    assert "only graph trainer's: " + ", ".join(checked["only_graph_trainer"]) in text
    assert "step for step" not in text


@pytest.mark.parametrize("preset", ["default", "offload", "titan-eager"])
def test_explain_reads_the_steps_from_the_engine(preset: str) -> None:
    record = TITAN_STEPS if PRESETS[preset].dialect == GRAPH_TRAINER else STEPS
    result = explain(preset)
    assert result["steps"] == [step.words for step in record]
    text = explain_text(result)
    assert all(f"  {i}. {step.words}" in text for i, step in enumerate(record, start=1))


def test_explain_states_the_fsdp_choice_the_followers_and_the_in_place_rule() -> None:
    words = " ".join(explain("default")["steps"])
    for what in ("FSDP choice", "getitem", "wait_tensor", "unshard chain", "written in place"):
        assert what in words
    titan = " ".join(explain("titan-default")["steps"])
    assert "wait_tensor takes its parent's tag" in titan and "unsharded value" in titan


def test_only_eager_differs_outside_the_layers_and_full_has_no_save_list() -> None:
    assert "eager outside layers" in {d.key for d in differences_of("eager")}
    assert "eager outside layers" not in {d.key for d in differences_of("default")}
    assert "save list" not in {d.key for d in differences_of("full")}


@pytest.mark.parametrize(
    "preset", sorted(name for name, p in PRESETS.items() if p.dialect == GRAPH_TRAINER)
)
def test_titan_presets_are_graph_trainers_and_list_no_difference(preset: str) -> None:
    result = explain(preset)
    assert result["differences"] == [] and result["steps"][0].startswith("nodes of `lm_head*`")
    assert result["graph_trainer_counterpart"] == preset.removeprefix("titan-")
    assert "node for node" in explain_text(result)
    assert any("SymInt" in rule for rule in result["not_reproduced"])
    assert not any("FSDP" in rule for rule in result["not_reproduced"])  # reproduced now


def test_rule_words_are_the_presets_docstring_and_requests_are_listed() -> None:
    policy = Policy(
        "none",
        selectors=[{"select": "layers.*.attention::aten.mm.default", "action": "recompute"}],
        overrides={"layers.*.attention::aten.mul.Tensor#0": "save"},
    )
    result = explain(policy)
    assert result["rule"] == " ".join((PRESETS["none"].rule.__doc__ or "").split())
    assert result["graph_trainer_counterpart"] is None and result["differences"] == []
    text = explain_text(result)
    assert "selector layers.*.attention::aten.mm.default: recompute" in text
    assert "override layers.*.attention::aten.mul.Tensor#0: save" in text
    assert "no memory policy of this name" in text


def test_decisions_by_reason_count_every_decision(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    _, graph = small_graphs["llama3-debug"]
    result = explain("full", graph)
    decisions = decide(graph, Policy("full"))
    counts = result["decisions_by_reason"]
    assert sum(c["save"] + c["recompute"] for c in counts.values()) == len(decisions)
    assert counts["preset"]["save"] == 0  # `full` asks to recompute everything
    assert counts["mutates its input"] == {
        "save": sum(t.why.value == "mutates its input" for t in decisions.values()),
        "recompute": 0,
        "offload": 0,
    }


def test_without_torchtitan_the_comparison_is_skipped_with_its_reason(
    small_graphs: dict[str, tuple[Workload, JointGraph]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torchtitan.experiments.graph_trainer.memory_policy", None)
    _, graph = small_graphs["llama3-debug"]
    result = explain("default", graph)
    assert "pip install -e '.[torchtitan]'" in result["graph_trainer"]["skipped"]
    assert "decisions_by_reason" in result
    assert "against graph trainer's own tagging: skipped" in explain_text(result)


def test_policy_explain_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "explain", "--policy", "eager", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    result = json.loads(out)
    assert result["preset"] == "eager" and "model" not in result
    assert main(["policy", "explain", "--policy", "eager"]) == 0
    assert capsys.readouterr().out.startswith("policy: eager (workbench preset)\n")


def test_policy_explain_command_with_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["policy", "explain", "--policy", "none", "--model", "llama3-debug", "--layers", "2"]
    assert main([*argv, "--seq", "32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "llama3-debug" and "graph_trainer" not in result  # no `none`
    assert set(result["decisions_by_reason"]) == {"preset", "random op", "mutates its input"}


def test_policy_explain_bad_policy_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "explain", "--policy", "titan-defualt"]) == 2
    assert "did you mean 'titan-default'" in capsys.readouterr().err
