"""Graph trainer's compile-time pass stack on a workbench graph, in graph trainer's order,
calling its own passes: the `--passes graph-trainer` choice.

Entry points: `prepare(graph, passes) -> JointGraph` (the graph the workbench analyses: as
traced for `workbench`, after graph trainer's cleanup for `graph-trainer`) and
`run_passes(graph, policy) -> PassesResult` (tagging, its offload pass, its remat pass and
what follows, each pass named with what became of it: run, replaced or skipped, and why).
Its expert-parallel overlap passes (`EP_PASSES`) are opt-in there as here (`ep_overlap=True`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph, describe_nodes
from workbench.capture.models.torchtitan import torchtitan_log
from workbench.decide.decider import Decisions, decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.decide.presets import GRAPH_TRAINER, PRESETS
from workbench.errors import WorkbenchError
from workbench.rewrite.placement import REPLAYED_VIEW, is_offload_node

__all__ = [
    "CLEANUP",
    "DEFER_0",
    "EP_NOT_REQUESTED",
    "EP_PASSES",
    "PASSES",
    "PASS_STACKS",
    "SKIPPED",
    "PassStep",
    "PassesResult",
    "check_ep_overlap",
    "check_pass_stack",
    "cleanup",
    "graph_trainer_config",
    "prepare",
    "run_passes",
]

PASS_STACKS = ("workbench", "graph-trainer")
PassStack = Literal["workbench", "graph-trainer"]
_GT = "torchtitan.experiments.graph_trainer"
MODULE_FQN = "module_fqn"  # where graph trainer's passes read a node's module path
_A2A = "_c10d_functional.all_to_all_single.default"

# Graph trainer's compile-time passes with its default config, in the order of its
# `passes.compile_time_passes` (`include_inductor=False`) then `final_inductor_compile_passes`
# and `construct_default_graph_passes`' cudagraph: (module, function). A test reads that
# order from graph trainer's source.
CLEANUP: tuple[tuple[str, str], ...] = (
    ("remove_noop_passes", "eliminate_dead_code_pass"),
    ("remove_noop_passes", "canonicalize_graph_pass"),
    ("fsdp_passes", "deduplicate_fsdp_unshard_chains_pass"),
)
PASSES: tuple[tuple[str, str], ...] = (
    *CLEANUP,
    ("memory_policy", "tag_with_memory_policy_pass"),
    ("cpu_offload", "apply_cpu_offload_pass"),
    ("selective_activation_remat", "selective_activation_remat_pass"),
    ("fsdp_passes", "joint_transformer_block_bucketing_reordering_pass"),
    ("inductor_passes", "annotate_flex_attention_for_regional_inductor_pass"),
    ("inductor_passes", "regional_inductor_pass"),
    ("cudagraph", "cudagraph_pass"),
)
# Graph trainer's EP-overlap passes (`compile.ep_overlap.enabled`, off by default), in the
# order `compile_time_passes` runs them: after its remat pass, then (after bucketing) the last two.
EP_PASSES: tuple[tuple[str, str], ...] = (
    ("ep_chunk_pass", "populate_chunk_dim_metadata_pass"),
    ("ep_chunk_pass", "ep_overlap_chunk_pass"),
    ("ep_process_group_pass", "isolate_ep_process_group_pass"),
    ("remove_noop_passes", "eliminate_dead_code_pass"),
    ("ep_overlap_pass", "ep_overlap_schedule_pass"),
    ("ep_pass_utils", "concretize_ep_chunk_symbolic_shapes_pass"),
)
EP_NOT_REQUESTED = (
    "EP overlap not requested: opt-in in graph trainer (compile.ep_overlap.enabled), "
    "here ep_overlap=True / --ep-overlap"
)
# Why graph trainer's chunking cannot run on the workbench's trace (its own error follows).
_UNCHUNKED = (
    "graph chunking needs the batch dimension traced as an unbacked size (graph trainer's "
    "`prepare_ep_overlap_trace_inputs` marks it at trace time); the workbench traces static "
    "shapes (its tracer given its preparers fails in torch's make_fx on this rank: "
    "AssertionError 'Expected Proxy' in `_set_unbacked_bindings`)"
)
# Said where a policy asks for `defer_layers` 0, which graph trainer's pass runs as 1.
DEFER_0 = (
    "defer_layers 0 asked: torchtitan 0.3.0's pass refuses it (its closing lint), so it ran "
    "with 1, as `export --format torchtitan` asks"
)
# The passes after its remat pass cannot run here, and why.
SKIPPED = {
    "joint_transformer_block_bucketing_reordering_pass": "its overlap scheduler estimates "
    "node runtimes through triton's GPU driver (none on a CPU); not reproduced: the "
    "estimate reads the order graph trainer's remat pass leaves",
    "annotate_flex_attention_for_regional_inductor_pass": "marks regions for inductor, "
    "which compiles kernels; the estimate reads the FX graph before compilation",
    "regional_inductor_pass": "inductor compiles the graph into kernels; the estimate reads "
    "the FX graph before compilation",
    "cudagraph_pass": "captures CUDA graphs at run time; needs a CUDA device",
}


@dataclass(frozen=True)
class PassStep:
    """What became of one of graph trainer's passes: `ran` (its own function), `replaced`
    (the workbench's stand-in ran: `why` says which), or `skipped` (`why` says why)."""

    name: str
    status: Literal["ran", "replaced", "skipped"]
    why: str = ""
    nodes: int | None = None  # nodes of the graph after it, where it ran

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PassesResult:
    """Graph trainer's pass stack on one policy: the graph it made from `graph` (the cleaned
    graph, see `prepare`), the decisions it applied, each pass's fate, and the nodes where
    graph trainer's own tagging differed from the decisions applied (node -> its tag)."""

    gm: fx.GraphModule
    graph: JointGraph
    decisions: Decisions
    steps: list[PassStep]
    retagged: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline": "graph-trainer",  # the pass stack, under the key --json always had
            "passes": [step.to_json() for step in self.steps],
            "skipped": {s.name: s.why for s in self.steps if s.status == "skipped"},
            "retagged": self.retagged,
        }


