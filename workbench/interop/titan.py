"""Parity with torchtitan's graph trainer: its own memory-policy pass run on a workbench graph.

Entry points: `graph_trainer_tags(graph, memory_policy)` (torchtitan's tags per forward node),
`graph_trainer_log(graph, memory_policy)` (its activation-memory log),
`compare(graph, policy, memory_policy=None) -> list[Mismatch]` against `decide`,
`offload_passes(graph, policy)` / `offload_mismatches(passes)` (its offload pass against the
workbench's), `DIFFERENCES` and `OFFLOAD_PLACEMENT` (where the two differ, and why).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import ORIGIN_KEY, JointGraph, NodeInfo
from workbench.decide.decider import decidable, decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.decide.presets import (
    COMPUTE_INTENSIVE_OPS,
    PRESETS,
    TITAN_NOT_IN_LAYERS,
    TITAN_PRESETS,
    TITAN_SAVE_OPS,
    titan_layer,
)
from workbench.decide.tags import OFFLOAD, RECOMPUTE, Why
from workbench.errors import WorkbenchError
from workbench.rewrite.offload import offload_pass
from workbench.rewrite.placement import OFFLOAD_META, REPLAYED_VIEW, is_offload_node
from workbench.rewrite.remat import copy_graph_module, remat

__all__ = [
    "CPU_FORCED",
    "WRITTEN_FORCED",
    "DIFFERENCES",
    "MEMORY_POLICIES",
    "NOT_REPRODUCED",
    "OFFLOAD_PLACEMENT",
    "STEP_NAMES",
    "Difference",
    "Mismatch",
    "OffloadMismatch",
    "OffloadPasses",
    "OffloadSteps",
    "compare",
    "counterpart",
    "differences_of",
    "differences_table",
    "explained_by",
    "graph_trainer_log",
    "graph_trainer_tags",
    "offload_mismatches",
    "offload_passes",
]

# Graph trainer's memory policies the harness runs (for `sac_and_offload` its tagging here;
# its offload pass in `offload_passes`, which rewrites a graph without a stream), and the key
# its passes read the module path from (`common_utils._MODULE_FQN`).
MEMORY_POLICIES = ("default", "full", "eager", "sac_and_offload")
TITAN_OFFLOAD_BUDGET_GB = 100.0  # graph trainer's default `cpu_offload_budget_gb`
MODULE_FQN = "module_fqn"
_POLICY_MODULE = "torchtitan.experiments.graph_trainer.memory_policy"


def _registry() -> dict[str, Any]:
    try:
        importlib.import_module(_POLICY_MODULE)  # registers the policies
        registry = importlib.import_module("torchtitan.experiments.graph_trainer.registry")
    except ImportError as err:
        raise WorkbenchError(
            f"the graph trainer parity check needs torchtitan ({err}): "
            "pip install -e '.[torchtitan]'"
        ) from None
    return registry.MEMORY_POLICY_REGISTRY  # type: ignore[no-any-return]


def _config(memory_policy: str) -> Any:
    """The slice of graph trainer's config its memory-policy passes read (single device)."""
    from torchtitan.config import ParallelismConfig

    return types.SimpleNamespace(
        parallelism=ParallelismConfig(),
        compile=types.SimpleNamespace(
            memory_policy=memory_policy, cpu_offload_budget_gb=TITAN_OFFLOAD_BUDGET_GB
        ),
    )


def _tagged_copy(graph: JointGraph, memory_policy: str) -> fx.GraphModule:
    """A copy of the graph tagged by graph trainer's registered pass for `memory_policy`,
    its nodes carrying what the pass reads: `meta["custom"]["module_fqn"]` (the workbench's
    module path, as its `annotate_module_fqns` would set it) and `meta["autograd_backward"]`
    (already set by tracing)."""
    if memory_policy not in MEMORY_POLICIES:
        raise WorkbenchError(
            f"unknown graph trainer memory policy {memory_policy!r}; choose one of "
            f"{', '.join(MEMORY_POLICIES)}"
        )
    registry = _registry()
    gm = copy_graph_module(graph.gm)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        custom = dict(node.meta.get("custom") or {})
        custom[MODULE_FQN] = graph.nodes[node.name].module
        node.meta["custom"] = custom
    with _torchtitan_log(logging.WARNING):  # its per-layer summary is for training logs
        registry[memory_policy](gm, config=_config(memory_policy))
    return gm


