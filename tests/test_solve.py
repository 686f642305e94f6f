"""Policy search: budgets met by the exact estimate, presets beaten, solutions that remat."""

from __future__ import annotations

import json

import pytest
import torch

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.capture.workload import eager_step
from workbench.cli import main
from workbench.cost.estimate import Estimator
from workbench.cost.profiles import H100
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.interop.export import export
from workbench.rewrite.remat import remat
from workbench.search.pareto import pareto
from workbench.search.solve import SolveOptions, Solver, solve

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
        options = SolveOptions(objective=objective)
        found = solve(graph, reference.peak_bytes, options, estimator=estimator)
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
    exact = solve(graph, budget, SolveOptions(method="exact"), estimator=estimator)
    best = exact.estimate.recompute_seconds["h100"]
    for method in ("greedy", "knapsack"):
        found = solve(graph, budget, SolveOptions(method=method), estimator=estimator)
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
    (search,) = Solver(graph, estimator=Estimator(graph, PROFILES))._searches
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
    """The floor is the lowest peak of the presets, not full recompute's (issue 37, item 5:
    `titan-full` keeps `_log_softmax` and peaks lower); a budget below every peak the search
    reaches is refused with the lowest one it found."""
    _, graph = llama_debug
    estimator = Estimator(graph, PROFILES)
    peaks = {
        p: estimator.estimate(Policy(p)).peak_bytes
        for p, preset in PRESETS.items()
        if preset.offloads is None
    }
    floor = Solver(graph, estimator=estimator).floor_bytes
    assert floor == min(peaks.values())
    assert solve(graph, floor, estimator=estimator).estimate.peak_bytes <= floor
    with pytest.raises(WorkbenchError, match=r"smallest feasible budget found .* is \d+ bytes"):
        solve(graph, floor // 2, estimator=estimator)


def test_bad_arguments_list_the_choices(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    with pytest.raises(WorkbenchError, match="unknown method 'ilp'.*greedy, knapsack, exact"):
        SolveOptions(method="ilp")  # type: ignore[arg-type]
    with pytest.raises(WorkbenchError, match="unknown objective 'memory'"):
        SolveOptions(objective="memory")  # type: ignore[arg-type]
    with pytest.raises(WorkbenchError, match="host_budget_bytes must be a whole number from 0"):
        SolveOptions(host_budget_bytes=-1)
    with pytest.raises(WorkbenchError, match="no profile 'h200'"):
        solve(graph, 10**9, SolveOptions(profile="h200"), estimator=Estimator(graph, PROFILES))
    with pytest.raises(WorkbenchError, match="unknown device profile 'h900'"):
        solve(graph, 10**9, SolveOptions(profile="h900"), estimator=Estimator(graph, PROFILES))


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug"])
def test_pareto_is_monotone_and_reports_progress(
    model: str, small_graphs: dict[str, Fixture]
) -> None:
    _, graph = small_graphs[model]
    seen: list[int] = []
    points = pareto(graph, points=6, progress=lambda done, total, s: seen.append(done))
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
        "none",
        "default",
        "eager",
        "full",
        "titan-default",
        "titan-eager",
        "titan-full",
    }
    assert result["seconds"] >= 0 and captured.err.count("\n") == 3
    assert main(["solve", *common, "--budget-bytes", "1"]) == 2
    assert "smallest feasible budget" in capsys.readouterr().err


def test_solver_answers_many_budgets_as_solve_does(small_graphs: dict[str, Fixture]) -> None:
    """One `Solver` per graph and options (what `pareto` and `floor_search` reuse) answers
    each budget as `solve` would; a `DeviceProfile` works as well as its name."""
    _, graph = small_graphs["llama3-debug"]
    estimator = Estimator(graph, PROFILES)
    solver = Solver(graph, SolveOptions(profile=H100), estimator)
    assert SolveOptions(profile=H100).profile_name == "h100"
    none = estimator.estimate(Policy("none")).peak_bytes
    lowest = min(
        estimator.estimate(Policy(p)).peak_bytes
        for p, preset in PRESETS.items()
        if preset.offloads is None
    )
    assert solver.floor_bytes == lowest and solver.top_bytes == none
    for budget in (solver.floor_bytes, (solver.floor_bytes + none) // 2, none):
        mine, theirs = solver.solve(budget), solve(graph, budget, estimator=estimator)
        assert (mine.policy, mine.estimate) == (theirs.policy, theirs.estimate)
    with pytest.raises(WorkbenchError, match="smallest feasible budget"):
        solver.solve(solver.floor_bytes // 2)


def test_exact_refuses_a_graph_with_too_many_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    import workbench.search.solve as module

    monkeypatch.setattr(module, "EXACT_KEY_LIMIT", 10)
    graph = trace(load_workload("llama3-debug", layers=1, seq=16), "fake")
    with pytest.raises(WorkbenchError, match="above the limit of 10; use method='greedy'"):
        Solver(graph, SolveOptions(method="exact"))
