"""The named presets: one record per preset (`Preset`: its rule factory
`() -> rule(facts) -> CheckpointPolicy`, its dialect, what it offloads, graph trainer's memory
policy it maps to and where it differs), the workbench's own and graph trainer's, node for node.

Entry points: `@register_preset(name, ...)`, the decorator that fills the registry `PRESETS`
(name -> `Preset`), `preset_record(name)` and `preset_rule(name)`; `DIALECTS` (how each dialect
reads layers, boundaries and offloads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

from torch.utils.checkpoint import CheckpointPolicy

from workbench.decide.facts import MATMUL_OPS, OpFacts

# Compute-intensive ops torchtitan saves by default (its `_save_list`), as op names.
COMPUTE_INTENSIVE_OPS: frozenset[str] = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.linear.default",
        "aten._grouped_mm.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten.max.default",
        "aten.topk.default",
        # communication torchtitan's save list also keeps, so backward does not redo it
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_to_all_single.default",
    }
)


# --- dialects: whose rules decide a preset's tags -----------------------------------------

# `workbench`: the workbench's own steps (`engine.STEPS`); `graph-trainer`: torchtitan graph
# trainer's `tag_sac_policy`, node for node (`engine.TITAN_STEPS`).
Dialect = Literal["workbench", "graph-trainer"]
WORKBENCH: Dialect = "workbench"
GRAPH_TRAINER: Dialect = "graph-trainer"

# Graph trainer's `--compile.memory_policy` choices (torchtitan 0.3.0, and its main branch at
# the snapshot `interop.torchtitan_options` names).
MEMORY_POLICIES: tuple[str, ...] = ("default", "full", "eager", "sac_and_offload")


class DialectRules(NamedTuple):
    """How a dialect reads the graph where presets of it differ by more than their rule: the
    layer a node counts in (None outside the layers), the layer-boundary rule and the order
    it walks the graph in, how many layers a graph needs to have a last one (never
    offloaded), and whether offloading checks storages (the workbench: random ops, in-place
    writes, aliases, returned values, and nothing backward does not read) or graph trainer's
    view-op list."""

    layer: Callable[[OpFacts], int | None]
    crosses: Callable[[OpFacts, OpFacts], bool]  # (node, user): the user is across a boundary
    walk_reversed: bool  # the layer-boundary walk: reverse graph order, or graph order
    min_layers: int  # a last layer exists with at least this many layers
    storage_checks: bool


TITAN_NOT_IN_LAYERS = -1


def titan_layer(module: str) -> int:
    """Graph trainer's layer id: N for `layers.N...`, -1 for every other module.

    >>> titan_layer("layers.3.attention"), titan_layer("norm"), titan_layer("model.layers.3")
    (3, -1, -1)
    """
    parts = module.split(".")
    if parts[0] == "layers" and len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1])
    return TITAN_NOT_IN_LAYERS


def _crosses_any_layer(f: OpFacts, user: OpFacts) -> bool:
    """A recomputed node feeding a recomputed user in another layer must be saved, or
    torch's remat pass would chain recomputation across layers."""
    return f.layer != user.layer


def _titan_layer_of(f: OpFacts) -> int | None:
    layer = titan_layer(f.module)
    return None if layer == TITAN_NOT_IN_LAYERS else layer


def _crosses_higher_layer(f: OpFacts, user: OpFacts) -> bool:
    """Graph trainer's boundary: only a user in a *higher* layer id (non-layer nodes: -1)."""
    return titan_layer(user.module) > titan_layer(f.module)


DIALECTS: dict[Dialect, DialectRules] = {
    WORKBENCH: DialectRules(
        layer=lambda f: f.layer,
        crosses=_crosses_any_layer,
        walk_reversed=True,  # a user's final tag is known before its inputs are judged
        min_layers=1,
        storage_checks=True,
    ),
    GRAPH_TRAINER: DialectRules(
        layer=_titan_layer_of,
        crosses=_crosses_higher_layer,
        walk_reversed=False,
        min_layers=2,  # graph trainer has no last layer with fewer than two
        storage_checks=False,
    ),
}

# --- the registry: preset name -> its record ---------------------------------------------