@contextlib.contextmanager
def _torchtitan_log(level: int, handler: logging.Handler | None = None) -> Iterator[None]:
    logger = logging.getLogger()  # torchtitan logs through the root logger
    previous = logger.level
    logger.setLevel(level)
    if handler is not None:
        logger.addHandler(handler)
    try:
        yield
    finally:
        logger.setLevel(previous)
        if handler is not None:
            logger.removeHandler(handler)


def graph_trainer_tags(graph: JointGraph, memory_policy: str) -> dict[str, CheckpointPolicy | None]:
    """torchtitan's tag (None: untagged) for every forward and loss node of `graph`, from
    graph trainer's own pass on a copy of it; the graph itself is not changed."""
    gm = _tagged_copy(graph, memory_policy)
    return {
        node.name: node.meta.get("recompute")
        for node in gm.graph.nodes
        if decidable(graph.nodes[node.name])
    }


def graph_trainer_log(graph: JointGraph, memory_policy: str) -> str:
    """The activation-memory table graph trainer logs after tagging `graph` with its own
    `memory_policy` (`log_activation_memory_policy`, captured from its debug log)."""
    from torchtitan.experiments.graph_trainer.log_activation_memory_policy import (
        log_activation_memory_policy,
    )

    gm = _tagged_copy(graph, memory_policy)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    with _torchtitan_log(logging.DEBUG, handler):
        log_activation_memory_policy(gm)
    text = stream.getvalue()
    return text[text.index("\n") + 1 :].rstrip("\n")  # without its one-line heading


@dataclass(frozen=True)
class Mismatch:
    """A node the workbench saves where graph trainer recomputes it, or the reverse."""

    node: str
    op: str
    module: str
    graph_trainer: CheckpointPolicy | None
    workbench: CheckpointPolicy
    reason: str  # the workbench's reason for its tag

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "op": self.op,
            "module": self.module,
            "graph_trainer": self.graph_trainer.name if self.graph_trainer else "untagged",
            "workbench": self.workbench.name,
            "reason": self.reason,
        }


def compare(
    graph: JointGraph, policy: Policy | str, memory_policy: str | None = None
) -> list[Mismatch]:
    """Nodes where `decide(graph, policy)` and graph trainer's `memory_policy` (default: the
    preset's `counterpart`; run with its default config, so FSDP reshards after
    forward) disagree on save vs recompute vs offload, in graph order."""
    policy = policy if isinstance(policy, Policy) else Policy(policy)
    memory_policy = memory_policy or counterpart(policy.preset) or policy.preset
    theirs = graph_trainer_tags(graph, memory_policy)
    ours = decide(graph, policy)
    return [
        Mismatch(
            node=name,
            op=graph.nodes[name].op,
            module=graph.nodes[name].module,
            graph_trainer=theirs.get(name),
            workbench=tag.policy,
            reason=tag.reason,
        )
        for name, tag in ours.items()
        if (theirs.get(name) in RECOMPUTE) != tag.recompute
        or (theirs.get(name) in OFFLOAD) != tag.offload
    ]


# --- where the workbench's own presets differ from graph trainer's ------------------------


@dataclass(frozen=True)
class Difference:
    """One rule where the workbench's `default` / `full` / `eager` decide otherwise than
    graph trainer's memory policy of the same name (which the `titan-*` presets follow)."""

    key: str
    rule: str
    presets: tuple[str, ...]  # the workbench presets it applies to
    workbench: str
    graph_trainer: str
    why: str

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "rule": self.rule,
            "presets": list(self.presets),
            "workbench": self.workbench,
            "graph_trainer": self.graph_trainer,
            "why": self.why,
        }


