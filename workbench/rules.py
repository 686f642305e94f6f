"""The tagging rules: which forward ops of a joint graph are saved or recomputed, and why.

Entry points: `PRESETS` (name -> rule factory; the `titan-*` ones are torchtitan graph
trainer's, node for node), `op_facts(rows)`, `decide_ops(facts, ...)` for graph SAC (save,
recompute or CPU offload, with `offload_refusal` saying what may not be offloaded) and
`eager_tag(facts, ...)` for eager SAC's `policy_fn`.
"""

# This module imports only torch and the standard library: the exported `graph_pass` and
# `policy_fn` embed its source verbatim, so a training job runs these very rules and the
# workbench's `decide` cannot drift from what it exports. Records are NamedTuples, not
# dataclasses, so the embedded code also runs where it is exec'd outside `sys.modules`.

from __future__ import annotations

import collections
import enum
import fnmatch
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

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
ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"
WAIT = "_c10d_functional.wait_tensor.default"
# Ops whose tag is their input's: a getitem unpacks it, a wait_tensor ends its collective.
FOLLOWERS = frozenset({"getitem", WAIT})
# Matmuls, counted per layer forward (the `eager` preset recomputes every second one).
MATMUL_OPS: frozenset[str] = frozenset({"aten.mm.default", "aten.linear.default"})

RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
OFFLOAD = (CheckpointPolicy.PREFER_CPU_OFFLOAD, CheckpointPolicy.MUST_CPU_OFFLOAD)
# The three decisions a forward activation can have, and the tag each request writes.
DECISIONS = ("save", "recompute", "offload")
MUST = {
    "save": CheckpointPolicy.MUST_SAVE,
    "recompute": CheckpointPolicy.MUST_RECOMPUTE,
    "offload": CheckpointPolicy.MUST_CPU_OFFLOAD,
}
# Offload moves whole storages: smaller ones cost more in transfer overhead than they free
# (graph trainer's `_MIN_OFFLOAD_BYTES`).
MIN_OFFLOAD_BYTES = 4096

_LAYER_RE = re.compile(r"(?<=\.)\d+(?=\.|$)")


def layer_of(module: str) -> int | None:
    """Index of the repeated block a module path belongs to.

    >>> layer_of("layers.3.attention"), layer_of("norm")
    (3, None)
    """
    match = _LAYER_RE.search(module)
    return int(match.group()) if match else None


def layer_pattern(module: str) -> str:
    """The path shared by identical layers.

    >>> layer_pattern("layers.3.attention.wq")
    'layers.*.attention.wq'
    """
    return _LAYER_RE.sub("*", module, count=1)


def op_name(target: Any) -> str:
    """`aten.mm.default` for an OpOverload; a plain callable's name (`getitem`) otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def is_random(target: Any) -> bool:
    """Ops tagged nondeterministic_seeded: torch's remat pass cannot replay their RNG."""
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    )


