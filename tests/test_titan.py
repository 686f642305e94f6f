"""torchtitan's own models as inputs, and the titan-* presets against graph trainer's tagging.

The parity tests run torchtitan 0.3.0's memory-policy pass on the very graph the workbench
traced; they are skipped, with the reason, where torchtitan is not installed.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch.fx.traceback import annotate_fn
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.models.torchtitan import SDPA_NOTE, flavors
from workbench.capture.ops import WAIT, op_name, storage_inputs
from workbench.capture.parallel import Parallel
from workbench.capture.trace import trace
from workbench.capture.workload import eager_step
from workbench.cost.estimate import Estimator
from workbench.decide.decider import decide
from workbench.decide.facts import unshard_chains, unshard_outputs
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.decide.presets import TITAN_SAVE_OPS
from workbench.decide.tags import Why
from workbench.errors import WorkbenchError
from workbench.interop.activations import activation_log, activation_rows
from workbench.interop.titan import (
    CPU_FORCED,
    _tagged_copy,
    compare,
    differences_of,
    graph_trainer_log,
    graph_trainer_tags,
)
from workbench.interop.titan_offload import OFFLOAD_PLACEMENT, offload_mismatches, offload_passes
from workbench.rewrite.index import graph_index
from workbench.rewrite.placement import OFFLOAD_META, is_offload_node
from workbench.rewrite.remat import copy_graph_module, remat
from workbench.show.explain import explain

needs_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan not installed: pip install -e '.[torchtitan]'",
)

TITAN_MODELS = ("torchtitan:llama3/debugmodel", "torchtitan:deepseek_v3/debugmodel")
# The parity matrix: these models, each on one device and on one FSDP-2 rank.
MATRIX_MODELS = (
    "torchtitan:llama3/debugmodel",
    "torchtitan:qwen3/debugmodel",
    "torchtitan:qwen3/debugmodel_moe",
    "torchtitan:deepseek_v3/debugmodel",
)
TITAN_PRESET_NAMES = ("titan-default", "titan-full", "titan-eager", "titan-sac_and_offload")
# Decisions forced on the CPU: torch tags the CPU flash-attention op nondeterministic_seeded
# and its remat pass refuses to recompute random ops, so the workbench saves it (and the
# getitems unpacking it) where graph trainer's `default` and `eager` tag it
# PREFER_RECOMPUTE (on CUDA the flash op is in graph trainer's save list). DeepSeek-V3's
# attention (different q/k and v head dims) takes the math path instead: nothing forced.
CPU_FORCED_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"


@pytest.fixture(scope="module")
def titan_graphs() -> dict[str, tuple[Workload, JointGraph]]:
    graphs = {}
    for spec in TITAN_MODELS:
        workload = load_workload(spec, layers=2, seq=32)
        graphs[spec] = (workload, trace(workload, mode="real"))
    return graphs


@pytest.fixture(scope="module")
def annotated_graphs() -> dict[str, tuple[Workload, JointGraph]]:
    """One device, traced with graph trainer's own module annotations too (its
    `annotate_module_fqns` and annotated loss): the parity harness reads those."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan not installed: pip install -e '.[torchtitan]'")
    from torchtitan.experiments.graph_trainer.common_utils import (
        _MODULE_FQN,
        annotate_module_fqns,
    )

    anchors = set(torch.fx.proxy._STACK_TRACE_ANCHORS)
    graphs = {}
    for spec in MATRIX_MODELS:
        workload = load_workload(spec, layers=2, seq=32)
        annotate_module_fqns(workload.model)
        workload.loss_fn = annotate_fn({_MODULE_FQN: "loss"})(workload.loss_fn)
        graphs[spec] = (workload, trace(workload, mode="real"))
    # `annotate_fn` registers the loss function as a stack-trace anchor, process-wide: later
    # traces would record the loss's frames (the Source column of loss rows)
    torch.fx.proxy._STACK_TRACE_ANCHORS.intersection_update(anchors)
    return graphs


