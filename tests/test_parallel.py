"""Per-rank graphs: FSDP x TP on one process (fake group), their collectives, the what-if
on sharded graphs, the CLI flags, bad input, and the bitwise check on real gloo ranks."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import workbench.capture.parallel as parallel_module
from workbench.capture.degrees import DEGREES, EXPERT_MESH_DIMS, MESH_DIMS, Degrees
from workbench.capture.expert_parallel import (
    ExpertDispatch,
    apply_expert_parallel,
    expert_mesh,
    expert_shard,
)
from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.models.deepseek_v3 import MoE
from workbench.capture.models.llama3 import Llama3, Llama3Config
from workbench.capture.parallel import (
    Parallel,
    eager_rank_step,
    fake_process_group,
    shard_workload,
    trace_rank,
)
from workbench.capture.stages import Pipeline
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.ranks import check_ranks
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.rewrite.remat import remat

PRESETS = ["none", "default", "eager", "full"]
SMALL = {"layers": 2, "seq": 32}
# Per rank of FSDP2 x TP2, 2 layers: one fsdp all-gather per parameter in forward and one
# reduce-scatter of its gradient in backward; TP moves the sequence in and out of each
# attention/FFN (all-gather before, reduce-scatter after, the reverse in backward),
# all-reduces the gradients of the sequence-parallel norms, and loss_parallel all-reduces
# three times. DeepSeek-V3's MoE block is replicated over tp: no TP matmul collectives
# (a redistribute of its output to sequence shards is a local chunk).
EXPECTED = {
    "llama3-debug": {
        ("all_gather", "fsdp"): 21,
        ("reduce_scatter", "fsdp"): 21,
        ("all_gather", "tp"): 10,
        ("reduce_scatter", "tp"): 10,
        ("all_reduce", "tp"): 8,
    },
    "dsv3-debug": {
        ("all_gather", "fsdp"): 25,
        ("reduce_scatter", "fsdp"): 25,
        ("all_gather", "tp"): 10,
        ("reduce_scatter", "tp"): 8,
        ("all_reduce", "tp"): 8,
    },
}


@pytest.fixture(scope="module")
def rank_graphs() -> dict[str, JointGraph]:
    """Both reference models, FSDP2 x TP2, traced for rank 0 on fake tensors."""
    return {
        model: trace(load_workload(model, device="meta", **SMALL), "fake", Parallel(fsdp=2, tp=2))
        for model in EXPECTED
    }


@pytest.mark.parametrize("model", list(EXPECTED))
def test_rank_graph_collectives_by_kind_and_mesh_dim(
    model: str, rank_graphs: dict[str, JointGraph]
) -> None:
    graph = rank_graphs[model]
    found = Counter((c.kind, c.mesh_dim) for c in graph.collectives() if c.kind != "wait")
    assert dict(found) == EXPECTED[model]
    counts = graph.collective_counts()
    assert counts["wait"] == sum(EXPECTED[model].values())  # each collective is waited on
    summary = graph.summary()
    assert summary["world_size"] == 4 and summary["collectives"] == counts
    assert (summary["fsdp"], summary["tp"]) == (2, 2)


@pytest.mark.parametrize("model", list(EXPECTED))
def test_rank_graph_node_facts(model: str, rank_graphs: dict[str, JointGraph]) -> None:
    graph = rank_graphs[model]
    kinds = [spec.kind for spec in graph.inputs]
    assert kinds[0] == "mesh" and kinds.count("mesh") == 1
    assert graph.param_names[:3] == [
        "tok_embeddings.weight",
        "layers.0.attention_norm.weight",
        "layers.0.attention.wq.weight",
    ]
    shapes = {
        s.fqn: graph.nodes[s.placeholder].shapes[0] for s in graph.inputs if s.kind == "param"
    }
    # wq: heads split by tp, rows again by fsdp; norms: rows by fsdp only; embedding: vocab
    # split by tp (row-wise parallel) and by fsdp
    assert shapes["layers.0.attention.wq.weight"] == (256 // 4, 256)
    assert shapes["layers.0.attention_norm.weight"] == (256 // 2,)
    assert shapes["tok_embeddings.weight"] == (2048 // 4, 256)
    fsdp = [c for c in graph.collectives() if c.mesh_dim == "fsdp" and c.kind != "wait"]
    gathers = [graph.nodes[c.node] for c in fsdp if c.kind == "all_gather"]
    scatters = [graph.nodes[c.node] for c in fsdp if c.kind == "reduce_scatter"]
    # mixed precision: bf16 on the wire forward, fp32 gradient reduce-scatter backward
    assert {g.dtype for g in gathers} == {"bfloat16"}
    assert {g.phase for g in gathers} == {"forward"}
    assert {s.dtype for s in scatters} == {"float32"}
    assert {s.phase for s in scatters} == {"backward"}
    wq = next(g for g in gathers if g.module == "layers.0.attention.wq")
    assert wq.shapes == ((128, 256),)  # the tp-local whole: 8 of 16 heads
    assert all(c.bytes > 0 for c in graph.collectives())
    assert graph.nodes[wq.name].bytes == 128 * 256 * 2


@pytest.mark.parametrize("model", list(EXPECTED))
def test_whatif_equals_torch_remat_on_sharded_graphs(
    model: str, rank_graphs: dict[str, JointGraph]
) -> None:
    graph = rank_graphs[model]
    estimator = Estimator(graph, ("h100",))
    saved = {}
    for preset in PRESETS:
        fast = estimator.estimate(Policy(preset))
        full = estimate_remat(graph, remat(graph, Policy(preset)), estimator)
        assert fast.peak_bytes == full.peak_bytes, preset
        assert fast.timeline == full.timeline, preset
        saved[preset] = fast.saved_activation_bytes
    # (peaks of these tiny graphs sit in the loss, alike for every preset once FSDP
    # reshards after forward)
    assert saved["full"] < saved["none"]


def test_real_rank_graph_runs_in_a_fake_group_and_matches_its_eager_shapes() -> None:
    parallel = Parallel(fsdp=2, tp=2)
    workload = load_workload("llama3-debug", **SMALL)
    with fake_process_group(parallel) as mesh:
        graph = trace_rank(workload, "real", parallel, mesh)
        outputs = graph.run()
        eager = eager_rank_step(shard_workload(workload, parallel, mesh))
    assert not dist.is_initialized()
    with pytest.raises(WorkbenchError, match="runs collectives: run it inside the process group"):
        graph.run()
    assert [t.shape for t in outputs] == [t.shape for t in eager]
    assert [t.dtype for t in outputs[1:]] == [torch.float32] * len(graph.param_names)
    # the caller's model is left unsharded
    assert not any(".parametrizations." in name for name, _ in workload.model.named_parameters())


def test_fsdp_only_keeps_tp_out_and_user_tp_plan() -> None:
    graph = trace(load_workload("llama3-debug", device="meta", **SMALL), "fake", Parallel(fsdp=4))
    assert {c.mesh_dim for c in graph.collectives()} == {"fsdp"}
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    workload = Workload(mlp, torch.randn(4, 8), torch.randn(4, 8), name="mlp", tp_plan=plan)
    graph = trace(workload, "fake", Parallel(fsdp=2, tp=2))
    kinds = Counter((c.kind, c.mesh_dim) for c in graph.collectives())
    assert kinds[("all_reduce", "tp")] >= 1  # the row-wise output
    assert graph.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def _llama(**changes: int) -> Workload:
    config = Llama3Config(
        dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=128, ffn_hidden=96
    )
    fields = {**config.__dict__, **changes}
    with torch.device("meta"):
        model = Llama3(Llama3Config(**fields), 16)
        ids = torch.zeros(1, 17, dtype=torch.long)
    return Workload(model, ids[:, :-1], ids[:, 1:], name="tiny")


def test_tied_embeddings_stay_tied_under_tp() -> None:
    workload = _llama(tie_embeddings=True)
    graph = trace(workload, "fake", Parallel(fsdp=2, tp=2))
    assert len(graph.param_names) == len(list(workload.model.parameters()))
    assert "output.weight" not in graph.param_names


@pytest.mark.parametrize(
    ("workload", "parallel", "message"),
    [
        (lambda: _llama(n_heads=2, n_kv_heads=2), Parallel(tp=4), "heads of 'tiny' (2)"),
        (lambda: _llama(n_kv_heads=2), Parallel(tp=4), "kv heads of 'tiny' (2)"),
        (lambda: _llama(ffn_hidden=90), Parallel(tp=4), "ffn hidden size of 'tiny' (90)"),
        (lambda: _llama(vocab_size=130), Parallel(tp=4), "vocabulary of 'tiny' (130)"),
        (
            lambda: load_workload("llama3-debug", layers=1, seq=30, device="meta"),
            Parallel(tp=4),
            "sequence of 'llama3-debug' (30)",
        ),
        (lambda: _llama(dim=60), Parallel(fsdp=8), "--fsdp 8 does not divide parameter"),
        (
            lambda: Workload(nn.Linear(4, 4), torch.zeros(2, 4), torch.zeros(2, 4), name="lin"),
            Parallel(tp=2),
            "has no tensor-parallel plan; give one as workload.tp_plan",
        ),
    ],
)
def test_bad_shapes_and_plans_are_one_line_errors(
    workload: object, parallel: Parallel, message: str
) -> None:
    with pytest.raises(WorkbenchError) as err:
        trace(workload(), "fake", parallel)  # type: ignore[operator]
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not dist.is_initialized()


def test_bad_degrees_and_an_initialised_group_are_refused() -> None:
    with pytest.raises(WorkbenchError, match="fsdp must be a whole number from 1"):
        Parallel(fsdp=0)
    with pytest.raises(WorkbenchError, match="param_dtype 'fp8'"):
        Parallel(param_dtype="fp8")  # type: ignore[arg-type]
    workload = load_workload("llama3-debug", device="meta", **SMALL)
    with fake_process_group(Parallel(fsdp=2)):
        with pytest.raises(WorkbenchError, match="already initialised .backend fake, world size 2"):
            trace(workload, "fake", Parallel(fsdp=2, tp=2))
    assert not dist.is_initialized()


def test_real_mode_that_cannot_fit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_module, "available_bytes", lambda device: 1024)
    workload = load_workload("llama3-debug", **SMALL)
    with pytest.raises(WorkbenchError, match="one rank of 'llama3-debug' at fsdp 2 x tp 2"):
        trace(workload, "real", Parallel(fsdp=2, tp=2))


def test_cli_fsdp_tp_flags_json(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--model", "llama3-debug", "--layers", "2", "--seq", "32", "--mode", "fake"]
    flags = ["--fsdp", "2", "--tp", "2", "--json"]
    assert main(["trace", *small, *flags]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert traced["world_size"] == 4 and traced["nodes"] > 900
    assert traced["collectives"]["all_gather"] == 31
    assert main(["bench", "trace", *small, *flags]) == 0
    bench = json.loads(capsys.readouterr().out)
    assert bench["world_size"] == 4 and bench["collectives"] == traced["collectives"]
    assert main(["trace", *small, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 1
    assert main(["trace", *small, "--tp", "3", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tp 3 does not divide the heads") and err.count("\n") == 1


def test_gloo_ranks_match_eager_bitwise_for_every_preset(tmp_path: Path) -> None:
    """World size 4 (FSDP2 x TP2) on CPU processes: each rank traces once, remats per
    preset (and once keeping the gathered weights unsharded), runs its collectives on the
    gloo group, and equals its eager step bitwise."""
    keep = str(Policy("default", fsdp_reshard=False).save(tmp_path / "keep.json"))
    policies = [*PRESETS, keep]
    checks = check_ranks("llama3-debug", Parallel(fsdp=2, tp=2), policies, layers=2, seq=32)
    assert [(c.rank, c.policy) for c in checks] == [(r, p) for r in range(4) for p in policies]
    assert [c for c in checks if not c.bitwise_equal] == []
    # the same batch on every rank: one loss, near log(vocab) for an untrained model, which
    # a rank whose collectives did not run would not reach
    assert len({c.loss for c in checks}) == 1
    assert abs(checks[0].loss - math.log(2048)) < 0.5


def test_trace_speedups_leave_the_graph_as_it_was(
    rank_graphs: dict[str, JointGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without stack capture in backward and with the collector paused, the per-rank graph
    is the one traced with neither: same code, nodes, facts and collectives."""
    import contextlib
    import importlib

    trace_module = importlib.import_module(
        "workbench.capture.tracing"
    )  # the package's `trace` is the function
    fast = rank_graphs["llama3-debug"]
    monkeypatch.setattr(trace_module, "backward_without_stack_traces", contextlib.nullcontext)
    monkeypatch.setattr(trace_module, "collector_paused", contextlib.nullcontext)
    slow = trace(
        load_workload("llama3-debug", device="meta", **SMALL), "fake", Parallel(fsdp=2, tp=2)
    )
    assert fast.gm.code == slow.gm.code
    assert len(fast.gm.graph.nodes) == len(slow.gm.graph.nodes)
    assert fast.collectives() == slow.collectives()
    assert fast.nodes == slow.nodes  # module, phase, bytes, FLOPs, source line of every node
    backward = [n for n in fast.gm.graph.nodes if n.meta.get("autograd_backward")]
    captured = [n for n in slow.gm.graph.nodes if n.meta.get("autograd_backward")]
    # what went: stacks captured inside torch's autograd, which no node's source shows
    assert sum(bool(n.meta.get("stack_trace")) for n in backward) < sum(
        bool(n.meta.get("stack_trace")) for n in captured
    )


