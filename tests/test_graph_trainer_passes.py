"""`--passes graph-trainer`: graph trainer's compile-time passes, in its order, on the graph
the workbench traced, checked against graph trainer's own functions (torchtitan 0.3.0;
skipped, with the reason, where it is not installed)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.titan_rank import graph_trainer_imports
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cli.benchmarks import bench_whatif
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.graph_trainer_replay import replay_graph_trainer
from workbench.cost.pass_stacks import REPLAYED, PassStackEstimator, estimator_for
from workbench.decide.decider import decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.decide.tags import MUST, Tag, Why
from workbench.errors import WorkbenchError
from workbench.interop.titan import graph_trainer_log
from workbench.rewrite.graph_trainer import (
    CLEANUP,
    EP_NOT_REQUESTED,
    EP_PASSES,
    PASSES,
    SKIPPED,
    cleanup,
    graph_trainer_config,
    prepare,
    run_passes,
)
from workbench.rewrite.placement import is_offload_node
from workbench.search.soundness import random_policies

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan not installed: pip install -e '.[torchtitan]'",
)

MODELS = (
    "torchtitan:llama3/debugmodel",
    "torchtitan:qwen3/debugmodel",
    "torchtitan:qwen3/debugmodel_moe",
    "torchtitan:deepseek_v3/debugmodel",
)
TITAN = ("titan-default", "titan-full", "titan-eager", "titan-sac_and_offload")
SHAPE = {"layers": 2, "seq": 32}
# graph trainer's offload defaults (`cpu_offload_prefetch_n_layers`, `..._defer_n_layers`)
GT_OFFLOAD = OffloadOptions(prefetch_layers=1, defer_layers=1)


@functools.cache
def traced(spec: str) -> JointGraph:
    return trace(load_workload(spec, **SHAPE), "real")  # type: ignore[arg-type]


def _random(node: fx.Node) -> bool:
    """A random op, or a getitem unpacking one: saved on the CPU (torch's remat refuses)."""
    if node.op != "call_function":
        return False
    target = node.args[0].target if node.target.__name__ == "getitem" else node.target  # type: ignore[union-attr]
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def test_pass_order_is_graph_trainers() -> None:
    """`PASSES` lists graph trainer's passes in the order `compile_time_passes` (then its
    inductor and cudagraph passes) appends them, read from its source (passes.py cannot be
    imported without torchtitan's training requirements, e.g. torchdata)."""
    spec = importlib.util.find_spec("torchtitan.experiments.graph_trainer.passes")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    functions = {
        node.name: ast.get_source_segment(source, node) or ""
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef)
    }
    body = "".join(
        functions[f]
        for f in (
            "compile_time_passes",
            "final_inductor_compile_passes",
            "construct_default_graph_passes",
        )
    )
    names = [name for _, name in PASSES]
    positions = [body.find(f"{name},") if f"{name}," in body else body.find(name) for name in names]
    assert -1 not in positions and positions == sorted(positions), dict(
        zip(names, positions, strict=True)
    )
    for module, name in PASSES[: len(CLEANUP) + 3]:  # the ones run here are its own
        assert callable(
            getattr(importlib.import_module(f"torchtitan.experiments.graph_trainer.{module}"), name)
        )