@pytest.fixture(scope="module")
def fsdp_graphs() -> dict[str, JointGraph]:
    """One FSDP-2 rank (fake tensors) of each model, the workbench's module paths: graph
    trainer's annotations bind the unsharded model's forwards, which sharding replaces."""
    return {
        spec: trace(load_workload(spec, layers=2, seq=32), "fake", Parallel(fsdp=2))
        for spec in MATRIX_MODELS
    }


def _cpu_forced(graph: JointGraph) -> set[str]:
    """The CPU flash-attention nodes and the getitems that unpack them."""
    ops = {name for name, info in graph.nodes.items() if info.op == CPU_FORCED_OP}
    getitems = {
        n.name
        for n in graph.gm.graph.nodes
        if n.args and isinstance(n.args[0], torch.fx.Node) and n.args[0].name in ops
    }
    return ops | getitems


@needs_torchtitan
@pytest.mark.parametrize("spec", MATRIX_MODELS)
@pytest.mark.parametrize("fsdp", ["one device", "fsdp 2 reshard default", "fsdp 2 reshard never"])
def test_titan_presets_match_graph_trainer_node_for_node(
    annotated_graphs: dict[str, tuple[Workload, JointGraph]],
    fsdp_graphs: dict[str, JointGraph],
    spec: str,
    fsdp: str,
) -> None:
    """Every titan preset against graph trainer's own tagging of the same graph, with
    `fsdp_reshard_after_forward` default or never: on the one-device graphs (real mode, the
    CPU's kernels) they differ on the CPU-forced flash op (and its getitems) alone; on the
    FSDP ranks (fake mode, an H100's kernels: flex attention's op) in nothing at all."""
    graph = annotated_graphs[spec][1] if fsdp == "one device" else fsdp_graphs[spec]
    assert graph.config["kernels"] == ("cpu" if fsdp == "one device" else "h100")
    reshard = not fsdp.endswith("never")
    for preset in TITAN_PRESET_NAMES:
        policy = Policy(preset, fsdp_reshard=reshard)
        mismatches = compare(graph, policy)
        # graph trainer's own `full` saves random ops, so only default and eager differ
        forced = set() if preset == "titan-full" else _cpu_forced(graph)
        assert {m.node for m in mismatches} == forced, preset
        assert all(m.graph_trainer is CheckpointPolicy.PREFER_RECOMPUTE for m in mismatches)
        assert all(m.tag.why is Why.RANDOM for m in mismatches)
        cpu_flash = not spec.endswith("deepseek_v3/debugmodel") and fsdp == "one device"
        if cpu_flash and preset != "titan-full":
            assert len(mismatches) == 6  # 2 layers x (the op + its output and logsumexp)
        if fsdp != "one device":
            assert not mismatches, preset
        # beyond save vs recompute, the very tags agree (untagged where graph trainer skips)
        theirs = graph_trainer_tags(graph, preset.removeprefix("titan-"), reshard)
        decisions = decide(graph, policy)
        ours = {
            name: None if tag.why is Why.UNTAGGED else tag.policy
            for name, tag in decisions.items()
            if name not in forced
        }
        assert ours == {name: tag for name, tag in theirs.items() if name not in forced}
        offloaded = CheckpointPolicy.MUST_CPU_OFFLOAD in theirs.values()
        assert offloaded == (preset == "titan-sac_and_offload")
        kept = {name for name, tag in decisions.items() if tag.why is Why.FSDP}
        keeps = not reshard and preset in ("titan-default", "titan-sac_and_offload")
        # graph trainer leaves lm_head's untagged (saved) before it looks for unshards
        values = {n for n in unshard_outputs(graph.gm) if graph.nodes[n].module != "lm_head"}
        assert kept == (values if keeps else set())
        assert bool(kept) == keeps  # the FSDP graphs have unshards to keep


