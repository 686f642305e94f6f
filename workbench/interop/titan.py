"""Parity with torchtitan's graph trainer: its own memory-policy pass run on a workbench graph.

Entry points: `graph_trainer_tags(graph, memory_policy)` (torchtitan's tags per forward node),
`graph_trainer_log(graph, memory_policy)` (its activation-memory log),
`compare(graph, policy, memory_policy=None) -> list[Mismatch]` against `decide`, and
`DIFFERENCES` (where the workbench's presets differ, and why) with `explained_by(mismatch, preset)`.
Its offload pass against the workbench's: `workbench.interop.titan_offload`.
"""

from __future__ import annotations

import importlib
import io
import logging
import types
from dataclasses import dataclass
from typing import Any, Literal

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models.torchtitan import torchtitan_log
from workbench.decide.decider import decidable, decide
from workbench.decide.policy import Policy
from workbench.decide.presets import (
    COMPUTE_INTENSIVE_OPS,
    GRAPH_TRAINER,
    MEMORY_POLICIES,
    PRESETS,
    TITAN_NOT_IN_LAYERS,
    TITAN_SAVE_OPS,
    preset_record,
    titan_layer,
)
from workbench.decide.tags import OFFLOAD, RECOMPUTE, Tag, Why
from workbench.errors import WorkbenchError
from workbench.rewrite.remat import copy_graph_module

__all__ = [
    "CPU_FORCED",
    "DIFFERENCES",
    "MEMORY_POLICIES",
    "MODULE_FQN",
    "NOT_REPRODUCED",
    "WRITTEN_FORCED",
    "Difference",
    "Mismatch",
    "compare",
    "counterpart",
    "differences_of",
    "differences_table",
    "explained_by",
    "graph_trainer_log",
    "graph_trainer_registry",
    "graph_trainer_tags",
]

# The harness runs graph trainer's `MEMORY_POLICIES` (for `sac_and_offload` its tagging here;
# its offload pass in `titan_offload.offload_passes`, which rewrites a graph without a
# stream); `MODULE_FQN` is the key its passes read the module path from
# (`common_utils._MODULE_FQN`).
TITAN_OFFLOAD_BUDGET_GB = 100.0  # graph trainer's default `cpu_offload_budget_gb`
MODULE_FQN = "module_fqn"
_POLICY_MODULE = "torchtitan.experiments.graph_trainer.memory_policy"


def graph_trainer_registry() -> dict[str, Any]:
    """Graph trainer's memory-policy passes by name; without torchtitan, a `WorkbenchError`
    saying how to install it."""
    try:
        importlib.import_module(_POLICY_MODULE)  # registers the policies
        registry = importlib.import_module("torchtitan.experiments.graph_trainer.registry")
    except ImportError as err:
        raise WorkbenchError(
            f"the graph trainer parity check needs torchtitan ({err}): "
            "pip install -e '.[torchtitan]'"
        ) from None
    return registry.MEMORY_POLICY_REGISTRY  # type: ignore[no-any-return]


def _config(memory_policy: str, fsdp_reshard: bool = True) -> Any:
    """The slice of graph trainer's config its memory-policy passes read: FSDP reshards after
    forward (`fsdp_reshard_after_forward` "default", without pipeline parallelism) or not
    ("never")."""
    from torchtitan.config import ParallelismConfig

    reshard = "default" if fsdp_reshard else "never"
    return types.SimpleNamespace(
        parallelism=ParallelismConfig(fsdp_reshard_after_forward=reshard),
        compile=types.SimpleNamespace(
            memory_policy=memory_policy, cpu_offload_budget_gb=TITAN_OFFLOAD_BUDGET_GB
        ),
    )