def check_pass_stack(passes: str) -> PassStack:
    """`passes` if it names a pass stack; for `graph-trainer`, torchtitan must be importable."""
    if passes not in PASS_STACKS:
        raise WorkbenchError(
            f"unknown pass stack {passes!r}; choose one of {', '.join(PASS_STACKS)}"
        )
    if passes == "graph-trainer":
        _pass("memory_policy", "tag_with_memory_policy_pass")
    return passes  # type: ignore[return-value]


def _pass(module: str, name: str) -> Callable[..., Any]:
    """Graph trainer's pass `name` from its module; a one-line error without torchtitan."""
    try:
        return getattr(importlib.import_module(f"{_GT}.{module}"), name)  # type: ignore[no-any-return]
    except ImportError as err:
        raise WorkbenchError(
            f"--passes graph-trainer runs torchtitan's graph trainer passes ({err}): "
            "pip install -e '.[torchtitan]'"
        ) from None


def _run(name: str, fn: Callable[..., Any], gm: fx.GraphModule) -> fx.GraphModule:
    """One of graph trainer's passes; its failure as a one-line error naming it."""
    try:
        with torchtitan_log(logging.WARNING):  # its passes log summaries
            out = fn(gm, None)
    except Exception as err:  # any failure inside graph trainer: say which pass
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise WorkbenchError(f"graph trainer's {name} failed: {first}") from None
    return out  # type: ignore[no-any-return]


_CLEANED: weakref.WeakKeyDictionary[JointGraph, JointGraph] = weakref.WeakKeyDictionary()
# each cleaned graph -> what its cleanup passes did
_CLEANUP_STEPS: weakref.WeakKeyDictionary[JointGraph, list[PassStep]] = weakref.WeakKeyDictionary()


