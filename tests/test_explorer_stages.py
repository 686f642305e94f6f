"""The explorer on a pipelined job (llama3-debug, pp 2, fake): the strip's figures are the
pipeline estimate's, a flip changes its own stage's policy only and moves the peak of its rank
only, opening a stage shows that stage's graph, and per-stage policies survive a new session."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.stages import Pipeline, StageLayout, trace_stages
from workbench.cost.stages import PipelineModel
from workbench.decide.decider import decidable
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.search.stages import solve_stages
from workbench.show.viz.stages import layers_words, stage_rows, stage_strip
from workbench.show.widgets import PolicyExplorer
from workbench.show.widgets.stages import STAGES_STATE, StagesModel
from workbench.units import format_seconds

Job = tuple[list[JointGraph], StageLayout]


def _job(schedule: str, layers: int) -> Job:
    pipeline = Pipeline(pp=2, schedule=schedule, microbatches=4)
    workload = load_workload("llama3-debug", layers=layers, batch=4, seq=32, device="meta")
    return trace_stages(workload, "fake", None, pipeline), pipeline.layout(layers)


@pytest.fixture(scope="module")
def one_f_one_b() -> Job:
    return _job("1F1B", 2)


@pytest.fixture(scope="module")
def interleaved() -> Job:
    return _job("Interleaved1F1B", 4)


@pytest.fixture(autouse=True)
def _autosave_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAC_WORKBENCH_AUTOSAVE_DIR", str(tmp_path))


def _figures(rows: list[dict[str, object]]) -> list[tuple[object, ...]]:
    keys = ("stage", "rank", "peak_bytes", "inflight_microbatches")
    return [tuple(r[k] for k in keys) for r in rows]


def _expected(job: Job, policies: list[Policy]) -> list[tuple[object, ...]]:
    """The same figures from a fresh `PipelineModel` of the same graphs and policies."""
    estimate = PipelineModel(*job).estimate(policies)
    keys = ("stage", "rank", "peak_bytes", "inflight_microbatches")
    return [tuple(getattr(row, k) for k in keys) for row in estimate.schedule.stages]


def _biggest_saved(model: StagesModel, stage: int) -> str:
    """The forward op of `stage` whose saved output is the largest: flipping it must move
    its rank's peak."""
    explorer = model.open(stage)
    saved = [
        info
        for info in explorer.graph.nodes.values()
        if decidable(info) and explorer.decisions[info.name].action == "save"
    ]
    return max(saved, key=lambda info: info.bytes).name


@pytest.mark.parametrize("job_name", ["one_f_one_b", "interleaved"])
def test_a_flip_moves_its_stage_policy_and_its_rank_peak_only(
    job_name: str, request: pytest.FixtureRequest
) -> None:
    job: Job = request.getfixturevalue(job_name)
    model = StagesModel(*job, "default")
    assert _figures(model.rows) == _expected(job, [Policy("default")] * job[1].n_stages)
    before = {r["stage"]: r["peak_bytes"] for r in model.rows}
    flipped = 1
    model.flip(flipped, _biggest_saved(model, flipped))
    assert model.policies[flipped] != Policy("default")
    assert all(p == Policy("default") for s, p in enumerate(model.policies) if s != flipped)
    assert _figures(model.rows) == _expected(job, model.policies)
    rank = job[1].ranks[flipped]
    for row in model.rows:  # 1F1B: stage 1's rank; interleaved: both stages of that rank
        moved = row["peak_bytes"] != before[row["stage"]]
        assert moved == (row["rank"] == rank), row
    assert [r["policy"] for r in model.rows][flipped] == "default + 1 edits"


def test_opening_a_stage_shows_its_graph_and_policy(one_f_one_b: Job) -> None:
    graphs, layout = one_f_one_b
    model = StagesModel(graphs, layout, ["default", "full"])
    for stage in (1, 0):
        explorer = model.open(stage)
        assert explorer.graph is graphs[stage] and model.stage == stage
        assert explorer.policy == model.policies[stage]
        assert explorer.svg and explorer.metrics["peak_bytes"] > 0
    assert model.policies == [Policy("default"), Policy("full")]
    assert model.open(1) is model.explorers[1]  # kept, with its undo stack
    data = model.to_json()
    assert data["open_stage"] == 1 and data["policies"][1]["preset"] == "full"
    assert data["peak_bytes"] == max(r["peak_bytes"] for r in data["rows"])
    assert [r["peak_bytes"] for r in data["stages"]] == [r["peak_bytes"] for r in model.rows]
    assert repr(model) == "StagesModel(1F1B, pp 2, 2 stages)"