def mutates(target: Any) -> bool:
    """In-place ops: a recomputed copy would apply the mutation twice."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def reads_until_wait(target: Any) -> bool:
    """Collectives that run asynchronously: they read their input until the `wait_tensor`
    on their output, not only when they are called (every `_c10d_functional` op but the
    wait itself)."""
    name = op_name(target)
    return name.startswith("_c10d_functional.") and name != WAIT


def module_matches(pattern: str, module: str) -> bool:
    """fnmatch per dotted component, `**` spans any number of components. Linear in the
    product of the component counts (no backtracking), whatever the pattern.

    >>> module_matches("layers.*.attention", "layers.3.attention")
    True
    >>> module_matches("**.wq", "layers.3.attention.wq"), module_matches("**", "")
    (True, True)
    """
    pattern_parts = pattern.split(".") if pattern else []
    parts = module.split(".") if module else []
    # matched[j]: pattern_parts[i:] matches parts[j:], computed from the last component back.
    matched = [False] * len(parts) + [True]
    for component in reversed(pattern_parts):
        after = matched
        matched = [False] * (len(parts) + 1)
        for j in range(len(parts), -1, -1):
            if component == "**":
                matched[j] = after[j] or (j < len(parts) and matched[j + 1])
            else:
                matched[j] = (
                    j < len(parts) and after[j + 1] and fnmatch.fnmatchcase(parts[j], component)
                )
    return matched[0]


class Why(enum.Enum):
    """Why a node has its tag. The last four are forced (`forced`): no request can undo them.
    They are saves in graph SAC; eager SAC recomputes in-place ops and what they write."""

    PRESET = "preset"
    SELECTOR = "selector"
    OVERRIDE = "override"
    FSDP = "fsdp"  # the policy's reshard-after-forward choice on a parameter all-gather
    PARTITIONER = "partition"  # a partitioner's choice replayed as tags (the studies)
    UNTAGGED = "untagged"  # left without a tag, as torchtitan's graph trainer leaves it
    # An offload request the rules cannot grant (a view, the last layer, over the budget,
    # ...): saved instead, `detail` says why. Not forced: the node may still be recomputed.
    OFFLOAD_REFUSED = "offload refused"
    RANDOM = "random op"
    MUTATION = "mutates its input"
    LAYER_BOUNDARY = "layer boundary"
    # A recompute that would not see what forward saw: it writes a storage that is not
    # recomputed, reads one written after it, or could be replayed out of order with a
    # write (`save_written_inputs`; `detail` names the nodes).
    WRITTEN_INPUT = "written in place"

    @property
    def forced(self) -> bool:
        return self in (Why.RANDOM, Why.MUTATION, Why.LAYER_BOUNDARY, Why.WRITTEN_INPUT)


_FORCED_WORDS = {
    Why.RANDOM: " (nondeterministic_seeded); torch's remat pass cannot replay RNG",
    Why.MUTATION: "; recomputing would apply the mutation twice",
    Why.LAYER_BOUNDARY: " (recomputed user {} is in another layer)",
    Why.WRITTEN_INPUT: " ({})",
}


class OffloadOptions(NamedTuple):
    """How offloaded activations move (graph trainer's `cpu_offload_*` options).

    `budget_bytes`: host bytes the offloaded storages may take, chosen largest first (None:
    no limit). `prefetch_layers`: the reload starts this many layers before the producer's
    layer in backward, never after the first backward reader (0: right before it), as graph
    trainer counts. `defer_layers`: the device copy is freed at the end of the layer this
    many layers after the producer's in forward (0: right after its last forward reader,
    which torchtitan 0.3.0's pass cannot do)."""

    budget_bytes: int | None = None
    prefetch_layers: int = 1
    defer_layers: int = 0


class Storage(NamedTuple):
    """What offloading needs to know of a node's output: a single tensor's bytes, whether it
    is contiguous and owns its storage (not a view or alias of an input), whether the step
    returns it (or a view of it) and whether forward writes into it in place later."""

    bytes: int
    contiguous: bool
    fresh: bool
    output: bool
    mutated: bool  # a forward op writes into the storage in place


class Tag(NamedTuple):
    """A node's checkpoint policy and why; `detail` is the preset name, the selector, the
    override key or the boundary-crossing user."""

    policy: CheckpointPolicy
    why: Why
    detail: str = ""

    @property
    def recompute(self) -> bool:
        return self.policy in RECOMPUTE

    @property
    def offload(self) -> bool:
        return self.policy in OFFLOAD

    @property
    def action(self) -> str:
        """`save`, `recompute` or `offload`: the decision in one word."""
        return "recompute" if self.recompute else "offload" if self.offload else "save"

    @property
    def forced(self) -> bool:
        return self.why.forced

    @property
    def explanation(self) -> str:
        """Why, in words: `preset:eager`, `selector:S`, `layer boundary (recomputed user ...)`,
        `offload refused: ...`."""
        if self.forced:
            return self.why.value + _FORCED_WORDS[self.why].format(self.detail)
        if self.why is Why.OFFLOAD_REFUSED:
            return f"{self.why.value}: {self.detail}"
        return f"{self.why.value}:{self.detail}"

    @property
    def reason(self) -> str:
        """`explanation`, marked `forced:` for the decisions no request can change."""
        return f"forced:{self.explanation}" if self.forced else self.explanation


class OpFacts(NamedTuple):
    """What the rules see of one forward or loss node."""

    name: str
    module: str
    op: str
    layer: int | None
    occurrence: int  # occurrences of (module, op) before this one
    matmul_index: int  # matmuls of this layer so far, this one included (from 1)
    random: bool
    mutation: bool
    parent: str | None  # the multi-output node a getitem unpacks, the collective a wait ends
    users: tuple[str, ...]
    key: str  # `layers.*.attention::aten.mm.default#0`: the op in every identical layer
    layer_key: str  # `layers.3.attention::aten.mm.default#0`: the op in this layer only
    # The FSDP all-gather of the parameter unshard chain this node is part of (cast ->
    # all_gather -> wait -> view ..., computed from graph inputs alone): one decision, the
    # gather's. Its own name for the gather itself; None off such chains.
    gather: str | None = None
    # Its output storage, for the offload rules; None when it returns no single tensor
    # (and in eager SAC, which cannot offload).
    storage: Storage | None = None
    # What the in-place rule (`save_written_inputs`) reads: every input node (graph inputs
    # included), the input whose storage the output shares (a view, an in-place op's
    # `self`, a getitem's tuple; None for a new storage) and the inputs it writes in place.
    inputs: tuple[str, ...] = ()
    alias: str | None = None
    writes: tuple[str, ...] = ()


# (name, module, op, random, mutation, parent, users, gather[, storage[, inputs, alias,
# writes]]), in graph order: eager SAC's rows stop after `gather`.
Row = tuple[Any, ...]


class OpCounter:
    """Counts ops per module and matmuls per layer, in the order they run: the graph's order
    for graph SAC, dispatch order inside one layer forward for eager SAC."""

    def __init__(self) -> None:
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()
        self.matmuls: collections.Counter[int | None] = collections.Counter()

    def facts(self, row: Row) -> OpFacts:
        name, module, op, random, mutation, parent, users, gather = row[:8]
        storage = row[8] if len(row) > 8 else None  # rows without it: nothing to offload
        inputs, alias, writes = row[9:12] if len(row) > 9 else ((), None, ())
        layer = layer_of(module)
        if op in MATMUL_OPS:
            self.matmuls[layer] += 1
        k = self.seen[(module, op)]
        self.seen[(module, op)] += 1
        key, layer_key = f"{layer_pattern(module)}::{op}#{k}", f"{module}::{op}#{k}"
        return OpFacts(
            name, module, op, layer, k, self.matmuls[layer], random, mutation, parent, users,
            key, layer_key, gather, storage, inputs, alias, writes,
        )  # fmt: skip


def op_facts(rows: Iterable[Row]) -> list[OpFacts]:
    """Facts of the forward and loss nodes of a graph, counted in graph order."""
    counter = OpCounter()
    return [counter.facts(row) for row in rows]


def storage_keys(node: torch.fx.Node) -> set[Any]:
    """The storages behind a node's output tensors (one per tensor; views share their
    base's, in fake tensors as in real ones)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    return {StorageWeakRef(v.untyped_storage()) for v in values if isinstance(v, torch.Tensor)}


def storage_of(node: torch.fx.Node) -> Storage | None:
    """The offload facts of `node`'s output (None unless it is a single tensor), from the
    fake tensors in `meta["val"]`: aliases share their base's storage there."""
    value = node.meta.get("val")
    if node.op != "call_function" or not isinstance(value, torch.Tensor):
        return None
    (key,) = storage_keys(node)
    try:
        contiguous, size = bool(value.is_contiguous()), int(value.numel() * value.element_size())
    except Exception:  # symbolic shapes: graph trainer assumes contiguous and large enough
        contiguous, size = True, MIN_OFFLOAD_BYTES
    output = mutated = False
    todo, seen = [node], {node}
    while todo:  # forward nodes sharing the storage: views, getitems, in-place ops
        for user in todo.pop().users:
            if user.op == "output":
                output = True
            elif user not in seen and not user.meta.get("autograd_backward"):
                if key not in storage_keys(user):
                    continue
                seen.add(user)
                todo.append(user)
                mutated = mutated or mutates(user.target)
    fresh = not any(key in storage_keys(x) for x in node.all_input_nodes)
    return Storage(size, contiguous, fresh, output, mutated)


def fx_rows(gm: torch.fx.GraphModule, module_of: Callable[[torch.fx.Node], str]) -> list[Row]:
    """Rows of the forward and loss call nodes of a joint graph: every node that is neither
    a placeholder, the output, nor marked `meta["autograd_backward"]`."""
    gathers = unshard_chains(gm)
    rows: list[Row] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node.meta.get("autograd_backward"):
            continue
        target = node.target if node.op == "call_function" else None
        op = op_name(target) if target is not None else node.op
        parent = node.args[0] if op in FOLLOWERS and node.args else None
        rows.append(
            (
                node.name,
                module_of(node),
                op,
                is_random(target),
                mutates(target),
                parent.name if isinstance(parent, torch.fx.Node) else None,
                tuple(user.name for user in node.users),
                gathers.get(node.name),
                storage_of(node),
                tuple(x.name for x in node.all_input_nodes),
                alias_input(node),
                written_inputs(node),
            )  # fmt: skip
        )
    return rows


def alias_input(node: torch.fx.Node) -> str | None:
    """The input whose storage `node`'s output shares (a view of it, an in-place op on it, a
    getitem of its tuple), or None when the output is a new storage."""
    keys = storage_keys(node)
    if keys:
        for x in node.all_input_nodes:
            if keys & storage_keys(x):
                return x.name
    return None


def written_inputs(node: torch.fx.Node) -> tuple[str, ...]:
    """The inputs `node` writes in place: its schema's `Tensor(a!)` arguments."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return ()
    written: list[str] = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else None)
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.fx.Node):
                written.append(v.name)
    return tuple(written)


def unshard_chains(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Forward node -> the all-gather of its FSDP unshard chain: nodes computed from graph
    inputs alone (no activation flows in) that lead to or come from an all-gather, the
    parameter's cast -> all_gather -> wait -> views (TP's all-gathers of activations are
    not on such chains). Below a gather the chain takes only nodes fed by it alone: the
    embedding lookup (gathered table and token input) starts the activations."""
    from_inputs: dict[torch.fx.Node, str | None] = {}  # input-only node -> its gather so far
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("autograd_backward"):
            continue
        inputs = node.all_input_nodes
        if not inputs or not all(x.op == "placeholder" or x in from_inputs for x in inputs):
            continue
        above = {from_inputs.get(x) for x in inputs}
        if above - {None} and len(above) > 1:
            continue  # a gathered parameter meeting data or another parameter: compute
        from_inputs[node] = (
            node.name if op_name(node.target) == ALL_GATHER else next(iter(above), None)
        )
    for node in reversed(list(from_inputs)):  # the casts and views before a gather
        if from_inputs[node] is None:
            below = [from_inputs[u] for u in node.users if from_inputs.get(u)]
            from_inputs[node] = next(iter(below), None)
    return {node.name: gather for node, gather in from_inputs.items() if gather is not None}


# --- presets: rule(facts) -> CheckpointPolicy -------------------------------------------

Rule = Callable[[OpFacts], CheckpointPolicy]


def _save_all() -> Rule:
    """Keep every activation (no activation checkpointing)."""
    return lambda facts: CheckpointPolicy.PREFER_SAVE


def _recompute_all() -> Rule:
    """Recompute every activation that may be recomputed."""
    return lambda facts: CheckpointPolicy.PREFER_RECOMPUTE


def _save_listed(ops: frozenset[str], save: CheckpointPolicy) -> Rule:
    """`save` for the ops in `ops`, PREFER_RECOMPUTE for the rest."""

    def rule(facts: OpFacts) -> CheckpointPolicy:
        return save if facts.op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return rule


def _save_compute_intensive() -> Rule:
    """Save the compute-intensive ops (torchtitan's save list), recompute the rest."""
    return _save_listed(COMPUTE_INTENSIVE_OPS, CheckpointPolicy.PREFER_SAVE)


def _eager_every_other_mm() -> Rule:
    """torchtitan's eager SAC rule: only layers are checkpointed, and within a layer every
    second matmul is recomputed; everything outside the layers is saved as autograd would."""
    compute_intensive = _save_compute_intensive()

    def rule(facts: OpFacts) -> CheckpointPolicy:
        if facts.layer is None:
            return CheckpointPolicy.PREFER_SAVE
        if facts.op in MATMUL_OPS and facts.matmul_index % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return compute_intensive(facts)

    return rule


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


def _titan_default() -> Rule:
    """graph trainer `default`: MUST_SAVE its save list, PREFER_RECOMPUTE the rest."""
    return _save_listed(TITAN_SAVE_OPS, CheckpointPolicy.MUST_SAVE)


def _titan_full() -> Rule:
    """graph trainer `full`: MUST_RECOMPUTE everything but random ops (MUST_SAVE)."""

    def rule(facts: OpFacts) -> CheckpointPolicy:
        if facts.random:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE

    return rule


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
        if facts.op in MATMUL_OPS:
            count += 1
            if facts.op in TITAN_SAVE_OPS and count % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return default(facts)

    return rule


def _default_then_offload() -> Rule:
    """graph trainer's `sac_and_offload` on the workbench's rules: `default`, then every saved
    storage that may be offloaded (`offload_refusal`) is, largest first within the budget."""
    return _save_compute_intensive()


def _titan_sac_and_offload() -> Rule:
    """graph trainer `sac_and_offload`: its `default`, then MUST_CPU_OFFLOAD on saved,
    contiguous, non-view tensors of at least 4 KiB in the layers but the last, largest first
    within the budget (`tag_all_offloadable_activations`)."""
    return _titan_default()


TITAN_PRESETS: dict[str, Callable[[], Rule]] = {
    "titan-default": _titan_default,
    "titan-full": _titan_full,
    "titan-eager": _titan_eager,
    "titan-sac_and_offload": _titan_sac_and_offload,
}
# Presets that offload what their base preset saves -> that base preset.
OFFLOAD_PRESETS = {"offload": "default", "titan-sac_and_offload": "titan-default"}

PRESETS: dict[str, Callable[[], Rule]] = {
    "none": _save_all,
    "full": _recompute_all,
    "default": _save_compute_intensive,
    "eager": _eager_every_other_mm,
    "offload": _default_then_offload,
    **TITAN_PRESETS,
}

# (module pattern, op pattern, action), later ones win.
SelectorRow = tuple[str, str, str]


def selector_matches(module_pattern: str, op_pattern: str, facts: OpFacts) -> bool:
    return module_matches(module_pattern, facts.module) and fnmatch.fnmatchcase(
        facts.op, op_pattern
    )


def requested(
    facts: OpFacts,
    rule: Rule,
    preset: str,
    selectors: Sequence[SelectorRow],
    overrides: Mapping[str, str],
) -> Tag:
    """What the policy asks for: the preset's choice, then selectors (later ones win), then
    overrides (a key naming one layer wins over a `layers.*` key)."""
    tag = Tag(rule(facts), Why.PRESET, preset)
    for module_pattern, op_pattern, action in selectors:
        if selector_matches(module_pattern, op_pattern, facts):
            tag = Tag(MUST[action], Why.SELECTOR, f"{module_pattern}::{op_pattern}")
    for key in (facts.key, facts.layer_key):
        if key in overrides:
            tag = Tag(MUST[overrides[key]], Why.OVERRIDE, key)
    return tag


def forced_save(facts: OpFacts) -> Why | None:
    """Graph SAC saves random ops and in-place ops whatever was asked."""
    if facts.random:
        return Why.RANDOM
    if facts.mutation:
        return Why.MUTATION
    return None


def fsdp_tag(reshard: bool) -> Tag:
    """The FSDP choice for a parameter's all-gather: reshard after forward (recompute the
    unshard chain in backward, as FSDP2 and torchtitan do by default) or keep the gathered
    copy from forward to backward."""
    if reshard:
        return Tag(CheckpointPolicy.MUST_RECOMPUTE, Why.FSDP, "reshard after forward")
    return Tag(CheckpointPolicy.MUST_SAVE, Why.FSDP, "keep unsharded")


class DecidePlan(NamedTuple):
    """What deciding derives from the facts alone, built once per graph (`decide_plan`) so
    that re-deciding after a flip only touches the nodes a policy can change: the
    overridden ones, the followers, and the nodes with a user across a layer boundary;
    and so that the offload rules look a node up without a pass over the graph."""

    by_name: dict[str, OpFacts]
    last_layers: tuple[int | None, int | None]  # `last_layer`: graph SAC's, graph trainer's
    by_key: dict[str, list[str]]  # `OpFacts.key` -> nodes
    by_layer_key: dict[str, list[str]]  # `OpFacts.layer_key` -> nodes
    leaders: list[tuple[str, str, bool]]  # (node, its leader, on an unshard chain), in order
    boundaries: list[tuple[str, tuple[str, ...]]]  # graph SAC's layer-boundary walk
    titan_boundaries: list[tuple[str, tuple[str, ...]]]  # graph trainer's
    writes: WritePlan  # the in-place rule's storages, writes and readers
    # (preset, selectors, fsdp_reshard) -> tags before overrides, followers and boundaries,
    # and those tags once followers took their leader's
    requested: dict[tuple[Any, ...], tuple[dict[str, Tag], dict[str, Tag]]]


REQUEST_MEMO = 8  # request tables a plan remembers (one per preset and selector list)


class WritePlan(NamedTuple):
    """What the in-place rule reads, from the facts alone: each node's position in graph
    order, the storage each node's output lives in (named by the node or graph input that
    made it: `alias` followed to its end), the writes into each storage in graph order, and
    the nodes that read a written storage (the only ones the rule can force), in order."""

    position: dict[str, int]
    root: dict[str, str]
    writes: dict[str, list[tuple[int, str]]]  # storage -> [(position, writer)]
    readers: tuple[str, ...]


def write_plan(facts: Sequence[OpFacts]) -> WritePlan:
    """The `WritePlan` of these facts (graph order)."""
    position: dict[str, int] = {}
    root: dict[str, str] = {}
    writes: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for i, f in enumerate(facts):
        position[f.name] = i
        root[f.name] = f.name if f.alias is None else root.get(f.alias, f.alias)
        for x in f.writes:
            writes[root.get(x, x)].append((i, f.name))
    readers = tuple(f.name for f in facts if any(root.get(x, x) in writes for x in f.inputs))
    return WritePlan(position, root, dict(writes), readers)


def decide_plan(facts: Sequence[OpFacts]) -> DecidePlan:
    """The plan of `decide_ops` for these facts (graph order)."""
    by_name = {f.name: f for f in facts}
    by_key: dict[str, list[str]] = collections.defaultdict(list)
    by_layer_key: dict[str, list[str]] = collections.defaultdict(list)
    leaders = []
    for f in facts:
        by_key[f.key].append(f.name)
        by_layer_key[f.layer_key].append(f.name)
        leader = f.gather if f.gather not in (None, f.name) else f.parent
        if leader is not None and leader in by_name:
            leaders.append((f.name, leader, leader == f.gather))
    return DecidePlan(
        by_name,
        (last_layer(facts), last_layer(facts, titan=True)),
        dict(by_key),
        dict(by_layer_key),
        leaders,
        layer_boundaries(facts, by_name, lambda f, u: crosses_layer(f.layer, u.layer)),
        layer_boundaries(
            facts, by_name, lambda f, u: titan_layer(u.module) > titan_layer(f.module), False
        ),
        write_plan(facts),
        {},
    )


def decide_ops(
    facts: Sequence[OpFacts],
    preset: str,
    selectors: Sequence[SelectorRow] = (),
    overrides: Mapping[str, str] | None = None,
    fsdp_reshard: bool = True,
    offload: OffloadOptions | None = None,
    plan: DecidePlan | None = None,
) -> dict[str, Tag]:
    """The tag of every node in `facts` (graph order): the request (preset, then the FSDP
    choice on parameter all-gathers, then selectors and overrides), the forced saves, then
    getitems and waits follow the op they unpack or end and unshard chains their
    all-gather, then the layer-boundary rule, then the offload step (`decide_offload`). The
    `titan-*` presets run graph trainer's own variants of these steps (`decide_titan_ops`).
    Pass the facts' `plan` to decide many policies of one graph: the requests before
    overrides are then kept per preset and selector list, so a flip costs a pass over the
    few nodes it can change."""
    plan = plan or decide_plan(facts)
    if preset in TITAN_PRESETS:
        return decide_titan_ops(facts, preset, selectors, overrides, fsdp_reshard, offload, plan)
    requested, followed = _requests(facts, plan, preset, selectors, fsdp_reshard)
    tags, overridden = dict(followed), set()
    for nodes_of in (plan.by_key, plan.by_layer_key):  # a key naming one layer wins
        for key, action in (overrides or {}).items():
            for name in nodes_of.get(key, ()):
                if not requested[name].forced:
                    tags[name] = Tag(MUST[action], Why.OVERRIDE, key)
                    overridden.add(name)
    _follow(tags, requested, plan.leaders, overridden)
    save_layer_boundaries(tags, plan.boundaries)
    save_written_inputs(tags, plan)
    if may_offload(preset, selectors, overrides):
        decide_offload(facts, tags, preset, offload or OffloadOptions(), plan)
    return tags


def _follow(
    tags: dict[str, Tag],
    asked: Mapping[str, Tag],
    leaders: Sequence[tuple[str, str, bool]],
    overridden: set[str] | None = None,
) -> None:
    """Followers take their leader's tag: always on an unshard chain, otherwise where they
    differ on recompute; forced saves stay. `asked`: the tags before this step. With
    `overridden` (nodes whose tags in `tags` are overrides, the rest already followed
    from `asked`), only the followers of changed tags are redone."""
    changed = None if overridden is None else set(overridden)
    for name, leader, chain in leaders:
        if changed is not None:
            if name not in changed and leader not in changed:
                continue
            changed.add(name)
        tag = tags[name] if overridden is not None and name in overridden else asked[name]
        if not tag.forced and (chain or tags[leader].recompute != tag.recompute):
            tag = tags[leader]
        tags[name] = tag


def _requests(
    facts: Sequence[OpFacts],
    plan: DecidePlan,
    preset: str,
    selectors: Sequence[SelectorRow],
    fsdp_reshard: bool,
) -> tuple[dict[str, Tag], dict[str, Tag]]:
    """The tags without overrides, kept in `plan`: forced saves, then the preset's rule,
    the FSDP choice and selectors; and those tags once followers took their leader's."""
    memo_key = (preset, tuple(selectors), fsdp_reshard)
    if memo_key not in plan.requested:
        rule, fsdp = PRESETS[preset](), fsdp_tag(fsdp_reshard)
        tags: dict[str, Tag] = {}
        for f in facts:
            forced = forced_save(f)
            if forced is not None:
                tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, forced)
                continue
            tag = requested(f, rule, preset, selectors, {})
            tags[f.name] = fsdp if tag.why is Why.PRESET and f.gather == f.name else tag
        followed = dict(tags)
        _follow(followed, tags, plan.leaders)
        if len(plan.requested) >= REQUEST_MEMO:
            plan.requested.clear()
        plan.requested[memo_key] = (tags, followed)
    return plan.requested[memo_key]