def cleanup(graph: JointGraph) -> JointGraph:
    """`graph` after graph trainer's cleanup passes (`CLEANUP`: DCE, `canonicalize_graph_pass`
    dropping `detach` and back-to-back `t` and retargeting views to `reshape`, FSDP
    unshard-chain dedup), as a JointGraph of its own whose surviving nodes keep the traced
    graph's facts (module, phase). Built once per graph; a cleaned graph is its own."""
    if graph in _CLEANUP_STEPS:
        return graph
    if graph in _CLEANED:
        return _CLEANED[graph]
    gm = fx.GraphModule(graph.gm, _copy(graph.gm.graph))
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        info = graph.traced_info(node)
        custom = dict(node.meta.get("custom") or {})
        custom[MODULE_FQN] = info.module if info is not None else ""
        node.meta["custom"] = custom
    traced = {node: graph.traced_info(node) for node in gm.graph.nodes}
    steps = []
    for module, name in CLEANUP:
        gm = _run(name, _pass(module, name), gm)
        steps.append(PassStep(name, "ran", nodes=len(gm.graph.nodes)))
    infos = describe_nodes(gm)  # a new trace token: the cleaned graph is its own origin
    for node in gm.graph.nodes:
        before = traced.get(node)
        if before is not None:  # keep what the trace said (module attribution, phase)
            infos[node.name] = dataclasses.replace(
                infos[node.name],
                module=before.module,
                layer=before.layer,
                phase=before.phase,
                graph_level=before.graph_level,
            )
    cleaned = dataclasses.replace(graph, gm=gm, nodes=infos)
    _CLEANED[graph] = cleaned
    _CLEANUP_STEPS[cleaned] = steps
    return cleaned