def _tagged_copy(
    graph: JointGraph, memory_policy: str, fsdp_reshard: bool = True
) -> fx.GraphModule:
    """A copy of the graph tagged by graph trainer's registered pass for `memory_policy`
    (with `fsdp_reshard` as its `_config`), its nodes carrying what the pass reads:
    `meta["autograd_backward"]` (set by tracing) and `meta["custom"]["module_fqn"]`: graph
    trainer's own, where the graph was traced with its module annotations
    (`annotate_module_fqns`, its annotated loss), copied to backward nodes by its tracer's
    `_copy_fwd_metadata_to_bw_nodes`; else the workbench's module path, as those would set
    it."""
    if memory_policy not in MEMORY_POLICIES:
        raise WorkbenchError(
            f"unknown graph trainer memory policy {memory_policy!r}; choose one of "
            f"{', '.join(MEMORY_POLICIES)}"
        )
    registry = graph_trainer_registry()
    gm = copy_graph_module(graph.gm)
    own = any(MODULE_FQN in (node.meta.get("custom") or {}) for node in gm.graph.nodes)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        custom = dict(node.meta.get("custom") or {})
        if not own:
            custom[MODULE_FQN] = graph.nodes[node.name].module
        node.meta["custom"] = custom
    if own:
        from torchtitan.experiments.graph_trainer.make_fx_tracer import (
            _copy_fwd_metadata_to_bw_nodes,
        )

        _copy_fwd_metadata_to_bw_nodes(gm)
    with torchtitan_log(logging.WARNING):  # its per-layer summary is for training logs
        registry[memory_policy](gm, config=_config(memory_policy, fsdp_reshard))
    return gm


def graph_trainer_tags(
    graph: JointGraph, memory_policy: str, fsdp_reshard: bool = True
) -> dict[str, CheckpointPolicy | None]:
    """torchtitan's tag (None: untagged) for every forward and loss node of `graph`, from
    graph trainer's own pass on a copy of it (FSDP resharding after forward or not); the
    graph itself is not changed."""
    gm = _tagged_copy(graph, memory_policy, fsdp_reshard)
    return {
        node.name: node.meta.get("recompute")
        for node in gm.graph.nodes
        if decidable(graph.nodes[node.name])
    }


def graph_trainer_log(graph: JointGraph, memory_policy: str, fsdp_reshard: bool = True) -> str:
    """The activation-memory table graph trainer logs after tagging `graph` with its own
    `memory_policy` (`log_activation_memory_policy`, captured from its debug log)."""
    from torchtitan.experiments.graph_trainer.log_activation_memory_policy import (
        log_activation_memory_policy,
    )

    gm = _tagged_copy(graph, memory_policy, fsdp_reshard)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    with torchtitan_log(logging.DEBUG, handler):
        log_activation_memory_policy(gm)
    text = stream.getvalue()
    return text[text.index("\n") + 1 :].rstrip("\n")  # without its one-line heading


@dataclass(frozen=True)
class Mismatch:
    """A node the workbench saves where graph trainer recomputes it, or the reverse: graph
    trainer's tag (None: untagged) and the workbench's `Tag`, with its reason (`Tag.why`)."""

    node: str
    op: str
    module: str
    graph_trainer: CheckpointPolicy | None
    tag: Tag

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "op": self.op,
            "module": self.module,
            "graph_trainer": self.graph_trainer.name if self.graph_trainer else "untagged",
            "workbench": self.tag.policy.name,
            "reason": self.tag.reason,
        }


def compare(
    graph: JointGraph, policy: Policy | str, memory_policy: str | None = None
) -> list[Mismatch]:
    """Nodes where `decide(graph, policy)` and graph trainer's `memory_policy` (default: the
    preset's `counterpart`; run with the policy's FSDP choice as its
    `fsdp_reshard_after_forward`, "default" or "never") disagree on save vs recompute vs
    offload, in graph order."""
    policy = policy if isinstance(policy, Policy) else Policy(policy)
    memory_policy = memory_policy or counterpart(policy.preset) or policy.preset
    theirs = graph_trainer_tags(graph, memory_policy, policy.fsdp_reshard)
    ours = decide(graph, policy)
    return [
        Mismatch(
            node=name,
            op=graph.nodes[name].op,
            module=graph.nodes[name].module,
            graph_trainer=theirs.get(name),
            tag=tag,
        )
        for name, tag in ours.items()
        if (theirs.get(name) in RECOMPUTE) != tag.recompute
        or (theirs.get(name) in OFFLOAD) != tag.offload
    ]