def crosses_layer(layer: int | None, user_layer: int | None) -> bool:
    """A recomputed node feeding a recomputed user in another layer must be saved, or
    torch's remat pass would chain recomputation across layers."""
    return layer != user_layer


def layer_boundaries(
    facts: Sequence[OpFacts],
    by_name: Mapping[str, OpFacts],
    crosses: Callable[[OpFacts, OpFacts], bool],
    reverse: bool = True,
) -> list[tuple[str, tuple[str, ...]]]:
    """The nodes with users that `crosses` a layer boundary, and those users, in the order
    the layer-boundary rule walks them: reverse graph order by default, so a user's final
    tag is known before its inputs are judged (graph trainer walks forward)."""
    walk = reversed(facts) if reverse else facts
    result = []
    for f in walk:
        users = tuple(u for u in f.users if u in by_name and crosses(f, by_name[u]))
        if users:
            result.append((f.name, users))
    return result


def save_layer_boundaries(
    tags: dict[str, Tag], boundaries: Sequence[tuple[str, tuple[str, ...]]]
) -> None:
    """Save a recomputed node with a recomputed user across a layer boundary (walking
    `layer_boundaries`), naming the first such user."""
    for name, users in boundaries:
        if not tags[name].recompute:
            continue
        for user in users:
            if tags[user].recompute:
                tags[name] = Tag(CheckpointPolicy.MUST_SAVE, Why.LAYER_BOUNDARY, user)
                break