Rule = Callable[[OpFacts], CheckpointPolicy]
RuleFactory = Callable[[], Rule]


class Preset(NamedTuple):
    """Everything the workbench knows of one preset; every module reads it from here."""

    name: str
    # A factory of fresh rules (a rule may count the nodes it sees, so one per graph or run);
    # its docstring is the rule's description (`policy explain` prints it).
    rule: RuleFactory
    dialect: Dialect = WORKBENCH
    # The preset whose saves this one offloads (None: it offloads nothing by itself).
    offloads: str | None = None
    # Graph trainer's `--compile.memory_policy` it maps to (the torchtitan export), and how
    # the two differ, in a sentence; None: no memory policy says it.
    memory_policy: str | None = None
    memory_policy_note: str = ""
    # The keys of the rules where it decides otherwise than that memory policy
    # (`interop.titan.DIFFERENCES`, `CPU_FORCED`).
    differences: tuple[str, ...] = ()
    # Without reshard after forward, graph trainer's memory policy saves FSDP unshards
    # (`engine.titan_keep_unsharded`).
    keeps_unsharded: bool = False

    @property
    def description(self) -> str:
        """The rule's docstring on one line."""
        return " ".join((self.rule.__doc__ or "").split())

    @property
    def counterpart(self) -> str | None:
        """Graph trainer's memory policy it follows, where graph trainer has it.

        >>> preset_record("titan-eager").counterpart, preset_record("offload").counterpart
        ('eager', 'sac_and_offload')
        >>> preset_record("none").counterpart is None
        True
        """
        return self.memory_policy if self.memory_policy in MEMORY_POLICIES else None


# Every preset, in the order registered (the order every list of presets shows).
PRESETS: dict[str, Preset] = {}


def register_preset(
    name: str,
    *,
    dialect: Dialect = WORKBENCH,
    offloads: str | None = None,
    memory_policy: str | None = None,
    memory_policy_note: str = "",
    differences: tuple[str, ...] = (),
    keeps_unsharded: bool = False,
) -> Callable[[RuleFactory], RuleFactory]:
    """Register a rule factory as preset `name`, with the traits of its `Preset` record; its
    docstring is the rule's description. Every list of presets, `policy explain`, the exports
    and the explorer read the record: adding a preset is this one registration."""

    def register(factory: RuleFactory) -> RuleFactory:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} is registered twice")
        if dialect not in DIALECTS:
            raise ValueError(f"preset {name!r}: unknown dialect {dialect!r}; one of {DIALECTS}")
        PRESETS[name] = Preset(
            name=name,
            rule=factory,
            dialect=dialect,
            offloads=offloads,
            memory_policy=memory_policy,
            memory_policy_note=memory_policy_note,
            differences=differences,
            keeps_unsharded=keeps_unsharded,
        )
        return factory

    return register


def preset_record(name: str) -> Preset:
    """The record of preset `name`; an unknown name raises, listing the presets.

    >>> preset_record("defualt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown preset 'defualt'; available: none, full, default, eager, offload, ...
    """
    record = PRESETS.get(name)
    if record is None:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return record


def preset_rule(name: str) -> Rule:
    """A fresh rule of the preset `name`; an unknown name raises, listing the presets.

    >>> preset_rule("defualt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown preset 'defualt'; available: none, full, default, eager, offload, ...
    """
    return preset_record(name).rule()


def graph_trainer_preset(memory_policy: str) -> str | None:
    """The graph-trainer preset that is graph trainer's `memory_policy`, node for node.

    >>> graph_trainer_preset("eager"), graph_trainer_preset("none")
    ('titan-eager', None)
    """
    return next(
        (
            p.name
            for p in PRESETS.values()
            if p.dialect == GRAPH_TRAINER and p.memory_policy == memory_policy
        ),
        None,
    )


# --- the workbench's presets --------------------------------------------------------------

# Where every graph SAC preset of the workbench decides otherwise than graph trainer's
# (`interop.titan.DIFFERENCES`), and, where it saves what graph trainer recomputes on the
# CPU, `cpu-forced` (`interop.titan.CPU_FORCED`).
_GRAPH_SAC = ("in-place", "lm_head/loss", "layer boundary")
_SAVE_LIST = (*_GRAPH_SAC, "save list", "cpu-forced")


