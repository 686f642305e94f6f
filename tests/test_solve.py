"""Policy search: budgets met by the exact estimate, presets beaten, solutions that remat."""

from __future__ import annotations

import json

import pytest
import torch

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.workload import eager_step
from workbench.cli import main
from workbench.cost.estimate import Estimator
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.interop.export import export
from workbench.rewrite.remat import remat
from workbench.search.solve import _search, pareto, solve

Fixture = tuple[Workload, JointGraph]
PROFILES = ("h100",)


@pytest.mark.parametrize("preset", ["default", "eager", "full"])
@pytest.mark.parametrize("fixture", ["llama_debug", "dsv3_debug"])
def test_solve_within_a_presets_peak_recomputes_no_more(
    fixture: str, preset: str, request: pytest.FixtureRequest
) -> None:
    _, graph = request.getfixturevalue(fixture)
    estimator = Estimator(graph, PROFILES)
    reference = estimator.estimate(Policy(preset))
    for objective in ("recompute_flops", "recompute_time"):
        found = solve(graph, reference.peak_bytes, objective=objective, estimator=estimator)
        assert found.estimate.peak_bytes <= reference.peak_bytes
        assert found.estimate == estimator.estimate(found.policy)  # the exact estimate
        if objective == "recompute_flops":
            assert found.estimate.recompute_flops <= reference.recompute_flops
        else:
            assert found.estimate.recompute_seconds["h100"] <= reference.recompute_seconds["h100"]


@pytest.mark.parametrize("fixture", ["llama_debug", "dsv3_debug"])
def test_greedy_and_knapsack_within_5_percent_of_exact(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    _, graph = request.getfixturevalue(fixture)
    estimator = Estimator(graph, PROFILES)
    budget = estimator.estimate(Policy("eager")).peak_bytes
    exact = solve(graph, budget, method="exact", estimator=estimator)
    best = exact.estimate.recompute_seconds["h100"]
    for method in ("greedy", "knapsack"):
        found = solve(graph, budget, method=method, estimator=estimator)
        assert found.estimate.peak_bytes <= budget
        assert found.estimate.recompute_seconds["h100"] <= 1.05 * best, method


@pytest.mark.parametrize("fixture", ["llama_debug", "dsv3_debug"])
def test_solved_policy_remats_bitwise_equal_and_exports(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    workload, graph = request.getfixturevalue(fixture)
    estimator = Estimator(graph, PROFILES)
    full, none = (estimator.estimate(Policy(p)).peak_bytes for p in ("full", "none"))
    found = solve(graph, (full + none) // 2, estimator=estimator)
    assert found.policy.overrides  # something between the presets
    result = remat(graph, found.policy)
    assert result.report.problems == []
    assert graph.example_inputs is not None
    traced, eager = result.run(graph.example_inputs), eager_step(workload)
    for name, a, b in zip(["loss", *graph.param_names], traced, eager, strict=True):
        assert torch.equal(a, b), f"{name} differs from eager"
    code = export(found.policy, "policy_fn")
    compile(code, "<policy_fn>", "exec")
    assert Policy.from_json(json.loads(json.dumps(found.policy.to_json()))) == found.policy


def test_full_and_none_forms_decide_alike(small_graphs: dict[str, Fixture]) -> None:
    """A solution is written as `full` + saves or `none` + recomputes, whichever is shorter:
    both forms must tag every node the same."""
    _, graph = small_graphs["dsv3-debug"]
    search = _search(graph, "recompute_time", "h100", Estimator(graph, PROFILES))
    keys = search.model.candidates
    for chosen in (set(range(0, len(keys), 3)), set(range(len(keys))) - {0, 5}):
        short = search.policy(chosen)
        assert short.preset == ("full" if len(chosen) <= len(keys) / 2 else "none")
        as_full = Policy("full", overrides={keys[c]: "save" for c in chosen})
        assert decide(graph, short) == decide(graph, as_full) or _same_tags(
            decide(graph, short), decide(graph, as_full)
        )


def _same_tags(a: dict, b: dict) -> bool:
    return {n: d.recompute for n, d in a.items()} == {n: d.recompute for n, d in b.items()}


def test_infeasible_budget_names_the_floor(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    estimator = Estimator(graph, PROFILES)
    floor = estimator.estimate(Policy("full")).peak_bytes
    with pytest.raises(WorkbenchError, match=f"smallest feasible budget .* is {floor} bytes"):
        solve(graph, floor - 1, estimator=estimator)
    assert solve(graph, floor, estimator=estimator).estimate.peak_bytes <= floor


def test_bad_arguments_list_the_choices(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    with pytest.raises(WorkbenchError, match="unknown method 'ilp'.*greedy, knapsack, exact"):
        solve(graph, 10**9, method="ilp")
    with pytest.raises(WorkbenchError, match="unknown objective 'memory'"):
        solve(graph, 10**9, objective="memory")
    with pytest.raises(WorkbenchError, match="no profile 'h200'"):
        solve(graph, 10**9, profile="h200", estimator=Estimator(graph, PROFILES))


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug"])
def test_pareto_is_monotone_and_reports_progress(
    model: str, small_graphs: dict[str, Fixture]
) -> None:
    _, graph = small_graphs[model]
    seen: list[int] = []
    points = pareto(graph, n=6, progress=lambda done, total, s: seen.append(done))
    assert seen == list(range(1, 7))
    budgets = [p.budget_bytes for p in points]
    assert budgets == sorted(budgets)
    for p in points:
        assert p.budget_bytes is not None and p.estimate.peak_bytes <= p.budget_bytes
    costs = [p.estimate.recompute_seconds["h100"] for p in points]
    assert all(a >= b for a, b in zip(costs, costs[1:], strict=False))
    assert costs[-1] == 0  # the last budget is the no-AC peak


def test_cli_solve_and_pareto_json(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", "llama3-debug", "--layers", "2", "--seq", "32", "--json"]
    assert main(["solve", *common, "--budget-frac", "1.0"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out)
    keys = {"peak_bytes", "recompute_flops", "est_step_seconds", "policy", "method", "seconds"}
    assert keys | {"budget_bytes"} <= set(result)
    assert result["peak_bytes"] <= result["budget_bytes"]
    Policy.from_json(result["policy"])
    assert main(["pareto", *common, "--points", "3"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert len(result["points"]) == 3 and set(result["presets"]) >= {
        "none", "default", "eager", "full", "titan-default", "titan-eager", "titan-full",
    }  # fmt: skip
    assert result["seconds"] >= 0 and captured.err.count("\n") == 3
    assert main(["solve", *common, "--budget-bytes", "1"]) == 2
    assert "smallest feasible budget" in capsys.readouterr().err