def replayed_by(tags: Mapping[str, Tag], by_name: Mapping[str, OpFacts]) -> Callable[[str], bool]:
    """A test of whether torch's remat pass copies a node into backward: it is tagged
    recompute and a backward node reads it, or a copied node does (what the pass's
    `gather_recompute_deps` collects). Users that are not forward nodes are backward ones."""
    replayed: dict[str, bool] = {}

    def test(name: str) -> bool:
        if name not in replayed:
            replayed[name] = False  # a cycle guard: the facts are a DAG
            replayed[name] = tags[name].recompute and any(
                u not in by_name or test(u) for u in by_name[name].users
            )
        return replayed[name]

    return test


def save_written_inputs(tags: dict[str, Tag], plan: DecidePlan) -> None:
    """Save, in place on `tags`, every node whose recompute would not compute what forward
    computed because of an in-place write (`Why.WRITTEN_INPUT`, `detail` says which):

    - it reads a storage that is not recomputed (a saved node's, a graph input's) and that a
      forward node writes at or after it: in backward the recompute reads the written value,
      and if it is the writer itself, it writes that storage a second time;
    - it reads a storage the recomputation makes anew, that another recomputed node writes,
      with no path of recomputed nodes between the two: torch's remat pass copies nodes in
      batches per backward reader, so only a data path fixes their order.

    Only nodes the remat pass copies into backward count (`replayed_by`). Saving is always
    sound (with nothing recomputed, backward reads what forward made), and each save can
    only end others' reasons or move them to later readers, so the walk repeats until
    nothing changes. Backward ops are assumed not to write forward storages (autograd's
    formulas never do). In-place ops are saved by `forced_save` in the workbench's
    presets; the `titan-*` ones tag them like any op, as graph trainer does."""
    wp = plan.writes
    if not wp.writes:
        return
    while True:
        replayed = replayed_by(tags, plan.by_name)
        for name in wp.readers:
            if replayed(name):
                detail = _written_input(name, tags, plan, replayed)
                if detail is not None:
                    tags[name] = Tag(CheckpointPolicy.MUST_SAVE, Why.WRITTEN_INPUT, detail)
                    break  # the replayed set changed: walk again
        else:
            return


