"""Tracing: node facts, backward attribution, bitwise equality with eager, fake 8B, errors."""

from __future__ import annotations

import collections

import pytest
import torch

from workbench.capture.graph import JointGraph, describe_nodes
from workbench.capture.models import Workload, load_workload
from workbench.capture.ops import layer_of, layer_pattern
from workbench.capture.trace import trace
from workbench.capture.tracing import annotate_modules
from workbench.capture.workload import eager_step
from workbench.errors import WorkbenchError


@pytest.mark.parametrize("fixture", ["llama_debug", "dsv3_debug"])
def test_graph_run_is_bitwise_equal_to_eager(fixture: str, request: pytest.FixtureRequest) -> None:
    workload, graph = request.getfixturevalue(fixture)
    traced = graph.run()
    eager = eager_step(workload)
    assert len(traced) == len(eager) == len(graph.param_names) + 1
    for name, a, b in zip(["loss", *graph.param_names], traced, eager, strict=True):
        assert torch.equal(a, b), f"{name} differs from eager"


@pytest.mark.parametrize("fixture", ["llama_debug", "dsv3_debug"])
def test_every_node_has_its_facts(fixture: str, request: pytest.FixtureRequest) -> None:
    _, graph = request.getfixturevalue(fixture)
    assert list(graph.nodes) == [n.name for n in graph.gm.graph.nodes]
    for node in graph.gm.graph.nodes:
        info = graph.nodes[node.name]
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert info.shapes == (tuple(val.shape),)
            assert info.bytes == val.numel() * val.element_size()
            assert info.dtype == str(val.dtype).removeprefix("torch.")
        if info.phase in ("forward", "backward") and node.op == "call_function":
            assert info.op.startswith("aten.") or info.op == "getitem", info.op
            assert "sym_size" not in info.op, "shapes are static"
    ops = list(graph.ops())
    assert {i.phase for i in ops} == {"forward", "loss", "backward"}
    # forward ops all come from a module: the root ("") or a named one
    fwd = [i for i in ops if i.phase == "forward"]
    assert sum(1 for i in fwd if i.module.startswith("layers.")) > 0.9 * len(fwd)
    # backward ops all carry a module path but for true graph-level ones, flagged as such
    bwd = [i for i in ops if i.phase == "backward"]
    assert all(i.module or i.graph_level for i in bwd)
    assert sum(i.graph_level for i in bwd) <= 2
    # the loss function's ops are the loss's; the gradient's seed, made by autograd.grad
    # outside it, is no module's (as graph trainer's tracer leaves it)
    assert {i.module for i in ops if i.phase == "loss" and i.op != "aten.ones_like.default"} == {
        "loss"
    }
    assert [i.module for i in ops if i.op == "aten.ones_like.default"] == [""]


def test_llama_node_facts(llama_debug: tuple[Workload, JointGraph]) -> None:
    _, graph = llama_debug
    wq = next(i for i in graph.ops() if i.module == "layers.0.attention.wq" and "mm" in i.op)
    assert (wq.op, wq.phase, wq.layer) == ("aten.mm.default", "forward", 0)
    assert wq.shapes == ((256, 256),)
    assert wq.flops == 2 * 256 * 256 * 256  # 2*M*N*K from torch's flop counter
    assert wq.bytes == 256 * 256 * 4
    assert wq.source.startswith("llama3.py:") and "self.wq(x)" in wq.source
    assert wq.pattern_key == "layers.*.attention.wq::aten.mm.default"
    sdpa = [i for i in graph.ops() if "scaled_dot_product" in i.op and i.phase == "forward"]
    assert len(sdpa) == 6 and all(i.is_random for i in sdpa)  # the CPU flash kernel is seeded
    views = [i for i in graph.ops() if i.op == "aten.view.default"]
    assert views and all(i.is_view for i in views)
    assert not any(i.is_view for i in graph.ops() if i.op == "aten.mm.default")


def test_backward_nodes_take_their_forward_module(llama_debug: tuple[Workload, JointGraph]) -> None:
    _, graph = llama_debug
    bwd = [i for i in graph.ops() if i.phase == "backward"]
    per_layer = collections.Counter(i.layer for i in bwd if i.layer is not None)
    assert sorted(per_layer) == list(range(6))
    assert len(set(per_layer.values())) == 1  # identical layers, identical backward
    # the weight gradient of wq is an mm in layers.N.attention.wq's backward
    wq_bwd = [i for i in bwd if i.module == "layers.3.attention.wq" and i.op == "aten.mm.default"]
    assert len(wq_bwd) == 2  # grad input and grad weight
    assert any(i.module == "loss" for i in bwd)


def test_gradient_accumulation_nodes_are_not_labelled_as_loss(
    llama_debug: tuple[Workload, JointGraph],
) -> None:
    _, graph = llama_debug
    acc = [n for n in graph.gm.graph.nodes if n.meta.get("is_gradient_acc")]
    assert acc, "residual streams accumulate gradients"
    for node in acc:
        info = graph.nodes[node.name]
        assert info.module != "loss", f"{node.name} inherited the loss's seq_nr"
    assert sum(graph.nodes[n.name].layer is not None for n in acc) >= len(acc) - 1