# The one table of differences: the README's table is `differences_table()` verbatim (a
# test holds them together), `policy explain` prints the rows of a preset, and
# `explained_by` names the row behind each mismatch `compare` finds.
DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        key="in-place",
        rule="in-place ops (`add_` in RMSNorm)",
        presets=("default", "full", "eager", "offload"),
        workbench="saved, whatever the preset asks",
        graph_trainer="tagged like any op (recomputed)",
        why="a recompute applies the mutation to its input a second time; the workbench "
        "never risks it, graph trainer does not check (harmless in RMSNorm, whose `add_` "
        "mutates the fresh `mean` recomputed with it)",
    ),
    Difference(
        key="lm_head/loss",
        rule="`lm_head*` / `loss*` modules",
        presets=("default", "full", "eager", "offload"),
        workbench="tagged by the preset",
        graph_trainer="never tagged (saved): its `full` keeps `_log_softmax`",
        why="graph trainer skips the epilogue because a chunked loss splits backward into "
        "regions its remat pass cannot handle; the workbench lets a policy choose there",
    ),
    Difference(
        key="layer boundary",
        rule="layer boundary",
        presets=("default", "full", "eager", "offload"),
        workbench="saved if a recomputed user is in any *other* layer",
        graph_trainer="saved only if it is in a *higher* layer (non-layer = -1)",
        why="both stop recomputation chaining across layers; graph trainer looks only "
        "forward in layer ids, so the last layer's output add feeding the final norm stays "
        "recomputed there",
    ),
    Difference(
        key="save list",
        rule="save list",
        presets=("default", "eager", "offload"),
        workbench="`COMPUTE_INTENSIVE_OPS` (with `_grouped_mm`, CPU flash attention)",
        graph_trainer="its `_get_default_save_ops()` (convolutions, `_scaled_mm`, collectives)",
        why="the workbench saves MoE expert matmuls (`_grouped_mm`) as compute-intensive; "
        "graph trainer 0.3.0's list lacks them",
    ),
    Difference(
        key="eager outside layers",
        rule="`eager` outside the layers",
        presets=("eager",),
        workbench="everything saved",
        graph_trainer="matmuls counted on (every second one recomputed), the rest recomputed",
        why="eager SAC wraps only the layers, so autograd saves everything outside them; "
        "graph trainer applies its eager rule to the whole graph",
    ),
    Difference(
        key="offload candidates",
        rule="what `offload` / `sac_and_offload` offload",
        presets=("offload",),
        workbench="saved contiguous storages of at least 4 KiB that backward reads and that "
        "own their memory, in the layers but the last, none random, written in place or "
        "returned by the step",
        graph_trainer="every saved contiguous tensor of at least 4 KiB in the layers but the "
        "last that its view-op list does not name, read by backward or not",
        why="offloading a view or a tensor backward never reads moves bytes and frees nothing; "
        "graph trainer tags by op, so it also tags a matmul whose output only a residual "
        "add reads (w2's `mm`)",
    ),
)
# Decisions forced on the CPU, in every preset: not a difference of rules.
CPU_FORCED = Difference(
    key="cpu-forced",
    rule="random ops (the CPU flash-attention op)",
    presets=(
        "default",
        "eager",
        "offload",
        "titan-default",
        "titan-eager",
        "titan-sac_and_offload",
    ),
    workbench="saved, whatever the preset asks",
    graph_trainer="`default` and `eager` recompute it (PREFER_RECOMPUTE)",
    why="torch tags `_scaled_dot_product_flash_attention_for_cpu` nondeterministic_seeded and "
    "its remat pass refuses to recompute random ops; on CUDA the flash op is in graph "
    "trainer's save list, so nothing is forced there",
)

# Saves the in-place rule forces (`rules.save_written_inputs`), in every preset.
WRITTEN_FORCED = Difference(
    key="written in place",
    rule="a recompute that would not see what forward saw (an in-place write)",
    presets=tuple(PRESETS),
    workbench="saved: it writes a storage that is not recomputed, reads one forward writes "
    "in place after it, or could be replayed out of order with a recomputed write",
    graph_trainer="recomputed as its policy asks",
    why="the recompute would compute another value than forward did, so loss and gradients "
    "would differ from eager's; with graph trainer's own presets this happens only on models "
    "that write a saved activation in place (the workbench's reference models do not)",
)

