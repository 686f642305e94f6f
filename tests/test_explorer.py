"""The explorer driven through its traitlets and messages, as the browser drives it."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from pathlib import Path

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.cost.estimate import Estimator
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.show.viz import render_overview, svg_id
from workbench.show.widgets import PolicyExplorer
from workbench.show.widgets.baselines import baseline_options, baseline_rows, cached_rows
from workbench.show.widgets.model import STATE
from workbench.show.widgets.session import Autosave, Edits, History, Point, graph_key
from workbench.show.widgets.stages import STAGES_STATE
from workbench.units import byte_ticks, format_bytes

Fixture = tuple[Workload, JointGraph]


@pytest.fixture(scope="module")
def peaky() -> Fixture:
    """Long enough sequences that one flip moves the peak (mm_4: feed_forward.w1's matmul)."""
    workload = load_workload("llama3-debug", layers=2, seq=256)
    return workload, trace(workload, mode="real")


def explorer(fixture: Fixture, tmp_path: Path, policy: str = "default") -> PolicyExplorer:
    workload, graph = fixture
    return PolicyExplorer(graph, policy, workload=workload, autosave=tmp_path / "policy.json")


def _unmarked(path: Path) -> str:
    """A saved export without the workbench's mark (`workbench.files.marked`)."""
    mark = r'# written by sac-workbench[^\n]*\n|"written_by": "[^"]*",\s*'
    return re.sub(mark, "", path.read_text(), count=1)


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
    send(ex, type="click", id=svg_id("b", "layers.0.attention"))
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
    assert _unmarked(target) == ex.export_code
    ex.flip("mm_4")
    ex.save_export(str(target))  # ours, unchanged since: replaced
    assert _unmarked(target) == ex.export_code
    target.write_text("# my own edits")
    send(ex, type="save_export", path=str(target))
    assert "not written by this explorer" in ex.message
    assert target.read_text() == "# my own edits"
    send(ex, type="save_export", path=str(tmp_path))
    assert "is a folder" in ex.message
    send(ex, type="save_export", path=str(tmp_path / "nowhere" / "ac.py"))
    assert "is missing" in ex.message


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
    assert measured[0]["profile"] == "cpu" and len(ex.history) == 2
    ex.flip("mm_4")  # the Run's line now says it was for another policy
    assert ex.status.startswith("last Run was for eager (measured on cpu")
    ex.undo()
    assert ex.status.startswith("measured on cpu")


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


def test_suggest_and_sweep_use_the_host_budget(
    peaky: Fixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import workbench.search.pareto
    from workbench.cost import profiles

    # at 32 tokens parameters set the peak (full recompute's equals no AC's), so offload
    # buys nothing there: 256 tokens, where half-way between the two it does, given a host
    # link fast enough (at the H100's measured in-step rate, recomputing is cheaper here)
    fast = dataclasses.replace(
        profiles.H100, host_bytes_per_s=1e12, host_in_step_factor=1.0, host_hbm_contention=False
    )
    monkeypatch.setitem(profiles.PROFILES, "h100", lambda: fast)
    ex = explorer(peaky, tmp_path, "none")
    budget = (ex.budget_range["min"] + ex.budget_range["max"]) // 2
    send(ex, type="host_budget", bytes=2**30)
    assert ex.suggest_host_budget_bytes == 2**30 and "up to 1.0 GiB" in ex.message
    send(ex, type="suggest", budget=budget)
    assert ex.metrics["peak_bytes"] <= budget and "suggested by greedy" in ex.message
    offloaded = [k for k, a in ex.policy_json["overrides"].items() if a == "offload"]
    assert offloaded and "offloads 2.0 MiB to host (budget 1.0 GiB)" in ex.message
    history_index = len(ex.history) - 1
    # the policy (with its host budget) is autosaved: a new explorer goes on with it
    again = explorer(peaky, tmp_path, "none")
    assert again.suggest_host_budget_bytes == 2**30
    send(ex, type="host_budget", bytes=0)
    assert ex.suggest_host_budget_bytes == 0 and "do not offload" in ex.message
    send(ex, type="suggest", budget=budget)
    assert "offload" not in ex.policy_json["overrides"].values()
    assert "no offload (host budget 0)" in ex.message
    send(ex, type="restore", index=history_index)  # the offloading point, and its budget
    assert ex.suggest_host_budget_bytes == 2**30
    send(ex, type="host_budget", bytes=-1)
    assert "host budget must be a whole number from 0" in ex.message
    assert ex.suggest_host_budget_bytes == 2**30
    seen: list[int] = []
    real = workbench.search.pareto.pareto

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(kwargs["options"].host_budget_bytes)  # type: ignore[attr-defined]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(workbench.search.pareto, "pareto", spy)
    ex.sweep(points=2)
    assert seen == [2**30]


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
    monkeypatch.setattr("workbench.cost.measure.available_bytes", lambda device: 1024)
    send(ex, type="run")
    assert "estimated to need" in ex.message and "GiB" in ex.message
    assert ex.policy_json == edited and not ex.running and ex.run_result == {}


# --- issue 16: each problem a researcher met, driven through the widget's messages ---------


def test_clicking_a_folded_layer_frame_opens_the_layer(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    frame = svg_id("g", "layers.0–1")  # the frame of `layers.0–1 ×2`, as the browser sends it
    assert f'id="{frame}"' in html.unescape(ex.svg)
    assert any("'layers.0–1 ×2': 2 identical layers" in line for line in ex.legend["lines"])
    static = html.unescape(render_overview(small_graphs["llama3-debug"][1]).dot.source)
    assert "'layers.0–1 ×2' = 2 identical layers" in static and "×32" not in static
    send(ex, type="click", id=frame)
    assert ex.view == "layer:0" and ex.message == ""
    send(ex, type="show", view="overview")
    send(ex, type="click", id=svg_id("g", "layers.0–1 ×2"))  # no view draws this id
    assert ex.view == "overview" and "no decision to flip" in ex.message


def test_history_is_retimed_per_profile_and_measured_points_stand_apart(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path, "none")
    ex.set_preset("full")
    est = Estimator(small_graphs["llama3-debug"][1], ["h100", "cpu"])
    full = est.estimate(Policy("full"))
    assert ex.history[-1]["step_seconds"] == full.step_seconds["h100"]
    ex.profile = "cpu"
    assert ex.history[-1]["step_seconds"] == full.step_seconds["cpu"]
    assert all(p["profile"] == "cpu" for p in ex.history) and ex.metrics["profile"] == "cpu"
    history = History()
    for name, seconds in (("none", 1.0), ("full", 2.0)):
        policy = Policy(name).to_json()
        history.add(Point(policy, 10 if name == "full" else 20, {"h100": seconds * 1e-3}))
        history.add(Point(policy, 30, {"cpu": seconds}, measured=True))
    rows = history.to_json("h100")
    estimated = [r for r in rows if not r["measured"]]
    measured = [r for r in rows if r["measured"]]
    assert all(r["pareto"] for r in estimated)  # each kind has its own front
    assert [r["pareto"] for r in measured] == [True, False] and measured[0]["profile"] == "cpu"


def test_one_saved_figure_and_backward_readers_through_views(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    est = Estimator(graph, ["h100"]).estimate(Policy("default"))
    assert ex.metrics["saved_bytes"] == est.saved_activation_bytes
    assert ex.legend["lines"][0].startswith(
        "kept for backward (whole step): " + ex.metrics["saved"]
    )
    assert "kept for backward" not in ex.svg.split("<g id=")[1]  # no second header figure
    direct = {
        n.name
        for n in graph.gm.graph.nodes
        if any(graph.nodes.get(u.name) and graph.nodes[u.name].phase == "backward" for u in n.users)
    }
    through_view = next(
        n
        for n, info in graph.nodes.items()
        if info.phase == "forward" and n not in direct and ex.estimator.backward_readers(n)
    )
    ex.select(through_view)
    assert ex.details["backward_consumers"] == ex.estimator.backward_readers(through_view)


def test_search_opens_and_selects_then_cycles_and_peak_is_marked(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    assert ex.legend["title"].endswith(": overview") and ex.peak_ids
    send(ex, type="search", query="mm_4")
    assert ex.selected == "mm_4" and ex.view == "layer:0"
    assert ex.focus["id"] == svg_id("n", "mm_4") and "match 1 of" in ex.message
    send(ex, type="search", query="wo")
    first = ex.selected
    send(ex, type="search", query="wo")
    assert ex.selected != first and "match 2 of" in ex.message
    assert ex.graph.nodes[ex.selected].module.endswith("wo")
    send(ex, type="search", query="no-such-thing")
    assert "no forward op matches" in ex.message
    send(ex, type="peak")
    assert "peak" in ex.message and ex.metrics["peak"] in ex.message
    assert any(f'id="{i}"' in html.unescape(ex.svg) for i in ex.peak_ids)
    assert f'id="{ex.focus["id"]}"' in html.unescape(ex.svg)
    marks = ex.timeline["marks"]
    assert 0 <= marks["peak"] <= 1 and len(ex.timeline["values"]) <= 240
    assert max(ex.timeline["values"]) == ex.timeline["max"] == ex.metrics["peak_bytes"]


def test_policy_rows_show_solver_output_and_each_is_editable(
    peaky: Fixture, tmp_path: Path
) -> None:
    ex = explorer(peaky, tmp_path, "none")
    send(ex, type="suggest", budget=(ex.budget_range["min"] + ex.budget_range["max"]) // 2)
    policy = ex.policy_json
    assert policy["overrides"] and ex.metrics["peak_bytes"] < ex.budget_range["max"]
    assert policy["preset"] == "full" and "many more overrides" in ex.message
    ex.set_preset("default")
    send(ex, type="suggest", budget=(ex.budget_range["min"] + ex.budget_range["max"]) // 2)
    assert ex.policy_json["preset"] == "default"  # the drop-down keeps the user's preset
    assert ex.policy_json["overrides"] and ex.metrics["peak_bytes"] < ex.budget_range["max"]
    assert f"{len(ex.policy_json['overrides'])} overrides (listed under Policy)" in ex.message
    ex.reset()
    send(ex, type="switch", module="layers.*.attention", op="aten.mm.default", action="save")
    send(ex, type="edit_selector", index=0, action="recompute")
    assert ex.policy_json["selectors"][0]["action"] == "recompute"
    ex.flip("mm_4")
    key = next(iter(ex.policy_json["overrides"]))
    send(ex, type="override", key=key, action="save")
    assert ex.policy_json["overrides"][key] == "save"
    send(ex, type="override", key=key)
    assert key not in ex.policy_json["overrides"]


def test_every_edit_says_what_it_did(small_graphs: dict[str, Fixture], tmp_path: Path) -> None:
    """The message line after each edit of a row, Reset, Undo and Redo is that edit's own:
    never the words of an earlier action left standing."""
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    send(ex, type="search", query="mm_4")
    send(ex, type="click", id=svg_id("n", "mm_4"))
    key = next(iter(ex.policy_json["overrides"]))
    said = []
    for request in (
        {"type": "override", "key": key, "action": "save"},
        {"type": "override", "key": key},
        {"type": "selector", "select": "layers.*.attention.wo::aten.mm.default", "action": "save"},
        {"type": "edit_selector", "index": 0, "action": "recompute"},
        {"type": "preset", "name": "full"},
        {"type": "remove_selector", "index": 0},
        {"type": "undo"},
        {"type": "redo"},
        {"type": "reset"},
        {
            "type": "switch",
            "module": "layers.*.attention",
            "op": "aten.mm.default",
            "action": "save",
        },
        {"type": "reset"},
    ):
        send(ex, **request)
        assert ex.message and ex.message not in said, (request, ex.message)
        said.append(ex.message)
    assert said[0] == f"override {key}: now saved" and said[1].startswith("removed the override")
    assert (
        said[3].startswith("selector 1 now has layers.*.attention.wo") and "recomputed" in said[3]
    )
    assert said[5].startswith("removed selector 1: recompute")
    assert said[6].startswith("undone:") and said[7].startswith("redone:")
    assert said[8] == "nothing to reset: the preset full has no edits"
    assert said[10] == (
        "reset to the preset full alone: dropped 1 selector and 0 overrides (Undo brings them back)"
    )


def test_export_file_is_named_for_its_format(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    endings = {"policy_fn": ".py", "graph_pass": ".py", "torchtitan": ".sh", "json": ".json"}
    names = set()
    for fmt, suffix in endings.items():
        ex.export_format = fmt
        assert ex.export_path.endswith(suffix) and fmt.split("_")[-1] in ex.export_path
        names.add(ex.export_path)
        send(ex, type="save_export", path=ex.export_path)
        assert _unmarked(Path(ex.export_path)) == ex.export_code
    assert len(names) == 4
    ex.export_path = str(tmp_path / "mine.py")
    ex.export_format = "torchtitan"
    assert ex.export_path == str(tmp_path / "mine.sh")  # a chosen name keeps its stem


def test_default_autosave_folder_comes_from_the_environment(
    small_graphs: dict[str, Fixture], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAC_WORKBENCH_AUTOSAVE_DIR", str(tmp_path))
    workload, graph = small_graphs["llama3-debug"]
    ex = PolicyExplorer(graph, workload=workload)
    assert ex.autosave_path == tmp_path / f"{graph_key(graph)}.policy.json"
    assert ex.autosave_path.exists()


# --- issue 17: nothing lost, no exception escapes the message handler -----------------------


def test_stale_autosave_is_kept_aside_before_it_is_rewritten(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    stale = Policy("eager", overrides={"layers.7.attention::aten.mm.default#0": "save"})
    stale.save(tmp_path / "policy.json")
    original = (tmp_path / "policy.json").read_bytes()
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    assert ex.policy_json["overrides"] == {} and "kept as policy.json.stale" in ex.message
    assert (tmp_path / "policy.json.stale").read_bytes() == original
    stale.save(tmp_path / "policy.json", overwrite=True)
    again = explorer(small_graphs["llama3-debug"], tmp_path)
    assert "policy.json.stale.2" in again.message
    assert (tmp_path / "policy.json.stale").read_bytes() == original


def test_a_second_unreadable_autosave_keeps_the_first_backup(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    (tmp_path / "policy.json").write_bytes(b"{first")
    explorer(small_graphs["llama3-debug"], tmp_path)
    (tmp_path / "policy.json").write_bytes(b"\xff\xfe not utf-8")
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    assert "not UTF-8" in ex.message and "policy.json.unreadable.2" in ex.message
    assert (tmp_path / "policy.json.unreadable").read_bytes() == b"{first"
    assert (tmp_path / "policy.json.unreadable.2").read_bytes() == b"\xff\xfe not utf-8"


def test_two_explorers_on_one_autosave_keep_both_edits(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    first = explorer(small_graphs["llama3-debug"], tmp_path)
    second = explorer(small_graphs["llama3-debug"], tmp_path)
    first.flip("mm_4")
    second.set_preset("full")
    assert "changed outside this explorer" in second.message
    assert second.autosave_path == tmp_path / "policy.2.json"
    assert Policy.load(tmp_path / "policy.json").to_json() == first.policy_json
    assert Policy.load(tmp_path / "policy.2.json").to_json() == second.policy_json
    first.reset()  # the first explorer still owns its file
    assert Policy.load(tmp_path / "policy.json").to_json() == first.policy_json


def test_a_failed_autosave_shows_in_the_message_line(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("a file, not a folder")
    workload, graph = small_graphs["llama3-debug"]
    ex = PolicyExplorer(graph, workload=workload, autosave=tmp_path / "file" / "policy.json")
    assert "NOT autosaved" in ex.message
    send(ex, type="click", id=svg_id("n", "mm_4"))
    assert "is now recomputed" in ex.message and "NOT autosaved" in ex.message
    assert ex.policy_json["overrides"]  # the edit itself is kept in the explorer


@pytest.mark.parametrize(
    "msg",
    [
        {"type": "click"},
        {"type": "click", "id": 3},
        {"type": "click", "id": "n-mm_4", "shift": "yes"},
        {"type": "show", "view": None},
        {"type": "preset", "name": ["full"]},
        {"type": "selector", "select": "**::aten.mm.default"},
        {"type": "remove_selector", "index": "zero"},
        {"type": "restore", "index": 1.5},
        {"type": "suggest", "budget": "lots"},
        {"type": "suggest", "budget": True},
        {"type": "search", "query": 42},
        {"type": "override", "key": "nope", "action": "save"},
        {"type": "save_export", "path": 7},
        {"type": None},
        {},
    ],
)
def test_malformed_messages_set_the_message_line(
    small_graphs: dict[str, Fixture], tmp_path: Path, msg: dict[str, object]
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    before = dict(ex.policy_json)
    ex._on_msg(ex, msg, None)
    assert ex.message and ex.policy_json == before


def test_a_message_that_is_not_an_object_is_refused(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    ex._on_msg(ex, ["click"], None)
    assert "not an object" in ex.message


def test_session_pieces_without_a_widget(tmp_path: Path) -> None:
    edits = Edits(Policy("default"))
    assert not edits.change(Policy("default")) and edits.change(Policy("full"))
    assert edits.undo() == Policy("default") and edits.can_redo
    assert edits.redo() == Policy("full") and not edits.can_redo
    with pytest.raises(WorkbenchError, match="nothing to redo"):
        edits.redo()
    autosave = Autosave(tmp_path / "p.json")
    assert autosave.save(Policy("eager")) == ""
    assert Policy.load(tmp_path / "p.json") == Policy("eager")
    (tmp_path / "p.json").write_text('{"edited": "by hand"}')
    assert "changed outside" in autosave.save(Policy("full"))
    assert (tmp_path / "p.json").read_text() == '{"edited": "by hand"}'
    assert Policy.load(tmp_path / "p.2.json") == Policy("full")
    (tmp_path / "plain").write_text("")
    note = Autosave(tmp_path / "plain" / "p.json").save(Policy("full"))
    assert note.startswith("NOT autosaved") and "live only in this explorer" in note


def test_edits_keep_the_fsdp_choice(peaky: Fixture, tmp_path: Path) -> None:
    """Preset, selector, override and reset edits change only their own field."""
    workload, graph = peaky
    start = Policy("default", fsdp_reshard=False)
    widget = PolicyExplorer(graph, start, workload=workload, autosave=tmp_path / "policy.json")
    widget.set_preset("eager")
    widget.add_selector("layers.*.attention.**::aten.mm.default", "save")
    widget.edit_selector(0, "recompute")
    widget.remove_selector(0)
    widget.reset()
    assert widget.policy.preset == "eager" and widget.policy.fsdp_reshard is False
    assert widget.policy.selectors == [] and widget.policy.overrides == {}


# --- issue 23: the widget is a shell around the plain-Python model ---------------------------


def test_every_model_state_is_a_synced_traitlet_and_repr_names_the_session(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path, "eager")
    synced = set(ex.keys) - {"presets", "profiles", "export_formats"}
    assert {
        n for n in synced if not n.startswith("_") and n not in ("layout", "tabbable", "tooltip")
    } == set(STATE) | set(STAGES_STATE)
    for name in STATE:
        assert getattr(ex, name) == getattr(ex.model, name), name
    assert repr(ex) == "PolicyExplorer(llama3-debug, policy eager)"
    ex.flip("mm_4")
    assert repr(ex) == "PolicyExplorer(llama3-debug, policy eager + 1 edits)"


def test_traitlets_set_from_outside_reach_the_model(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    ex.profile = "cpu"
    assert ex.model.profile == "cpu" and ex.metrics["profile"] == "cpu"
    ex.profile = "tpu"  # refused: the message says why, the traitlet shows the model's again
    assert ex.profile == "cpu" and "unknown profile 'tpu'" in ex.message
    ex.export_format = "cobol"
    assert ex.export_format == "policy_fn" and "unknown export format" in ex.message
    ex.suggest_host_budget_bytes = 2**20
    assert ex.model.suggest_host_budget_bytes == 2**20 and "up to 1.0 MiB" in ex.message
    ex.all_layers = False
    assert not ex.model.all_layers


def test_figures_reach_the_front_end_as_text(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    ex = explorer(small_graphs["llama3-debug"], tmp_path)
    stops, texts = ex.budget_range["stops"], ex.budget_range["texts"]
    assert stops[0] == ex.budget_range["min"] and stops[-1] == ex.budget_range["max"]
    assert texts == [format_bytes(b) for b in stops]
    assert ex.timeline["labels"]["peak"] == f"peak {ex.metrics['peak']}"
    (plot,) = ex.history_plots
    y = plot["y"]
    assert y["ticks"] and y["ticks"] == [list(t) for t in byte_ticks(y["lo"], y["hi"])]
    assert ex.history[0]["peak"] == ex.metrics["peak"]
    assert ex.offload_text == ""
    send(ex, type="offload", budget_bytes=2**30, prefetch_layers=2)
    assert ex.offload_text == "host budget 1.0 GiB, prefetch 2 layer(s), defer 0"
    assert ex.message == "offload options: " + ex.offload_text
    js = (Path(__file__).parents[1] / "workbench/show/widgets/explorer.js").read_text()
    assert "toFixed" not in js and "bytesText" not in js and "secondsText" not in js


def test_eager_baselines_in_the_side_panel(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    """Asked once (the panel's button sends `baselines`), the eager baselines are rows of the
    side panel, computed once per graph and shown again without running."""
    workload, graph = small_graphs["llama3-debug"]
    ex = PolicyExplorer(graph, "eager", workload=workload, autosave=tmp_path / "p.json")
    assert ex.baselines == [] and cached_rows(graph) == []
    rows = ex.show_baselines()
    assert [r["name"] for r in rows] == ["no AC", "eager SAC", "eager full AC"]
    assert ex.baselines == rows and "eager baselines: no AC" in ex.message
    assert all(r["peak"].endswith("iB") and r["reserved"] == "-" for r in rows)  # real: no GPU
    assert all(r["streams"] == "" for r in rows)  # nor its allocator's streams
    again = PolicyExplorer(graph, "full", workload=workload, autosave=tmp_path / "q.json")
    assert again.baselines == rows  # once per graph
    assert baseline_rows(graph, None, again.estimator) is cached_rows(graph)
    ex.model.message = ""
    ex._on_msg(ex, {"type": "baselines"}, [])  # the panel's button
    assert ex.message.startswith("eager baselines: no AC")


def test_eager_baselines_need_the_workload(rank_debug: JointGraph, tmp_path: Path) -> None:
    """A rank's baselines run its job: the sharding, kernels and optimizer of its graph and
    estimator; without the workload the message line says what to give."""
    ex = PolicyExplorer(rank_debug, "default", autosave=tmp_path / "p.json")
    options = baseline_options(rank_debug, ex.estimator)
    assert options.parallel is not None and (options.parallel.fsdp, options.parallel.tp) == (2, 2)
    assert options.mode == "fake" and options.kernels == "h100" and options.optimizer == "adamw"
    ex._on_msg(ex, {"type": "baselines"}, [])
    assert "open the explorer with its workload" in ex.message and ex.baselines == []


def test_a_ranks_baselines_say_each_streams_pools() -> None:
    """On a sharded rank each row says what each stream's pools reserved: FSDP2's copy-in and
    reduce-scatter streams beside the default one (the reserved cell's tooltip). A graph of
    its own: the rows are kept per graph."""
    from workbench.capture.parallel import Parallel

    workload = load_workload("llama3-debug", device="meta", layers=2, seq=128)
    graph = trace(workload, "fake", Parallel(fsdp=2, tp=2))
    rows = baseline_rows(graph, workload, Estimator(graph, ["h100"]))
    for row in rows:
        names = [part.rsplit(" ", 2)[0] for part in row["streams"].split(", ")]
        assert names == ["default", "all_gather_copy_in", "reduce_scatter"], row["streams"]
        assert row["reserved"].endswith("iB")
