"""The solver on per-rank graphs: its linear model follows `decide` on collectives, the
FSDP choice is a decision (both settings searched, the better kept, on Pareto fronts too),
and the figures it reports are the exact estimate of the policy it returns."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.ops import ALL_GATHER, WAIT
from workbench.cli import main
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.workspaces import BLAS_WORKSPACES
from workbench.decide.decider import decide, node_keys, rules_of
from workbench.decide.policy import Policy
from workbench.rewrite.remat import remat
from workbench.search.model import RECOMPUTED, SAVED
from workbench.search.pareto import pareto
from workbench.search.solve import SolveOptions, Solver, fsdp_choices, solve

PROFILES = ("h100",)
DEBUG_RANK = ["--model", "llama3-debug", "--layers", "2", "--seq", "128", "--fsdp", "2"]


@pytest.mark.parametrize("reshard", [True, False])
def test_linear_model_follows_decide_on_collectives(rank_debug: JointGraph, reshard: bool) -> None:
    """TP's collectives are choices, their waits follow them, unshard chains follow the FSDP
    choice; for saved sets of candidates the model tags every node as `decide` tags the
    policy the search writes (`test_search_model` holds the property on every fixture)."""
    options = SolveOptions(fsdp_reshard=reshard)
    (search,) = Solver(rank_debug, options, Estimator(rank_debug, PROFILES))._searches
    model, facts = search.model, {f.name: f for f in rules_of(rank_debug).facts}
    names = list(node_keys(rank_debug))
    assert model.names == names
    ops = {f.op for f in facts.values() if f.key in model.candidates}
    assert {ALL_GATHER, "_c10d_functional.reduce_scatter_tensor.default"} <= ops  # TP's
    waits = [p for p, n in enumerate(names) if facts[n].op == WAIT]
    assert any(model.source[p] >= 0 for p in waits)  # a TP collective's wait: a choice
    chains = [p for p, n in enumerate(names) if facts[n].gather is not None]
    assert chains and {model.source[p] for p in chains} == {RECOMPUTED if reshard else SAVED}
    rng = random.Random(0)
    count = len(model.candidates)
    for chosen in (set(), set(range(count)), set(rng.sample(range(count), count // 2))):
        tags = decide(rank_debug, search.policy(chosen))
        assert model.tags(chosen) == [tags[n].recompute for n in names]


def test_solve_takes_the_better_fsdp_choice_for_the_budget(rank_debug: JointGraph) -> None:
    estimator = Estimator(rank_debug, PROFILES)
    assert fsdp_choices(rank_debug) == (True, False)
    floors = {
        r: min(estimator.estimate(Policy(p, fsdp_reshard=r)).peak_bytes for p in ("full", "none"))
        for r in (True, False)
    }
    assert floors[True] < floors[False]  # keeping gathered weights costs their bytes
    tight = solve(rank_debug, floors[True], estimator=estimator)
    assert tight.policy.fsdp_reshard and tight.to_json()["fsdp_reshard"] is True
    roomy_budget = estimator.estimate(Policy("none", fsdp_reshard=False)).peak_bytes
    roomy = solve(rank_debug, roomy_budget, estimator=estimator)
    assert not roomy.policy.fsdp_reshard and roomy.to_json()["fsdp_reshard"] is False
    assert roomy.cost() == 0  # no all-gather redone, nothing recomputed
    for found in (tight, roomy):
        assert found.estimate.peak_bytes <= found.budget_bytes  # type: ignore[operator]
        # the reported figures are the policy's own estimate, from a fresh estimator too
        assert Estimator(rank_debug, PROFILES).estimate(found.policy) == found.estimate
        full_path = estimate_remat(rank_debug, remat(rank_debug, found.policy), estimator)
        assert full_path.peak_bytes == found.estimate.peak_bytes
    fixed = solve(rank_debug, roomy_budget, SolveOptions(fsdp_reshard=True), estimator=estimator)
    assert fixed.policy.fsdp_reshard and fixed.cost() > roomy.cost()


def test_pareto_front_holds_points_of_both_fsdp_choices(rank_debug: JointGraph) -> None:
    points = pareto(rank_debug, points=5, estimator=Estimator(rank_debug, PROFILES))
    choices = [p.policy.fsdp_reshard for p in points]
    assert choices[0] is True and choices[-1] is False  # reshard where memory is tight
    costs = [p.cost() for p in points]
    assert all(a >= b for a, b in zip(costs, costs[1:], strict=False)) and costs[-1] == 0
    assert all(p.estimate.peak_bytes <= (p.budget_bytes or 0) for p in points)
    only = pareto(
        rank_debug,
        points=3,
        options=SolveOptions(fsdp_reshard=True),
        estimator=Estimator(rank_debug, PROFILES),
    )
    assert all(p.policy.fsdp_reshard for p in only)


@pytest.mark.parametrize("mode", ["fake", "real"])
def test_cli_solve_on_a_rank_estimates_as_reported(
    mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [*DEBUG_RANK, "--tp", "2", "--mode", mode, "--json"]
    # a fake rank is a GPU's: it holds cuBLAS's workspaces beside the CPU rank's bytes
    budget = 15_000_000 + (sum(BLAS_WORKSPACES) if mode == "fake" else 0)
    assert main(["solve", *common, "--budget-bytes", str(budget)]) == 0
    solved = json.loads(capsys.readouterr().out)
    assert solved["peak_bytes"] <= solved["budget_bytes"]
    assert solved["policy"].get("fsdp_reshard", True) is solved["fsdp_reshard"]
    path = tmp_path / "solved.json"
    path.write_text(json.dumps(solved["policy"]))
    assert main(["estimate", *common, "--policy", str(path)]) == 0
    estimated = json.loads(capsys.readouterr().out)
    for key in ("peak_bytes", "recompute_flops", "est_step_seconds", "saved_activation_bytes"):
        value = estimated[key]["h100"] if isinstance(estimated[key], dict) else estimated[key]
        assert value == solved[key], key


def test_cli_pareto_on_a_rank(capsys: pytest.CaptureFixture[str]) -> None:
    common = [*DEBUG_RANK, "--tp", "2", "--mode", "fake", "--json", "--points", "4"]
    assert main(["pareto", *common]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert {p["fsdp_reshard"] for p in result["points"]} == {True, False}
    assert set(result["presets_keep_unsharded"]) == set(result["presets"])
    assert "FSDP keep unsharded" in captured.err
    assert main(["pareto", *common, "--fsdp-choice", "keep"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert {p["fsdp_reshard"] for p in kept["points"]} == {False}