def _copy(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` whose nodes have their own meta dicts (the passes rewrite them)."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def prepare(graph: JointGraph, passes: str = "workbench", ep_overlap: bool = False) -> JointGraph:
    """The graph the workbench analyses under a pass stack: `graph` itself for
    `workbench`, `cleanup(graph)` for `graph-trainer` (whose tagging runs after cleanup).
    `ep_overlap` (graph trainer's EP-overlap passes, `run_passes`) is refused with
    `workbench` and on a graph without EP all-to-alls, before any pass runs."""
    if ep_overlap:
        if check_pass_stack(passes) != "graph-trainer":
            raise WorkbenchError(
                f"EP overlap runs graph trainer's EP-overlap passes, which the {passes} "
                "pass stack does not run: choose graph-trainer"
            )
        check_ep_overlap(graph)
    return graph if check_pass_stack(passes) == "workbench" else cleanup(graph)


def graph_trainer_config(policy: Policy) -> Any:
    """The slice of graph trainer's config its memory-policy pass reads: the graph-trainer
    preset's memory policy (`default` for others), its offload budget, one device."""
    from torchtitan.config import ParallelismConfig

    memory_policy = PRESETS[policy.preset].memory_policy if _is_titan(policy) else "default"
    budget = policy.offload.budget_bytes
    return types.SimpleNamespace(
        parallelism=ParallelismConfig(),
        compile=types.SimpleNamespace(
            memory_policy=memory_policy,
            # its "GB" are GiB (`budget_gb * 1024**3`); None: its default, 100
            cpu_offload_budget_gb=100.0 if budget is None else budget / 2**30,
        ),
    )


def _is_titan(policy: Policy) -> bool:
    """A bare preset of graph trainer's dialect: graph trainer's own tagging decides it."""
    return PRESETS[policy.preset].dialect == GRAPH_TRAINER and policy == Policy(
        policy.preset, offload=policy.offload
    )


def _tag(
    gm: fx.GraphModule, graph: JointGraph, policy: Policy | Decisions
) -> tuple[Decisions, PassStep, dict[str, str]]:
    """Memory-policy tagging. A bare `titan-*` preset runs graph trainer's
    `tag_with_memory_policy_pass`; then every node takes the workbench's decision (for the
    `titan-*` presets graph trainer's tag but where the CPU forces a save: random ops, which
    its remat pass refuses) and the nodes where the two differ are returned."""
    name = "tag_with_memory_policy_pass"
    retagged: dict[str, str] = {}
    if isinstance(policy, Policy) and _is_titan(policy):
        fn = functools.partial(_pass("memory_policy", name), config=graph_trainer_config(policy))
        _run(name, fn, gm)
        step = PassStep(name, "ran", nodes=len(gm.graph.nodes))
    else:
        what = f"policy {policy.preset!r}" if isinstance(policy, Policy) else "given decisions"
        step = PassStep(
            name, "replaced", f"the workbench's decider tags {what} (not a bare titan-* preset)"
        )
    decisions = decide(graph, policy) if isinstance(policy, Policy) else policy
    for node in gm.graph.nodes:
        theirs = node.meta.pop("recompute", None)
        tag = decisions.get(node.name)
        if tag is None or node.op != "call_function":  # its passes read call nodes' tags only
            continue
        node.meta["recompute"] = tag.policy
        offloads = theirs is CheckpointPolicy.MUST_CPU_OFFLOAD
        if step.status == "ran" and (
            (theirs in _RECOMPUTE) != tag.recompute or offloads != tag.offload
        ):
            name_of = theirs.name if theirs is not None else "untagged"
            retagged[node.name] = f"{name_of} -> {tag.policy.name}: {tag.reason}"
    return decisions, step, retagged


_RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def run_passes(
    graph: JointGraph,
    policy: Policy | str | Decisions,
    offload: OffloadOptions | None = None,
    *,
    ep_overlap: bool = False,
) -> PassesResult:
    """Graph trainer's compile-time passes (`PASSES`) in its order on `graph` for `policy`:
    cleanup (`cleanup`; skipped if `graph` is already a cleaned graph), memory-policy
    tagging (`_tag`), `apply_cpu_offload_pass` with the policy's prefetch and defer,
    `selective_activation_remat_pass`, then the passes that need a GPU or compile kernels,
    skipped and named with why. `ep_overlap` adds graph trainer's EP-overlap passes
    (`EP_PASSES`, `_ep_passes`) where it runs them; without it they are listed as not requested.

    On entry: a traced graph or `cleanup`'s result. Returns a `PassesResult` whose `gm`
    maps back to `result.graph` (estimate it with `estimate_remat(result.graph, result.gm)`);
    views graph trainer's offload pass replays on reloads are marked `REPLAYED_VIEW`. Raises
    `WorkbenchError` naming the pass that failed inside graph trainer, or for `ep_overlap`
    on a graph without EP all-to-alls."""
    policy = Policy(policy) if isinstance(policy, str) else policy
    if ep_overlap:
        check_ep_overlap(graph)
    if offload is None:
        offload = policy.offload if isinstance(policy, Policy) else OffloadOptions()
    cleaned = cleanup(graph)
    steps = list(_CLEANUP_STEPS[cleaned])
    gm = fx.GraphModule(cleaned.gm, _copy(cleaned.gm.graph))
    decisions, step, retagged = _tag(gm, cleaned, policy)
    steps.append(step)
    before = set(gm.graph.nodes)
    name = "apply_cpu_offload_pass"
    defer = max(offload.defer_layers, 1)
    gm = _run(
        name,
        functools.partial(
            _pass("cpu_offload", name),
            prefetch_lookahead=offload.prefetch_layers,
            defer_n_layers=defer,
        ),
        gm,
    )
    for node in gm.graph.nodes:
        if node not in before and not is_offload_node(node):
            node.meta[REPLAYED_VIEW] = True  # a forward view replayed on a reload
    offloads = any(tag.offload for tag in decisions.values())
    note = DEFER_0 if offloads and defer != offload.defer_layers else ""
    steps.append(PassStep(name, "ran", note, nodes=len(gm.graph.nodes)))
    name = "selective_activation_remat_pass"
    gm = _run(name, _pass("selective_activation_remat", name), gm)
    steps.append(PassStep(name, "ran", nodes=len(gm.graph.nodes)))
    if ep_overlap:
        gm, ep_steps, cleaned = _ep_passes(gm, cleaned)
    else:
        ep_steps = [PassStep(name, "skipped", EP_NOT_REQUESTED) for _, name in EP_PASSES]
    bucketing, *final = PASSES[len(CLEANUP) + 3 :]
    steps += [*ep_steps[:4], PassStep(bucketing[1], "skipped", SKIPPED[bucketing[1]])]
    steps += ep_steps[4:]
    steps += [PassStep(name, "skipped", SKIPPED[name]) for _, name in final]
    return PassesResult(gm, cleaned, decisions, steps, retagged)


def check_ep_overlap(graph: JointGraph) -> None:
    """Graph trainer's EP-overlap passes need an expert-parallel graph: EP all-to-alls its
    parallelize annotated (the reference MoE's EP has none of its annotations)."""
    if not any(_is_ep_all_to_all(node) for node in graph.gm.graph.nodes):
        raise WorkbenchError(
            f"EP overlap needs graph trainer's EP all-to-alls, and {graph.model_name} has none: "
            "trace an MoE torchtitan model with --ep 2 or more"
        )


def _is_ep_all_to_all(node: fx.Node) -> bool:
    return str(node.target) == _A2A and "EP" in (node.meta.get("custom") or {})


def _ep_passes(
    gm: fx.GraphModule, graph: JointGraph
) -> tuple[fx.GraphModule, list[PassStep], JointGraph]:
    """Graph trainer's EP-overlap passes (`EP_PASSES`) with its default `EpOverlapConfig`
    (validated by its `validate_ep_overlap_config`), each called, in its order. Its graph
    chunking raises on the workbench's static-shape trace, and its `ep_overlap_schedule_pass`
    then finds no chunked regions: each is skipped with graph trainer's own error. Its PG
    isolation runs on a fake world of the graph's size (it resolves and creates process
    groups); the group it makes is added to the returned graph's `mesh_dims`, on the source
    group's dimension."""
    from workbench.capture.parallel import fake_world
    from workbench.capture.titan_rank import graph_trainer_imports

    with graph_trainer_imports():  # its EP modules import its configs, which need it
        from torchtitan.experiments.graph_trainer.configs import (
            EpOverlapConfig,
            validate_ep_overlap_config,
        )

        passes = [(name, _pass(module, name)) for module, name in EP_PASSES]
    dim, _, pattern = validate_ep_overlap_config(EpOverlapConfig(enabled=True))
    static = sum(1 for spec in graph.inputs if spec.kind in ("param", "buffer"))
    kwargs: dict[str, dict[str, Any]] = {
        "populate_chunk_dim_metadata_pass": {"mode": dim},
        "ep_overlap_chunk_pass": {
            "mode": dim,
            "module_pattern": pattern,
            "num_static_inputs": static,
            "require_all_to_all": True,
        },
        "ep_overlap_schedule_pass": {"module_pattern": pattern, "require_all_to_all": True},
    }
    before = {node.name: node.args[3] for node in gm.graph.nodes if _is_ep_all_to_all(node)}
    steps = []
    for name, function in passes:
        fn = functools.partial(function, **kwargs.get(name, {}))
        try:
            with torchtitan_log(logging.WARNING):  # its passes log summaries
                if name == "isolate_ep_process_group_pass":
                    with fake_world(graph.world_size):
                        gm = fn(gm, None)
                else:
                    gm = fn(gm, None)
        except Exception as err:  # graph trainer's own refusal on this graph: say it
            first = (str(err).splitlines() or [type(err).__name__])[0]
            cause = _UNCHUNKED if "chunk" in name or "schedule" in name else "it failed here"
            steps.append(PassStep(name, "skipped", f"{cause}; graph trainer: {first}"))
            continue
        unchunked = name.startswith("concretize") and steps[1].status == "skipped"
        note = "no chunk symbols to concretize (chunking skipped): graph unchanged"
        steps.append(PassStep(name, "ran", note if unchunked else "", len(gm.graph.nodes)))
    groups = {
        str(before[node.name]): str(node.args[3])
        for node in gm.graph.nodes
        if node.name in before and node.args[3] != before[node.name]
    }
    if not groups:
        return gm, steps, graph
    mesh_dims = dict(graph.mesh_dims)
    for source, isolated in groups.items():
        mesh_dims[isolated] = mesh_dims.get(source, "ep")
    return gm, steps, dataclasses.replace(graph, mesh_dims=mesh_dims)
