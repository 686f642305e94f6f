"""The explorer driven through its traitlets and messages, as the browser drives it."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from workbench.errors import WorkbenchError
from workbench.estimate import Estimator
from workbench.graph import JointGraph
from workbench.models import Workload, load_workload
from workbench.policy import Policy, decide
from workbench.trace import trace
from workbench.viz import svg_id
from workbench.widgets import PolicyExplorer

Fixture = tuple[Workload, JointGraph]


@pytest.fixture(scope="module")
def peaky() -> Fixture:
    """Long enough sequences that one flip moves the peak (mm_4: feed_forward.w1's matmul)."""
    workload = load_workload("llama3-debug", layers=2, seq=256)
    return workload, trace(workload, mode="real")


def explorer(fixture: Fixture, tmp_path: Path, policy: str = "default") -> PolicyExplorer:
    workload, graph = fixture
    return PolicyExplorer(graph, policy, workload=workload, autosave=tmp_path / "policy.json")


def send(widget: PolicyExplorer, **msg: object) -> None:
    widget._on_msg(widget, dict(msg), None)


def test_initial_state(peaky: Fixture, tmp_path: Path) -> None:
    ex = explorer(peaky, tmp_path)
    assert ex.view == "overview" and 'id="m&#45;layers' in ex.svg
    assert (
        ex.metrics["peak_bytes"]
        == Estimator(peaky[1], ["h100"]).estimate(Policy("default")).peak_bytes
    )
    assert ex.policy_json["preset"] == "default" and not ex.can_undo
    assert len(ex.history) == 1 and ex.history[0]["pareto"]
    assert "def policy_fn" in ex.export_code
    assert json.loads((tmp_path / "policy.json").read_text())["preset"] == "default"


def test_click_a_module_then_an_op_flips_it_and_moves_the_peak(
    peaky: Fixture, tmp_path: Path
) -> None:
    ex = explorer(peaky, tmp_path)
    peak = ex.metrics["peak_bytes"]
    folded = svg_id("m", "layers.0–1.feed_forward")  # two identical layers, one box
    assert f'id="{folded}"' in html.unescape(ex.svg)
    send(ex, type="click", id=folded)
    assert ex.view == "module:layers.0.feed_forward"
    assert f'id="{svg_id("n", "mm_4")}"' in html.unescape(ex.svg)
    send(ex, type="click", id=svg_id("n", "mm_4"))
    assert ex.selected == "mm_4" and ex.details["decision"] == "MUST_RECOMPUTE"
    assert "recomputed in every identical layer" in ex.message
    assert ex.metrics["peak_bytes"] < peak
    assert ex.policy_json["overrides"] == {
        "layers.*.feed_forward.w1::aten.mm.default#0": "recompute"
    }
    assert ex.can_undo and len(ex.history) == 2
    # every identical layer flipped
    decisions = decide(peaky[1], Policy.from_json(ex.policy_json))
    layer1 = [n for n in decisions if peaky[1].nodes[n].module == "layers.1.feed_forward.w1"]
    assert any(
        decisions[n].recompute for n in layer1 if peaky[1].nodes[n].op.endswith("mm.default")
    )
    send(ex, type="undo")
    assert ex.metrics["peak_bytes"] == peak and ex.can_redo
    send(ex, type="redo")
    assert ex.metrics["peak_bytes"] < peak


def test_shift_click_only_selects(peaky: Fixture, tmp_path: Path) -> None:
    ex = explorer(peaky, tmp_path)
    ex.show("layer:0")
    send(ex, type="click", id=svg_id("n", "mm_4"), shift=True)
    assert ex.selected == "mm_4" and ex.policy_json["overrides"] == {}
    details = ex.details
    assert details["module"] == "layers.0.feed_forward.w1" and details["layer"] == 0
    assert details["op"] == "aten.mm.default" and details["bytes"].endswith("MiB")
    assert details["backward_consumers"] and details["can_flip"]
    assert details["preset_decision"] == details["decision"] == "PREFER_SAVE"
    assert ex.selected_id == svg_id("n", "mm_4")


def test_one_layer_only(peaky: Fixture, tmp_path: Path) -> None:
    ex = explorer(peaky, tmp_path)
    ex.all_layers = False
    ex.flip("mm_4")
    assert ex.policy_json["overrides"] == {
        "layers.0.feed_forward.w1::aten.mm.default#0": "recompute"
    }
    assert "in this layer" in ex.message


def test_forced_and_backward_clicks_explain_and_change_nothing(
    peaky: Fixture, tmp_path: Path
) -> None:
    ex = explorer(peaky, tmp_path, "full")
    graph = peaky[1]
    decisions = decide(graph, Policy("full"))
    forced = next(n for n, d in decisions.items() if d.forced)
    before = dict(ex.policy_json)
    send(ex, type="click", id=svg_id("n", forced))
    assert "cannot flip" in ex.message and ex.policy_json == before
    assert ex.selected == forced and not ex.details["can_flip"]
    backward = next(i.name for i in graph.nodes.values() if i.phase == "backward")
    send(ex, type="click", id=svg_id("n", backward))
    assert "backward node" in ex.message and ex.policy_json == before
    send(ex, type="click", id="b-layers.0.attention")
    assert "backward ops of layers.0.attention" in ex.message
    send(ex, type="click", id="m-")
    assert "outside any module" in ex.message
    assert not ex.can_undo


def test_presets_selectors_switches_reset_and_restore(peaky: Fixture, tmp_path: Path) -> None:
    ex = explorer(peaky, tmp_path)
    saved = ex.metrics["saved_bytes"]
    send(ex, type="preset", name="full")
    assert ex.metrics["saved_bytes"] < saved and ex.policy_json["preset"] == "full"
    send(ex, type="switch", module="layers.*.attention", op="aten.mm.default", action="save")
    assert ex.policy_json["selectors"] == [
        {"select": "layers.*.attention.**::aten.mm.default", "action": "save"}
    ]
    send(ex, type="selector", select="layers.*.nope::aten.mm.default", action="save")
    assert "no module matches" in ex.message and len(ex.policy_json["selectors"]) == 1
    send(ex, type="remove_selector", index=0)
    assert ex.policy_json["selectors"] == []
    send(ex, type="preset", name="bogus")
    assert "unknown preset 'bogus'" in ex.message and ex.policy_json["preset"] == "full"
    send(ex, type="reset")
    assert ex.policy_json["overrides"] == {} and ex.policy_json["selectors"] == []
    first = next(p for p in ex.history if p["policy"]["preset"] == "default")
    send(ex, type="restore", index=first["index"])
    assert ex.policy_json == first["policy"] and ex.metrics["saved_bytes"] == saved
    send(ex, type="bogus")
    assert "unknown action 'bogus'" in ex.message


def test_history_marks_the_pareto_front(peaky: Fixture, tmp_path: Path) -> None:
    ex = explorer(peaky, tmp_path, "none")
    ex.set_preset("full")
    ex.set_preset("default")
    points = ex.history
    assert len(points) == 3 and [p["index"] for p in points] == [0, 1, 2]
    for p in points:
        dominated = any(
            q["peak_bytes"] <= p["peak_bytes"]
            and q["step_seconds"] < p["step_seconds"]
            or q["peak_bytes"] < p["peak_bytes"]
            and q["step_seconds"] <= p["step_seconds"]
            for q in points
        )
        assert p["pareto"] == (not dominated)


def test_export_shows_every_format_and_saves_without_clobbering(
    peaky: Fixture, tmp_path: Path
) -> None:
    ex = explorer(peaky, tmp_path)
    for fmt in ex.export_formats:
        ex.export_format = fmt
        assert ex.export_code.strip()
    ex.export_format = "policy_fn"
    target = tmp_path / "ac.py"
    send(ex, type="save_export", path=str(target))
    assert target.read_text() == ex.export_code
    ex.flip("mm_4")
    ex.save_export(str(target))  # ours, unchanged since: replaced
    assert target.read_text() == ex.export_code
    target.write_text("# my own edits")
    send(ex, type="save_export", path=str(target))
    assert "not written by this explorer" in ex.message
    assert target.read_text() == "# my own edits"


def test_autosave_restores_and_drops_what_no_longer_applies(peaky: Fixture, tmp_path: Path) -> None:
    ex = explorer(peaky, tmp_path)
    ex.flip("mm_4")
    again = explorer(peaky, tmp_path)
    assert again.policy_json == ex.policy_json and "restored" in again.message
    stale = Policy(
        "eager",
        overrides={
            "layers.7.attention::aten.mm.default#0": "save",
            "layers.*.feed_forward.w1::aten.mm.default#0": "save",
        },
    )
    stale.save(tmp_path / "policy.json", overwrite=True)
    third = explorer(peaky, tmp_path)
    assert third.policy_json["overrides"] == {"layers.*.feed_forward.w1::aten.mm.default#0": "save"}
    assert "1 entries no longer match" in third.message and "layers.7" in third.message
    (tmp_path / "policy.json").write_text("{broken")
    fourth = explorer(peaky, tmp_path)
    assert fourth.policy_json["preset"] == "default" and "not valid JSON" in fourth.message
    assert (tmp_path / "policy.json.unreadable").read_text() == "{broken"


def test_run_measures_and_marks_the_point(small_graphs: dict[str, Fixture], tmp_path: Path) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path, "eager")
    result = ex.run(repeats=1)
    assert result["bitwise_equal"] and ex.run_result == result
    assert result["peak_bytes"] >= result["estimated_peak_bytes"]
    measured = [p for p in ex.history if p["measured"]]
    assert len(measured) == 1 and measured[0]["device"] == "cpu"
    assert "bitwise equal to eager" in ex.status and not ex.running