def written_later_keys(plan: DecidePlan) -> frozenset[str]:
    """Layer keys (`layers.3.attention_norm::aten.mean.dim#0`) of the nodes whose output
    storage a later forward node writes in place: what eager SAC may not cache."""
    wp = plan.writes
    return frozenset(
        plan.by_name[name].layer_key
        for name, at in wp.position.items()
        if any(later > at for later, _ in wp.writes.get(wp.root[name], ()))
    )


def _written_input(
    name: str, tags: Mapping[str, Tag], plan: DecidePlan, replayed: Callable[[str], bool]
) -> str | None:
    """Why recomputing `name` would not see what forward saw (`save_written_inputs`)."""
    wp, by_name = plan.writes, plan.by_name
    here = wp.position[name]
    for x in by_name[name].inputs:
        storage = wp.root.get(x, x)
        if storage not in wp.writes:
            continue
        made = x  # where the recomputation gets the storage: follow recomputed aliases
        while made in by_name and tags[made].recompute and by_name[made].alias is not None:
            made = by_name[made].alias  # type: ignore[assignment]
        if made not in by_name or not tags[made].recompute:  # forward's own storage
            later = [w for at, w in wp.writes[storage] if at >= here]
            if later and later[0] == name:
                return (
                    f"{name} writes {x}, which is not recomputed: its recompute in backward "
                    "would write it a second time"
                )
            if later:
                return (
                    f"reads {x}, which {later[0]} writes in place later in forward: its "
                    "recompute in backward would read the written value"
                )
            continue
        for at, writer in wp.writes[storage]:
            if writer == name or not replayed(writer):
                continue
            first, then = (name, writer) if here < at else (writer, name)
            if not _reads_through_recomputed(then, first, tags, plan):
                return (
                    f"reads the storage recomputed {made} makes, which recomputed {writer} "
                    "writes in place with no data path between them: torch's remat pass "
                    "may replay them in another order"
                )
    return None


