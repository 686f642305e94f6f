"""Remat with torch's own pass: reports, numerics bitwise equal to eager, loud failures."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_facts import read_by_backward
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.capture.workload import eager_step
from workbench.cost.estimate import estimate
from workbench.decide.decider import decide, node_keys
from workbench.decide.policy import Policy
from workbench.decide.tags import Tag, Why
from workbench.errors import WorkbenchError
from workbench.rewrite.remat import RematWarning, remat, tag_graph

Fixture = tuple[Workload, JointGraph]
PRESETS = ["none", "default", "eager", "full"]


def assert_bitwise(
    graph: JointGraph, traced: list[torch.Tensor], eager: list[torch.Tensor]
) -> None:
    for name, a, b in zip(["loss", *graph.param_names], traced, eager, strict=True):
        assert torch.equal(a, b), f"{name} differs from eager"


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fixture", ["llama_debug", "dsv3_debug"])
def test_every_preset_is_bitwise_equal_to_eager(
    fixture: str, preset: str, request: pytest.FixtureRequest
) -> None:
    workload, graph = request.getfixturevalue(fixture)
    result = remat(graph, Policy(preset))
    assert graph.example_inputs is not None
    assert_bitwise(graph, result.run(graph.example_inputs), eager_step(workload))
    report = result.report
    assert report.problems == []
    assert report.tagged_save + report.tagged_recompute == len(result.decisions)
    if preset == "none":
        assert report.recomputed_nodes == [] and report.bytes_no_longer_saved == 0
    else:
        assert report.recomputed_nodes and report.bytes_no_longer_saved > 0
        assert report.saved_bytes_after < report.saved_bytes_before


def test_recomputed_nodes_are_the_tagged_ones(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    result = remat(graph, Policy("default"))
    decisions = result.decisions
    assert all(decisions[n].recompute for n in result.report.recomputed_nodes)
    copies = [n for n in result.gm.graph.nodes if n.name.endswith("_recomputed")]
    assert all(n.meta.get("autograd_backward") for n in copies)
    # nothing tagged recompute is still read by backward from the forward region
    direct = read_by_backward(graph, result.gm)
    assert not [n for n in direct if decisions.get(n, None) and decisions[n].recompute]


def test_more_recompute_saves_less(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    saved = {p: remat(graph, Policy(p)).report.saved_bytes_after for p in PRESETS}
    assert saved["full"] < saved["default"] < saved["none"]
    assert saved["eager"] < saved["none"]


def test_joint_graph_is_left_untouched(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    before = [(n.name, dict(n.meta).get("recompute")) for n in graph.gm.graph.nodes]
    remat(graph, Policy("full"))
    after = [(n.name, dict(n.meta).get("recompute")) for n in graph.gm.graph.nodes]
    assert before == after
    assert all(tag is None for _, tag in after)


def test_tag_graph_tags_only_forward(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    gm = tag_graph(graph, decide(graph, Policy("full")))
    for node in gm.graph.nodes:
        if node.meta.get("autograd_backward"):
            assert "recompute" not in node.meta
    backward = next(i.name for i in graph.ops() if i.phase == "backward")
    bad = {backward: Tag(CheckpointPolicy.MUST_SAVE, Why.OVERRIDE, "test")}
    with pytest.raises(WorkbenchError, match="refusing to tag backward node"):
        tag_graph(graph, bad)


def test_nothing_recomputed_is_said_loudly(llama_debug: Fixture) -> None:
    """A graph whose backward lost its autograd_backward marks: remat silently does nothing."""
    _, graph = llama_debug
    from workbench.rewrite.remat import copy_graph_module

    gm = copy_graph_module(graph.gm)
    for node in gm.graph.nodes:
        node.meta.pop("autograd_backward", None)
    unmarked = dataclasses.replace(graph, gm=gm)
    with pytest.warns(RematWarning) as caught:
        result = remat(unmarked, decide(graph, Policy("full")))
    assert "recomputed nothing" in result.report.problems[0]
    assert "still saved" in result.report.problems[1]
    assert [str(w.message) for w in caught] == result.report.problems


def test_saved_bytes_of_the_traced_graph_are_the_no_ac_estimate(llama_debug: Fixture) -> None:
    """Before remat, the report's saved bytes are autograd's: the `none` estimate's."""
    _, graph = llama_debug
    report = remat(graph, Policy("none")).report
    saved = report.saved_bytes_by_node_before
    assert saved and all(graph.nodes[n].phase in ("forward", "loss") for n in saved)
    assert report.saved_bytes_before == report.saved_bytes_after
    assert report.saved_bytes_before == estimate(graph, Policy("none")).saved_activation_bytes
    # views are followed to their base: no view owns kept bytes
    assert not [n for n in saved if graph.nodes[n].is_view]


@pytest.fixture(scope="module", params=["llama3-debug", "dsv3-debug"])
def small(request: pytest.FixtureRequest) -> Fixture:
    workload = load_workload(request.param, layers=2, seq=32)
    return workload, trace(workload)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_policies_are_bitwise_equal(small: Fixture, data: st.DataObject) -> None:
    workload, graph = small
    keys = sorted(set(node_keys(graph).values()))
    preset = data.draw(st.sampled_from(PRESETS))
    chosen = data.draw(st.lists(st.sampled_from(keys), max_size=40, unique=True))
    actions = data.draw(
        st.lists(st.sampled_from(["save", "recompute"]), min_size=len(chosen), max_size=len(chosen))
    )
    policy = Policy(preset, overrides=dict(zip(chosen, actions, strict=True)))
    result = remat(graph, policy)
    assert graph.example_inputs is not None
    assert_bitwise(graph, result.run(graph.example_inputs), eager_step(workload))
    assert result.report.problems == []


def test_region_summary_of_the_router() -> None:
    from workbench.capture.models import load_workload
    from workbench.capture.trace import trace
    from workbench.decide.policy import Policy, Selector
    from workbench.rewrite.remat import region_summary

    graph = trace(load_workload("dsv3-debug", layers=2, seq=16), mode="real")
    gate = "layers.*.feed_forward.router.gate::aten.mm.default"
    router = "layers.1.feed_forward.router"
    saved = region_summary(graph, remat(graph, Policy("full", [Selector(gate, "save")])), router)
    again = region_summary(graph, remat(graph, Policy("full")), router)
    assert [graph.nodes[n].op for n in saved.kept] == ["aten.mm.default"]
    assert saved.kept_bytes == graph.nodes[saved.kept[0]].bytes
    assert again.kept == [] and "mm" in again.recomputed_ops and "topk" in again.recomputed_ops
    assert "mm" not in saved.recomputed_ops


def test_traced_info_maps_a_rewritten_node_to_its_trace(small_graphs: dict[str, Fixture]) -> None:
    """Copies torch's pass makes (`*_recomputed`) and the offload pass's steps: the first map
    to the traced node they copy, the second to none; another trace's nodes to none."""
    _, graph = small_graphs["llama3-debug"]
    _, other = small_graphs["dsv3-debug"]
    result = remat(graph, Policy("offload"))
    copies = [n for n in result.gm.graph.nodes if n.name.endswith("_recomputed")]
    assert copies and all(
        graph.traced_info(n) is graph.nodes[n.name.removesuffix("_recomputed")] for n in copies
    )
    added = [n for n in result.gm.graph.nodes if "workbench" in str(n.target)]
    assert added and all(graph.traced_info(n) is None for n in added)
    assert all(other.traced_info(n) is None for n in graph.gm.graph.nodes)
