"""The explorer's session without Jupyter: `ExplorerModel` driven by plain calls, the panels
it shows computed from the library's answers, and the peak outline through
`Estimator.traced_node` for every kind of step an estimate names."""

from __future__ import annotations

import dataclasses
import doctest
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.cost.estimate import Estimate, Estimator
from workbench.cost.measure import PEAK_COUNTS
from workbench.decide.decider import decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.decide.tags import Tag, Why
from workbench.errors import WorkbenchError
from workbench.show.viz import Element, View, expand, render_view, svg_id
from workbench.show.viz.style import KIND_STYLE, ORANGE, OUTLINES, SKY
from workbench.show.widgets import ExplorerModel, panels, policy_edits, session
from workbench.show.widgets.model import STATE, load_source
from workbench.show.widgets.panels import (
    BUDGET_STOPS,
    LABEL_CHAR_PX,
    budget_slider,
    details_panel,
    history_plots,
    legend_panel,
    match_words,
    metrics_panel,
    newly_forced,
    offload_line,
    peak_ids,
    peak_twins,
    peak_words,
    run_status,
    search_matches,
    timeline_panel,
)
from workbench.show.widgets.policy_edits import (
    edited,
    op_switch,
    with_offload,
    with_override,
    with_selector,
    with_selector_action,
    without_selector,
)
from workbench.show.widgets.session import (
    EXPORT_NAMES,
    Exports,
    History,
    Point,
    default_autosave,
    export_stem,
    graph_key,
)
from workbench.show.widgets.suggest import rebased, suggestion, without_idle_overrides
from workbench.units import format_bytes, format_seconds, second_ticks

Fixture = tuple[Workload, JointGraph]
OFFLOAD = Policy("offload", offload=OffloadOptions(defer_layers=1))


@pytest.fixture
def small(small_graphs: dict[str, Fixture]) -> Fixture:
    return small_graphs["llama3-debug"]


def model_of(fixture: Fixture, tmp_path: Path, policy: Policy | str = "default") -> ExplorerModel:
    workload, graph = fixture
    return ExplorerModel(graph, policy, workload=workload, autosave=tmp_path / "policy.json")


def element_id(picture: View, kind: str, name: str) -> str:
    return next(i for i, e in picture.elements.items() if e.kind == kind and e.name == name)