def _reads_through_recomputed(
    then: str, first: str, tags: Mapping[str, Tag], plan: DecidePlan
) -> bool:
    """Whether `then` reads `first` through recomputed nodes only, so that torch's remat
    pass must copy `first` before `then` (it gathers recomputed inputs depth first)."""
    by_name, stop = plan.by_name, plan.writes.position[first]
    todo, seen = [then], {then}
    while todo:
        for x in by_name[todo.pop()].inputs:
            if x == first:
                return True
            if x in by_name and x not in seen and tags[x].recompute:
                if plan.writes.position[x] > stop:
                    seen.add(x)
                    todo.append(x)
    return False


def decide_titan_ops(
    facts: Sequence[OpFacts],
    preset: str,
    selectors: Sequence[SelectorRow] = (),
    overrides: Mapping[str, str] | None = None,
    fsdp_reshard: bool = True,
    offload: OffloadOptions | None = None,
    plan: DecidePlan | None = None,
) -> dict[str, Tag]:
    """Graph trainer's `tag_sac_policy` on the facts (graph order): `lm_head*`/`loss*`
    nodes untagged, getitems and waits take their parent's tag, the rest the request; then,
    in graph order, a recomputed node with a recomputed user in a higher layer is saved.
    Random ops are saved whatever was asked, as in every graph SAC preset here: torch's
    remat pass refuses them (on the CPU, graph trainer's `default` and `eager` recompute
    SDPA). Without `fsdp_reshard` (its `fsdp_reshard_after_forward="never"`), `titan-default`
    saves the unshard chains from their all-gather on (graph trainer saves the chain's last
    non-view node: the same bytes); its `full` and `eager` ignore that option."""
    rule, overrides = PRESETS[preset](), overrides or {}
    leave, untagged = _save_all(), Tag(CheckpointPolicy.PREFER_SAVE, Why.UNTAGGED, "")
    keep = not fsdp_reshard and preset == "titan-default"
    gathered: set[str] = set()
    tags: dict[str, Tag] = {}
    for f in facts:
        if keep and (f.gather == f.name or f.gather in gathered):
            gathered.add(f.name)
            tags[f.name] = fsdp_tag(False)
            continue
        if f.module.startswith(TITAN_UNTAGGED_MODULES):
            tag = requested(f, leave, preset, selectors, overrides)
            detail = f"{f.module} (graph trainer never tags lm_head*/loss* modules)"
            tags[f.name] = untagged._replace(detail=detail) if tag.why is Why.PRESET else tag
            continue
        if f.parent is not None:
            tags[f.name] = tags.get(f.parent, untagged)
            continue
        tag = requested(f, rule, preset, selectors, overrides)
        if f.random and tag.recompute:
            tag = Tag(CheckpointPolicy.MUST_SAVE, Why.RANDOM)
        tags[f.name] = tag
    plan = plan or decide_plan(facts)
    save_layer_boundaries(tags, plan.titan_boundaries)
    save_written_inputs(tags, plan)
    if may_offload(preset, selectors, overrides):
        decide_offload(facts, tags, preset, offload or OffloadOptions(), plan)
    return tags