# --- where the workbench's own presets differ from graph trainer's ------------------------


@dataclass(frozen=True)
class Difference:
    """One rule where the workbench's `default` / `full` / `eager` decide otherwise than
    graph trainer's memory policy of the same name (which the `titan-*` presets follow).
    The presets it applies to are read off the preset records (`presets`): those that list
    its key (`Preset.differences`), every preset, or every preset that offloads."""

    key: str
    rule: str
    workbench: str
    graph_trainer: str
    why: str
    scope: Literal["listed", "all", "offloading"] = "listed"

    @property
    def presets(self) -> tuple[str, ...]:
        """The presets it applies to, in the registry's order."""
        if self.scope == "all":
            return tuple(PRESETS)
        if self.scope == "offloading":
            return tuple(name for name, p in PRESETS.items() if p.offloads is not None)
        return tuple(name for name, p in PRESETS.items() if self.key in p.differences)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "rule": self.rule,
            "presets": list(self.presets),
            "workbench": self.workbench,
            "graph_trainer": self.graph_trainer,
            "why": self.why,
        }


# The one table of differences: docs/torchtitan.md's table is `differences_table()` verbatim (a
# test holds them together), `policy explain` prints the rows of a preset, and
# `explained_by` names the row behind each mismatch `compare` finds.
DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        key="in-place",
        rule="in-place ops (`add_` in RMSNorm)",
        workbench="saved, whatever the preset asks",
        graph_trainer="tagged like any op (recomputed)",
        why="a recompute applies the mutation to its input a second time; the workbench "
        "never risks it, graph trainer does not check (harmless in RMSNorm, whose `add_` "
        "mutates the fresh `mean` recomputed with it)",
    ),
    Difference(
        key="lm_head/loss",
        rule="`lm_head*` / `loss*` modules",
        workbench="tagged by the preset",
        graph_trainer="never tagged (saved): its `full` keeps `_log_softmax`",
        why="graph trainer skips the epilogue because a chunked loss splits backward into "
        "regions its remat pass cannot handle; the workbench lets a policy choose there",
    ),
    Difference(
        key="layer boundary",
        rule="layer boundary",
        workbench="saved if a recomputed user is in any *other* layer",
        graph_trainer="saved only if it is in a *higher* layer (non-layer = -1)",
        why="both stop recomputation chaining across layers; graph trainer looks only "
        "forward in layer ids, so the last layer's output add feeding the final norm stays "
        "recomputed there",
    ),
    Difference(
        key="save list",
        rule="save list",
        workbench="`COMPUTE_INTENSIVE_OPS` (with `_grouped_mm`, CPU flash attention)",
        graph_trainer="its `_get_default_save_ops()` (convolutions, `_scaled_mm`, collectives)",
        why="the workbench saves MoE expert matmuls (`_grouped_mm`) as compute-intensive; "
        "graph trainer 0.3.0's list lacks them",
    ),
    Difference(
        key="eager outside layers",
        rule="`eager` outside the layers",
        workbench="everything saved",
        graph_trainer="matmuls counted on (every second one recomputed), the rest recomputed",
        why="eager SAC wraps only the layers, so autograd saves everything outside them; "
        "graph trainer applies its eager rule to the whole graph",
    ),
    Difference(
        key="eager addmm",
        rule="`eager` on a linear with a bias (`addmm`)",
        workbench="counted as a matmul: every second one recomputed",
        graph_trainer="not counted (its `mm_ops` are `mm` and `linear`), always saved",
        why="on GPT-2, BERT or ViT graph trainer's rule recomputes none of a block's matmuls; "
        "`titan-eager` does as it does",
    ),
    Difference(
        key="offload candidates",
        rule="what `offload` / `sac_and_offload` offload",
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
    workbench="saved: it writes a storage that is not recomputed, reads one forward writes "
    "in place after it, or could be replayed out of order with a recomputed write",
    graph_trainer="recomputed as its policy asks",
    why="the recompute would compute another value than forward did, so loss and gradients "
    "would differ from eager's; with graph trainer's own presets this happens only on models "
    "that write a saved activation in place (the workbench's reference models do not)",
    scope="all",
)

