"""Policies and estimates on per-rank graphs: waits follow their collective, FSDP unshard
chains follow their all-gather (reshard after forward or keep unsharded), optimizer state
and gathered copies in the peak, collectives on the roofline, exports that say so."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.ops import ALL_GATHER, WAIT
from workbench.capture.parallel import Parallel
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.overlap import collective_time
from workbench.cost.profiles import H100
from workbench.decide.decider import decide, rules_of
from workbench.decide.policy import Policy
from workbench.decide.tags import Why
from workbench.errors import WorkbenchError
from workbench.interop.export import export
from workbench.rewrite.remat import remat
from workbench.show.viz import render_view
from workbench.show.viz.style import COLLECTIVE_WORDS, svg_id

SMALL = {"layers": 2, "seq": 32}
PRESETS = ["none", "default", "eager", "full", "titan-default"]


@pytest.fixture(scope="module")
def rank_graph() -> JointGraph:
    """llama3-debug, 2 layers, seq 32, FSDP2 x TP2, rank 0 on fake tensors."""
    return trace(
        load_workload("llama3-debug", device="meta", **SMALL), "fake", Parallel(fsdp=2, tp=2)
    )


def _fsdp_gathers(graph: JointGraph) -> list[str]:
    return [c.node for c in graph.collectives() if (c.kind, c.mesh_dim) == ("all_gather", "fsdp")]


def test_unshard_chains_and_waits_in_the_facts(rank_graph: JointGraph) -> None:
    facts = {f.name: f for f in rules_of(rank_graph).facts}
    gathers = _fsdp_gathers(rank_graph)
    # one chain per parameter, led by its fsdp all-gather; TP's all-gathers of activations
    # are on no chain
    assert sorted(n for n, f in facts.items() if f.gather == n) == sorted(gathers)
    assert len(gathers) == len(rank_graph.param_names) == 21
    tp = [c.node for c in rank_graph.collectives() if c.mesh_dim == "tp" and c.node in facts]
    assert tp and all(facts[n].gather is None for n in tp)
    chain = [f.op for f in facts.values() if f.gather == gathers[0]]
    assert chain[chain.index(ALL_GATHER) - 1] == "aten._to_copy.default"  # cast, then gather
    assert chain[chain.index(ALL_GATHER) + 1] == WAIT
    waits = [f for f in facts.values() if f.op == WAIT]
    assert waits and all(facts[w.parent].op.startswith("_c10d") for w in waits if w.parent)


def test_unshard_chains_stop_where_data_comes_in_on_fsdp_only_graphs() -> None:
    # without TP the embedding reads the gathered table and the tokens alone: it and every
    # activation after it are on no chain, so a policy still decides them
    graph = trace(load_workload("llama3-debug", device="meta", **SMALL), "fake", Parallel(fsdp=2))
    facts = rules_of(graph).facts
    on_chains = [f for f in facts if f.gather is not None]
    assert {f.op for f in on_chains if f.gather == f.name} == {ALL_GATHER}
    assert len({f.gather for f in on_chains}) == len(graph.param_names) == 21
    assert not [f.name for f in on_chains if f.op in ("aten.embedding.default", "aten.mm.default")]
    tags = decide(graph, Policy("none"))
    assert not any(tags[f.name].recompute for f in facts if f.op == "aten.mm.default")


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_reshard_decides_the_chains_and_waits_follow(
    rank_graph: JointGraph, reshard: bool
) -> None:
    facts = rules_of(rank_graph).facts
    for preset in ("none", "default", "full"):
        tags = decide(rank_graph, Policy(preset, fsdp_reshard=reshard))
        for gather in _fsdp_gathers(rank_graph):
            assert tags[gather].why is Why.FSDP and tags[gather].recompute == reshard
        # each chain is one decision (views of the placeholders aside: saved at the layer
        # boundary, they alias the graph input)
        for f in facts:
            if f.gather is not None and tags[f.name].why is not Why.LAYER_BOUNDARY:
                assert tags[f.name] == tags[f.gather], (preset, f.name)
            if f.op == WAIT and f.parent in tags:
                assert tags[f.name].recompute == tags[f.parent].recompute
    # torchtitan's save list keeps TP reduce-scatters under `default`
    tags = decide(rank_graph, Policy("default", fsdp_reshard=reshard))
    scatters = [c.node for c in rank_graph.collectives() if c.kind == "reduce_scatter"]
    assert [tags[n].recompute for n in scatters if n in tags] == [False] * 5


def test_selectors_name_all_gathers_and_win_over_the_fsdp_choice(rank_graph: JointGraph) -> None:
    save = {"select": f"layers.0.**::{ALL_GATHER}", "action": "save"}
    tags = decide(rank_graph, Policy("full", [save]))
    facts = {f.name: f for f in rules_of(rank_graph).facts}
    by_layer = Counter((facts[g].layer, tags[g].recompute) for g in _fsdp_gathers(rank_graph))
    assert by_layer[(0, False)] == 9 and by_layer[(0, True)] == 0  # 9 parameters a layer
    assert by_layer[(1, True)] == 9
    assert tags[next(g for g in _fsdp_gathers(rank_graph) if facts[g].layer == 0)].why is (
        Why.SELECTOR
    )
    recompute = {"select": f"**::{ALL_GATHER}", "action": "recompute"}
    kept = decide(rank_graph, Policy("none", [recompute], fsdp_reshard=False))
    assert all(kept[g].recompute for g in _fsdp_gathers(rank_graph))


@pytest.mark.parametrize("reshard", [True, False])
def test_whatif_equals_torch_remat_with_either_fsdp_choice(
    rank_graph: JointGraph, reshard: bool
) -> None:
    estimator = Estimator(rank_graph, ("h100",))
    for preset in PRESETS:
        policy = Policy(preset, fsdp_reshard=reshard)
        fast = estimator.estimate(policy)
        full = estimate_remat(rank_graph, remat(rank_graph, policy), estimator)
        assert fast.peak_bytes == full.peak_bytes and fast.timeline == full.timeline, preset
        # one definition of saved bytes: the remat report agrees, gathered weights apart
        report = remat(rank_graph, policy).report
        assert report.saved_bytes_after == fast.saved_activation_bytes, preset


def test_keeping_gathered_weights_costs_their_bytes(rank_graph: JointGraph) -> None:
    estimator = Estimator(rank_graph, ("h100",), optimizer="none")
    reshard = estimator.estimate(Policy("none"))
    keep = estimator.estimate(Policy("none", fsdp_reshard=False))
    assert keep.peak_bytes > reshard.peak_bytes
    assert keep.peak_breakdown["gathered"] > reshard.peak_breakdown["gathered"]
    # the bf16 gathered layer weights (tp-local) stay from forward to backward
    layer_weights = sum(
        rank_graph.nodes[g].bytes
        for g in _fsdp_gathers(rank_graph)
        if rank_graph.nodes[g].layer is not None
    )
    assert keep.peak_breakdown["gathered"] >= layer_weights


@pytest.mark.parametrize(("optimizer", "per_element"), [("adamw", 8), ("sgd", 4), ("none", 0)])
def test_optimizer_state_is_held_the_whole_step(
    rank_graph: JointGraph, optimizer: str, per_element: int
) -> None:
    shard_bytes = sum(
        rank_graph.nodes[s.placeholder].bytes for s in rank_graph.inputs if s.kind == "param"
    )  # fp32 shards: 4 bytes an element
    est = Estimator(rank_graph, ("h100",), optimizer).estimate(Policy("default"))  # type: ignore[arg-type]
    plain = Estimator(rank_graph, ("h100",), "none").estimate(Policy("default"))
    assert est.peak_breakdown["optimizer"] == shard_bytes // 4 * per_element
    assert set(est.timeline["optimizer"]) == {shard_bytes // 4 * per_element}
    assert est.peak_bytes == plain.peak_bytes + shard_bytes // 4 * per_element
    with pytest.raises(WorkbenchError, match="unknown optimizer 'adam'; choose one of adamw"):
        Estimator(rank_graph, ("h100",), "adam")  # type: ignore[arg-type]


def test_collectives_take_ring_time_on_their_link(rank_graph: JointGraph) -> None:
    """Collectives take no compute-stream time; on the communication stream each takes the
    ring model's bytes over NVLink (world size 4 fits one node) plus NCCL's Ring/Simple
    latency per step from torch's tables."""
    from torch._inductor import comm_analysis as ca

    estimator = Estimator(rank_graph, ("h100",))
    seconds = dict(
        zip((n.name for n in rank_graph.gm.graph.nodes), estimator.seconds["h100"], strict=True)
    )
    ring, simple, nvlink = ca.NCCL_ALGO.RING, ca.NCCL_PROTO.SIMPLE, ca.NCCL_HW.NVLINK
    for c in rank_graph.collectives():
        assert seconds[c.node] == 0.0
        if c.kind == "wait":
            continue
        factor = 2 * (2 - 1) / 2 if c.kind == "all_reduce" else (2 - 1) / 2
        steps = 2 * (2 - 1) if c.kind == "all_reduce" else 2 - 1
        latency = (ca.baseLat[ring][simple] + steps * ca.hwLat[nvlink][ring][simple]) * 1e-6
        assert collective_time(H100, c.kind, c.bytes, 2, False) == pytest.approx(
            factor * c.bytes / H100.intra_node_bytes_per_s + latency
        )
    assert H100.intra_node_bytes_per_s == 450e9 and H100.inter_node_bytes_per_s == 50e9
    est = estimator.estimate(Policy("none"))
    assert 0 < est.exposed_comm_seconds["h100"] <= est.comm_seconds["h100"]