# Where graph trainer's offload pass places the steps otherwise than the workbench's
# `offload_pass` for the same options, on the same graph (`offload_mismatches` names the
# row behind each step it finds apart; the README shows `differences_table(OFFLOAD_PLACEMENT)`).
# With defer >= 1 and prefetch 0 the two agree step for step on both Llama3 debug models.
OFFLOAD_PLACEMENT: tuple[Difference, ...] = (
    Difference(
        key="defer 0",
        rule="`defer_layers` 0 (`cpu_offload_defer_n_layers 0`)",
        presets=("offload", "titan-sac_and_offload"),
        workbench="the device original is freed right after its last forward reader, found "
        "through every alias of its storage",
        graph_trainer="0.3.0's pass refuses the graph: its free is left right after the copy "
        "but names that reader as `last_use_of_storage`, and its own lint fails; sorted, the "
        "free would follow the reader's first getitem, and its alias walk stops at ops "
        "outside its view list (`unbind`, `split_with_sizes`), so q/k/v views of a matmul "
        "would still be read after the free",
        why="torchtitan 0.3.0 cannot run defer 0, so the export asks it for 1 (freed at the "
        "end of the layer after the producer's: more device memory than the workbench's 0); "
        "the workbench's rule frees as early as is safe",
    ),
)


# Graph trainer rules the `titan-*` presets do not reproduce yet (`compare` runs graph
# trainer with its default config, where the first does not fire).
NOT_REPRODUCED: tuple[str, ...] = (
    "FSDP unshards forced MUST_SAVE when FSDP does not reshard after forward "
    "(`--parallelism.fsdp_reshard_after_forward never`, or `default` with pipeline "
    "parallelism; the `default` policy only): on one FSDP-2 rank of torchtitan's 2-layer "
    "Llama3 that is 15 wait_tensor nodes `titan-default` recomputes",
    "SymInt outputs saved: the workbench traces static shapes, so none occur",
    "a wait_tensor takes its collective's tag: here the preset's rule gives both the same tag "
    "on the graphs traced so far, but nothing enforces it",
)


# Workbench presets named otherwise than their graph trainer memory policy.
_RENAMED = {"offload": "sac_and_offload"}


def counterpart(preset: str) -> str | None:
    """Graph trainer's memory policy of the same name (`titan-eager` -> `eager`), or the
    one a workbench preset follows under another name (`offload` -> `sac_and_offload`).

    >>> counterpart("titan-eager"), counterpart("full"), counterpart("none")
    ('eager', 'full', None)
    >>> counterpart("offload"), counterpart("titan-sac_and_offload")
    ('sac_and_offload', 'sac_and_offload')
    """
    name = _RENAMED.get(preset, preset.removeprefix("titan-"))
    return name if name in MEMORY_POLICIES else None


def differences_of(preset: str) -> list[Difference]:
    """The rows of `DIFFERENCES` for a workbench preset; none for the `titan-*` presets."""
    return [d for d in DIFFERENCES if preset in d.presets]


def differences_table(
    rows: tuple[Difference, ...] = DIFFERENCES, theirs: str = "graph trainer (`titan-*`)"
) -> str:
    """`DIFFERENCES` (or `OFFLOAD_PLACEMENT`, with graph trainer's column named `theirs`) as
    the Markdown table the README shows."""
    lines = [
        f"| rule | presets | workbench | {theirs} | why |",
        "|---|---|---|---|---|",
    ]
    for d in rows:
        presets = " / ".join(f"`{p}`" for p in d.presets)
        lines.append(f"| {d.rule} | {presets} | {d.workbench} | {d.graph_trainer} | {d.why} |")
    return "\n".join(lines)