def test_tracing_a_workload_gives_the_same_strip(one_f_one_b: Job) -> None:
    workload = load_workload("llama3-debug", layers=2, batch=4, seq=32, device="meta")
    traced = StagesModel.trace(workload, Pipeline(pp=2, microbatches=4), policy="full")
    assert _figures(traced.rows) == _expected(one_f_one_b, [Policy("full")] * 2)
    assert traced.strip()._repr_svg_() == traced.stages_svg


def test_set_policy_is_per_stage_and_kept_by_the_next_session(one_f_one_b: Job) -> None:
    graphs, layout = one_f_one_b
    model = StagesModel(graphs, layout)
    model.set_policy(0, "full")  # a closed stage: autosaved directly
    model.open(1)
    model.set_policy(1, "none")  # an open one: through its explorer, undoable
    assert model.policies == [Policy("full"), Policy("none")]
    assert _figures(model.rows) == _expected(one_f_one_b, model.policies)
    model.explorers[1].undo()
    model.sync()
    assert model.policies == [Policy("full"), Policy("default")]
    again = StagesModel(graphs, layout)
    assert again.policies == [Policy("full"), Policy("default")]


def test_the_strip_draws_one_cell_per_stage(interleaved: Job) -> None:
    model = StagesModel(*interleaved, budget_bytes=1)
    model.set_budget(max(r["peak_bytes"] for r in model.rows) - 1)
    model.open(2)
    svg = model.strip().svg()
    assert re.findall(r'data-stage="(\d+)"', svg) == ["0", "1", "2", "3"]
    cell = svg.split('data-stage="2"', 1)[1].split("</g>", 1)[0]
    assert "stage 2 · rank 0 · open" in cell and 'stroke-width="3"' in cell
    over = [r for r in model.rows if not r["fits"]]
    assert over and all(r["budget_fraction"] > 1 for r in over)
    assert svg.count("<line") == 4  # the budget mark in every cell
    for row in model.rows:
        assert f"rank peak {row['peak']}" in svg
    assert stage_strip(model.estimate, ["a"] * 4).selected is None
    assert "of the largest peak" not in svg


def test_the_strip_says_its_figures_in_units(one_f_one_b: Job) -> None:
    """One microbatch in flight is one microbatch; the step time reads as format_seconds
    writes it (`13.82 s`, never `13821.98 ms`)."""
    model = StagesModel(*one_f_one_b)
    svg = model.stages_svg
    inflight = {r["stage"]: r["inflight_microbatches"] for r in model.rows}
    assert 1 in inflight.values() and "1 microbatch in flight" in svg
    assert "1 microbatches" not in svg and "4 microbatches ·" in svg
    step = format_seconds(model.estimate.schedule.step_seconds)
    assert f"step {step} on h100" in svg
    assert not re.search(r"\d{4,}\.\d+ ms", svg)


def test_stage_rows_and_words(one_f_one_b: Job) -> None:
    estimate = PipelineModel(*one_f_one_b).estimate(Policy("default"))
    rows = stage_rows(estimate, ["default", "default"])
    assert [r["holds"] for r in rows] == ["embedding + layer 0", "layer 1 + norm, output"]
    assert rows[0]["fits"] is None and rows[0]["budget_fraction"] is None
    assert layers_words([2, 3, 4], False, False) == "layers 2–4"
    with pytest.raises(WorkbenchError, match="one policy label per stage"):
        stage_rows(estimate, ["default"])