# --- CPU offload ------------------------------------------------------------------------

# Graph trainer's view ops (`cpu_offload._VIEW_OPS`, by overload packet): never offloaded.
TITAN_VIEW_OPS = frozenset(
    "t transpose view _unsafe_view reshape unsqueeze squeeze slice select expand permute "
    "as_strided alias split narrow unfold detach".split()
)


def last_layer(facts: Sequence[OpFacts], titan: bool = False) -> int | None:
    """The layer whose activations are never offloaded: backward reads them at once. Graph
    trainer has none when the graph holds fewer than two layers."""
    layers = {titan_layer(f.module) if titan else f.layer for f in facts}
    layers -= {None, TITAN_NOT_IN_LAYERS}
    if titan and len(layers) < 2:
        return None
    return max(layers, default=None)  # type: ignore[type-var]


def offload_refusal(f: OpFacts, last: int | None, titan: bool = False) -> str | None:
    """Why `f`'s output may not be offloaded, or None if it may: it must be one contiguous
    tensor of at least `MIN_OFFLOAD_BYTES` owning its storage (offloading a view frees
    nothing), made in a layer other than the last, by no random, in-place or communication
    op, with nothing writing into it later, not returned by the step. The `titan-*` presets
    check what graph trainer checks: its view list instead of storages, no random, in-place
    or output rule (the pass still skips what it cannot offload safely)."""
    storage = f.storage
    if storage is None:
        return "returns no single tensor"
    if f.gather is not None:
        return "is part of a parameter's FSDP all-gather chain"
    if f.op.startswith("_c10d_functional."):
        return "is a collective or its wait"
    layer = titan_layer(f.module) if titan else f.layer
    if layer in (None, TITAN_NOT_IN_LAYERS):
        return "is outside the layers"
    if layer == last:
        return f"is in the last layer ({layer}): backward reads it at once"
    if titan:
        if f.op.split(".")[1:2] and f.op.split(".")[1] in TITAN_VIEW_OPS:
            return "is a view op"
    else:
        if f.random:
            return "is a random op"
        if f.mutation or storage.mutated:
            return "has its storage written in place in forward"
        if not storage.fresh:
            return "is a view or alias of another node's storage: offloading it frees nothing"
        if storage.output:
            return "is returned by the step"
    if not storage.contiguous:
        return "is not contiguous"
    if storage.bytes < MIN_OFFLOAD_BYTES:
        return f"is {storage.bytes} bytes, under the {MIN_OFFLOAD_BYTES}-byte minimum"
    return None