@needs_torchtitan
@pytest.mark.parametrize("spec", MATRIX_MODELS)
def test_unsharded_values_are_the_nodes_graph_trainer_saves(
    annotated_graphs: dict[str, tuple[Workload, JointGraph]],
    fsdp_graphs: dict[str, JointGraph],
    spec: str,
) -> None:
    """`unshard_outputs` finds what graph trainer's `find_fsdp_unshard_save_nodes` finds
    from every parameter input: each gathered parameter's wait (the embedding's chain is
    read twice in this raw graph, so neither finds it), and only on FSDP graphs."""
    from torchtitan.experiments.graph_trainer.fsdp_patterns import find_fsdp_unshard_save_nodes

    graph = fsdp_graphs[spec]
    theirs = {
        n.name
        for p in graph.gm.graph.find_nodes(op="placeholder")
        for n in find_fsdp_unshard_save_nodes(p)
    }
    kept = unshard_outputs(graph.gm)
    assert kept == theirs
    assert kept and all(graph.nodes[n].op == WAIT for n in kept)
    assert kept <= set(unshard_chains(graph.gm))  # on the chains the workbench decides
    # the workbench's own `default` keeps whole chains: every node of each, not only these
    decisions = decide(graph, Policy("default", fsdp_reshard=False))
    chain_saves = {n for n, t in decisions.items() if t.why is Why.FSDP}
    assert chain_saves == set(unshard_chains(graph.gm)) > kept
    assert unshard_outputs(annotated_graphs[spec][1].gm) == frozenset()  # one device: none


@needs_torchtitan
@pytest.mark.parametrize("spec", MATRIX_MODELS)
def test_modules_are_graph_trainers(
    annotated_graphs: dict[str, tuple[Workload, JointGraph]], spec: str
) -> None:
    """Every forward and loss node has the module graph trainer's own annotations give it
    (`annotate_module_fqns`, its annotated loss, its tracer's copy to backward nodes); the
    loss gradient's seed `ones_like`, made by `autograd.grad` outside the loss, has none."""
    from torchtitan.experiments.graph_trainer.common_utils import _get_module_fqn
    from torchtitan.experiments.graph_trainer.make_fx_tracer import (
        _copy_fwd_metadata_to_bw_nodes,
    )

    _, graph = annotated_graphs[spec]
    gm = copy_graph_module(graph.gm)
    _copy_fwd_metadata_to_bw_nodes(gm)
    forward = [n for n in gm.graph.nodes if graph.nodes[n.name].phase in ("forward", "loss")]
    assert {n.name: _get_module_fqn(n) for n in forward} == {
        n.name: graph.nodes[n.name].module for n in forward
    }
    seeds = [n for n in forward if graph.nodes[n.name].op == "aten.ones_like.default"]
    assert len(seeds) == 1 and graph.nodes[seeds[0].name].module == ""
    assert graph.nodes[seeds[0].name].phase == "loss"