def explained_by(mismatch: Mismatch, preset: str) -> str:
    """The key of the `DIFFERENCES` row (or `CPU_FORCED`) behind a mismatch of `preset`'s
    decisions; `selector` / `override` for a policy's own requests, `unexplained` else."""
    reason = mismatch.reason
    if reason.startswith("forced:random op"):
        return CPU_FORCED.key
    if reason.startswith(f"forced:{Why.WRITTEN_INPUT.value}"):
        return WRITTEN_FORCED.key
    if reason.startswith(("selector:", "override:")):
        return reason.split(":", 1)[0]
    if preset in TITAN_PRESETS:
        return "unexplained"
    if reason.startswith("forced:mutates"):
        return "in-place"
    if mismatch.graph_trainer is None:
        return "lm_head/loss"
    if reason.startswith("forced:layer boundary"):
        return "layer boundary"
    if preset == "eager" and titan_layer(mismatch.module) == TITAN_NOT_IN_LAYERS:
        return "eager outside layers"
    if (mismatch.op in COMPUTE_INTENSIVE_OPS) != (mismatch.op in TITAN_SAVE_OPS):
        return "save list"
    offloads = CheckpointPolicy.MUST_CPU_OFFLOAD
    if preset == "offload" and (mismatch.graph_trainer is offloads) != (
        mismatch.workbench is offloads
    ):
        return "offload candidates"
    return "unexplained"


# --- offload placement: graph trainer's offload pass against the workbench's ---------------


class OffloadSteps(NamedTuple):
    """Where one offloaded value's four steps land: for each, the name of the node of the
    rematerialized graph it follows (the other offload steps and the views replayed on
    reloads are not nodes of that graph, so they do not count)."""

    copy: str
    free: str
    reload: str
    wait: str


STEP_NAMES = OffloadSteps._fields


@dataclass(frozen=True)
class OffloadPasses:
    """One rematerialized graph offloaded by each pass: `workbench` by `offload_pass`,
    `graph_trainer` by `apply_cpu_offload_pass` (its replayed views marked as ours, so
    `Estimator.schedule_of` reads both), the values offloaded with the layers of each one's
    producer and first backward reader, the options, and `refused`: graph trainer's own
    error when its pass refused the graph (its closing lint), which was then sorted as its
    bucketing pass would sort it, to show where it meant the steps to go."""

    workbench: fx.GraphModule
    graph_trainer: fx.GraphModule
    # offloaded node -> layers of (producer, first backward reader; the producer's where the
    # reader is outside the layers): what prefetch is counted from and where it is needed
    layers: dict[str, tuple[int | None, int | None]]
    options: OffloadOptions
    refused: str | None = None

    def landings(self) -> tuple[dict[str, OffloadSteps], dict[str, OffloadSteps]]:
        """Per offloaded node, the nodes its steps follow: the workbench's, graph trainer's."""
        return _steps(self.workbench, list(self.layers)), _steps(
            self.graph_trainer, list(self.layers)
        )


@dataclass(frozen=True)
class OffloadMismatch:
    """A step of an offloaded value that the two passes put after different nodes, and the
    key of the `OFFLOAD_PLACEMENT` row that explains it (`unexplained` if none does)."""

    node: str
    step: str
    workbench: str
    graph_trainer: str
    difference: str


def offload_mismatches(passes: OffloadPasses) -> list[OffloadMismatch]:
    """Every step the two passes place apart, by offloaded node then step, each named by
    its row of `OFFLOAD_PLACEMENT`. Steps sharing a gap between two nodes may run in another
    order there: that moves no device memory (only reloads allocate, only in backward)."""
    ours, theirs = passes.landings()
    result = []
    for name in passes.layers:
        for step, a, b in zip(STEP_NAMES, ours[name], theirs[name], strict=True):
            if a == b:
                continue
            if step == "free" and passes.refused is not None:
                key = "defer 0"
            else:
                key = "unexplained"
            result.append(OffloadMismatch(name, step, a, b, key))
    return result


