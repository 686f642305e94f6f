"""The solver's linear model holds what its docstring claims, on seeded random saved sets:
its tags are `decide`'s, its recomputed nodes are those torch's remat pass copies, and its
saved bytes are the estimate's; and the three selection methods read it as documented."""

from __future__ import annotations

import random

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.cost.estimate import Estimator
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.rewrite.remat import remat
from workbench.search.model import LinearModel
from workbench.search.select import greedy_path, select_exact, select_greedy, select_knapsack
from workbench.search.solve import SolveOptions, Solver

Fixture = tuple[Workload, JointGraph]
CASES = [
    ("llama3-debug", True),
    ("dsv3-debug", True),
    ("llama3-debug-fsdp2-tp2", True),
    ("llama3-debug-fsdp2-tp2", False),
]


@pytest.fixture(scope="module")
def graphs(small_graphs_and_rank: dict[str, JointGraph]) -> dict[str, JointGraph]:
    return small_graphs_and_rank


def saved_sets(count: int, seed: int, trials: int = 6) -> list[set[int]]:
    """Nothing, everything, a few, nearly all, and random sizes in between."""
    rng = random.Random(seed)
    sizes = [0, count, 1, count - 1, *(rng.randint(0, count) for _ in range(trials - 4))]
    return [set(rng.sample(range(count), k)) for k in sizes]


@pytest.mark.parametrize(("name", "reshard"), CASES, ids=[f"{n}-{r}" for n, r in CASES])
def test_model_is_decide_and_torchs_remat_pass(
    graphs: dict[str, JointGraph], name: str, reshard: bool
) -> None:
    graph = graphs[name]
    estimator = Estimator(graph, ("h100",))
    (search,) = Solver(graph, SolveOptions(fsdp_reshard=reshard), estimator)._searches
    model = search.model
    for saved in saved_sets(len(model.candidates), seed=len(name) + reshard):
        overrides = {model.candidates[c]: "save" for c in saved}
        policy = Policy("full", overrides=overrides, fsdp_reshard=reshard)  # type: ignore[arg-type]
        tags = model.tags(saved)
        assert tags == [t.recompute for t in decide(graph, policy).values()]
        # the shorter form the solver writes decides alike
        solver_form = decide(graph, search.policy(saved))
        assert tags == [solver_form[n].recompute for n in model.names]
        recomputed = model.recomputed(saved)
        assert recomputed == set(remat(graph, policy).report.recomputed_nodes)
        est = estimator.estimate(policy)
        assert model.evaluate(saved)[0] == est.saved_activation_bytes
        assert sum(graph.nodes[n].flops for n in recomputed) == est.recompute_flops


def test_folding_keeps_bytes_and_costs(graphs: dict[str, JointGraph]) -> None:
    graph = graphs["llama3-debug-fsdp2-tp2"]
    model = LinearModel(graph, Estimator(graph, ("h100",)), "recompute_time", "h100")
    folded = model.folded()
    assert folded.nodes == list(dict.fromkeys(model.key_of))
    assert sum(folded.sizes) == sum(model.sizes)
    assert sum(folded.cost) == pytest.approx(sum(model.cost))
    assert all(s < len(folded.sizes) for storages in folded.storages for s in storages)
    # a node's source is its key's: identical layers decide alike
    for p, key in enumerate(model.key_of):
        assert folded.source[folded.nodes.index(key)] == model.source[p]


@pytest.mark.parametrize("name", ["llama3-debug", "dsv3-debug"])
def test_selections_fit_the_cap_under_the_model(graphs: dict[str, JointGraph], name: str) -> None:
    graph = graphs[name]
    model = LinearModel(graph, Estimator(graph, ("h100",)), "recompute_time", "h100")
    path = greedy_path(model)
    assert path and path[-1][2] == 0  # down to nothing recomputed
    assert [model.evaluate({c for c, _, _ in path[: k + 1]}) for k in range(len(path))] == [
        (b, c) for _, b, c in path
    ]
    assert all(a[2] > b[2] for a, b in zip(path, path[1:], strict=False))
    low = model.evaluate(set())[0]
    high = model.evaluate(set(range(len(model.candidates))))[0]
    order = [c for c, _, _ in path]
    folded = model.folded()
    for cap in (low, (low + high) / 2, high):
        greedy = select_greedy(model, path, cap)
        knapsack = select_knapsack(model, order, cap)
        for chosen in (greedy, knapsack):
            assert model.evaluate(chosen)[0] <= cap
        exact = select_exact(folded, cap)
        assert exact <= set(range(len(model.candidates)))
    assert model.evaluate(select_greedy(model, path, high))[1] == 0
