"""torchtitan models sharded by graph trainer's own `parallelize` (SimpleFSDP, TP, EP) on the
fake process group, traced by its own tracer; expert token counts; every family of
torchtitan 0.3.0 traced or refused in one line.

Skipped, with the reason, where torchtitan is not installed.
"""

from __future__ import annotations

import collections
import importlib.util
import json

import pytest
import torch

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.models.torchtitan import REFUSED, VISION_NOTE
from workbench.capture.parallel import Parallel
from workbench.capture.titan_rank import bind_token_counts, graph_trainer_imports
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.interop.titan import compare
from workbench.rewrite.remat import remat

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan not installed: pip install -e '.[torchtitan]'",
)

TITAN_PRESETS = ("titan-default", "titan-full", "titan-eager", "titan-sac_and_offload")
CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


@pytest.fixture(scope="module")
def llama_rank() -> JointGraph:
    # other worlds first (the workbench's own sharding on a mesh of the same shape, a wider
    # one): the rank traced after them must gather on its own groups
    own = load_workload("llama3-debug", layers=1, seq=32, device="meta")
    trace(own, "fake", Parallel(fsdp=2, tp=2))
    wider = load_workload("torchtitan:llama3/debugmodel", layers=1, seq=32, device="meta")
    trace(wider, "fake", Parallel(fsdp=4, tp=4))
    workload = load_workload("torchtitan:llama3/debugmodel", layers=2, seq=32)
    return trace(workload, "real", Parallel(fsdp=2, tp=2))


@pytest.fixture(scope="module")
def dsv3_rank() -> JointGraph:
    workload = load_workload("torchtitan:deepseek_v3/debugmodel", layers=2, seq=32)
    return trace(workload, "real", Parallel(fsdp=2, ep=2))


def _cpu_forced(graph: JointGraph) -> set[str]:
    """The CPU flash-attention nodes and the getitems unpacking them (saved on the CPU)."""
    ops = {name for name, info in graph.nodes.items() if info.op == CPU_FLASH}
    return ops | {
        n.name
        for n in graph.gm.graph.nodes
        if n.args and isinstance(n.args[0], torch.fx.Node) and n.args[0].name in ops
    }


def test_llama_rank_is_graph_trainers_own_graph(llama_rank: JointGraph) -> None:
    """Node modules are graph trainer's `module_fqn` annotations (its fused `wqkv`), the
    parameters its state FQNs, and the step's collectives run on the fsdp and tp meshes."""
    for node in llama_rank.gm.graph.nodes:
        info = llama_rank.nodes[node.name]
        fqn = (node.meta.get("custom") or {}).get("module_fqn")
        if info.phase == "forward" and fqn is not None:
            assert info.module == fqn
    modules = {i.module for i in llama_rank.nodes.values() if i.phase == "forward"}
    assert {"layers.0.attention.qkv_linear.wqkv", "layers.1.feed_forward.w2"} <= modules
    assert "layers.0.attention.qkv_linear.wqkv.weight" in llama_rank.param_names
    # the loss's own ops are graph trainer's `loss`; what it annotates with no module (the
    # gradient seed `ones_like`) belongs to no module, as in its memory policy
    loss_phase = {n: i.module for n, i in llama_rank.nodes.items() if i.phase == "loss"}
    assert set(loss_phase.values()) == {"loss", ""}
    assert all("ones_like" in llama_rank.nodes[n].op for n, m in loss_phase.items() if not m)
    counts = llama_rank.collective_counts()
    assert counts["all_gather"] and counts["reduce_scatter"] and counts["all_reduce"]
    assert set(llama_rank.mesh_dims.values()) == {"fsdp", "tp"}
    assert all(c.mesh_dim for c in llama_rank.collectives() if c.kind != "wait")
    assert llama_rank.config["parallelize"] == "graph trainer"
    assert llama_rank.world_size == 4


@pytest.mark.parametrize("preset", TITAN_PRESETS)
def test_titan_presets_match_graph_trainer_on_its_sharded_graph(
    llama_rank: JointGraph, preset: str
) -> None:
    mismatches = {m.node for m in compare(llama_rank, preset)}
    assert mismatches == (set() if preset == "titan-full" else _cpu_forced(llama_rank))
    if preset != "titan-full":
        assert len(mismatches) == 6  # 2 layers x (the op and its two getitems)


def test_decide_and_estimate_run_on_the_rank(llama_rank: JointGraph) -> None:
    estimator = Estimator(llama_rank)
    none, full = (estimator.estimate(Policy(p)) for p in ("none", "full"))
    assert 0 < full.saved_activation_bytes < none.saved_activation_bytes
    assert any(t.recompute for t in decide(llama_rank, Policy("titan-default")).values())


def test_expert_parallel_rank_has_its_all_to_alls(dsv3_rank: JointGraph) -> None:
    """Dispatch and combine, forward and backward, plus the token-count exchange; every
    size bound (the estimate reads them) and the routing assumption stated."""
    a2a = [c for c in dsv3_rank.collectives() if c.kind == "all_to_all"]
    assert len(a2a) == 5 and all(c.bytes > 0 for c in a2a)
    assert {c.phase for c in a2a} == {"forward", "backward"}
    assert any("expert routing" in note for note in dsv3_rank.notes)
    assert dsv3_rank.summary()["ep"] == 2
    assert {c.mesh_dim for c in a2a} == {"fsdp+ep"}  # both span the world of 2
    for preset in TITAN_PRESETS:
        assert compare(dsv3_rank, preset) == []
    assert Estimator(dsv3_rank).estimate(Policy("default")).peak_bytes > 0


