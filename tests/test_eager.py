"""Eager SAC from the exported policy_fn: it decides like the graph policy inside the layers
(with documented exceptions) and gives loss and grads bitwise equal to no checkpointing."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.workload import eager_step
from workbench.decide.decider import decide, layer_key, node_keys
from workbench.decide.policy import Policy, Selector
from workbench.decide.presets import GRAPH_TRAINER, PRESETS
from workbench.decide.tags import Why
from workbench.errors import WorkbenchError
from workbench.interop.eager import (
    apply_eager_sac,
    apply_eager_sac_to,
    eager_decisions,
    policy_from_eager,
)

MODELS = ("llama3-debug", "dsv3-debug")
CUSTOM = Policy(
    "eager",
    selectors=[
        Selector("layers.*.attention::aten.mul.Tensor", "save"),
        Selector("layers.*.feed_forward.**::aten.mm.default", "recompute"),
    ],
    overrides={
        "layers.*.attention.wq::aten.mm.default#0": "recompute",
        "layers.1.attention.wq::aten.mm.default#0": "save",
        "layers.*.attention_norm::aten.mul.Tensor#1": "save",
        "layers.0::aten.add.Tensor#0": "recompute",
    },
)
# The workbench's own presets: the titan-* ones reproduce graph trainer, not eager SAC.
POLICIES: dict[str, Policy] = {
    # offload presets run in eager SAC as their base preset (test_offload checks that)
    **{
        name: Policy(name)
        for name, preset in PRESETS.items()
        if preset.dialect != GRAPH_TRAINER and name != "offload"
    },
    "custom": CUSTOM,
}
# Graph nodes eager SAC never sees: torch's SAC ignores aten.detach (SAC_IGNORED_OPS), and
# getitem is Python unpacking a multi-output op's tuple, not a dispatched op.
NEVER_DISPATCHED = {"aten.detach.default", "getitem"}
# Graph decisions eager SAC cannot make: a layer's output feeding the next layer (in eager it
# is the checkpoint's output, kept by autograd whatever policy_fn says), and in-place ops
# (eager SAC raises in backward if an in-place op's output is cached, so they are recomputed).
EAGER_DIFFERS = (Why.LAYER_BOUNDARY, Why.MUTATION)
RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def graph_decisions(graph: JointGraph, policy: Policy) -> dict[str, tuple[str, Why, object]]:
    """Layer ops by `MODULE::OP#k` -> (op, why, policy)."""
    decisions = decide(graph, policy)
    return {
        layer_key(graph.nodes[name], key): (
            graph.nodes[name].op,
            decisions[name].why,
            decisions[name].policy,
        )
        for name, key in node_keys(graph).items()
        if graph.nodes[name].layer is not None
    }


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model", MODELS)
def test_eager_sac_decides_like_the_graph_inside_layers(
    model: str, policy: str, small_graphs: dict[str, tuple[Workload, JointGraph]]
) -> None:
    workload, graph = small_graphs[model]
    eager = eager_decisions(workload, POLICIES[policy])
    expected = graph_decisions(graph, POLICIES[policy])
    if policy == "none":  # nothing to recompute: no layer is wrapped, autograd keeps all
        assert eager == {}
        assert not any(p in RECOMPUTE for _, _, p in expected.values())
        return
    assert set(eager) <= set(expected), "eager SAC saw ops the traced graph does not have"
    unseen = collections.Counter(expected[k][0] for k in set(expected) - set(eager))
    assert set(unseen) <= NEVER_DISPATCHED
    differ = {k for k in eager if eager[k] != expected[k][2]}
    for key in differ:
        op, why, _ = expected[key]
        assert why in EAGER_DIFFERS, (key, eager[key], expected[key])
        assert eager[key] is CheckpointPolicy.PREFER_RECOMPUTE
    # The ones that carry the memory: matmuls, attention, norm outputs decide identically.
    core = [
        k
        for k, (op, _, _) in expected.items()
        if op in ("aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default")
        or (k.split("::")[0].endswith("norm") and op == "aten.mul.Tensor")
    ]
    assert core and all(k in eager and k not in differ for k in core)


def test_eager_preset_saves_every_other_matmul_per_layer(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    workload, _ = small_graphs["llama3-debug"]
    eager = eager_decisions(workload, Policy("eager"))
    for layer in (0, 1):
        mms = [p for k, p in eager.items() if k.startswith(f"layers.{layer}.") and "aten.mm." in k]
        assert [p in RECOMPUTE for p in mms] == [False, True, False, True, False, True, False]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model", MODELS)
def test_eager_sac_is_bitwise_equal_to_no_checkpointing(
    model: str, policy: str, small_graphs: dict[str, tuple[Workload, JointGraph]]
) -> None:
    workload, _ = small_graphs[model]
    reference = eager_step(workload)
    wrapped = apply_eager_sac(copy.deepcopy(workload.model), POLICIES[policy])
    sac = eager_step(Workload(wrapped, workload.inputs, workload.target, workload.loss_fn))
    names = ["loss", *(n for n, _ in workload.model.named_parameters())]
    for name, a, b in zip(names, reference, sac, strict=True):
        assert torch.equal(a, b), f"{name} differs under eager SAC ({policy})"


def test_apply_eager_sac_works_in_place_and_only_once(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    workload, _ = small_graphs["llama3-debug"]
    model = copy.deepcopy(workload.model)
    keys = list(model.state_dict())
    assert apply_eager_sac(model, Policy("default")) is model
    assert list(model.state_dict()) == keys
    assert all("forward" in vars(block) for block in model.layers.values())
    with pytest.raises(WorkbenchError, match="already wrapped in eager SAC"):
        apply_eager_sac(model, Policy("full"))
    untouched = copy.deepcopy(workload.model)
    assert apply_eager_sac(untouched, Policy("none")) is untouched
    assert not any("forward" in vars(block) for block in untouched.layers.values())


def test_apply_eager_sac_needs_a_container_of_blocks(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    workload, _ = small_graphs["llama3-debug"]
    with pytest.raises(WorkbenchError, match="no container of blocks at 'blocks'"):
        apply_eager_sac(copy.deepcopy(workload.model), Policy("full"), layers_attr="blocks")


SUBMODULES = ["layers.*.attention", "layers.*.feed_forward"]


def test_apply_eager_sac_to_submodules_is_bitwise_equal_and_counts_per_region(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    reference = eager_step(workload)
    model = apply_eager_sac_to(copy.deepcopy(workload.model), Policy("eager"), SUBMODULES)
    assert all(
        "forward" in vars(b.attention) and "forward" not in vars(b) for b in model.layers.values()
    )
    sac = eager_step(Workload(model, workload.inputs, workload.target, workload.loss_fn))
    assert all(torch.equal(a, b) for a, b in zip(reference, sac, strict=True))
    chosen = eager_decisions(workload, Policy("eager"), regions=SUBMODULES)
    assert chosen and all(
        k.split("::")[0].split(".")[2] in ("attention", "feed_forward") for k in chosen
    )
    # One region per Linear: every matmul is the first of its region, so none is recomputed.
    linears = ["layers.*.attention.w*", "layers.*.feed_forward.w*"]
    alone = eager_decisions(workload, Policy("eager"), regions=linears)
    assert all(p not in RECOMPUTE for k, p in alone.items() if "aten.mm." in k)
    # As a graph policy: the norms between the regions are kept, matmul choices unchanged.
    blocks = decide(graph, policy_from_eager(graph, eager_decisions(workload, Policy("eager"))))
    split = decide(graph, policy_from_eager(graph, chosen))
    changed = {graph.nodes[n].module for n in blocks if blocks[n].recompute != split[n].recompute}
    assert changed == {"layers.0", "layers.1"} | {
        f"layers.{i}.{norm}" for i in (0, 1) for norm in ("attention_norm", "ffn_norm")
    }


def test_apply_eager_sac_to_refuses_nested_unknown_or_wrapped_regions(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    workload, _ = small_graphs["llama3-debug"]
    model = copy.deepcopy(workload.model)
    with pytest.raises(WorkbenchError, match="no submodule"):
        apply_eager_sac_to(model, Policy("eager"), ["layers.*.mlp"])
    with pytest.raises(WorkbenchError, match="cannot nest"):
        apply_eager_sac_to(model, Policy("eager"), ["layers.*", "layers.*.attention"])
    apply_eager_sac_to(model, Policy("eager"), SUBMODULES)
    with pytest.raises(WorkbenchError, match="already wrapped"):
        apply_eager_sac_to(model, Policy("eager"), SUBMODULES)
