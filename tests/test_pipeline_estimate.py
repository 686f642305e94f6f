"""Pipelined estimates: a stage's phases from its graph, per-stage policies under one budget."""

from __future__ import annotations

import dataclasses

import pytest

from workbench.capture.models import load_workload
from workbench.capture.stages import Pipeline, trace_stages
from workbench.cost.estimate import Estimator
from workbench.cost.stages import PipelineModel, stage_cost
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.rewrite.di_dw import split_di_dw, weight_grad_nodes
from workbench.search.stages import solve_stages, stage_ladders


@pytest.fixture(scope="module")
def stages() -> tuple[Pipeline, list]:
    workload = load_workload("llama3-debug", layers=4, batch=4, seq=32, device="meta")
    pipeline = Pipeline(pp=2, microbatches=4)
    return pipeline, trace_stages(workload, "fake", None, pipeline)


def test_forward_leaves_what_backward_reads(stages: tuple[Pipeline, list]) -> None:
    """A microbatch holds, from its forward to its backward, exactly the saved activations,
    the stage's output (kept for its backward; the loss on the last) and what it received."""
    _, graphs = stages
    for graph in graphs:
        estimator = Estimator(graph, profiles=["h100"])
        for preset in ("none", "full"):
            est = estimator.estimate(Policy(preset))
            cost = stage_cost(graph, est, estimator, "h100", graph.config["stage"]["stage"])
            received = sum(
                graph.nodes[s.placeholder].bytes
                for s in graph.inputs
                if s.fqn in ("inputs[0]", "target")
            )
            output = graph.gm.graph.output_node().args[0][0]
            held = est.saved_activation_bytes + received
            held += graph.nodes[output.name].bytes
            assert cost.phases["F"].residue_bytes == held
            assert cost.phases["B"].residue_bytes == 0
            assert cost.grad_bytes == sum(
                graph.nodes[n.name].bytes
                for n in graph.gm.graph.output_node().args[0][1 : 1 + len(graph.param_names)]
            )


def test_di_dw_split_keeps_the_graph(stages: tuple[Pipeline, list]) -> None:
    _, graphs = stages
    last = graphs[1]
    split = split_di_dw(last)
    weights = weight_grad_nodes(last)
    assert weights and set(split.nodes) == set(last.nodes)
    order = list(split.nodes)
    first_weight = order.index(split.config["weight_grads_from"])
    assert all(order.index(w) >= first_weight for w in weights)
    # every input-gradient op runs before the first weight-gradient op
    assert all(
        order.index(n) < first_weight
        for n, info in last.nodes.items()
        if info.phase == "backward" and n not in weights
    )
    with pytest.raises(WorkbenchError, match="a pipeline of 4 stages needs a graph per stage"):
        PipelineModel(graphs, Pipeline(pp=2, schedule="ZBVZeroBubble", microbatches=4).layout(4))
    with pytest.raises(WorkbenchError, match="not a pipeline stage"):
        weight_grad_nodes(dataclasses.replace(last, config={}))


def test_more_recompute_lowers_every_rank(stages: tuple[Pipeline, list]) -> None:
    pipeline, graphs = stages
    model = PipelineModel(graphs, pipeline.layout(4))
    none, full = model.estimate(Policy("none")), model.estimate(Policy("full"))
    assert full.peak_bytes < none.peak_bytes
    rows = full.to_json()["stages"]
    assert [r["stage"] for r in rows] == [0, 1] and full.to_json()["peak_bytes"] == max(
        r["peak_bytes"] for r in rows
    )
    assert rows[0]["inflight_microbatches"] == 2  # 1F1B: rank 0 holds pp microbatches


def test_per_stage_policies_fit_a_budget_one_policy_cannot_beat(
    stages: tuple[Pipeline, list],
) -> None:
    pipeline, graphs = stages
    model = PipelineModel(graphs, pipeline.layout(4))
    ladders = stage_ladders(model)
    floor = model.estimate([ladder[-1] for ladder in ladders]).peak_bytes
    top = model.estimate([ladder[0] for ladder in ladders]).peak_bytes
    for budget in (top, (floor + top) // 2, floor):
        mixed = solve_stages(model, budget, ladders=ladders)
        uniform = solve_stages(model, budget, per_stage=False, ladders=ladders)
        assert mixed.feasible and mixed.estimate.peak_bytes <= budget
        assert mixed.estimate.schedule.step_seconds <= uniform.estimate.schedule.step_seconds
    below = solve_stages(model, floor - 1, ladders=ladders)
    assert not below.feasible and below.estimate.peak_bytes == floor