@needs_torchtitan
def test_top_k_indices_are_offloaded_as_graph_trainer_tags_them(
    annotated_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    """On Qwen3 MoE, graph trainer offloads the router's top-k index getitem (int64, its own
    storage: `topk` makes both outputs); the workbench's pass offloads exactly its tagged
    set, places each step where its pass does, and the estimate prices that graph."""
    _, graph = annotated_graphs["torchtitan:qwen3/debugmodel_moe"]
    policy = Policy(
        "titan-sac_and_offload", offload=OffloadOptions(prefetch_layers=1, defer_layers=1)
    )
    theirs = graph_trainer_tags(graph, "sac_and_offload")
    tagged = {n for n, t in theirs.items() if t is CheckpointPolicy.MUST_CPU_OFFLOAD}
    passes = offload_passes(graph, policy)
    plan = passes.workbench.meta[OFFLOAD_META]
    assert set(plan.names) == tagged and plan.skipped == {}
    assert offload_mismatches(passes) == []
    topk = {n for n in tagged if graph.nodes[n].op == "getitem" and graph.nodes[n].dtype == "int64"}
    assert len(topk) == 1  # layer 0's (the last layer's are not offloaded)
    (name,) = topk
    node = next(n for n in graph.gm.graph.nodes if n.name == name)
    assert op_name(node.args[0].target) == "aten.topk.default"
    assert storage_inputs(node) == node.args[0].all_input_nodes  # the router scores
    index = graph_index(graph)
    i, parent = index.index_of[name], index.index_of[node.args[0].name]
    assert index.value_slots[i] == index.value_slots[parent] + node.args[1] >= 0  # topk's slot
    estimator = Estimator(graph)
    ours = estimator.simulate(estimator.order_of(passes.workbench))
    assert ours.peak_bytes == estimator.estimate(policy).peak_bytes
    assert (
        ours.offloaded_bytes
        == sum(plan.bytes.values())
        == estimator.estimate(policy).offloaded_bytes
    )


@needs_torchtitan
def test_workbench_presets_differ_where_documented(
    titan_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    """The workbench's own `full` saves in-place ops and tags lm_head/loss; graph trainer's
    recomputes the one and leaves the other untagged (saved)."""
    _, graph = titan_graphs["torchtitan:llama3/debugmodel"]
    mismatches = compare(graph, "full")
    in_place = {m.node for m in mismatches if m.tag.why is Why.MUTATION}
    untagged = {m.node for m in mismatches if m.graph_trainer is None}
    assert in_place and all(graph.nodes[n].op.endswith("_.Scalar") for n in in_place)
    assert {graph.nodes[n].module for n in untagged} == {"lm_head", "loss"}
    assert "_log_softmax" in untagged


@needs_torchtitan
def test_titan_save_list_is_graph_trainers() -> None:
    from torchtitan.distributed.activation_checkpoint import _get_default_save_ops

    theirs = {op_name(op) for op in _get_default_save_ops()}
    assert theirs <= TITAN_SAVE_OPS  # ours also names ops of optional backends
    assert all(
        op.split(".")[0] in ("deepep", "hybridep", "torch_attn") for op in TITAN_SAVE_OPS - theirs
    )


@needs_torchtitan
@pytest.mark.parametrize("preset", ["titan-default", "titan-full", "titan-eager"])
def test_titan_presets_remat_bitwise(
    titan_graphs: dict[str, tuple[Workload, JointGraph]], preset: str
) -> None:
    workload, graph = titan_graphs["torchtitan:llama3/debugmodel"]
    result = remat(graph, Policy(preset))
    assert result.report.recomputed_nodes and not result.report.problems
    assert graph.example_inputs is not None
    got = result.run(graph.example_inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, eager_step(workload), strict=True))


@needs_torchtitan
def test_torchtitan_models_trace_with_layer_module_paths(
    titan_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    workload, graph = titan_graphs["torchtitan:deepseek_v3/debugmodel"]
    assert workload.notes == [SDPA_NOTE]
    assert workload.config["layers"] == 2 and graph.tokens == 2 * 32
    modules = {i.module for i in graph.nodes.values() if i.phase == "forward"}
    assert {"layers.0.attention.inner_attention", "layers.1.moe", "lm_head"} <= modules
    assert {i.layer for i in graph.nodes.values() if i.phase == "forward"} == {None, 0, 1}


@needs_torchtitan
def test_big_flavor_traces_on_fake_tensors() -> None:
    workload = load_workload("torchtitan:qwen3/8B", layers=1, seq=64, device="meta")
    graph = trace(workload, mode="fake")
    assert graph.mode == "fake" and graph.example_inputs is None
    assert graph.summary()["param_bytes"] > 2 * 10**9  # 8B's embeddings and lm_head alone


@needs_torchtitan
@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        ("torchtitan:llama3", {}, "must be torchtitan:FAMILY/FLAVOR"),
        ("torchtitan:llama4/debugmodel", {}, "choose one of"),
        ("torchtitan:llama3/9B", {}, "choose one of debugmodel, 1B"),
        ("torchtitan:llama3/debugmodel", {"layers": 7}, "has 6 layers"),
    ],
)
def test_bad_torchtitan_specs_are_clear_errors(spec: str, kwargs: dict, message: str) -> None:
    with pytest.raises(WorkbenchError, match=message):
        load_workload(spec, **kwargs)


