"""Stamped graphs against full traces: node for node, byte for byte, on one device, one rank
of FSDP x TP (x EP), and a model whose first layer differs (DeepSeek-V3's dense layer)."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.capture.fresh import FreshValues
from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.models.deepseek_v3 import DSV3_FLAVORS, DeepSeekV3
from workbench.capture.parallel import Parallel
from workbench.capture.stamp import (
    StampRefused,
    keep_layers,
    stamp_graph,
    template_key,
    trace_layers,
)
from workbench.capture.trace import trace
from workbench.capture.workload import Workload, token_workload
from workbench.errors import WorkbenchError

SMALL = {"seq": 16, "batch": 1, "device": "meta"}


def _node_facts(graph: JointGraph) -> list[tuple[Any, ...]]:
    """Everything a node holds that the workbench or torch's passes read, with storages
    numbered in order of first appearance and seq_nr counted from the first node's."""
    storages: dict[StorageWeakRef, int] = {}
    nodes = list(graph.gm.graph.nodes)
    base = nodes[0].meta.get("seq_nr", 0)
    facts = []
    for node in nodes:
        values = node.meta.get("val")
        values = values if isinstance(values, (list, tuple)) else [values]
        tensors = []
        for t in values:
            if isinstance(t, torch.Tensor):
                number = storages.setdefault(StorageWeakRef(t.untyped_storage()), len(storages))
                tensors.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, number))
            else:
                tensors.append(repr(t) if isinstance(t, (int, type(None))) else type(t).__name__)
        seq = node.meta.get("seq_nr")
        facts.append(
            (
                node.name,
                node.op,
                str(node.target),
                str(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)),
                tensors,
                (node.meta.get("custom") or {}).get("module"),
                seq - base if isinstance(seq, int) else seq,
                node.meta.get("autograd_backward"),
                node.meta.get("is_gradient_acc"),
                node.meta.get("stack_trace"),
                sorted(k for k in node.meta if k != "workbench_origin"),
            )
        )
    return facts


def full_layers(graph: JointGraph) -> set[int]:
    return {i.layer for i in graph.nodes.values() if i.layer is not None}


def assert_same_graph(stamped: JointGraph, full: JointGraph) -> None:
    assert stamped.config.pop("stamped") == len(full_layers(full)) - 3
    assert _node_facts(stamped) == _node_facts(full)
    assert stamped.nodes == full.nodes  # describe_nodes' facts: module, phase, bytes, ...
    assert stamped.inputs == full.inputs
    assert stamped.mesh_dims == full.mesh_dims
    assert stamped.config == full.config
    assert stamped.gm.code == full.gm.code


@pytest.mark.parametrize(
    ("name", "layers", "parallel"),
    [
        ("llama3-debug", 6, None),
        ("llama3-debug", 5, Parallel(fsdp=2, tp=2)),
        ("dsv3-debug", 5, None),  # a dense first layer, then MoE layers
        # routed experts over EP: token all-to-alls in every MoE layer, experts' own mesh
        ("dsv3-debug", 5, Parallel(fsdp=2, tp=2, ep=4, ep_imbalance=1.5)),
    ],
)
def test_stamped_graph_is_the_full_trace(name: str, layers: int, parallel: Any) -> None:
    workload = load_workload(name, layers=layers, **SMALL)
    stamped = trace(workload, "fake", parallel)
    assert f"layers 2-{layers - 2} stamped from layer 1" in stamped.notes
    full = trace(workload, "fake", parallel, stamp=False)
    assert set(full.notes) <= set(stamped.notes)  # what tracing noted (EP's routing) stays
    assert_same_graph(stamped, full)


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan not installed: pip install -e '.[torchtitan]'",
)
@pytest.mark.parametrize(
    ("name", "parallel"),
    [
        # graph trainer's rank: a mesh placeholder per DTensor parameter, flex attention's
        # numbered score and mask subgraphs per layer, fused wqkv
        ("torchtitan:llama3/debugmodel", Parallel(fsdp=2, tp=2)),
        # tied embeddings (lm_head's gradient too), MoE over EP, unbound token counts bound
        ("torchtitan:qwen3/debugmodel_moe", Parallel(fsdp=2, ep=2)),
        # a dense first layer; the routing's size arithmetic the tracer makes and erases
        ("torchtitan:deepseek_v3/debugmodel", Parallel(fsdp=2, ep=2)),
    ],
)
def test_torchtitan_ranks_are_stamped_as_full_traces(name: str, parallel: Parallel) -> None:
    """torchtitan models traced through graph trainer's `parallelize` stamp from three
    layers too, node for node (names, targets, metadata, values, inputs, code) the full
    trace."""
    workload = load_workload(name, layers=5, seq=256, device="meta")
    stamped = trace(workload, "fake", parallel)
    assert "layers 2-3 stamped from layer 1" in stamped.notes
    full = trace(workload, "fake", parallel, stamp=False)
    assert set(full.notes) <= set(stamped.notes)
    assert_same_graph(stamped, full)