def offload_passes(graph: JointGraph, policy: Policy | str) -> OffloadPasses:
    """Both offload passes, for the policy's prefetch/defer options, on the same graph:
    torch's remat pass run on the policy's decisions (offloads saved), then each pass on a
    copy, graph trainer's on the values the workbench's offloaded, tagged MUST_CPU_OFFLOAD
    again (torch's remat pass rewrites those tags to MUST_SAVE). Graph trainer runs its pass
    before its own remat pass; one graph keeps placement apart from the remat passes'
    differences, so the what-if can price each placement rule."""
    _registry()  # a clear error without torchtitan
    policy = policy if isinstance(policy, Policy) else Policy(policy)
    decisions = decide(graph, policy)
    saved = {
        name: tag._replace(policy=CheckpointPolicy.MUST_SAVE) if tag.offload else tag
        for name, tag in decisions.items()
    }
    base = remat(graph, saved).gm
    layer_of = {
        node.name: getattr(_origin(graph, node), "layer", None) for node in base.graph.nodes
    }
    ours = offload_pass(
        copy_graph_module(base),
        [name for name, tag in decisions.items() if tag.offload],
        lambda node: layer_of[node.name],
        policy.offload,
    )
    plan = ours.meta[OFFLOAD_META]
    offloaded = plan.names
    nodes = [node.name for node in base.graph.nodes]
    layers = {}
    for name, value in zip(offloaded, plan.values, strict=True):
        producer, reader = (
            layer_of[nodes[value.producer]],
            layer_of[nodes[value.first_backward_use]],
        )
        layers[name] = (producer, producer if reader is None else reader)
    theirs = copy_graph_module(base)
    for node in theirs.graph.nodes:
        node.meta.pop("recompute", None)
        module = getattr(_origin(graph, node), "module", "")
        node.meta["custom"] = {**(node.meta.get("custom") or {}), MODULE_FQN: module}
        if node.name in offloaded:
            node.meta["recompute"] = CheckpointPolicy.MUST_CPU_OFFLOAD
    refused = _graph_trainer_offload(theirs, policy.offload)
    for node in theirs.graph.nodes:
        if node.name not in layer_of and not is_offload_node(node):
            node.meta[REPLAYED_VIEW] = True
    return OffloadPasses(ours, theirs, layers, policy.offload, refused)


def _graph_trainer_offload(gm: fx.GraphModule, options: OffloadOptions) -> str | None:
    """Run `apply_cpu_offload_pass` on `gm`. With defer 0 its forward wait stays right after
    the copy but names the last forward reader as `last_use_of_storage`, and its closing
    lint refuses the graph: return that error, the graph sorted as graph trainer's
    bucketing pass sorts (`_stable_topological_sort`, which puts the wait right after that
    reader)."""
    from torch._dynamo.graph_deduplication import _stable_topological_sort
    from torchtitan.experiments.graph_trainer.cpu_offload import apply_cpu_offload_pass

    try:
        with _torchtitan_log(logging.WARNING):
            apply_cpu_offload_pass(
                gm,
                prefetch_lookahead=options.prefetch_layers,
                defer_n_layers=options.defer_layers,
            )
    except RuntimeError as err:
        if "topologically ordered" not in str(err):
            raise
        _stable_topological_sort(gm.graph, {})
        gm.graph.lint()
        gm.recompile()
        return str(err).splitlines()[0]
    return None


def _origin(graph: JointGraph, node: fx.Node) -> NodeInfo | None:
    """The traced node a node of a rematerialized graph comes from (recomputed copies
    carry their original's `ORIGIN_KEY`; the output node has none)."""
    origin = node.meta.get(ORIGIN_KEY)
    return graph.nodes.get(origin[1]) if origin is not None else None


def _steps(gm: fx.GraphModule, offloaded: list[str]) -> dict[str, OffloadSteps]:
    """For each offloaded node, the node of the rematerialized graph each of its steps
    follows in `gm`: the copy reads the node, the free waits on the copy, the reload reads
    the free's host tensor and the wait reads the reload."""
    follows: dict[fx.Node, str] = {}
    last = ""
    for node in gm.graph.nodes:
        if is_offload_node(node) or node.meta.get(REPLAYED_VIEW):
            follows[node] = last
        else:
            last = node.name

    def step(node: fx.Node, op: str) -> fx.Node:
        return next(u for u in node.users if is_offload_node(u) and u.target._opname == op)  # type: ignore[union-attr]

    by_name = {n.name: n for n in gm.graph.nodes}
    result = {}
    for name in offloaded:
        copy = step(by_name[name], "offload")
        free = step(copy, "wait_tensor")
        reload = step(free, "reload")
        wait = step(reload, "wait_tensor")
        result[name] = OffloadSteps(*(follows[s] for s in (copy, free, reload, wait)))
    return result