@register_preset(
    "none",
    memory_policy="none",
    memory_policy_note="the workbench's 'none' saves everything; no torchtitan version here "
    "has such a policy.",
)
def _save_all() -> Rule:
    """Keep every activation (no activation checkpointing)."""
    return lambda facts: CheckpointPolicy.PREFER_SAVE


@register_preset(
    "full",
    memory_policy="full",
    memory_policy_note="torchtitan tags MUST_RECOMPUTE, recomputes in-place ops and leaves "
    "modules named lm_head*/loss* untagged; the workbench saves in-place ops and also tags the "
    "output projection and loss (preset 'titan-full' is torchtitan's).",
    differences=_GRAPH_SAC,
)
def _recompute_all() -> Rule:
    """Recompute every activation that may be recomputed."""
    return lambda facts: CheckpointPolicy.PREFER_RECOMPUTE


def _save_listed(ops: frozenset[str], save: CheckpointPolicy) -> Rule:
    """`save` for the ops in `ops`, PREFER_RECOMPUTE for the rest."""

    def rule(facts: OpFacts) -> CheckpointPolicy:
        return save if facts.op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return rule


@register_preset(
    "default",
    memory_policy="default",
    memory_policy_note="torchtitan saves its own save list (MUST_SAVE, plus FSDP all-gathers "
    "without reshard-after-forward); the workbench saves COMPUTE_INTENSIVE_OPS (preset "
    "'titan-default' is torchtitan's).",
    differences=_SAVE_LIST,
)
def _save_compute_intensive() -> Rule:
    """Save the compute-intensive ops (torchtitan's save list), recompute the rest."""
    return _save_listed(COMPUTE_INTENSIVE_OPS, CheckpointPolicy.PREFER_SAVE)


@register_preset(
    "eager",
    memory_policy="eager",
    memory_policy_note="torchtitan also alternates matmuls outside the layers; the workbench "
    "keeps everything outside the layers (preset 'titan-eager' is torchtitan's).",
    differences=(*_SAVE_LIST, "eager outside layers", "eager addmm"),
)
def _eager_every_other_mm() -> Rule:
    """torchtitan's eager SAC rule: only layers are checkpointed, and within a layer every
    second matmul (`mm`, `linear`, and `addmm`: a linear with a bias) is recomputed;
    everything outside the layers is saved as autograd would."""
    compute_intensive = _save_compute_intensive()

    def rule(facts: OpFacts) -> CheckpointPolicy:
        if facts.layer is None:
            return CheckpointPolicy.PREFER_SAVE
        if facts.op in MATMUL_OPS and facts.matmul_index % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return compute_intensive(facts)

    return rule


@register_preset(
    "offload",
    offloads="default",
    memory_policy="sac_and_offload",
    memory_policy_note="torchtitan offloads on top of its own 'default' by its own rules (its "
    "view-op list instead of storages; random and in-place ops and saved nodes backward never "
    "reads are tagged too); the workbench offloads on top of its 'default' (preset "
    "'titan-sac_and_offload' is torchtitan's).",
    differences=(*_SAVE_LIST, "offload candidates"),
)
def _default_then_offload() -> Rule:
    """graph trainer's `sac_and_offload` on the workbench's rules: `default`, then every saved
    storage that may be offloaded (`offload_refusal`) is, largest first within the budget."""
    return _save_compute_intensive()


# --- torchtitan graph trainer's presets, node for node ---------------------------------
# As torchtitan 0.3.0 tags a joint graph (torchtitan/experiments/graph_trainer/
# memory_policy.py, `tag_sac_policy` with its default / full / eager policy functions):
# - its save list (`_get_default_save_ops()` on torch 2.13): no `_grouped_mm` and no CPU
#   flash attention, but convolutions, `_scaled_mm`, flex attention and collectives;
# - nodes of modules named `lm_head*` / `loss*` are never tagged (so they are saved), and
#   in-place ops are tagged like any other op (recomputed by `default` and `full`);
# - a getitem takes its parent's tag, whatever it is;
# - the layer-boundary rule runs in graph order and only fires when the recomputed user's
#   layer id is *higher*; its layer id is N for `layers.N...` and -1 for everything else;
# - `eager` counts matmuls in one running count that restarts when a new layer begins
#   (nodes outside the layers count on without restarting it), also outside the layers.
# Graph trainer also saves SymInt outputs (the workbench traces static shapes: none occur),
# makes wait_tensor follow its collective, and with fsdp_reshard_after_forward="never"
# (not its default without pipeline parallelism) saves FSDP unshards under `default`.