def test_imbalance_scales_what_the_hottest_rank_receives() -> None:
    workload = load_workload("torchtitan:qwen3/debugmodel_moe", layers=1, seq=32, device="meta")
    graphs = [trace(workload, "fake", Parallel(fsdp=2, ep=2, ep_imbalance=f)) for f in (1, 2)]
    received = [
        [c.bytes for c in g.collectives() if c.kind == "all_to_all" and c.phase == "forward"]
        for g in graphs
    ]
    assert received[1][1] == 2 * received[0][1]  # the dispatch: this rank receives twice
    assert "receives 2 x the balanced count" in graphs[1].notes[-1]


def test_graph_trainer_imports_without_its_training_packages() -> None:
    """Graph trainer's EP modules import torchtitan's trainer; inside the context they import
    without torchdata, and a placeholder trainer never outlives it."""
    import sys

    before = sys.modules.get("torchtitan.trainer")
    with graph_trainer_imports():
        module = importlib.import_module("torchtitan.experiments.graph_trainer.ep_pass_utils")
        assert hasattr(module, "concretize_ep_chunk_symbolic_shapes_pass")
        assert hasattr(sys.modules["torchtitan.trainer"], "Trainer")
    after = sys.modules.get("torchtitan.trainer")
    # the placeholder (a module with no file) is gone; a real trainer, where one imports, stays
    assert after is before or getattr(after, "__file__", None) is not None


def test_bind_token_counts_leaves_graphs_without_ep_alone(llama_rank: JointGraph) -> None:
    assert bind_token_counts(llama_rank.gm, Parallel(fsdp=2, tp=2)) == []


@pytest.mark.parametrize(
    "argv, kinds",
    [
        (
            ["torchtitan:llama3/debugmodel", "--fsdp", "2", "--tp", "2"],
            {"all_gather", "all_reduce"},
        ),
        (["torchtitan:qwen3/debugmodel_moe", "--fsdp", "2", "--ep", "2"], {"all_to_all"}),
    ],
)
def test_trace_json_reports_the_collectives(
    capsys: pytest.CaptureFixture[str], argv: list[str], kinds: set[str]
) -> None:
    shape = ["--mode", "fake", "--layers", "1", "--seq", "32", "--json"]
    assert main(["trace", "--model", *argv, *shape]) == 0
    result = json.loads(capsys.readouterr().out)
    assert kinds <= set(result["collectives"]) and result["parallelize"] == "graph trainer"


@pytest.mark.parametrize("family", ["kimi_k2_7", "muse_glimmer"])
def test_other_families_trace_on_one_device(family: str) -> None:
    workload = load_workload(f"torchtitan:{family}/debugmodel", layers=1, seq=16)
    graph = trace(workload, "fake")
    assert graph.summary()["backward_nodes"] > 0
    assert (VISION_NOTE in workload.notes) == (family == "kimi_k2_7")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_other_families_are_refused_with_the_reason(family: str) -> None:
    with pytest.raises(WorkbenchError, match=f"torchtitan:{family} cannot be traced here: "):
        load_workload(f"torchtitan:{family}/debugmodel")


def test_context_parallel_rank_gathers_keys_and_values_for_flex() -> None:
    """`--cp 2` (an H100's kernels): torchtitan's cp_shard gives the rank half of each
    sequence and its rows of the block mask, each layer all-gathers keys and values for flex
    attention and reduce-scatters their gradients; the what-if is torch's remat pass."""
    workload = load_workload("torchtitan:llama3/debugmodel", layers=2, seq=256, device="meta")
    rank = trace(workload, "fake", Parallel(cp=2))
    ids = next(s for s in rank.inputs if s.kind == "input")
    assert rank.nodes[ids.placeholder].shapes == ((2, 128),)
    mask = {s.fqn: rank.nodes[s.placeholder].shapes for s in rank.inputs}
    assert mask["attention_masks.kv_indices"] == ((2, 1, 1, 2),)  # 1 query block of 2 key blocks
    ops = collections.Counter(i.op for i in rank.ops())
    assert ops["cplib.flex_cp_allgather.default"] == ops["flex_attention"] == 2
    assert ops["cplib.flex_cp_allgather_backward.default"] == 2
    assert any(note.startswith("context parallelism: torchtitan's cp_shard") for note in rank.notes)
    estimator = Estimator(rank)
    for preset in ("titan-default", "titan-full", "none"):
        policy = Policy(preset)
        assert estimator.estimate(policy).peak_bytes == (
            estimate_remat(rank, remat(rank, policy), estimator).peak_bytes
        )


def test_context_parallel_traces_long_contexts() -> None:
    """32K tokens per GPU (cp 4 over 128K): the block mask is built from its block tables,
    not from 128K x 128K booleans."""
    workload = load_workload("torchtitan:llama3/debugmodel", layers=1, seq=131072, device="meta")
    rank = trace(workload, "fake", Parallel(cp=4))
    ids = next(s for s in rank.inputs if s.kind == "input")
    assert rank.nodes[ids.placeholder].shapes == ((2, 32768),)
    assert Estimator(rank).estimate(Policy("titan-default")).peak_bytes > 0