def test_parallel_json_names_ep_and_cp_only_when_used() -> None:
    """A 2-D job's JSON (and the keys made from it, the explorer's autosave) is what it was;
    EP borrows its ranks from fsdp x cp x tp, so it does not grow the world."""
    assert Parallel(fsdp=2, tp=2).to_json() == {
        "fsdp": 2,
        "tp": 2,
        "world_size": 4,
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
    }
    ep = Parallel(fsdp=8, ep=8, ep_imbalance=1.5)
    assert ep.world_size == 8 and ep.to_json()["ep"] == 8 and ep.to_json()["ep_imbalance"] == 1.5
    assert ep.describe() == "fsdp 8 x ep 8"
    assert Parallel(fsdp=2, cp=2, tp=2).world_size == 8


def test_degrees_are_one_value_for_every_package() -> None:
    """`Degrees` counts the ranks (`world_size` one pipeline rank's mesh, `gpus` all of
    them), names its meshes' sizes, reads back from its JSON and a stage graph's config, and
    checks itself in one line each; `Parallel` is a `Degrees` (plus precision and routing)
    and `Pipeline` takes its pp; the planner's layouts and a published run hold one."""
    degrees = Degrees(fsdp=4, cp=2, tp=2, pp=4, ep=8)
    assert (degrees.world_size, degrees.gpus, degrees.efsdp) == (16, 64, 2)
    assert degrees.non_data_parallel_size == 2 * 2 * 4
    assert degrees.mesh_sizes() == {"fsdp": 4, "cp": 2, "tp": 2, "efsdp": 2, "ep": 8}
    assert list(degrees.mesh_sizes()) == [*MESH_DIMS, *EXPERT_MESH_DIMS]
    assert degrees.describe() == "fsdp 4 x cp 2 x tp 2 x pp 4 x ep 8"
    assert degrees.to_json() == {"fsdp": 4, "tp": 2, "cp": 2, "pp": 4, "ep": 8, "world_size": 16}
    assert Degrees.from_json(degrees.to_json()) == degrees
    assert Degrees.from_json({"fsdp": 2, "pipeline": {"pp": 3}}) == Degrees(fsdp=2, pp=3)
    assert DEGREES == ("dp", "fsdp", "cp", "tp", "pp", "ep")
    assert not Degrees(pp=8).sharded and Degrees(ep=1, tp=2).sharded
    parallel = Parallel.of(degrees, ep_imbalance=2.0)
    assert isinstance(parallel, Degrees) and parallel.degrees() == degrees
    assert "pp" not in parallel.to_json() and parallel.to_json()["world_size"] == 16
    assert Pipeline(pp=degrees.pp).pp == 4
    for bad, message in [
        (lambda: Degrees(pp=0), "parallel pp must be a whole number from 1"),
        (lambda: Degrees(fsdp=2, ep=3), r"--ep 3 must divide fsdp x cp x tp = 2"),
        (lambda: Degrees(fsdp=2**11, tp=2**10), r"world size \(fsdp x cp x tp\) must be"),
        (lambda: Parallel(dp=2), "parallel dp 2: the workbench traces no replicated"),
        (
            lambda: trace(
                load_workload("llama3-debug", device="meta", **SMALL),
                "fake",
                Parallel(fsdp=2, pp=2),
            ),
            r"parallel pp 2 splits the model",
        ),
    ]:
        with pytest.raises(WorkbenchError, match=message) as raised:
            bad()
        assert "\n" not in str(raised.value)