# Graph trainer rules the `titan-*` presets do not reproduce yet.
NOT_REPRODUCED: tuple[str, ...] = (
    "SymInt outputs saved: the workbench traces static shapes, so none occur",
    "a wait_tensor takes its collective's tag: here the preset's rule gives both the same tag "
    "on the graphs traced so far, but nothing enforces it",
)


def counterpart(preset: str) -> str | None:
    """Graph trainer's memory policy the preset follows (`Preset.counterpart`): of the same
    name (`titan-eager` -> `eager`) or not (`offload` -> `sac_and_offload`).

    >>> counterpart("titan-eager"), counterpart("full"), counterpart("none")
    ('eager', 'full', None)
    >>> counterpart("offload"), counterpart("titan-sac_and_offload")
    ('sac_and_offload', 'sac_and_offload')
    """
    return preset_record(preset).counterpart


def differences_of(preset: str) -> list[Difference]:
    """The rows of `DIFFERENCES` for a workbench preset (those its record lists); none for
    graph trainer's presets."""
    listed = preset_record(preset).differences
    return [d for d in DIFFERENCES if d.key in listed]


def differences_table(
    rows: tuple[Difference, ...] = DIFFERENCES, theirs: str = "graph trainer (`titan-*`)"
) -> str:
    """`DIFFERENCES` (or `titan_offload.OFFLOAD_PLACEMENT`, with graph trainer's column named
    `theirs`) as the Markdown table docs/torchtitan.md shows."""
    lines = [
        f"| rule | presets | workbench | {theirs} | why |",
        "|---|---|---|---|---|",
    ]
    for d in rows:
        presets = " / ".join(f"`{p}`" for p in d.presets)
        lines.append(f"| {d.rule} | {presets} | {d.workbench} | {d.graph_trainer} | {d.why} |")
    return "\n".join(lines)


def explained_by(mismatch: Mismatch, preset: str) -> str:
    """The key of the `DIFFERENCES` row (or `CPU_FORCED`, `WRITTEN_FORCED`) behind a mismatch
    of `preset`'s decisions, read off the workbench's reason (`Tag.why`); `selector` /
    `override` for a policy's own requests, `unexplained` else."""
    why = mismatch.tag.why
    if why is Why.RANDOM:
        return CPU_FORCED.key
    if why is Why.WRITTEN_INPUT:
        return WRITTEN_FORCED.key
    if why in (Why.SELECTOR, Why.OVERRIDE):
        return why.value
    record = preset_record(preset)
    if record.dialect == GRAPH_TRAINER:
        return "unexplained"
    if why is Why.MUTATION:
        return "in-place"
    if mismatch.graph_trainer is None:
        return "lm_head/loss"
    if why is Why.LAYER_BOUNDARY:
        return "layer boundary"
    outside = titan_layer(mismatch.module) == TITAN_NOT_IN_LAYERS
    if "eager outside layers" in record.differences and outside:
        return "eager outside layers"
    if preset == "eager" and mismatch.op == "aten.addmm.default":
        return "eager addmm"
    if (mismatch.op in COMPUTE_INTENSIVE_OPS) != (mismatch.op in TITAN_SAVE_OPS):
        return "save list"
    offloads = CheckpointPolicy.MUST_CPU_OFFLOAD
    if "offload candidates" in record.differences and (mismatch.graph_trainer is offloads) != (
        mismatch.tag.policy is offloads
    ):
        return "offload candidates"
    return "unexplained"
