"""The array replay of torch's remat pass against a plain entry-by-entry replay (what the
pass does, one node at a time) for preset, random and per-rank FSDP recompute flags, and
against torch's pass itself."""

from __future__ import annotations

import random

import numpy as np
import pytest

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.replay import recompute_flags, replay, saved_bytes_by_node
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.rewrite.entries import NodeOrder
from workbench.rewrite.index import GraphIndex, graph_index
from workbench.rewrite.remat import remat

MODELS = ["llama3-debug", "dsv3-debug", "llama3-debug-fsdp2-tp2"]


@pytest.fixture(scope="module")
def graphs(small_graphs_and_rank: dict[str, JointGraph]) -> dict[str, JointGraph]:
    return small_graphs_and_rank


def _plain_replay(index: GraphIndex, rec: list[bool]) -> NodeOrder:
    """torch's pass one node at a time: each backward node of the region after the
    recomputed nodes it needs (in forward order, each once), dead code removed by a reverse
    walk, getitems moved after their producer."""
    n, args0 = index.n, index.args
    if not any(rec):
        return index.identity()
    regions = {
        index.region_of[u] for i in range(n) if rec[i] for u in index.users[i] if index.is_bwd[u]
    }
    if not regions:
        return index.identity()
    start, end = index.regions[regions.pop()]
    order, args = list(range(start)), {i: args0[i] for i in range(n)}
    done: set[int] = set()
    for b in range(start, end):
        stack = [x for x in args0[b] if rec[x]]
        deps: list[int] = []
        while stack:
            x = stack.pop()
            if x not in done:
                done.add(x)
                deps.append(x)
                stack.extend(y for y in args0[x] if rec[y])
        for d in sorted(deps):
            order.append(n + d)
            args[n + d] = tuple(n + y if rec[y] else y for y in args0[d])
        args[b] = tuple(n + x if rec[x] else x for x in args0[b])
        order.append(b)
    order.extend(range(end, n))
    alive: set[int] = set()
    for e in reversed(order):
        if e in alive or index.impure[e % n]:
            alive.add(e)
            alive.update(args[e])
    order = [e for e in order if e in alive]
    raisable = [
        g and not index.is_getitem[index.args[i][0]] for i, g in enumerate(index.is_getitem)
    ]
    children: dict[int, list[int]] = {}
    for e in order:
        if raisable[e % n]:
            children.setdefault(args[e][0], []).append(e)
    raised: list[int] = []
    for e in order:
        if not raisable[e % n]:
            raised += [e, *children.get(e, [])]
    return raised, args


def _flag_sets(graph: JointGraph, seed: int) -> list[list[bool]]:
    """Presets' flags, then random subsets of the recomputable nodes of one region."""
    index = graph_index(graph)
    flags = [recompute_flags(index, decide(graph, Policy(p))).tolist() for p in ("default", "full")]
    candidates = [
        index.index_of[name] for name, tag in decide(graph, Policy("full")).items() if tag.recompute
    ]
    rng = random.Random(seed)
    for share in (0.1, 0.3, 0.6, 0.9):
        rec = [False] * index.n
        for i in candidates:
            rec[i] = rng.random() < share
        flags.append(rec)
    return flags


@pytest.mark.parametrize("model", MODELS)
def test_replay_equals_a_plain_replay(graphs: dict[str, JointGraph], model: str) -> None:
    graph = graphs[model]
    index = graph_index(graph)
    for rec in _flag_sets(graph, seed=len(model)):
        flat = replay(index, rec)
        order, args = _plain_replay(index, rec)
        assert flat.entries.tolist() == order
        expected = [(p, x) for p, e in enumerate(order) for x in args[e]]
        assert list(zip(flat.reader.tolist(), flat.read.tolist(), strict=True)) == expected


@pytest.mark.parametrize("model", MODELS)
def test_replay_equals_torch_pass_for_random_flags(
    graphs: dict[str, JointGraph], model: str
) -> None:
    """Random flags, also ones the rules would never give (a getitem apart from its op)."""
    graph = graphs[model]
    index = graph_index(graph)
    estimator = Estimator(graph)
    names = index.names
    for rec in _flag_sets(graph, seed=7)[2:4]:
        decisions = decide(graph, Policy("none"))
        for i, flag in enumerate(rec):
            if flag and names[i] in decisions:
                decisions[names[i]] = decide(graph, Policy("full"))[names[i]]
        flags = recompute_flags(index, decisions)
        assert estimator.simulate(replay(index, flags)) == estimate_remat(
            graph, remat(graph, decisions), estimator
        )


@pytest.mark.parametrize("preset", ["none", "eager", "full"])
def test_saved_bytes_by_node_equals_torch_pass(graphs: dict[str, JointGraph], preset: str) -> None:
    """The replayed figure is the one torch's pass gives, node for node; None is the joint
    graph as traced."""
    graph = graphs["llama3-debug"]
    report = remat(graph, Policy(preset)).report
    assert (
        saved_bytes_by_node(graph, decide(graph, Policy(preset)))
        == report.saved_bytes_by_node_after
    )
    assert saved_bytes_by_node(graph, None) == report.saved_bytes_by_node_before


def test_replay_refuses_backward_flags(graphs: dict[str, JointGraph]) -> None:
    index = graph_index(graphs["llama3-debug"])
    rec = np.zeros(index.n, bool)
    rec[index.index_of[next(n for i, n in enumerate(index.names) if index.is_bwd[i])]] = True
    with pytest.raises(WorkbenchError, match="only forward and loss nodes"):
        replay(index, rec)