def test_dsv3_moe_facts(dsv3_debug: tuple[Workload, JointGraph]) -> None:
    _, graph = dsv3_debug
    grouped = [i for i in graph.ops() if i.op == "aten._grouped_mm.default"]
    fwd = [i for i in grouped if i.phase == "forward"]
    assert len(fwd) == 2 * 3  # two MoE layers, three expert matmuls each
    assert all(i.module == f"layers.{i.layer}.feed_forward.experts" for i in fwd)
    assert all(i.flops > 0 for i in fwd)
    gate = [i for i in graph.ops() if i.module.endswith("router.gate") and i.phase == "forward"]
    assert any(i.op == "aten.mm.default" for i in gate)


def test_phases_are_in_order(llama_debug: tuple[Workload, JointGraph]) -> None:
    _, graph = llama_debug
    order = {"input": 0, "forward": 1, "loss": 2, "backward": 3, "output": 4}
    ranks = [order[i.phase] for i in graph.nodes.values()]
    assert ranks == sorted(ranks)
    specs = collections.Counter(s.kind for s in graph.inputs)
    assert specs == {"param": 57, "buffer": 2, "input": 1, "target": 1}


def test_fake_mode_holds_no_tensors_and_matches_real_structure() -> None:
    """With the CPU's kernels a fake trace is the real one's graph (the GPU's: test_kernels)."""
    real = trace(load_workload("llama3-debug", layers=2, seq=32), mode="real")
    meta = load_workload("llama3-debug", layers=2, seq=32, device="meta")
    fake = trace(meta, mode="fake", kernels="cpu")
    assert fake.example_inputs is None
    assert real.config["kernels"] == fake.config["kernels"] == "cpu"
    assert [i.op for i in fake.nodes.values()] == [i.op for i in real.nodes.values()]
    assert [i.bytes for i in fake.nodes.values()] == [i.bytes for i in real.nodes.values()]
    with pytest.raises(WorkbenchError, match="fake mode"):
        fake.run()


def test_llama3_8b_traces_in_fake_mode() -> None:
    """Full 32 layers at seq 8192: node counts grow exactly by one layer's worth per layer."""
    two = trace(load_workload("llama3-8b", layers=2, device="meta"), mode="fake").summary()
    three = trace(load_workload("llama3-8b", layers=3, device="meta"), mode="fake").summary()
    full = trace(load_workload("llama3-8b", device="meta"), mode="fake")
    summary = full.summary()
    for key in ("nodes", "forward_nodes", "backward_nodes"):
        per_layer = three[key] - two[key]
        assert per_layer > 0
        assert summary[key] == two[key] + 30 * per_layer, key
    assert summary["layers"] == 32 and summary["seq"] == 8192
    assert 8.0e9 * 4 < summary["param_bytes"] < 8.1e9 * 4
    wq = next(i for i in full.ops() if i.module == "layers.31.attention.wq" and "mm" in i.op)
    assert wq.shapes == ((8192, 4096),) and wq.flops == 2 * 8192 * 4096 * 4096


def test_data_dependent_control_flow_is_a_clear_error() -> None:
    workload = load_workload("user_models:data_dependent")
    with pytest.raises(WorkbenchError, match="control flow depends on tensor values"):
        trace(workload)
    # the model's forward methods are restored after the failed trace
    assert "forward" not in vars(workload.model) and "forward" not in vars(workload.model.lin)


def test_non_scalar_loss_and_unused_parameters_are_clear_errors() -> None:
    with pytest.raises(WorkbenchError, match="must return a scalar tensor"):
        trace(load_workload("user_models:vector_loss"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    unused = Workload(model[0], torch.randn(2, 4), torch.randn(2, 4), name="half")
    unused.model.extra = torch.nn.Linear(4, 4)
    with pytest.raises(WorkbenchError, match="extra.weight"):
        trace(unused)


def test_meta_model_in_real_mode_is_refused() -> None:
    with pytest.raises(WorkbenchError, match="mode='fake'"):
        trace(load_workload("llama3-debug", layers=1, device="meta"), mode="real")
    with pytest.raises(WorkbenchError, match="unknown trace mode"):
        trace(load_workload("llama3-debug", layers=1), mode="symbolic")  # type: ignore[arg-type]


def test_user_model_traces_bitwise() -> None:
    workload = load_workload("user_models:mlp_with_loss")
    graph = trace(workload)
    for a, b in zip(graph.run(), eager_step(workload), strict=True):
        assert torch.equal(a, b)
    assert {i.module for i in graph.ops() if i.phase == "forward"} >= {"blocks.0", "head"}


def test_annotate_modules_keeps_an_instance_forward() -> None:
    model = torch.nn.Linear(2, 2)
    own = model.forward
    model.forward = own  # an instance attribute, as some wrappers set
    with annotate_modules(model):
        assert model.forward is not own
    assert vars(model)["forward"] is own


def test_layer_helpers() -> None:
    assert layer_of("layers.12.attention.wq") == 12
    assert layer_of("tok_embeddings") is None
    assert layer_pattern("layers.12.attention.wq") == "layers.*.attention.wq"
    assert layer_pattern("norm") == "norm"


def test_describe_nodes_is_a_pure_function_of_the_graph(
    llama_debug: tuple[Workload, JointGraph],
) -> None:
    _, graph = llama_debug
    assert describe_nodes(graph.gm) == graph.nodes