def test_widget_opens_stages_and_flips_within_one(one_f_one_b: Job) -> None:
    widget = PolicyExplorer.pipeline(*one_f_one_b, budget_bytes=2**30)
    assert widget.stage == 0 and len(widget.stages) == 2 and "data-stage" in widget.stages_svg
    widget.set_trait("profile", "h200")
    widget._on_msg(widget, {"type": "stage", "stage": 1}, None)
    assert widget.stage == 1 and widget.graph is one_f_one_b[0][1]
    assert widget.profile == "h200" and "stage 1 open" in widget.message
    assert widget.stages_model is not None
    name = _biggest_saved(widget.stages_model, 1)
    peaks = [r["peak_bytes"] for r in widget.stages]
    widget.flip(name)
    assert [r["policy"] for r in widget.stages] == ["default", "default + 1 edits"]
    assert widget.stages[0]["peak_bytes"] == peaks[0]
    assert widget.stages[1]["peak_bytes"] != peaks[1]
    assert _figures(widget.stages) == _expected(one_f_one_b, widget.stages_model.policies)
    for state in STAGES_STATE:
        assert getattr(widget, state) == getattr(widget.stages_model, state), state
    widget._on_msg(widget, {"type": "stage", "stage": 7}, None)
    assert widget.stage == 1 and "--stage" in widget.message
    widget.open_stage(0)
    assert widget.stage == 0 and widget.policy == Policy("default")
    widget.set_stage_budget(widget.stages[0]["peak_bytes"] // 2)
    assert widget.stages[0]["fits"] is False and "budget" in widget.stages_svg
    assert repr(widget) == "PolicyExplorer(llama3-debug, stage 0, policy default)"


def test_every_focus_request_is_new_whatever_the_stage(one_f_one_b: Job) -> None:
    """Find and Go to peak in one stage, then another: each request carries a number the
    front end has not seen (it drops one it has handled), also across the stages' sessions."""
    widget = PolicyExplorer.pipeline(*one_f_one_b)
    serials = []
    for stage in (1, 0, 1):
        widget.open_stage(stage)
        widget.search("wo")
        serials.append(widget.focus["serial"])
        assert widget.focus["id"] == widget.selected_id and widget.view.startswith("layer:")
        widget.go_to_peak()
        serials.append(widget.focus["serial"])
    assert serials == sorted(set(serials)), serials


def test_widget_refuses_stages_on_one_graph(one_f_one_b: Job) -> None:
    widget = PolicyExplorer(one_f_one_b[0][0])
    with pytest.raises(WorkbenchError, match="PolicyExplorer.pipeline"):
        widget.open_stage(1)
    with pytest.raises(WorkbenchError, match="PolicyExplorer.pipeline"):
        widget.set_stage_budget(2**30)
    assert widget.stages == [] and widget.stage == -1


def test_suggest_gives_each_stage_the_solver_policy(one_f_one_b: Job) -> None:
    """Suggest puts `solve_stages`' policies on the stages, and the strip's peaks fit."""
    model = StagesModel(*one_f_one_b, policy="none")
    with pytest.raises(WorkbenchError, match="needs a per-GPU budget"):
        model.suggest()
    full = PipelineModel(*one_f_one_b).estimate(Policy("full")).peak_bytes
    none = model.estimate.peak_bytes
    budget = (full + none) // 2
    model.set_budget(budget)
    assert "within" in model.suggest()
    plan = solve_stages(PipelineModel(*one_f_one_b), budget)
    assert model.policies == plan.policies
    assert all(row["fits"] for row in model.rows)
    widget = PolicyExplorer.pipeline(*one_f_one_b, policy="none", budget_bytes=budget)
    assert "within" in widget.suggest_stages()
    assert widget.policy == plan.policies[0] and all(r["fits"] for r in widget.stages)


def test_a_pipelined_suggest_and_sweep_are_per_gpu(one_f_one_b: Job) -> None:
    """The Suggest slider, Suggest, Sweep and the history of a pipelined explorer are in
    per-GPU terms over the schedule: Suggest from the front end gives every stage its plan
    and every rank's pipelined peak fits, never one stage's one-microbatch graph alone."""
    widget = PolicyExplorer.pipeline(*one_f_one_b, policy="none")
    stages = widget.stages_model
    assert stages is not None
    pipeline = PipelineModel(*one_f_one_b)
    full = pipeline.estimate(Policy("full")).peak_bytes
    none = pipeline.estimate(Policy("none")).peak_bytes
    assert (widget.budget_range["min"], widget.budget_range["max"]) == (full, none)
    assert "per GPU" in widget.budget_range["note"]
    assert widget.budget_range != stages.explorers[0].budget_range  # not the stage's own
    budget = widget.budget_range["stops"][len(widget.budget_range["stops"]) // 2]
    reply = widget._act({"type": "suggest", "budget": budget})
    assert reply["ok"] and "per GPU over the schedule" in widget.message, widget.message
    assert stages.budget_bytes == budget and widget.budget_range["start"] == budget
    assert all(row["fits"] for row in widget.stages)
    assert max(r["peak_bytes"] for r in widget.stages) <= budget
    assert stages.policies == solve_stages(pipeline, budget).policies
    assert widget.history == stages.history and widget.history[-1]["current"]
    assert widget.history[-1]["solver"] == "per stage" and not widget.running
    assert widget._act({"type": "sweep"})["ok"] and "per-GPU budgets" in widget.message
    points = widget.history
    assert len(points) > 2 and all(len(p["policy"]["stages"]) == 2 for p in points)
    assert widget.history_plots[0]["title"].startswith("per GPU over the schedule")
    start = [Policy("none").to_json()] * 2  # where the session started, and a Sweep point
    first = next(p for p in points if p["policy"]["stages"] == start)
    assert first["name"].endswith("none on every stage") and first["peak_bytes"] == none
    assert widget._act({"type": "restore", "index": first["index"]})["ok"]
    assert stages.policies == [Policy("none")] * 2 and widget.policy == Policy("none")
    assert widget.stages[0]["peak_bytes"] == stages.estimate.schedule.stages[0].peak_bytes