@needs_torchtitan
def test_flavors_are_torchtitans_registries() -> None:
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    assert flavors("deepseek_v3") == list(deepseekv3_configs)


def test_without_torchtitan_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torchtitan.models", None)
    with pytest.raises(WorkbenchError, match=r"pip install -e '\.\[torchtitan\]'"):
        load_workload("torchtitan:llama3/debugmodel")
    monkeypatch.setitem(sys.modules, "torchtitan.experiments.graph_trainer.memory_policy", None)
    graph = JointGraph.__new__(JointGraph)
    with pytest.raises(WorkbenchError, match=r"pip install -e '\.\[torchtitan\]'"):
        graph_trainer_tags(graph, "default")
    with pytest.raises(WorkbenchError, match=r"pip install -e '\.\[torchtitan\]'"):
        offload_passes(graph, "offload")


@needs_torchtitan
@pytest.mark.parametrize("spec", TITAN_MODELS)
@pytest.mark.parametrize("preset", ["titan-default", "titan-full"])
def test_activation_log_is_graph_trainers_line_for_line(
    titan_graphs: dict[str, tuple[Workload, JointGraph]], spec: str, preset: str
) -> None:
    """The workbench's table of a titan preset is the log graph trainer prints for its own
    policy, but for the CPU-forced rows (tagged SAVE here, RECOMPUTE there)."""
    _, graph = titan_graphs[spec]
    ours = activation_log(activation_rows(graph, preset)).splitlines()
    theirs = graph_trainer_log(graph, preset.removeprefix("titan-")).splitlines()
    assert len(ours) == len(theirs) and any(line.startswith("Total: ") for line in ours)
    differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    for our_line, their_line in differ:
        assert CPU_FORCED_OP in our_line and " SAVE " in our_line and " RECOMPUTE " in their_line
    forced = preset != "titan-full" and spec.endswith("llama3/debugmodel")
    assert len(differ) == (2 if forced else 0)  # the logsumexp row of each layer


@needs_torchtitan
@pytest.mark.parametrize("spec", TITAN_MODELS)
@pytest.mark.parametrize(
    "preset", ["default", "full", "eager", "titan-default", "titan-full", "titan-eager"]
)
def test_policy_explain_names_the_difference_behind_every_mismatch(
    titan_graphs: dict[str, tuple[Workload, JointGraph]], spec: str, preset: str
) -> None:
    """Every node where a preset and graph trainer's own tagging disagree is explained by a
    row of the differences table (for the workbench presets) or forced on the CPU."""
    _, graph = titan_graphs[spec]
    against = explain(preset, graph)["graph_trainer"]
    assert against["mismatches"] == len(compare(graph, preset)) == len(against["rows"])
    allowed = {d.key for d in differences_of(preset)} | {CPU_FORCED.key}
    assert set(against["by_difference"]) <= allowed
    forced = set() if preset.endswith("full") else _cpu_forced(graph)
    assert set(against["cpu_forced"]) == forced
    if preset.startswith("titan-"):
        assert against["mismatches"] == len(forced)
    else:  # the workbench's own presets differ where the table says (`eager` saves the
        # lm_head and loss as everything outside the layers: the same as untagged there)
        assert "in-place" in against["by_difference"]
        assert ("lm_head/loss" in against["by_difference"]) == (preset != "eager")


# --- offload placement: graph trainer's apply_cpu_offload_pass against offload_pass -------

OFFLOAD_OPTIONS = [
    OffloadOptions(prefetch_layers=p, defer_layers=d) for p in (0, 1, 2) for d in (0, 1, 2)
]