def test_activations_are_graph_trainers_log_line_for_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`activations --passes graph-trainer` lists what graph trainer's log lists after its
    cleanup (Source column included), but for the CPU-forced flash-attention rows; the
    workbench pass stack lists the graph before cleanup, as before."""
    spec = MODELS[0]
    argv = ["activations", "--model", spec, "--layers", "2", "--seq", "32"]
    assert main([*argv, "--policy", "titan-default", "--passes", "graph-trainer", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    theirs = graph_trainer_log(cleanup(traced(spec)), "default").splitlines()
    ours = result["table"].splitlines()
    assert len(ours) == len(theirs)
    differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    assert len(differ) == 4  # two outputs of each layer's flash op
    for our_line, their_line in differ:
        assert "_scaled_dot_product_flash_attention_for_cpu" in our_line
        assert " SAVE " in our_line and " RECOMPUTE " in their_line
    # every row has a source, the loss's included, but the gradient seed (made by autograd,
    # no Python frame: graph trainer's log shows none either)
    seed = "aten.ones_like.default"
    assert all(row["source"] for row in result["rows"] if row["op"] != seed)
    assert any(row["module"] == "loss" for row in result["rows"] if row["op"] != seed)
    assert main([*argv, "--policy", "titan-default", "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert before["total"]["activations"] > result["total"]["activations"]
    assert before["total"]["bytes"] > result["total"]["bytes"]
    assert before["passes"] == {"pipeline": "workbench"}


@pytest.mark.parametrize("spec", MODELS)
@pytest.mark.parametrize("preset", TITAN)
def test_titan_presets_through_graph_trainers_pass_stack(spec: str, preset: str) -> None:
    """Every titan-* preset runs through graph trainer's passes: its own tagging (differing
    only on the CPU-forced random ops), offload and remat; the rest skipped, named."""
    cleaned = cleanup(traced(spec))
    result = run_passes(cleaned, Policy(preset, offload=GT_OFFLOAD))
    ep = [step for step in result.steps if step.why == EP_NOT_REQUESTED]  # opt-in
    assert [step.name for step in ep] == [name for _, name in EP_PASSES]
    status = {step.name: step.status for step in result.steps if step not in ep}
    assert list(status) == [name for _, name in PASSES]
    assert {n for n, s in status.items() if s == "skipped"} == set(SKIPPED)
    assert all(step.why for step in result.steps if step.status == "skipped")
    assert all(s == "ran" for n, s in status.items() if n not in SKIPPED)
    nodes = {n.name: n for n in cleaned.gm.graph.nodes}
    assert all(_random(nodes[name]) for name in result.retagged)
    offloads = sum(1 for n in result.gm.graph.nodes if is_offload_node(n))
    assert (offloads > 0) == preset.endswith("offload")
    assert any(n.name.endswith("_recomputed") for n in result.gm.graph.nodes)


@pytest.mark.parametrize("spec", MODELS)
def test_offload_placement_is_graph_trainers_in_its_pass_order(spec: str) -> None:
    """titan-sac_and_offload through the pass stack gives the graph graph trainer's own
    functions give in its order (its tagging, the CPU-forced random ops saved, its offload
    pass, then its remat pass), node for node."""
    cleaned = cleanup(traced(spec))
    policy = Policy("titan-sac_and_offload", offload=GT_OFFLOAD)
    ours = run_passes(cleaned, policy).gm
    from torchtitan.experiments.graph_trainer.cpu_offload import apply_cpu_offload_pass
    from torchtitan.experiments.graph_trainer.memory_policy import tag_with_memory_policy_pass
    from torchtitan.experiments.graph_trainer.selective_activation_remat import (
        selective_activation_remat_pass,
    )

    gm = fx.GraphModule(cleaned.gm, fx.Graph())
    gm.graph.output(gm.graph.graph_copy(cleaned.gm.graph, {}))
    tag_with_memory_policy_pass(gm, config=graph_trainer_config(policy))
    for node in gm.graph.nodes:
        if _random(node) and "recompute" in node.meta:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    apply_cpu_offload_pass(gm, prefetch_lookahead=1, defer_n_layers=1)
    selective_activation_remat_pass(gm)

    def listing(g: fx.GraphModule) -> list[tuple[str, str, list[str]]]:
        return [(n.name, str(n.target), [a.name for a in n.all_input_nodes]) for n in g.graph.nodes]

    assert listing(ours) == listing(gm)
    assert any(is_offload_node(n) for n in gm.graph.nodes)


@pytest.mark.parametrize("spec", MODELS[::3])
@pytest.mark.parametrize(
    "policy",
    [
        Policy("titan-default"),
        Policy("titan-full"),
        Policy("titan-sac_and_offload", offload=GT_OFFLOAD),
        Policy("titan-sac_and_offload", offload=OffloadOptions(prefetch_layers=2, defer_layers=2)),
        Policy("default"),
        Policy("full"),
        Policy("offload", offload=GT_OFFLOAD),
    ],
    ids=str,
)
def test_whatif_is_exact_against_the_pass_stacks_graph(spec: str, policy: Policy) -> None:
    """The what-if of the graph-trainer pass stack equals, byte for byte at every step, the
    estimate of the graph graph trainer's passes made. For the titan-* presets without
    offload the workbench's index replay of torch's remat pass on the cleaned graph does too
    (not for the workbench's presets, which tag the loss: graph trainer's remat pass leaves
    backward before the last loss node alone, torch's recomputes there)."""
    estimator = estimator_for(traced(spec), "graph-trainer", ("h100",))
    assert isinstance(estimator, PassStackEstimator)
    cleaned = estimator.graph
    result = run_passes(cleaned, policy)
    full = estimate_remat(cleaned, result.gm, estimator)
    whatif = estimator.estimate(policy)
    assert whatif.peak_bytes == full.peak_bytes
    assert whatif.totals() == full.totals() and whatif.order == full.order
    offloads = any(tag.offload for tag in result.decisions.values())
    if policy.preset.startswith("titan-") and not offloads:  # lm_head/loss never tagged
        replayed = Estimator(cleaned, ("h100",)).estimate(policy)
        assert replayed.totals() == full.totals()


@pytest.mark.parametrize("preset", ["titan-default", "titan-full", "full"])
def test_pass_stack_graph_computes_what_eager_does(preset: str) -> None:
    """Graph trainer's rewritten graph (no offload: its ops need streams) returns the loss
    and gradients of the traced step, bitwise."""
    graph = traced(MODELS[0])
    result = run_passes(prepare(graph, "graph-trainer"), preset)
    assert graph.example_inputs is not None
    with torch.no_grad():
        ours = list(result.gm(*graph.example_inputs))
    expected = graph.run()
    assert len(ours) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True))