def test_policy_json_carries_the_fsdp_choice() -> None:
    default = Policy("eager").to_json()
    assert default["version"] == 1 and "fsdp_reshard" not in default
    keep = Policy("eager", fsdp_reshard=False)
    data = json.loads(json.dumps(keep.to_json()))
    assert data["version"] == 2 and data["fsdp_reshard"] is False
    assert Policy.from_json(data) == keep
    with pytest.raises(WorkbenchError, match=r"unknown policy fields \['fsdp_reshard'\]"):
        Policy.from_json({**data, "version": 1})
    with pytest.raises(WorkbenchError, match="fsdp_reshard 'no' must be true"):
        Policy.from_json({**data, "fsdp_reshard": "no"})


def test_exports_say_what_the_parallel_setting_means(rank_graph: JointGraph) -> None:
    policy = Policy("default", fsdp_reshard=False)
    code = export(policy, "graph_pass", rank_graph)
    assert "# Per-rank graph, fsdp 2 x tp 2 (world size 4); FSDP: keep unsharded" in code
    assert "# Forward collectives saved: 21 all_gather (fsdp)" in code
    assert "FSDP_RESHARD = False" in code
    namespace: dict[str, object] = {}
    exec(compile(code, "graph_pass", "exec"), namespace)  # noqa: S102
    gm = rank_graph.gm
    namespace["tag_graph"](gm)  # type: ignore[operator]
    tags = {n.name: n.meta.get("recompute") for n in gm.graph.nodes if "recompute" in n.meta}
    assert tags == {n: t.policy for n, t in decide(rank_graph, policy).items()}
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
    assert "FSDP: reshard after forward" in export(Policy("full"), "policy_fn", rank_graph)
    titan = export(policy, "torchtitan", rank_graph)
    assert "--parallelism.fsdp_reshard_after_forward never" in titan
    assert "# Forward collectives recomputed in backward:" in titan
    assert tags[_fsdp_gathers(rank_graph)[0]] == CheckpointPolicy.MUST_SAVE