def test_middle_stage_without_embedding_or_output() -> None:
    """A pipeline stage's model: hidden states in and out, as `workbench.capture.stages`
    builds it (here with a plain loss on the stage output)."""
    workload = load_workload("llama3-debug", layers=5, **SMALL)
    model = workload.model
    model.tok_embeddings = model.norm = model.output = None
    with torch.device("meta"):
        hidden = torch.empty(1, 16, model.config.dim)
    stage = Workload(model, (hidden,), torch.empty_like(hidden), name="stage")
    stamped = trace(stage, "fake")
    assert stamped.config["stamped"] == 2
    assert_same_graph(stamped, trace(stage, "fake", stamp=False))


@pytest.mark.parametrize("parallel", [None, Parallel(fsdp=2, tp=2)])
def test_pipeline_stages_stamped_from_kept_templates(parallel: Any) -> None:
    """Four stages of 18 layers (4, 5, 5, 4): the first, the middle two (one template) and
    the last, each equal to its full trace; received hidden states, output gradients and the
    input's gradient among the outputs."""
    from workbench.capture.stages import Pipeline, stage_workload

    workload = load_workload("llama3-debug", layers=18, seq=16, batch=4, device="meta")
    layout = Pipeline(pp=4).layout(18)
    templates: dict[Any, Any] = {}
    for stage in range(4):
        part = stage_workload(workload, layout, stage, parallel)
        stamped = trace(part, "fake", parallel, templates=templates)
        assert_same_graph(stamped, trace(part, "fake", parallel, stamp=False))
    assert len(templates) == 3  # first, middle, last


def test_ep_pipeline_stages_stamped_as_full_traces() -> None:
    """DeepSeek-V3 stages with routed experts over EP: a first stage of the dense layer and
    MoE layers, a last of MoE layers only, each equal to its full trace."""
    from workbench.capture.stages import Pipeline, stage_workload

    workload = load_workload("dsv3-debug", layers=10, seq=16, batch=2, device="meta")
    layout = Pipeline(pp=2).layout(10)
    parallel = Parallel(fsdp=2, ep=2)
    for stage in range(2):
        part = stage_workload(workload, layout, stage, parallel)
        stamped = trace(part, "fake", parallel)
        assert stamped.config["stamped"] == 2
        assert_same_graph(stamped, trace(part, "fake", parallel, stamp=False))


def _dsv3(dense: int) -> Workload:
    config = replace(DSV3_FLAVORS["debugmodel"], n_layers=5, n_dense_layers=dense)
    with torch.device("meta"):
        model = DeepSeekV3(config, 16)
    return token_workload(
        model, config.vocab_size, batch=1, seq=16, device="meta", seed=0, name="dsv3", config={}
    )


def test_template_of_unlike_layers_falls_back_to_the_full_trace() -> None:
    """Two dense layers: the template's middle layer is dense, its last MoE."""
    workload = _dsv3(dense=2)
    graph = trace(workload, "fake")
    assert "stamped" not in graph.config
    assert "layers not stamped (layer 2 is not built as layer 1): all 5 traced" in graph.notes
    full = trace(workload, "fake", stamp=False)
    assert graph.nodes == full.nodes and graph.gm.code == full.gm.code


def test_a_layer_changed_by_hand_is_traced_not_stamped() -> None:
    workload = load_workload("llama3-debug", layers=5, **SMALL)
    with torch.device("meta"):
        workload.model.layers["3"].feed_forward.w2 = torch.nn.Linear(768, 256, bias=True)
    graph = trace(workload, "fake")
    assert "stamped" not in graph.config
    assert "layers not stamped (layer 3 is not built as layer 1): all 5 traced" in graph.notes
    assert "layers.3.feed_forward.w2.bias" in graph.param_names


