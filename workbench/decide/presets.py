"""The named presets: rule factories `name -> () -> rule(facts) -> CheckpointPolicy`, the
workbench's own and torchtitan graph trainer's (`titan-*`), node for node.

Entry points: `@register_preset(name)`, the decorator that fills the registry `PRESETS` (and
`TITAN_PRESETS`, `OFFLOAD_PRESETS` from the name and its `offloads`), and `preset_rule(name)`.
"""

from __future__ import annotations

from collections.abc import Callable

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


# --- the registry: preset name -> rule factory ------------------------------------------

Rule = Callable[[OpFacts], CheckpointPolicy]
RuleFactory = Callable[[], Rule]

# Every preset, in the order registered (the order every list of presets shows): name ->
# a factory of fresh rules (a rule may count the nodes it sees, so one per graph or run).
PRESETS: dict[str, RuleFactory] = {}
# Graph trainer's presets, node for node: the `titan-` ones.
TITAN_PRESETS: dict[str, RuleFactory] = {}
TITAN_PREFIX = "titan-"
# Presets that offload what their base preset saves -> that base preset.
OFFLOAD_PRESETS: dict[str, str] = {}


def register_preset(name: str, offloads: str | None = None) -> Callable[[RuleFactory], RuleFactory]:
    """Register a rule factory as preset `name`; its docstring is the rule's description
    (`policy explain` prints it). `offloads`: the preset whose saves this one offloads.
    Names starting `titan-` are graph trainer's presets (`TITAN_PRESETS`)."""

    def register(factory: RuleFactory) -> RuleFactory:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} is registered twice")
        PRESETS[name] = factory
        if name.startswith(TITAN_PREFIX):
            TITAN_PRESETS[name] = factory
        if offloads is not None:
            OFFLOAD_PRESETS[name] = offloads
        return factory

    return register


def preset_rule(name: str) -> Rule:
    """A fresh rule of the preset `name`; an unknown name raises, listing the presets.

    >>> preset_rule("defualt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown preset 'defualt'; available: none, full, default, eager, offload, ...
    """
    factory = PRESETS.get(name)
    if factory is None:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return factory()


# --- the workbench's presets --------------------------------------------------------------


@register_preset("none")
def _save_all() -> Rule:
    """Keep every activation (no activation checkpointing)."""
    return lambda facts: CheckpointPolicy.PREFER_SAVE


@register_preset("full")
def _recompute_all() -> Rule:
    """Recompute every activation that may be recomputed."""
    return lambda facts: CheckpointPolicy.PREFER_RECOMPUTE


def _save_listed(ops: frozenset[str], save: CheckpointPolicy) -> Rule:
    """`save` for the ops in `ops`, PREFER_RECOMPUTE for the rest."""

    def rule(facts: OpFacts) -> CheckpointPolicy:
        return save if facts.op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return rule


@register_preset("default")
def _save_compute_intensive() -> Rule:
    """Save the compute-intensive ops (torchtitan's save list), recompute the rest."""
    return _save_listed(COMPUTE_INTENSIVE_OPS, CheckpointPolicy.PREFER_SAVE)


@register_preset("eager")
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


@register_preset("offload", offloads="default")
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


@register_preset("titan-default")
def _titan_default() -> Rule:
    """graph trainer `default`: MUST_SAVE its save list, PREFER_RECOMPUTE the rest."""
    return _save_listed(TITAN_SAVE_OPS, CheckpointPolicy.MUST_SAVE)


@register_preset("titan-full")
def _titan_full() -> Rule:
    """graph trainer `full`: MUST_RECOMPUTE everything but random ops (MUST_SAVE)."""

    def rule(facts: OpFacts) -> CheckpointPolicy:
        if facts.random:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE

    return rule


@register_preset("titan-eager")
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


@register_preset("titan-sac_and_offload", offloads="titan-default")
def _titan_sac_and_offload() -> Rule:
    """graph trainer `sac_and_offload`: its `default`, then MUST_CPU_OFFLOAD on saved,
    contiguous, non-view tensors of at least 4 KiB in the layers but the last, largest first
    within the budget (`tag_all_offloadable_activations`)."""
    return _titan_default()