def test_the_model_needs_no_widget_library() -> None:
    code = (
        "import sys, workbench.show.widgets.model; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('anywidget', 'ipywidgets', 'traitlets')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_session_by_plain_calls(small: Fixture, tmp_path: Path) -> None:
    model = model_of(small, tmp_path)
    assert model.view == "overview" and model.history and not model.can_undo
    assert repr(model) == "ExplorerModel(llama3-debug, policy default)"
    box = element_id(model.picture, "module", "layers.0.feed_forward")  # `layers.0–1.feed_forward`
    model.click(box)
    assert model.view == "module:layers.0.feed_forward" and model.message == ""
    peak = model.metrics["peak_bytes"]
    model.click(svg_id("n", "mm_4"))
    assert model.selected == "mm_4" and "recomputed in every identical layer" in model.message
    assert model.decisions["mm_4"].recompute and model.can_undo
    assert model.metrics["peak_bytes"] == Estimator(small[1]).estimate(model.policy).peak_bytes
    model.undo()
    assert model.metrics["peak_bytes"] == peak and model.can_redo
    model.show("overview")
    frame = element_id(model.picture, "layers", "layers.0")
    model.click(frame)
    assert model.view == "layer:0"
    with model.explained():
        model.show("layer:9")
    assert "no layer '9'" in model.message and model.view == "layer:0"
    assert set(STATE) <= set(dir(model))


def test_clicks_go_by_the_views_elements_not_by_id_text(small: Fixture, tmp_path: Path) -> None:
    model = model_of(small, tmp_path)
    model.picture.elements["anything"] = Element("module", "layers.1.attention")
    model.click("anything")
    assert model.view == "module:layers.1.attention"
    model.click("m-layers-2e-1-2e-attention")  # looks like a box id, but this view has none
    assert "no decision to flip" in model.message and model.view == "module:layers.1.attention"
    inputs = [i for i, e in model.picture.elements.items() if e.kind == "input"]
    model.click(inputs[0])
    assert "no decision to flip" in model.message
    backward = element_id(model.picture, "backward", "layers.1.attention.wo")
    model.click(backward)
    assert "backward ops of layers.1.attention.wo" in model.message
    assert model.policy == Policy("default")


def offloaded_node(graph: JointGraph, estimator: Estimator) -> tuple[str, Estimate]:
    est = estimator.estimate(OFFLOAD)
    return est.transfers[0]["node"], est


def test_every_step_of_an_op_outlines_that_op(small: Fixture) -> None:
    """A peak at a recomputed copy, a replayed view or an offload step (offload, free,
    reload, wait) names its traced node through `Estimator.traced_node`: the outline stays."""
    graph = small[1]
    estimator = Estimator(graph, ["h100"])
    moved, est = offloaded_node(graph, estimator)
    recomputed = next(n for n in est.recomputed_nodes if graph.nodes[n].layer is not None)
    decisions = decide(graph, OFFLOAD)
    for name in (moved, recomputed):
        steps = [n for n in est.order if estimator.traced_node(n) == name and n != name]
        assert steps, name
        layer = graph.nodes[name].layer
        for picture in (
            expand(graph, decisions, f"layer:{layer}"),
            render_view(graph, decisions, "overview"),
        ):
            outline = peak_ids(graph, estimator, name, picture)
            assert outline
            for step in steps:
                assert peak_twins(graph, estimator, step) == (name, [name])
                assert peak_ids(graph, estimator, step, picture) == outline
    kinds = {n.removeprefix(moved) for n in est.order if estimator.traced_node(n) == moved}
    assert {"_offload", "_reload", "_wait"} <= kinds


def test_a_peak_at_a_reload_keeps_its_outline(
    small: Fixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = small[1]
    moved, _ = offloaded_node(graph, Estimator(graph, ["h100"]))
    reload = f"{moved}_reload"
    simulate = Estimator.simulate

    def peak_at_reload(self: Estimator, *args: object, **kwargs: object) -> Estimate:
        return dataclasses.replace(simulate(self, *args, **kwargs), peak_node=reload)  # type: ignore[arg-type]

    monkeypatch.setattr(Estimator, "simulate", peak_at_reload)
    model = model_of(small, tmp_path, OFFLOAD)
    assert model.metrics["peak_node"] == reload
    holding = [i for i, e in model.picture.elements.items() if moved in e.nodes]
    assert model.peak_ids and set(model.peak_ids) <= set(holding)
    model.go_to_peak()
    assert model.view == f"layer:{graph.nodes[moved].layer}"
    assert svg_id("n", moved) in model.peak_ids and model.focus["id"] == svg_id("n", moved)
    assert f"while {reload} runs" in model.message and "host-memory step" in model.message
    model.select(moved)
    assert {"selected", "reloaded"} <= set(model.timeline["marks"])


def test_peak_words_name_what_stands_for_the_peak(small: Fixture) -> None:
    graph = small[1]
    decisions = decide(graph, Policy("default"))
    backward = next(n for n, i in graph.nodes.items() if i.phase == "backward" and i.module)
    assert peak_words(graph, decisions, "mm_4", "mm_4") == "this op"
    assert peak_words(graph, decisions, "mm_4", "mm_4_recomputed") == "its recomputed copy"
    assert "its forward ops are marked" in peak_words(graph, decisions, backward, backward)


def test_panels_carry_figures_as_text(small: Fixture) -> None:
    graph = small[1]
    estimator = Estimator(graph, ["h100", "cpu"])
    decisions = decide(graph, Policy("full"))
    est = estimator.estimate(decisions)
    metrics = metrics_panel(est, "cpu")
    assert metrics["peak"] == format_bytes(est.peak_bytes)
    assert metrics["step"] == format_seconds(est.step_seconds["cpu"])
    timeline = timeline_panel(est, estimator, decisions, "mm_4")
    assert timeline["labels"]["peak"] == f"peak {format_bytes(est.peak_bytes)}"
    assert timeline["labels"]["selected"] == "mm_4" and "recomputed" in timeline["marks"]
    assert timeline["marks"]["selected"] < timeline["marks"]["recomputed"] <= 1
    details = details_panel(
        graph, estimator, decisions, decide(graph, Policy("none")), Policy("full"), "mm_4"
    )
    assert (
        details["decision"].endswith("_RECOMPUTE") and details["preset_decision"] == "PREFER_SAVE"
    )
    assert details["bytes"] == format_bytes(graph.nodes["mm_4"].bytes)
    slider = budget_slider(1000, 2**20)
    assert slider["stops"][0] == 1000 and slider["stops"][-1] == 2**20
    assert len(slider["stops"]) == BUDGET_STOPS == len(slider["texts"])
    assert slider["texts"] == [format_bytes(b) for b in slider["stops"]]
    assert budget_slider(5, 5)["stops"] == [5]


def test_legend_reads_the_pictures_elements(small: Fixture) -> None:
    graph = small[1]
    decisions = decide(graph, Policy("default"))
    est = Estimator(graph, ["h100"]).estimate(decisions)
    picture = render_view(graph, decisions, "overview")
    legend = legend_panel("m", "overview", picture, est, Policy("default"))
    assert legend["title"] == "m · policy default: overview"
    assert (
        "'layers.0–1 ×2': 2 identical layers drawn once; box figures are totals" in legend["lines"]
    )
    picture.elements = {"x": Element("layers", "layers.0", "my title", (0, 1, 2))}
    lines = legend_panel("m", "overview", picture, est, Policy("default"))["lines"]
    assert any(line.startswith("'my title': 3 identical layers") for line in lines)
    hexagon = View(picture.dot, 1, 0, {"y": Element("op", "mm_4", collective=True)})
    lines = legend_panel("m", "layer:0", hexagon, est, Policy("default"))["lines"]
    assert any(line.startswith("hexagon:") for line in lines)


def test_history_plots_label_their_ticks() -> None:
    history = History()
    history.add(Point(Policy("none").to_json(), 3 * 2**20, {"h100": 2e-3}))
    history.add(Point(Policy("full").to_json(), 2**20, {"h100": 3e-3}))
    history.add(Point(Policy("full").to_json(), 5 * 2**20, {"cpu": 0.5}, measured=True))
    rows = history.to_json("h100")
    assert rows[0]["peak"] == "3.0 MiB" and rows[0]["step"] == format_seconds(2e-3)
    estimated, measured = history_plots(rows, "h100")
    assert estimated["title"] == "estimated on h100" and not estimated["measured"]
    assert measured["x_label"] == "step time measured on cpu" and measured["measured"]
    x, y = estimated["x"], estimated["y"]
    for axis in (x, y):
        assert axis["lo"] < axis["hi"] and len(axis["ticks"]) >= 2
        assert all(axis["lo"] <= v <= axis["hi"] for v, _ in axis["ticks"])
    texts = [text for _, text in x["ticks"]]
    assert len(set(texts)) == len(texts) and len({t.split()[-1] for t in texts}) == 1
    # peak ticks at round MiB (1.0, 1.5, ... not round bytes read as odd MiB), one unit
    for v, text in y["ticks"]:
        number, unit = text.split()
        assert unit == "MiB" and v == round(float(number) * 2**20) and float(number) * 2 % 1 == 0
    assert measured["y"]["lo"] < 5 * 2**20 < measured["y"]["hi"]  # one point: padded around it


def test_step_time_ticks_never_repeat() -> None:
    """Step times 1.336–1.351 s read `1.34 s, 1.34 s, 1.35 s` at format_seconds' digits: the
    ticks take as many decimals as tell them apart, at round values of one unit."""
    history = History()
    for k, seconds in enumerate((1.3362, 1.3405, 1.3511)):
        history.add(
            Point(Policy("none", overrides={}).to_json() | {"k": k}, 2**20, {"h100": seconds})
        )
    (plot,) = history_plots(history.to_json("h100"), "h100")
    texts = [text for _, text in plot["x"]["ticks"]]
    assert len(texts) >= 2 and len(set(texts)) == len(texts), texts
    assert texts == [text for _, text in second_ticks(plot["x"]["lo"], plot["x"]["hi"])]


def test_history_ticks_sit_at_round_values_of_the_shown_unit() -> None:
    """The ticks that read 95.4 / 100.1 / 143.1 MiB: round values of the shown unit now."""
    rows = [
        {"measured": False, "profile": "h100", "step_seconds": s, "peak_bytes": b}
        for s, b in ((1e-3, 98.4 * 2**20), (2e-3, 140.0 * 2**20), (3e-3, 64.3 * 2**20))
    ]
    (plot,) = history_plots(rows, "h100")
    assert plot["y"]["ticks"] == [
        [75 * 2**20, "75 MiB"],
        [100 * 2**20, "100 MiB"],
        [125 * 2**20, "125 MiB"],
    ]


def test_run_status_says_when_it_is_stale() -> None:
    result = {
        "device": "cpu",
        "peak_bytes": 2**20,
        "estimated_peak_bytes": 2**20,
        "peak_counts": PEAK_COUNTS["cpu"],
        "estimated_host_peak_bytes": 0,
        "optimizer": "adamw",
        "optimizer_bytes": 2**21,
        "step_seconds": 0.01,
        "bitwise_equal": True,
        "policy": Policy("eager").to_json(),
    }
    assert run_status({}, Policy("eager")) == ""
    line = run_status(result, Policy("eager"))
    assert line == (
        f"measured on cpu: peak 1.0 MiB, estimated 1.0 MiB ({PEAK_COUNTS['cpu']}; the panel's "
        "peak memory adds AdamW state 2.0 MiB); 10.00 ms/step, bitwise equal to eager"
    )
    assert run_status(result, Policy("full")).startswith("last Run was for eager (measured on")


def test_message_helpers(small: Fixture) -> None:
    graph = small[1]
    before = decide(graph, Policy("default"))
    free = [n for n, d in before.items() if not d.forced and n != "mm_4"]
    after = dict(before)
    for name in free[:4]:
        after[name] = Tag(before[name].policy, Why.LAYER_BOUNDARY, "mm_4")
    assert newly_forced(before, before, "mm_4") == ""
    words = newly_forced(before, after, "mm_4")
    assert words.startswith(f"; forced in turn: {', '.join(free[:3])} and 1 more saved (")
    options = OffloadOptions(None, 2, 1)
    assert offload_line(options) == "host budget no limit, prefetch 2 layer(s), defer 1"
    assert search_matches(graph, "mm_4")[0] == "mm_4"
    found = search_matches(graph, "wo")
    assert found and all(
        "wo" in n or "wo" in graph.nodes[n].op or "wo" in graph.nodes[n].module for n in found
    )
    info = graph.nodes[found[0]]
    assert (
        match_words(info, 0, 1, "wo")
        == f"{info.name} ({info.op} in {info.module}): match 1 of 1 for 'wo'"
    )
    assert match_words(info, 1, 3, "wo").endswith(
        "match 2 of 3 for 'wo'; search again for the next"
    )


def test_doctests_of_the_panels_and_session() -> None:
    assert doctest.testmod(panels).failed == 0
    assert doctest.testmod(session).failed == 0


def test_exports_name_their_file_and_never_clobber(small: Fixture, tmp_path: Path) -> None:
    graph = small[1]
    exports = Exports("m", tmp_path)
    assert exports.path == tmp_path / "m_sac_policy_fn.py"
    exports.show(Policy("eager"), graph)
    assert "def policy_fn" in exports.code and not exports.refusal
    for fmt, ending in EXPORT_NAMES.items():
        exports.set_format(fmt)
        assert exports.path.name == "m" + ending
    exports.choose(tmp_path / "mine.py")
    exports.set_format("torchtitan")
    assert exports.path == tmp_path / "mine.sh"
    with pytest.raises(WorkbenchError, match="unknown export format 'cobol'; choose one of"):
        exports.set_format("cobol")
    exports.show(Policy("eager"), graph)
    assert exports.save() == tmp_path / "mine.sh"
    exports.show(Policy("full"), graph)
    exports.save()  # ours, unchanged since: replaced
    (tmp_path / "mine.sh").write_text("edited")
    with pytest.raises(WorkbenchError, match="not written by this explorer"):
        exports.save()
    exports.set_format("policy_fn")
    exports.show(OFFLOAD, graph)
    assert exports.refusal and exports.code.startswith("# cannot export as policy_fn")
    with pytest.raises(WorkbenchError):
        exports.save(tmp_path / "other.py")


def test_default_export_names_are_per_graph_safe_and_importable(
    small: Fixture, tmp_path: Path
) -> None:
    """Default names are the graph key's (as the autosave's), without a character some OS
    refuses (`:` on Windows) and importable by module name; a default name holding another
    explorer's file moves on to the next free one, a chosen one is refused."""
    import importlib
    import sys

    graph = small[1]
    for name in ("torchtitan:llama3/debugmodel-seq32-fake-0a1b2c3d", "llama3-debug", "3b"):
        stem = export_stem(name)
        assert stem.isidentifier() and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", stem), stem
    exports = Exports(graph_key(graph), tmp_path)
    assert exports.path.name == f"{export_stem(graph_key(graph))}_sac_policy_fn.py"
    exports.show(Policy("eager"), graph)
    saved = exports.save()
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(saved.stem)
        assert callable(module.policy_fn)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(saved.stem, None)
    again = Exports(graph_key(graph), tmp_path)  # a second explorer on the same graph
    again.show(Policy("full"), graph)
    moved = again.save()
    assert moved.name == f"{export_stem(graph_key(graph))}_2_sac_policy_fn.py"
    assert saved.name in again.saved_words(moved) and "left as it is" in again.saved_words(moved)
    again.set_format("json")
    assert again.path.name.endswith("_2_sac_policy.json")
    again.choose(saved.with_suffix(".json"))
    again.show(Policy("full"), graph)
    again.save()
    again.choose(saved)
    again.set_format("policy_fn")
    again.show(Policy("full"), graph)
    with pytest.raises(WorkbenchError, match="not written by this explorer"):
        again.save()  # a name chosen: refused, never moved


def test_default_autosave_follows_the_environment(
    small: Fixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = small[1]
    name = f"{graph_key(graph)}.policy.json"
    monkeypatch.setenv("SAC_WORKBENCH_AUTOSAVE_DIR", str(tmp_path))
    assert default_autosave(graph) == tmp_path / name
    monkeypatch.delenv("SAC_WORKBENCH_AUTOSAVE_DIR")
    assert default_autosave(graph) == Path(name)


def test_rebased_keeps_the_users_preset(small: Fixture) -> None:
    graph = small[1]
    policy = rebased(graph, Policy("full"), Policy("default"))
    assert policy is not None and policy.preset == "default" and policy.overrides
    want, got = decide(graph, Policy("full")), decide(graph, policy)
    assert all(got[n].action == d.action for n, d in want.items())


def test_suggestion_fits_the_budget_and_says_so(small: Fixture) -> None:
    graph = small[1]
    estimator = Estimator(graph, ["h100"])
    budget = estimator.estimate(Policy("none")).peak_bytes
    policy, message = suggestion(
        graph,
        Policy("default"),
        budget,
        method="greedy",
        profile="h100",
        estimator=estimator,
        host_budget_bytes=0,
        has_fsdp=False,
    )
    assert estimator.estimate(policy).peak_bytes <= budget
    assert message.startswith("suggested by greedy for a budget of " + format_bytes(budget))
    assert "no offload (host budget 0)" in message and "FSDP" not in message


def test_suggest_leaves_out_overrides_that_change_nothing(small: Fixture) -> None:
    """A recompute override whose op backward never runs again (its saved view keeps the
    output) changes nothing: Suggest's policies leave it out, the step stays the same."""
    graph = small[1]
    estimator = Estimator(graph, ["h100"])
    wq = "layers.*.attention.wq::aten"
    idle, useful = f"{wq}.mm.default#0", "layers.*.feed_forward.w1::aten.mm.default#0"
    save = f"{wq}._unsafe_view.default#0"
    policy = Policy("default", overrides={idle: "recompute", save: "save", useful: "recompute"})
    pruned, left = without_idle_overrides(graph, policy, estimator)
    assert left == 1 and set(pruned.overrides) == {save, useful}
    before, after = estimator.estimate(policy), estimator.estimate(pruned)
    assert (before.order, before.peak_bytes) == (after.order, after.peak_bytes)
    assert after.recompute_flops_by_node.get(_named(graph, useful), 0) > 0
    assert without_idle_overrides(graph, pruned, estimator) == (pruned, 0)
    peaks = [estimator.estimate(Policy(p)).peak_bytes for p in ("full", "none")]
    suggested, _ = suggestion(
        graph,
        Policy("default"),
        sum(peaks) // 2,
        method="greedy",
        profile="h100",
        estimator=estimator,
        host_budget_bytes=0,
        has_fsdp=False,
    )
    assert without_idle_overrides(graph, suggested, estimator)[1] == 0


def _named(graph: JointGraph, key: str) -> str:
    """The first node a `layers.*` override key names."""
    from workbench.decide.decider import node_keys

    return next(n for n, k in node_keys(graph).items() if k == key)


def test_load_source_refuses_what_it_cannot_explore(small: Fixture) -> None:
    graph = small[1]
    assert load_source(graph) == (graph, None)
    with pytest.raises(WorkbenchError, match="takes a JointGraph, a Workload or a model name"):
        load_source(3.5)  # type: ignore[arg-type]


def test_policy_edits_keep_what_they_do_not_edit(small: Fixture) -> None:
    graph = small[1]
    start = Policy("eager", fsdp_reshard=False, offload=OffloadOptions(None, 2, 0))
    assert doctest.testmod(policy_edits).failed == 0
    assert edited(start, preset="full") == dataclasses.replace(start, preset="full")
    select = op_switch("layers.*.attention", "aten.mm.default", "save")
    one = with_selector(graph, start, select, "save")
    two = with_selector_action(one, 0, "recompute")
    assert [s.action for s in two.selectors] == ["recompute"] and two.offload == start.offload
    assert without_selector(two, 0) == start
    with pytest.raises(WorkbenchError, match="no module matches"):
        with_selector(graph, start, "layers.*.nope::aten.mm.default", "save")
    with pytest.raises(WorkbenchError, match="no selector #3; there are 1"):
        without_selector(one, 3)
    with pytest.raises(WorkbenchError, match="action 'keep' must be one of"):
        op_switch("", "aten.mm.default", "keep")
    assert op_switch("", "aten.mm.default", "save") == "**::aten.mm.default"
    key = "layers.*.feed_forward.w1::aten.mm.default#0"
    overridden = dataclasses.replace(start, overrides={key: "recompute"})
    assert with_override(overridden, key, "save").overrides == {key: "save"}
    assert with_override(overridden, key, None).overrides == {}
    with pytest.raises(WorkbenchError, match="no override 'nope'; the policy has 1"):
        with_override(overridden, "nope", "save")
    moved = with_offload(start, 2**30, 1, 1)
    assert moved.offload == OffloadOptions(2**30, 1, 1) and moved.fsdp_reshard is False


def test_the_budget_can_hold_reserved_bytes(small: Fixture, tmp_path: Path) -> None:
    workload, graph = small
    model = ExplorerModel(
        graph, "default", workload=workload, autosave=tmp_path / "p.json", budget_kind="reserved"
    )
    ends = [model.estimator.estimate(Policy(p)) for p in ("full", "none")]
    assert model.budget_range["min"] == min(e.reserved_peak_bytes for e in ends)
    assert model.budget_range["max"] == max(e.reserved_peak_bytes for e in ends)
    assert all(e.reserved_peak_bytes > e.peak_bytes for e in ends)
    model.suggest(model.budget_range["max"])
    assert "(reserved)" in model.message
    assert model.estimate.reserved_peak_bytes <= model.budget_range["max"]
    with pytest.raises(WorkbenchError, match="unknown budget kind 'free'"):
        ExplorerModel(graph, budget_kind="free", autosave=tmp_path / "q.json")  # type: ignore[arg-type]


# --- pictures that fill the panel and stay legible (issue 27, items 5-8) --------------------


def test_views_are_arranged_to_the_panel_the_front_end_reports(
    small: Fixture, tmp_path: Path
) -> None:
    model = model_of(small, tmp_path)
    model.show("module:layers.0.attention")
    wide = model.picture.arrangement
    assert wide.startswith("TB/")  # a tall chain in a 1.6:1 panel wraps into columns
    model.set_graph_aspect(0.5)  # a tall, narrow panel: drawn top to bottom again
    assert model.graph_aspect == 0.5 and model.picture.arrangement == "TB"
    model.set_graph_aspect(1.6)
    assert model.picture.arrangement == wide
    assert model.canvas.arranged[("module:layers.0.attention", 1.6)] == wide  # once per panel
    for bad, said in (
        (0.0, "must lie in 0.1–10.0"),
        (float("inf"), "must lie in"),
        (float("nan"), "must lie in"),
        ("wide", "must be a number, not str"),
        (True, "must be a number, not bool"),
    ):
        with pytest.raises(WorkbenchError, match=said):
            model.set_graph_aspect(bad)  # type: ignore[arg-type]
    assert model.graph_aspect == 1.6


def test_go_to_peak_focuses_the_peak_op_with_its_neighbours(small: Fixture, tmp_path: Path) -> None:
    model = model_of(small, tmp_path)
    model.go_to_peak()
    focus = model.focus
    assert focus["id"] in focus["ids"] and focus["ids"] == model.picture.around(focus["id"])
    neighbours = set(focus["ids"]) - {focus["id"]}
    assert neighbours and all(
        (focus["id"], n) in model.picture.links or (n, focus["id"]) in model.picture.links
        for n in neighbours
    )
    serial = focus["serial"]
    model.go_to_peak()
    assert model.focus["serial"] > serial  # a new request: the front end focuses again


def test_the_legend_lists_every_shade_the_view_can_show(small: Fixture, tmp_path: Path) -> None:
    model = model_of(small, tmp_path)
    model.show("layer:0")
    rows = [tuple(row) for row in model.legend["rows"]]
    drawn = len(model.picture.legend_rows)
    assert rows[:drawn] == model.picture.legend_rows  # the static render's rows, one source
    for kind in ("must_recompute", "must_save", "forced_save", "prefer_save", "backward"):
        assert (KIND_STYLE[kind][0]["fillcolor"], KIND_STYLE[kind][1]) in rows
    # then the explorer's outlines, each with its look: the selected op, the peak (Go to peak)
    assert rows[drawn:] == [(c, words, look) for c, look, words in OUTLINES.values()]
    css = (Path(panels.__file__).parent / "explorer.css").read_text()
    for kind, cls in (("selected", "sacwb-selected"), ("peak", "sacwb-peak-node")):
        colour, look, _ = OUTLINES[kind]
        rule = css.split(f"g.{cls} path {{", 1)[1].split("}", 1)[0]
        assert f"stroke: {colour.lower()};" in rule and ("dasharray" in rule) == (look == "dashed")
    assert "8e44ad" not in css  # the peak no longer looks like a forced save's purple
    model.show("overview")
    assert [row[0] for row in model.legend["rows"]][:2] == [SKY, ORANGE]


def test_timeline_labels_never_overlap(small: Fixture) -> None:
    graph = small[1]
    estimator = Estimator(graph, ["h100"])
    decisions = decide(graph, Policy("default"))
    est = estimator.estimate(decisions)
    peak_op = estimator.traced_node(est.peak_node)
    timeline = timeline_panel(est, estimator, decisions, peak_op)  # selected where the peak is
    placed, width = timeline["placed"], timeline["width"]
    assert set(placed) == set(timeline["marks"])
    spans = []
    for kind, spot in placed.items():
        x = timeline["marks"][kind] * width
        text = len(timeline["labels"][kind]) * LABEL_CHAR_PX
        left = x + 2 if spot["anchor"] == "start" else x - 2 - text
        assert 0 <= left and left + text <= width  # inside the plot
        spans.append((spot["row"], left, left + text))
    for i, (row, a, b) in enumerate(spans):
        assert all(row != r or b < c or d < a for r, c, d in spans[i + 1 :])
    assert len({row for row, _, _ in spans}) > 1  # the peak's and the op's labels: two rows
