"""`floor_search`: the lowest peak at eager's step time, with and without offload, and the
floor; its figures keep the relations that must hold and are the policies' own; the `floor`
command."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cost.estimate import Estimator
from workbench.decide.decider import decide, rules_of
from workbench.decide.offloadable import offload_refusal_in
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.search.floor import floor_policy, floor_search, floor_table
from workbench.search.solve import SolveOptions


@pytest.fixture(scope="module")
def offload_graph() -> JointGraph:
    """Three layers of 1,024 tokens: activations weigh enough that offload pays at eager's
    step time (with two layers only the first may offload, and it does not)."""
    return trace(load_workload("llama3-debug", device="meta", layers=3, seq=1024), "fake")


@pytest.fixture(scope="module")
def offload_result(offload_graph: JointGraph) -> dict[str, Any]:
    estimator = Estimator(offload_graph, ("h100",), "adamw")
    return floor_search(offload_graph, estimator, SolveOptions(host_budget_bytes=2**30))


def test_floor_search_keeps_the_relations_that_must_hold(offload_result: dict[str, Any]) -> None:
    eager, floor = offload_result["eager"], offload_result["floor"]
    without, moved = offload_result["without_offload"], offload_result["with_offload"]
    assert floor["peak_bytes"] <= moved["peak_bytes"] <= without["peak_bytes"]
    assert without["peak_bytes"] <= eager["peak_bytes"]
    assert moved["peak_bytes"] < without["peak_bytes"]  # offload pays on this shape
    limit = eager["est_step_seconds"] * (1 + offload_result["search"]["step_rtol"])
    assert without["est_step_seconds"] <= limit and moved["est_step_seconds"] <= limit
    assert without["host_peak_bytes"] == without["offloaded_bytes"] == 0
    assert 0 < moved["host_peak_bytes"] <= offload_result["host_budget_bytes"]
    for row in (without, moved, floor):
        assert row["below_eager_pct"] == round(
            100 * (1 - row["peak_bytes"] / eager["peak_bytes"]), 2
        )
    solves = offload_result["search"]["solves"]
    assert solves["without_offload"] > 1 and solves["with_offload"] > 1
    assert floor["peak_phase"] in ("forward", "loss", "backward") and floor["state_bytes"] > 0
    assert "eager" in floor_table(offload_result).splitlines()[2]
    stated = floor_table({**offload_result, "time_basis": {"h100": "roofline at X"}})
    assert "step time: roofline at X" in stated.splitlines()  # the basis `floor` adds


def test_floor_search_figures_are_the_policies_own(
    offload_graph: JointGraph, offload_result: dict[str, Any]
) -> None:
    estimator = Estimator(offload_graph, ("h100",), "adamw")
    assert offload_result["eager"]["peak_bytes"] == estimator.estimate(Policy("eager")).peak_bytes
    for key in ("without_offload", "with_offload", "floor"):
        row = offload_result[key]
        est = estimator.estimate(Policy.from_json(row["policy"]))
        assert (row["peak_bytes"], row["host_peak_bytes"], row["offloaded_bytes"]) == (
            est.peak_bytes,
            est.host_peak_bytes,
            est.offloaded_bytes,
        )
        assert row["est_step_seconds"] == est.step_seconds["h100"]
        assert row["exposed_transfer_seconds"] == est.exposed_transfer_seconds["h100"]
    floor = estimator.estimate(Policy.from_json(offload_result["floor"]["policy"]))
    assert offload_result["floor"]["peak_node"] == floor.peak_node


def test_floor_policy_offloads_what_full_recompute_keeps(
    offload_graph: JointGraph,
) -> None:
    full = decide(offload_graph, Policy("full"))
    floor = decide(offload_graph, floor_policy(offload_graph))
    tables = rules_of(offload_graph).tables
    may = {
        name
        for name, tag in full.items()
        if not tag.recompute and offload_refusal_in(tables, full, name, "full") is None
    }
    assert may and {name for name, tag in floor.items() if tag.offload} == may
    assert {n for n, t in floor.items() if t.recompute} == {
        n for n, t in full.items() if t.recompute
    }
    estimator = Estimator(offload_graph, ("h100",))
    floor_peak = estimator.estimate(floor_policy(offload_graph)).peak_bytes
    assert floor_peak < estimator.estimate(Policy("full")).peak_bytes


def test_floor_cli(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--model", "llama3-debug", "--layers", "2", "--seq", "32", "--mode", "fake"]
    assert main(["floor", *shape, "--optimizer", "none", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert captured.err == ""
    assert {"eager", "without_offload", "with_offload", "floor", "search", "seconds"} <= set(result)
    assert result["optimizer"] == "none" and result["host_budget_bytes"] == 64 * 2**30
    assert {"peak_bytes", "host_peak_bytes", "est_step_seconds", "below_eager_pct"} <= set(
        result["with_offload"]
    )
    assert main(["floor", *shape, "--host-budget-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert "solver, host 0 GiB" in out and "below eager" in out and "(greedy)" in out


def test_floor_search_refuses_what_it_cannot_answer(offload_graph: JointGraph) -> None:
    estimator = Estimator(offload_graph, ("h100",))
    with pytest.raises(WorkbenchError, match="bisects on step time"):
        floor_search(offload_graph, estimator, SolveOptions(objective="recompute_flops"))
    with pytest.raises(WorkbenchError, match="no profile 'cpu'"):
        floor_search(offload_graph, estimator, SolveOptions(profile="cpu"))
    with pytest.raises(WorkbenchError, match="tolerance_bytes must be 1 or more"):
        floor_search(offload_graph, estimator, tolerance_bytes=0)


def test_floor_search_searches_with_the_solvers_method_asked(offload_graph: JointGraph) -> None:
    estimator = Estimator(offload_graph, ("h100",), "adamw")
    options = SolveOptions(method="knapsack", host_budget_bytes=2**30)
    result = floor_search(offload_graph, estimator, options)
    assert result["search"]["method"] == "knapsack" and "(knapsack)" in result["search"]["how"]
    for key in ("without_offload", "with_offload"):  # knapsack's own answers, re-estimated
        row = result[key]
        est = estimator.estimate(Policy.from_json(row["policy"]))
        assert row["peak_bytes"] == est.peak_bytes <= result["eager"]["peak_bytes"]
        assert row["est_step_seconds"] <= result["eager"]["est_step_seconds"] * (1 + 1e-9)
