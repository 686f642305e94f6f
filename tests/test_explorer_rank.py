"""The explorer on a per-rank graph (llama3-debug, FSDP2 x TP2, fake): collectives drawn,
ops and all-gathers flipped, the FSDP toggle, Suggest and undo/redo, and the policy's FSDP
choice kept through all of it."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.cost.estimate import Estimator
from workbench.decide.policy import Policy
from workbench.search.solve import SolveOptions, solve
from workbench.show.viz import svg_id
from workbench.show.viz.style import COLLECTIVE_WORDS, KIND_STYLE, ORANGE, VERMILLION
from workbench.show.widgets import PolicyExplorer


def send(widget: PolicyExplorer, **msg: object) -> None:
    widget._on_msg(widget, dict(msg), None)


def _layer_op(graph: JointGraph, module: str, kind: str) -> str:
    return next(
        n
        for n, i in graph.nodes.items()
        if i.module == module and i.op.endswith(kind) and i.phase == "forward"
    )


def _consistent(widget: PolicyExplorer, reshard: bool) -> None:
    """Policy, toggle and autosave file say the same FSDP choice; the metrics are its."""
    assert widget.policy.fsdp_reshard is reshard and widget.fsdp_reshard is reshard
    saved = json.loads(widget.autosave_path.read_text())
    assert saved.get("fsdp_reshard", True) is reshard
    assert widget.metrics["peak_bytes"] == widget.estimator.estimate(widget.policy).peak_bytes


def test_explorer_on_a_rank_keeps_the_fsdp_choice(rank_debug: JointGraph, tmp_path: Path) -> None:
    ex = PolicyExplorer(rank_debug, "default", autosave=tmp_path / "rank.json")
    assert ex.has_fsdp and ex.fsdp_reshard
    gather = _layer_op(rank_debug, "layers.0.attention.wq", "all_gather_into_tensor.default")
    matmul = _layer_op(rank_debug, "layers.0.attention.wq", "aten.mm.default")
    ex.show("layer:0")
    drawn = html.unescape(ex.svg)
    node = drawn.split(f'id="{svg_id("n", gather)}"', 1)[1].split("</g>", 1)[0]
    points = node.split("<polygon", 1)[1].split('points="', 1)[1].split('"', 1)[0]
    assert len(points.split()) == 7  # a hexagon (closed: the first corner again)
    assert COLLECTIVE_WORDS in ex.legend["lines"]
    assert ex.decisions[gather].recompute  # reshard after forward
    # the toggle: keep unsharded saves every FSDP unshard chain and raises the peak
    peak = ex.metrics["peak_bytes"]
    send(ex, type="fsdp", reshard=False)
    assert "keep unsharded" in ex.message and not ex.decisions[gather].recompute
    assert ex.metrics["peak_bytes"] > peak
    _consistent(ex, False)
    # flip an op, then one all-gather (in every layer): the FSDP choice stays
    send(ex, type="click", id=svg_id("n", matmul))
    assert ex.decisions[matmul].recompute and len(ex.policy.overrides) == 1
    _consistent(ex, False)
    send(ex, type="click", id=svg_id("n", gather))
    assert "now recomputed" in ex.message
    twin = _layer_op(rank_debug, "layers.1.attention.wq", "all_gather_into_tensor.default")
    assert ex.decisions[gather].recompute and ex.decisions[twin].recompute
    assert ex.details["can_flip"] and ex.details["preset_decision"] == "MUST_SAVE"
    _consistent(ex, False)
    edited = ex.policy
    # Suggest: the solver's FSDP choice for the budget comes with its policy
    budget = ex.budget_range["min"]
    expected = solve(rank_debug, budget, SolveOptions(profile=ex.profile), estimator=ex.estimator)
    send(ex, type="suggest", budget=budget)
    assert "suggested by greedy" in ex.message and "FSDP reshard after forward" in ex.message
    assert ex.metrics["peak_bytes"] <= budget

    def recomputed(policy: Policy) -> set[str]:
        """What backward runs again (Suggest leaves out overrides that change nothing)."""
        return set(ex.estimator.estimate(policy).recompute_flops_by_node)

    assert recomputed(ex.policy) == recomputed(expected.policy)
    assert ex.metrics["peak_bytes"] == expected.estimate.peak_bytes
    _consistent(ex, expected.policy.fsdp_reshard)
    # where memory allows, keeping the gathered weights wins: no all-gather is redone
    send(ex, type="suggest", budget=ex.budget_range["max"])
    assert "FSDP keep unsharded" in ex.message and ex.metrics["recompute_flops"] == 0
    _consistent(ex, False)
    send(ex, type="undo")
    _consistent(ex, expected.policy.fsdp_reshard)
    send(ex, type="undo")
    assert ex.policy == edited
    _consistent(ex, False)
    send(ex, type="redo")
    _consistent(ex, expected.policy.fsdp_reshard)
    send(ex, type="undo")
    send(ex, type="undo")  # the all-gather flip
    assert not ex.decisions[gather].recompute
    _consistent(ex, False)
    # the budget slider spans both FSDP choices: up to keeping everything
    high = Estimator(rank_debug, ("h100",)).estimate(Policy("none", fsdp_reshard=False))
    assert ex.budget_range["max"] == high.peak_bytes


def test_a_fresh_rank_explorer_says_who_chose_each_colour(
    rank_debug: JointGraph, tmp_path: Path
) -> None:
    """Nobody chose the FSDP default (reshard after forward): its all-gather chains are drawn
    as the preset's choice and the legend says FSDP chose them; a user's flip is "you chose".
    Run is disabled on fake tensors, its tooltip saying why."""
    ex = PolicyExplorer(rank_debug, "default", autosave=tmp_path / "fresh.json")
    gather = _layer_op(rank_debug, "layers.0.attention.wq", "all_gather_into_tensor.default")
    ex.show("layer:0")
    fill = html.unescape(ex.svg).split(f'id="{svg_id("n", gather)}"', 1)[1].split("</g>", 1)[0]
    assert f'fill="{ORANGE.lower()}"' in fill.lower()
    words = dict((row[0], row[1]) for row in ex.legend["rows"])
    assert "FSDP all-gathers: reshard after forward" in words[ORANGE]
    assert "you chose" in words[VERMILLION] and "FSDP" not in words[VERMILLION]
    assert ex.run_refusal.startswith("Run needs real tensors") and "fake" in ex.run_refusal
    send(ex, type="run")
    assert ex.message == ex.run_refusal and not ex.run_result
    send(ex, type="click", id=svg_id("n", gather))  # now the user's: saved, "you chose"
    fill = html.unescape(ex.svg).split(f'id="{svg_id("n", gather)}"', 1)[1].split("</g>", 1)[0]
    assert ex.decisions[gather].action == "save"
    assert f'fill="{KIND_STYLE["must_save"][0]["fillcolor"].lower()}"' in fill.lower()


def test_fsdp_toggle_on_a_single_device_graph_explains(
    small_graphs: dict[str, tuple[Workload, JointGraph]], tmp_path: Path
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    ex = PolicyExplorer(graph, "default", workload=workload, autosave=tmp_path / "one.json")
    assert not ex.has_fsdp
    send(ex, type="fsdp", reshard=False)
    assert "no FSDP parameter all-gathers" in ex.message and ex.policy.fsdp_reshard


@pytest.mark.parametrize("reshard", [True, False])
def test_rank_explorer_starts_from_a_policy_with_either_choice(
    rank_debug: JointGraph, tmp_path: Path, reshard: bool
) -> None:
    start = Policy("eager", fsdp_reshard=reshard)
    ex = PolicyExplorer(rank_debug, start, autosave=tmp_path / f"r{reshard}.json")
    _consistent(ex, reshard)
    ex.sweep(points=3)
    solver = [p for p in ex.history if p.get("solver")]
    assert solver and all(
        "fsdp_reshard" in p["policy"] or p["policy"]["version"] == 1 for p in solver
    )
    send(ex, type="restore", index=solver[-1]["index"])
    _consistent(ex, Policy.from_json(solver[-1]["policy"]).fsdp_reshard)