def test_run_on_a_fake_graph_explains(tmp_path: Path) -> None:
    graph = trace(load_workload("llama3-debug", layers=1, seq=8, device="meta"), mode="fake")
    ex = PolicyExplorer(graph, autosave=tmp_path / "p.json")
    send(ex, type="run")
    assert "Run needs real tensors" in ex.message
    assert ex.metrics["peak_bytes"] > 0  # estimates still work


def test_bad_construction() -> None:
    with pytest.raises(WorkbenchError, match="takes a JointGraph, a Workload or a model name"):
        PolicyExplorer(42)  # type: ignore[arg-type]
    with pytest.raises(WorkbenchError, match="unknown model"):
        PolicyExplorer("llama4")


def test_suggest_loads_a_solved_policy_within_the_budget(peaky: Fixture, tmp_path: Path) -> None:
    ex = explorer(peaky, tmp_path, "none")
    low, high = ex.budget_range["min"], ex.budget_range["max"]
    assert low < high == ex.metrics["peak_bytes"]
    budget = (low + high) // 2
    send(ex, type="suggest", budget=budget)
    assert ex.metrics["peak_bytes"] <= budget and "suggested by greedy" in ex.message
    assert ex.can_undo
    send(ex, type="suggest", budget=low - 1)
    assert "smallest feasible" in ex.message or "budget" in ex.message
    assert ex.metrics["peak_bytes"] <= budget  # the failed suggestion changed nothing


def test_sweep_adds_the_solver_front_to_the_history(peaky: Fixture, tmp_path: Path) -> None:
    ex = explorer(peaky, tmp_path)
    ex.sweep(points=3)
    solver = [p for p in ex.history if p.get("solver")]
    assert solver and all(p["name"].startswith("solver: ") for p in solver)
    assert "solver points added" in ex.status
    send(ex, type="restore", index=solver[0]["index"])
    assert ex.policy_json == solver[0]["policy"]


def test_run_that_cannot_fit_refuses_and_keeps_the_edits(
    small_graphs: dict[str, Fixture], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path, "eager")
    ex.flip("mm_4")
    edited = dict(ex.policy_json)
    monkeypatch.setattr("workbench.measure.available_bytes", lambda device: 1024)
    send(ex, type="run")
    assert "estimated to need" in ex.message and "GiB" in ex.message
    assert ex.policy_json == edited and not ex.running and ex.run_result == {}