def test_explorer_flip_replays_graph_trainers_pass_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PolicyExplorer(..., passes="graph-trainer")` shows the cleaned graph; a flip replays
    graph trainer's passes on indices without running them, and the figures are those of
    the graph they make."""
    from workbench.cost import pass_stacks
    from workbench.show.widgets.explorer import PolicyExplorer

    graph = traced(MODELS[0])
    runs: list[int] = []

    def counted(*args: object, **kwargs: object) -> object:
        runs.append(1)
        return run_passes(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pass_stacks, "run_passes", counted)
    explorer = PolicyExplorer(
        graph, "titan-default", passes="graph-trainer", autosave=tmp_path / "p.json"
    )
    assert explorer.graph is cleanup(graph)
    before = len(runs)
    name = next(n for n, tag in explorer.model.decisions.items() if tag.recompute)
    explorer.flip(name)
    assert len(runs) == before
    assert not explorer.model.decisions[name].recompute
    result = run_passes(explorer.graph, explorer.model.decisions, explorer.model.policy.offload)
    full = estimate_remat(explorer.graph, result.gm, explorer.estimator)
    assert explorer.model.estimate.totals() == full.totals()


@pytest.mark.parametrize("command", [["estimate"], ["solve", "--budget-frac", "1"]], ids=str)
def test_commands_estimate_graph_trainers_output(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """`estimate` and `solve --passes graph-trainer` report the figures of the graph graph
    trainer's passes make for the policy, and name each pass's fate."""
    argv = [*command, "--model", MODELS[0], "--layers", "2", "--seq", "32", "--profile", "h100"]
    estimating = command[0] == "estimate"
    if estimating:
        argv += ["--policy", "titan-sac_and_offload", "--optimizer", "none"]
    assert main([*argv, "--passes", "graph-trainer", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    steps = {step["name"]: step["status"] for step in result["passes"]["passes"]}
    assert (
        set(result["passes"]["skipped"]) == set(SKIPPED) | {name for _, name in EP_PASSES}
        and steps["apply_cpu_offload_pass"] == "ran"
    )
    assert result["passes"].get("whatif") == (REPLAYED if estimating else None)
    policy = Policy.from_json(result["policy"])
    cleaned = cleanup(traced(MODELS[0]))
    optimizer = "none" if command[0] == "estimate" else "adamw"
    estimator = Estimator(cleaned, ("h100",), optimizer)  # type: ignore[arg-type]
    full = estimate_remat(cleaned, run_passes(cleaned, policy).gm, estimator)
    assert result["peak_bytes"] == full.peak_bytes
    assert result["saved_activation_bytes"] == full.saved_activation_bytes


@pytest.mark.parametrize("preset", ["titan-default", "titan-full"])
def test_a_per_rank_graph_through_graph_trainers_pass_stack(
    rank_debug: JointGraph, preset: str
) -> None:
    """One FSDP2 x TP2 rank on fake tensors: graph trainer's cleanup drops nodes (its
    back-to-back transposes of gathered weights among them), its tagging differs from the
    decisions only on random ops, and the what-if is exact against its output."""
    estimator = estimator_for(rank_debug, "graph-trainer", ("h100",))
    cleaned = estimator.graph
    assert len(cleaned.gm.graph.nodes) < len(rank_debug.gm.graph.nodes)
    result = run_passes(cleaned, preset)
    nodes = {n.name: n for n in cleaned.gm.graph.nodes}
    assert all(_random(nodes[name]) for name in result.retagged)
    full = estimate_remat(cleaned, result.gm, estimator)
    assert estimator.estimate(Policy(preset)).totals() == full.totals()
    assert cleaned.collective_counts() == rank_debug.collective_counts()


# --- graph trainer's EP-overlap passes (opt-in) -------------------------------------------


@pytest.fixture(scope="module")
def ep_rank() -> JointGraph:
    workload = load_workload("torchtitan:deepseek_v3/debugmodel", **SHAPE)  # type: ignore[arg-type]
    return trace(workload, "real", Parallel(fsdp=2, ep=2))


def _a2a_groups(gm: fx.GraphModule) -> set[str]:
    return {
        str(n.args[3])
        for n in gm.graph.nodes
        if n.target is torch.ops._c10d_functional.all_to_all_single.default
    }


def test_ep_pass_order_is_graph_trainers() -> None:
    """`EP_PASSES` sit where `compile_time_passes` appends them under `ep_overlap.enabled`:
    after its remat pass, the last two after bucketing; each is its own function."""
    spec = importlib.util.find_spec("torchtitan.experiments.graph_trainer.passes")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    body = source[source.index("def compile_time_passes") :]
    body = body[: body.index("\ndef ")]
    # its chunk passes are listed first, then appended after the remat pass
    chunking = body[body.index('ep_overlap_chunk_strategy == "graph":\n') :]
    assert chunking.index(EP_PASSES[0][1]) < chunking.index(f"{EP_PASSES[1][1]},")
    order = ["selective_activation_remat_pass,", "passes.extend(ep_overlap_chunk_passes)"]
    order += [f"{name}" for _, name in EP_PASSES[2:4]]
    order += ["joint_transformer_block_bucketing_reordering_pass"]
    order += [f"{name}" for _, name in EP_PASSES[4:]]
    position = 0
    for name in order:
        position = body.index(name, position + 1)  # ValueError: out of its order
    with graph_trainer_imports():  # its EP modules import torchtitan's trainer
        for module, name in EP_PASSES:
            module_path = f"torchtitan.experiments.graph_trainer.{module}"
            assert callable(getattr(importlib.import_module(module_path), name))


def test_ep_passes_are_listed_as_not_requested(ep_rank: JointGraph) -> None:
    """Without the option the report names each EP pass, opt-in, and the graph is as before."""
    result = run_passes(ep_rank, "titan-default")
    names = [step.name for step in result.steps]
    ep_steps = [step for step in result.steps[len(CLEANUP) + 3 :] if step.name not in SKIPPED]
    assert [step.name for step in ep_steps] == [name for _, name in EP_PASSES]
    assert all(step.status == "skipped" and step.why == EP_NOT_REQUESTED for step in ep_steps)
    assert names.index("ep_overlap_schedule_pass") > names.index(
        "joint_transformer_block_bucketing_reordering_pass"
    )
    assert _a2a_groups(result.gm) == {"0"}


def test_ep_overlap_runs_graph_trainers_ep_passes(ep_rank: JointGraph) -> None:
    """Its PG isolation moves every EP all-to-all off the group FSDP gathers on, onto a new
    group of the same ranks (on the same mesh dimension); its chunking and schedule refuse the
    static-shape trace, with its own error; the estimate runs on the result."""
    result = run_passes(ep_rank, "titan-default", ep_overlap=True)
    steps = {step.name: step for step in result.steps[len(CLEANUP) + 3 :]}
    assert steps["isolate_ep_process_group_pass"].status == "ran"
    (isolated,) = _a2a_groups(result.gm)
    gathers = {
        str(n.args[2])
        for n in result.gm.graph.nodes
        if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default
    }
    assert gathers == {"0"} and isolated != "0"
    assert result.graph.mesh_dims[isolated] == result.graph.mesh_dims["0"]
    for name in ("populate_chunk_dim_metadata_pass", "ep_overlap_chunk_pass"):
        assert steps[name].status == "skipped"
        assert "unbacked" in steps[name].why and "graph trainer: " in steps[name].why
    assert "any chunked EP all-to-all regions" in steps["ep_overlap_schedule_pass"].why
    assert steps["concretize_ep_chunk_symbolic_shapes_pass"].why.endswith("graph unchanged")
    plain = run_passes(ep_rank, "titan-default")
    full, without = estimate_remat(result.graph, result.gm), estimate_remat(plain.graph, plain.gm)
    assert full.peak_bytes == without.peak_bytes > 0
    assert full.comm_seconds == without.comm_seconds


def test_ep_overlap_is_refused_without_ep_or_graph_trainer(ep_rank: JointGraph) -> None:
    with pytest.raises(WorkbenchError, match=r"needs graph trainer's EP all-to-alls, and .* none"):
        prepare(traced(MODELS[0]), "graph-trainer", ep_overlap=True)
    with pytest.raises(WorkbenchError, match="the workbench pass stack does not run"):
        prepare(ep_rank, "workbench", ep_overlap=True)
    with pytest.raises(WorkbenchError, match="has none"):
        run_passes(traced(MODELS[0]), "titan-default", ep_overlap=True)


def test_estimate_ep_overlap_reports_each_ep_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """`estimate --passes graph-trainer --ep-overlap` on an EP rank names each EP pass's fate."""
    argv = ["estimate", "--model", "torchtitan:deepseek_v3/debugmodel", "--layers", "2"]
    argv += ["--seq", "32", "--fsdp", "2", "--ep", "2", "--profile", "h100", "--json"]
    assert main([*argv, "--passes", "graph-trainer", "--ep-overlap"]) == 0
    result = json.loads(capsys.readouterr().out)
    steps = {step["name"]: step["status"] for step in result["passes"]["passes"][6:]}
    assert steps["isolate_ep_process_group_pass"] == "ran" and result["peak_bytes"] > 0
    assert "graph trainer: " in result["passes"]["skipped"]["ep_overlap_chunk_pass"]


@pytest.mark.parametrize("preset", ["titan-default", "titan-full"])
def test_gpu_shaped_rank_through_graph_trainers_pass_stack(preset: str) -> None:
    """A rank traced for an H100 (flex attention's op, its score and mask subgraphs, which
    graph trainer's remat pass copies with the flex attention it recomputes): the what-if is
    exact against the graph its passes make."""
    workload = load_workload("torchtitan:deepseek_v3/debugmodel", device="meta", **SHAPE)  # type: ignore[arg-type]
    rank = trace(workload, "fake", Parallel(fsdp=2, ep=2))
    assert rank.attention_counts() == {"flex_attention": 2}
    estimator = estimator_for(rank, "graph-trainer", ("h100",))
    cleaned = estimator.graph
    result = run_passes(cleaned, preset)
    full = estimate_remat(cleaned, result.gm, estimator)
    assert estimator.estimate(Policy(preset)).totals() == full.totals()


# --- the what-if replays graph trainer's passes on indices ----------------------------------

# The presets with graph trainer's offload defaults and others (prefetch and defer 0 and 2):
# offload placed from the pre-remat graph, frees deferred, reloads prefetched and hoisted in
# front of the copies that read them.
PRESETS = [
    *(Policy(preset, offload=GT_OFFLOAD) for preset in TITAN),
    *(Policy(preset) for preset in ("default", "full", "eager", "offload")),
    Policy("titan-sac_and_offload", offload=OffloadOptions(prefetch_layers=0, defer_layers=0)),
    Policy("offload", offload=OffloadOptions(prefetch_layers=2, defer_layers=2)),
]


def _check_replay(graph: JointGraph, policies: list[Policy]) -> None:
    """Each policy's replayed node order is the one graph trainer's own passes make (entry for
    entry, input for input), with no fall back to running them; some offload, all recompute."""
    estimator = estimator_for(graph, "graph-trainer", ("h100",))
    assert isinstance(estimator, PassStackEstimator)
    offloading = 0
    for policy in policies:
        assert estimator.check_replay(policy) == [], policy
        order = estimator.order_for(decide(estimator.graph, policy), policy.offload)
        assert estimator.fallback is None
        offloading += bool(estimator.index.space.is_step(order.entries).any())
    assert offloading >= 2


@pytest.mark.parametrize("spec", MODELS)
def test_replay_is_graph_trainers_passes(spec: str) -> None:
    """Presets and random policies (selectors, overrides, offload budgets, prefetch and defer
    0 to 2) on the four families, one device."""
    graph = cleanup(traced(spec))
    _check_replay(graph, [*PRESETS, *random_policies(graph, 12, seed=MODELS.index(spec))])


@pytest.mark.parametrize(
    ("spec", "parallel"),
    [
        (MODELS[0], Parallel(fsdp=2, tp=2)),
        (MODELS[2], Parallel(fsdp=2, ep=2)),
        (MODELS[3], Parallel(fsdp=2, ep=2)),
    ],
    ids=["llama3-fsdp2-tp2", "qwen3-moe-fsdp2-ep2", "deepseek-v3-fsdp2-ep2"],
)
def test_replay_is_graph_trainers_passes_on_gpu_shaped_ranks(spec: str, parallel: Parallel) -> None:
    """Ranks traced for an H100 on fake tensors (flex attention's op, whose recomputed copies
    read its subgraphs; FSDP all-gathers, TP and EP collectives): presets and random
    policies, FSDP reshard choices among them."""
    workload = load_workload(spec, device="meta", **SHAPE)  # type: ignore[arg-type]
    graph = cleanup(trace(workload, "fake", parallel))
    _check_replay(graph, [*PRESETS, *random_policies(graph, 8, seed=1)])


def test_replay_is_graph_trainers_passes_for_tags_no_policy_writes() -> None:
    """Tags drawn at random on every forward and loss op, outside the rules (the loss and
    lm_head recomputed, any tensor graph trainer's pass accepts offloaded, in or out of the
    layers): frees deferred past other offloaded values, reloads hoisted for copies."""
    from torchtitan.experiments.graph_trainer.cpu_offload import _is_view

    graph = cleanup(traced(MODELS[0]))
    estimator = estimator_for(graph, "graph-trainer", ("h100",))
    assert isinstance(estimator, PassStackEstimator)
    nodes = {node.name: node for node in graph.gm.graph.nodes}
    base = decide(graph, Policy("titan-default"))
    rng = random.Random(0)
    for _ in range(20):
        recompute, offload = rng.choice([0.1, 0.4, 0.8]), rng.choice([0.1, 0.3])
        decisions = dict(base)
        for name, tag in base.items():
            draw, node = rng.random(), nodes[name]
            if tag.why.forced:  # random ops: graph trainer's remat refuses them
                continue
            movable = not _is_view(node) and isinstance(node.meta.get("val"), torch.Tensor)
            action = "recompute" if draw < recompute else "save"
            if recompute <= draw < recompute + offload and movable:
                action = "offload"
            decisions[name] = Tag(MUST[action], Why.OVERRIDE)
        options = OffloadOptions(None, rng.randint(0, 2), rng.randint(0, 2))
        replayed = replay_graph_trainer(estimator.index, decisions, options)
        ran = estimator.passes_order(decisions, options)
        assert all(np.array_equal(a, b) for a, b in zip(replayed, ran, strict=True))


def test_what_the_replay_cannot_say_runs_graph_trainers_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node order the replay cannot say (`Unreplayable`) is made by graph trainer's passes,
    for that estimate only, and `fallback` says why; a view tagged for offload gets graph
    trainer's own refusal that way. `reference=True` runs them for every estimate."""
    from workbench.cost import graph_trainer_replay, pass_stacks

    graph = traced(MODELS[0])
    estimator = estimator_for(graph, "graph-trainer", ("h100",))
    assert isinstance(estimator, PassStackEstimator)
    policy = Policy("titan-sac_and_offload", offload=GT_OFFLOAD)
    replayed = estimator.estimate(policy)
    assert estimator.whatif_note() == REPLAYED
    reference = estimator_for(graph, "graph-trainer", ("h100",), reference=True)
    assert reference.estimate(policy) == replayed
    assert isinstance(reference, PassStackEstimator) and "reference" in reference.whatif_note()

    def refuse(*args: object, **kwargs: object) -> None:
        raise graph_trainer_replay.Unreplayable("not this one")

    monkeypatch.setattr(pass_stacks, "replay_graph_trainer", refuse)
    assert estimator.estimate(policy) == replayed
    assert estimator.whatif_note() == "graph trainer's passes ran: not this one"
    monkeypatch.undo()
    assert estimator.estimate(policy) == replayed and estimator.fallback is None
    decisions = decide(estimator.graph, Policy("titan-default"))
    nodes = {node.name: node for node in estimator.graph.gm.graph.nodes}
    view = next(n for n in decisions if nodes[n].target is torch.ops.aten.reshape.default)
    decisions[view] = Tag(MUST["offload"], Why.OVERRIDE)
    with pytest.raises(WorkbenchError, match="apply_cpu_offload_pass failed: .* is a view op"):
        estimator.estimate(decisions)
    assert estimator.fallback is not None and "is a view" in estimator.fallback
    assert estimator.check_replay(decisions)[0].startswith("not replayed: ")


def test_bench_whatif_replays_graph_trainers_passes() -> None:
    """`bench whatif --passes graph-trainer`: flips through the replay, equal to the figures
    of the graph graph trainer's passes make, none run in its place."""
    result = bench_whatif(
        traced(MODELS[0]),
        Policy("titan-sac_and_offload", offload=GT_OFFLOAD),
        flips=6,
        full_path=3,
        seed=2,
        passes="graph-trainer",
    )
    assert result["passes"] == "graph-trainer" and result["equal_to_full_path"] is True
    assert result["full_path_runs"] == 3 and result["replay_fallbacks"] == 0
    assert set(result["stage_p50_seconds"]) == {"decide", "replay", "simulate"}