def test_cli_estimate_optimizer_json(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--model", "llama3-debug", "--layers", "2", "--seq", "32", "--mode", "fake"]
    flags = ["--fsdp", "2", "--tp", "2", "--profile", "h100", "--json"]
    assert main(["estimate", *small, *flags]) == 0
    adamw = json.loads(capsys.readouterr().out)
    assert main(["estimate", *small, *flags, "--optimizer", "none"]) == 0
    none = json.loads(capsys.readouterr().out)
    assert adamw["peak_breakdown"]["optimizer"] > 0 == none["peak_breakdown"]["optimizer"]
    assert adamw["peak_bytes"] - none["peak_bytes"] == adamw["peak_breakdown"]["optimizer"]


def test_op_view_of_a_sharded_layer_marks_its_collectives(rank_graph: JointGraph) -> None:
    decisions = decide(rank_graph, Policy("default"))
    source = render_view(rank_graph, decisions, "module:layers.0.attention.wq").dot.source
    assert COLLECTIVE_WORDS in source
    gather = next(
        c.node
        for c in rank_graph.collectives()
        if c.kind == "all_gather" and rank_graph.nodes[c.node].module == "layers.0.attention.wq"
    )
    assert f'id="{svg_id("n", gather)}" shape=hexagon' in source
    # a single-device graph has no collectives: no hexagon, no legend line
    one = trace(load_workload("llama3-debug", device="meta", **SMALL), "fake")
    plain = render_view(one, None, "module:layers.0.attention.wq").dot.source
    assert "hexagon" not in plain


def test_op_view_after_remat_draws_recomputed_collectives(rank_graph: JointGraph) -> None:
    """With the remat output, an unshard chain recomputed in backward (reshard after
    forward) draws its all-gather's copy as a dashed hexagon: the copy's style and the
    collective's shape together (the two had clashed, and the view raised)."""
    decisions = decide(rank_graph, Policy("default"))
    gm = remat(rank_graph, decisions).gm
    view = render_view(rank_graph, decisions, "module:layers.0.attention.wq", gm=gm)
    gather = next(
        c.node
        for c in rank_graph.collectives()
        if c.kind == "all_gather" and rank_graph.nodes[c.node].module == "layers.0.attention.wq"
    )
    copy = svg_id("n", f"{gather}_recomputed")
    line = next(line for line in view.dot.source.splitlines() if f'id="{copy}"' in line)
    assert "shape=hexagon" in line and 'style="filled,dashed,rounded"' in line