TITAN_SAVE_OPS: frozenset[str] = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.linear.default",
        "aten._scaled_mm.default",
        "aten.convolution.default",
        "aten.convolution_backward.default",
        "aten.upsample_bilinear2d.default",
        "aten.max.default",
        "aten.topk.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten._flash_attention_forward.default",
        "aten._efficient_attention_forward.default",
        "flex_attention",
        "inductor_compiled_code",
        "torch_attn._varlen_attn.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_to_all_single.default",
        "deepep.dispatch.default",
        "deepep.combine.default",
        "hybridep.dispatch.default",
        "hybridep.combine.default",
    }
)


TITAN_UNTAGGED_MODULES = ("lm_head", "loss")  # module path prefixes graph trainer skips
# What graph trainer's `eager` counts as a matmul (`mm_ops`): an `addmm` is saved, uncounted.
TITAN_MATMUL_OPS: frozenset[str] = frozenset({"aten.mm.default", "aten.linear.default"})

_NODE_FOR_NODE = (
    "the same tags node for node (workbench.decide.engine.decide_titan_ops), except random "
    "ops: the workbench saves them (torch's remat pass refuses to recompute them)."
)


@register_preset(
    "titan-default",
    dialect=GRAPH_TRAINER,
    memory_policy="default",
    memory_policy_note=_NODE_FOR_NODE,
    differences=("cpu-forced",),
    keeps_unsharded=True,
)
def _titan_default() -> Rule:
    """graph trainer `default`: MUST_SAVE its save list, PREFER_RECOMPUTE the rest."""
    return _save_listed(TITAN_SAVE_OPS, CheckpointPolicy.MUST_SAVE)


@register_preset(
    "titan-full", dialect=GRAPH_TRAINER, memory_policy="full", memory_policy_note=_NODE_FOR_NODE
)
def _titan_full() -> Rule:
    """graph trainer `full`: MUST_RECOMPUTE everything but random ops (MUST_SAVE)."""

    def rule(facts: OpFacts) -> CheckpointPolicy:
        if facts.random:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE

    return rule


@register_preset(
    "titan-eager",
    dialect=GRAPH_TRAINER,
    memory_policy="eager",
    memory_policy_note=_NODE_FOR_NODE,
    differences=("cpu-forced",),
)
def _titan_eager() -> Rule:
    """graph trainer `eager`: `default`, but every second matmul of the running count is
    PREFER_RECOMPUTE. Stateful: call it once per tagged node, in graph order."""
    default = _titan_default()
    count, current = 0, TITAN_NOT_IN_LAYERS

    def rule(facts: OpFacts) -> CheckpointPolicy:
        nonlocal count, current
        layer = titan_layer(facts.module)
        if layer not in (TITAN_NOT_IN_LAYERS, current):
            count, current = 0, layer
        if facts.op in TITAN_MATMUL_OPS:
            count += 1
            if facts.op in TITAN_SAVE_OPS and count % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return default(facts)

    return rule


@register_preset(
    "titan-sac_and_offload",
    dialect=GRAPH_TRAINER,
    offloads="titan-default",
    memory_policy="sac_and_offload",
    memory_policy_note=_NODE_FOR_NODE,
    differences=("cpu-forced",),
    keeps_unsharded=True,  # it runs `default`'s pass first
)
def _titan_sac_and_offload() -> Rule:
    """graph trainer `sac_and_offload`: its `default`, then MUST_CPU_OFFLOAD on saved,
    contiguous, non-view tensors of at least 4 KiB in the layers but the last, largest first
    within the budget (`tag_all_offloadable_activations`)."""
    return _titan_default()