def kept_for_backward(
    tags: Mapping[str, Tag], by_name: Mapping[str, OpFacts]
) -> Callable[[OpFacts], bool]:
    """A test of whether torch's remat pass keeps a saved node's storage for backward: a
    backward node reads it (or a saved forward view of it), or a recomputed node that
    backward needs does. Users that are not forward nodes are backward ones."""
    replayed = replayed_by(tags, by_name)

    def kept(f: OpFacts) -> bool:
        todo, seen = [f], {f.name}
        while todo:
            for user in todo.pop().users:
                u = by_name.get(user)
                if u is None or replayed(user):
                    return True
                view = u.storage is not None and not u.storage.fresh
                if view and not tags[user].recompute and user not in seen:
                    seen.add(user)
                    todo.append(u)
        return False

    return kept


def offload_refusal_in(
    plan: DecidePlan, tags: Mapping[str, Tag], name: str, preset: str
) -> str | None:
    """Why node `name` may not be offloaded under `tags` (the rules and the keep test of
    `decide_offload`, budget aside), or None if it may. Reads the facts through their
    `plan`: a flip or a look at one node costs that node's users, not the graph."""
    titan = preset in TITAN_PRESETS
    by_name = plan.by_name
    refusal = offload_refusal(by_name[name], plan.last_layers[titan], titan)
    if refusal is None and not kept_for_backward(tags, by_name)(by_name[name]):
        return "is not kept for backward: nothing to offload"
    return refusal


def may_offload(
    preset: str, selectors: Sequence[SelectorRow], overrides: Mapping[str, str] | None
) -> bool:
    """Whether a policy asks for any offload (its preset, a selector or an override): the
    offload step has nothing to do otherwise, the common case on every re-decision."""
    return (
        preset in OFFLOAD_PRESETS
        or any(row[2] == "offload" for row in selectors)
        or "offload" in (overrides or {}).values()
    )


def decide_offload(
    facts: Sequence[OpFacts],
    tags: dict[str, Tag],
    preset: str,
    options: OffloadOptions,
    plan: DecidePlan | None = None,
) -> None:
    """The offload step, in place on `tags`. An offload preset offloads every saved node
    the policy did not ask to save by name that may be offloaded and is kept for backward;
    an `offload` request (selector or override) the rules cannot grant is saved instead,
    tagged `Why.OFFLOAD_REFUSED` with the reason. Then the budget: offloads are kept largest
    first (graph order among equals) while they fit; the rest go back to their preset's
    save (`OFFLOAD_REFUSED` when asked for by name). The facts' `plan`, when given,
    saves the lookups built from them."""
    titan = preset in TITAN_PRESETS
    plan = plan or decide_plan(facts)
    last = plan.last_layers[titan]
    kept = kept_for_backward(tags, plan.by_name)
    chosen: list[OpFacts] = []
    before: dict[str, Tag] = {}
    for f in facts:
        tag = tags[f.name]
        if tag.recompute:
            continue
        asked = tag.offload
        if not asked and (preset not in OFFLOAD_PRESETS or tag.why in (Why.SELECTOR, Why.OVERRIDE)):
            continue
        refusal = offload_refusal(f, last, titan)
        if refusal is None and not kept(f):
            titan_save = titan and tag.policy is CheckpointPolicy.MUST_SAVE
            refusal = None if titan_save else "is not kept for backward: nothing to offload"
        if refusal is not None:
            if asked:
                tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, Why.OFFLOAD_REFUSED, refusal)
            continue
        before[f.name] = tag
        if not asked:  # MUST_: the one offload tag graph trainer's offload pass reads
            tags[f.name] = Tag(CheckpointPolicy.MUST_CPU_OFFLOAD, Why.PRESET, preset)
        chosen.append(f)
    budget, used = options.budget_bytes, 0
    if budget is None:
        return
    for f in sorted(chosen, key=lambda f: -f.storage.bytes):  # type: ignore[union-attr]
        size = f.storage.bytes  # type: ignore[union-attr]
        if used + size <= budget:
            used += size
        elif tags[f.name].why is Why.PRESET:
            tags[f.name] = before[f.name]
        else:
            detail = f"over the offload budget of {budget} bytes ({used} already offloaded)"
            tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, Why.OFFLOAD_REFUSED, detail)


def eager_tag(
    facts: OpFacts,
    rule: Rule,
    preset: str,
    selectors: Sequence[SelectorRow],
    overrides: Mapping[str, str],
    written_later: Collection[str] = frozenset(),
) -> Tag:
    """Eager SAC's decision for one op as it runs. In-place ops come first and are
    recomputed: eager SAC caches an op's output before autograd bumps an in-place op's
    version, so a saved in-place op fails in backward ("Tensor cached during selective
    activation checkpoint has been mutated"); its recompute mutates a fresh tensor, and
    checkpoint restores the RNG state, so a random in-place op (`bernoulli_`) replays exactly.
    Other random ops are saved, as in the graph; eager SAC cannot offload, so an offload
    request is saved (`Why.OFFLOAD_REFUSED`). An op whose output forward writes in place
    later (its layer key in `written_later`, from `written_later_keys` of a traced graph) is
    recomputed for the same reason as an in-place op: torch's SAC refuses a cached tensor
    that was written after it was cached."""
    if facts.mutation:
        return Tag(CheckpointPolicy.PREFER_RECOMPUTE, Why.MUTATION)
    if facts.random:
        return Tag(CheckpointPolicy.MUST_SAVE, Why.RANDOM)
    tag = requested(facts, rule, preset, selectors, overrides)
    if tag.offload:
        return Tag(CheckpointPolicy.MUST_SAVE, Why.OFFLOAD_REFUSED, "eager SAC cannot offload")
    if not tag.recompute and facts.layer_key in written_later:
        detail = "forward writes its output in place later: eager SAC recomputes it"
        return Tag(CheckpointPolicy.PREFER_RECOMPUTE, Why.WRITTEN_INPUT, detail)
    return tag