@needs_torchtitan
@pytest.mark.parametrize("spec", ["torchtitan:llama3/debugmodel", "llama3-debug"])
@pytest.mark.parametrize("preset", ["titan-sac_and_offload", "offload"])
def test_offload_steps_land_where_graph_trainers_do_but_for_documented_rows(
    titan_graphs: dict[str, tuple[Workload, JointGraph]],
    small_graphs: dict[str, tuple[Workload, JointGraph]],
    spec: str,
    preset: str,
) -> None:
    """Both passes on one rematerialized graph, prefetch and defer in {0, 1, 2}: every step
    lands after the same node but where a row of `OFFLOAD_PLACEMENT` says otherwise."""
    _, graph = (titan_graphs if spec.startswith("torchtitan:") else small_graphs)[spec]
    seen = set()
    for options in OFFLOAD_OPTIONS:
        passes = offload_passes(graph, Policy(preset, offload=options))
        assert len(passes.layers) >= 5  # layer 0's saved matmuls and its output, at least
        assert (passes.refused is not None) == (options.defer_layers == 0)
        mismatches = offload_mismatches(passes)
        for m in mismatches:  # their free after the unpacking getitem
            assert m.difference == "defer 0" and m.step == "free"
            assert m.graph_trainer.startswith("getitem")
        if options.defer_layers:
            assert mismatches == []  # every step after the same node
        seen |= {m.difference for m in mismatches}
    # a layer's output, read first by the next layer's backward, is among those compared
    pairs = [(p, r) for p, r in passes.layers.values() if p is not None and r is not None]
    assert any(reader == producer + 1 for producer, reader in pairs)
    assert seen == {d.key for d in OFFLOAD_PLACEMENT}


@needs_torchtitan
def test_graph_trainer_refuses_defer_0_on_its_own_tagging_of_its_own_model(
    titan_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    """torchtitan 0.3.0 as it runs: its tags, then its offload pass with defer 0, whose own
    lint refuses the graph (a wait before the reader it names). When a version runs it, the
    `defer 0` row and the export's defer of at least 1 are to be revisited."""
    from torchtitan.experiments.graph_trainer.cpu_offload import apply_cpu_offload_pass

    _, graph = titan_graphs["torchtitan:llama3/debugmodel"]
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        apply_cpu_offload_pass(_tagged_copy(graph, "sac_and_offload"), defer_n_layers=0)
    gm = apply_cpu_offload_pass(_tagged_copy(graph, "sac_and_offload"), defer_n_layers=1)
    assert any(str(n.target) == "ao.offload.default" for n in gm.graph.nodes)


@needs_torchtitan
def test_the_estimate_reads_graph_trainers_offloaded_graph(
    titan_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    """Graph trainer's placement priced by the workbench's estimator: the same peak and
    host bytes as the workbench's on a 2-layer graph, whose what-if equals its own graph."""
    _, graph = titan_graphs["torchtitan:llama3/debugmodel"]
    policy = Policy(
        "titan-sac_and_offload", offload=OffloadOptions(prefetch_layers=1, defer_layers=1)
    )
    passes = offload_passes(graph, policy)
    assert offload_mismatches(passes) == []
    estimator = Estimator(graph)
    ours = estimator.simulate(estimator.order_of(passes.workbench))
    theirs = estimator.simulate(estimator.order_of(passes.graph_trainer))
    assert ours.peak_bytes == estimator.estimate(policy).peak_bytes == theirs.peak_bytes
    assert ours.host_peak_bytes == theirs.host_peak_bytes > 0
    assert ours.offloaded_bytes == theirs.offloaded_bytes
    # reloads queued on the one transfer stream in the order backward reads them, as theirs
    assert _backward_steps(passes.workbench) == _backward_steps(passes.graph_trainer)


def _backward_steps(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """Each reload and wait in graph order, with the forward node it moves."""

    def source(node: torch.fx.Node) -> str:
        while is_offload_node(node):
            node = node.args[0]
        return node.name

    return [
        (n.target._opname, source(n))
        for n in gm.graph.nodes
        if is_offload_node(n) and n.meta.get("autograd_backward")
    ]