def test_stamp_graph_refuses_what_it_cannot_stamp() -> None:
    workload = load_workload("llama3-debug", layers=3, **SMALL)
    template = trace(workload, "fake", stamp=False)
    with pytest.raises(StampRefused, match=r"layers \[0, 1, 2\] follow one another"):
        stamp_graph(template, [0, 2, 1], range(6))  # not the order the graph runs them
    with pytest.raises(StampRefused, match="template layers"):
        stamp_graph(template, [0, 1], range(6))
    real = trace(load_workload("llama3-debug", layers=3, seq=16, batch=1), "real")
    with pytest.raises(StampRefused, match="real-mode"):
        stamp_graph(real, [0, 1, 2], range(6))


def test_pipeline_stage_stamps_from_a_kept_template() -> None:
    """A later stage's layers (other ids, same shapes) come from the first stage's template,
    renamed, and equal a full trace of those layers."""
    workload = load_workload("llama3-debug", layers=12, **SMALL)
    templates: dict[Any, Any] = {}

    def build(ids: list[int]) -> Workload:
        return keep_layers(workload, ids)

    untraced = functools.partial(trace, stamp=False)
    first = trace_layers(
        build, [0, 1, 2, 3, 4], "fake", trace_fn=untraced, templates=templates, kernels="h100"
    )
    assert len(templates) == 1 and first.config["stamped"] == 2
    later = trace_layers(
        build, [*range(6, 12)], "fake", trace_fn=untraced, templates=templates, kernels="h100"
    )
    assert len(templates) == 1
    assert "layers 6, 7, 11 renamed from the template's 0, 1, 2" in later.notes
    full = trace(build(list(range(6, 12))), "fake", stamp=False)
    assert_same_graph(later, full)
    three = trace_layers(
        build, [9, 10, 11], "fake", trace_fn=untraced, templates=templates, kernels="h100"
    )
    assert len(templates) == 1 and "renamed" in three.notes[-1]
    assert_same_graph(three, trace(build([9, 10, 11]), "fake", stamp=False))


def test_template_key_ignores_layer_ids_only() -> None:
    workload = load_workload("llama3-debug", layers=8, **SMALL)
    ids, shifted = [0, 1, 2], [4, 5, 6]
    key = template_key(keep_layers(workload, ids), ids, "fake", None, "h100")
    assert key == template_key(keep_layers(workload, shifted), shifted, "fake", None, "h100")
    assert key != template_key(keep_layers(workload, ids), ids, "fake", Parallel(tp=2), "h100")
    assert key != template_key(keep_layers(workload, ids), ids, "fake", None, "cpu")
    other = load_workload("llama3-debug", layers=8, seq=32, batch=1, device="meta")
    assert key != template_key(keep_layers(other, ids), ids, "fake", None, "h100")


def test_keep_layers_shares_the_kept_layers() -> None:
    workload = load_workload("llama3-debug", layers=6, **SMALL)
    part = keep_layers(workload, [2, 3])
    assert list(part.model.layers) == ["2", "3"]
    assert part.model.layers["2"] is workload.model.layers["2"]
    assert list(workload.model.layers) == [str(i) for i in range(6)]  # untouched
    assert keep_layers(workload, range(6)) is workload
    with pytest.raises(WorkbenchError, match=r"has no layers \['9'\] to keep"):
        keep_layers(workload, [9])


def test_trace_stamps_reference_models_in_fake_mode_only() -> None:
    workload = load_workload("llama3-debug", layers=4, seq=16, batch=1)
    assert trace(workload, "fake").config["stamped"] == 1
    assert "stamped" not in trace(workload, "real").config
    assert "stamped" not in trace(workload, "fake", stamp=False).config


def test_fresh_values_keep_aliasing_on_new_storages() -> None:
    """A view stays a view of its base's copy, a seeded input's storage is the new input's,
    and nothing shares the template's storages."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        outside, base = torch.empty(8), torch.empty(4, 6)
        view = base[1:].t()
        new_outside = torch.empty(8)
    fresh = FreshValues({})
    fresh.seed(outside, new_outside)
    copies = [fresh(v) for v in (base, view, outside[2:])]
    storage = [StorageWeakRef(t.untyped_storage()) for t in copies]
    assert storage[0] == storage[1] != StorageWeakRef(base.untyped_storage())
    assert storage[2] == StorageWeakRef(new_outside.untyped_storage())
    for old, new in zip((base, view, outside[2:]), copies, strict=True):
        assert (new.shape, new.stride(), new.storage_offset()) == (
            old.shape,
            old.stride(),
            old.storage_offset(),
        )
    assert fresh.mapped({"x": (view,)}) == {"x": (copies[1],)}