def test_ep_rank_graph_holds_the_all_to_alls_and_its_experts() -> None:
    """The reference MoE with EP 2 over fsdp 2 x tp 2 (one MoE layer): a token-count
    exchange, a dispatch and a combine all-to-all on the "ep" group in forward, the two token
    exchanges reversed in backward, each waited on; routed experts gathered over "efsdp" to
    1/ep of them, this rank holding 1/(fsdp x tp); the what-if equals torch's remat."""
    workload = load_workload("dsv3-debug", device="meta", **SMALL)
    parallel = Parallel(fsdp=2, tp=2, ep=2, ep_imbalance=1.5)
    graph = trace(workload, "fake", parallel)
    a2a = [c for c in graph.collectives() if c.kind == "all_to_all"]
    assert Counter((c.mesh_dim, c.phase) for c in a2a) == {
        ("ep", "forward"): 3,
        ("ep", "backward"): 2,
    }
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    waited = {str(n.args[0]) for n in nodes.values() if "wait_tensor" in str(n.target)}
    assert {c.node for c in a2a} <= waited
    # 2 x 32 tokens, 16 per tp rank, top 3: 96 copies, 48 to each EP rank, 1.5 x 48 back
    dispatch = [graph.nodes[c.node] for c in a2a if c.phase == "forward" and c.bytes > 64]
    assert [d.shapes[0] for d in dispatch] == [(144, 256), (96, 256)]
    experts = {
        s.fqn: graph.nodes[s.placeholder]
        for s in graph.inputs
        if s.kind == "param" and ".experts." in s.fqn
    }
    n_experts, dim, hidden = 8, 256, 256
    assert {e.shapes[0] for e in experts.values()} == {(n_experts // 4, dim, hidden)}
    assert sum(e.bytes for e in experts.values()) == 3 * n_experts * dim * hidden * 4 // 4
    gathers = [graph.nodes[c.node] for c in graph.collectives() if c.mesh_dim == "efsdp"]
    assert {g.shapes[0] for g in gathers if g.phase == "forward"} == {(n_experts // 2, dim, hidden)}
    assert graph.mesh_dims and set(graph.mesh_dims.values()) == {"fsdp", "tp", "efsdp", "ep"}
    assert [s.kind for s in graph.inputs[:2]] == ["mesh", "mesh"]
    assert any(note.startswith("expert routing: fake tensors cannot route") for note in graph.notes)
    estimator = Estimator(graph, ("h100",))
    for preset in ("none", "full"):
        fast = estimator.estimate(Policy(preset))
        assert (
            fast.peak_bytes
            == estimate_remat(graph, remat(graph, Policy(preset)), estimator).peak_bytes
        )


@pytest.mark.parametrize(
    ("parallel", "rows", "dim", "shape"),
    [  # 8 experts: 4 on each of ep 2, then efsdp 2 splits them (torchtitan's dim 0)
        (Parallel(fsdp=2, tp=2, ep=2), slice(0, 2), 0, (2, 16, 6)),
        # efsdp 8 x ep 2 > 8 experts: efsdp splits dimension 1 of this rank's 4 experts
        (Parallel(fsdp=4, tp=4, ep=2), slice(0, 4), 1, (4, 2, 6)),
    ],
)
def test_expert_shard_is_this_ranks_experts_then_its_efsdp_slice(
    parallel: Parallel, rows: slice, dim: int, shape: tuple[int, ...]
) -> None:
    weight = torch.arange(8 * 16 * 6.0).view(8, 16, 6)
    with fake_process_group(parallel):
        mesh = expert_mesh(parallel)
        assert mesh.mesh_dim_names == ("efsdp", "ep")
        assert mesh.shape == (parallel.world_size // parallel.ep, parallel.ep)
        shard, found = expert_shard(weight, parallel, mesh)
    assert found == dim and tuple(shard.shape) == shape
    assert torch.equal(shard, weight[rows].narrow(dim, 0, shape[dim]))


def test_apply_expert_parallel_gives_every_moe_one_dispatch_over_ep() -> None:
    """dsv3-debug, 3 layers: the dense first layer keeps its FFN, both MoE layers get the
    same dispatch on the "ep" group; the model the caller sharded is untouched."""
    workload = load_workload("dsv3-debug", layers=3, seq=32, device="meta")
    parallel = Parallel(fsdp=2, tp=2, ep=4, ep_imbalance=2.0)
    rank = None
    with fake_process_group(parallel) as mesh:
        rank = shard_workload(workload, parallel, mesh)
        assert rank.experts_mesh is not None
        group = rank.experts_mesh.get_group("ep").group_name
        copy = load_workload("dsv3-debug", layers=3, seq=32, device="meta").model
        assert apply_expert_parallel(copy, rank.experts_mesh, parallel) == 2
    moes = [m for m in rank.workload.model.modules() if isinstance(m, MoE)]
    assert len(moes) == 2
    assert {m.dispatch for m in moes} == {ExpertDispatch(group, 4, 2.0)}
    assert all(m.dispatch is None for m in workload.model.modules() if isinstance(m, MoE))
    assert [s.expert for s in rank.shards].count(True) == 6  # w1, w2, w3 of two MoE layers
