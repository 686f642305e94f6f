"""What the rules see of one forward or loss node of a joint graph: `OpFacts`.

Entry points: `fx_rows(gm, module_of)` (rows read off an FX graph: ops, storages, aliases,
in-place writes, FSDP unshard chains and the unsharded values, `unshard_chains` and
`unshard_outputs`), `op_facts(rows)` (counted in graph order), and `walk_storage(value, view)`:
the one walk over the forward users that share a value's storage, on FX nodes
(`fx_storage_view`), on facts or on index arrays.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from workbench.capture.ops import (
    ALL_GATHER,
    WAIT,
    NodeKey,
    is_random,
    layer_of,
    layer_pattern,
    mutates,
    op_name,
    storage_inputs,
    storage_keys,
)

# Ops whose tag is their input's: a getitem unpacks it, a wait_tensor ends its collective.
FOLLOWERS = frozenset({"getitem", WAIT})


# Matmuls, counted per layer forward (the `eager` preset recomputes every second one). A
# linear with a bias runs as `addmm` (GPT-2, BERT, ViT): counted too, or `eager` would recompute
# none of their matmuls (torchtitan's rule counts mm and linear only: `TITAN_MATMUL_OPS`).
MATMUL_OPS: frozenset[str] = frozenset(
    {"aten.mm.default", "aten.addmm.default", "aten.linear.default"}
)


# Offload moves whole storages: smaller ones cost more in transfer overhead than they free
# (graph trainer's `_MIN_OFFLOAD_BYTES`).
MIN_OFFLOAD_BYTES = 4096


class Storage(NamedTuple):
    """What offloading needs to know of a node's output: a single tensor's bytes, whether it
    is contiguous and owns its storage (not a view or alias of an input), whether the step
    returns it (or a view of it) and whether forward writes into it in place later."""

    bytes: int
    contiguous: bool
    fresh: bool
    output: bool
    mutated: bool  # a forward op writes into the storage in place


class StorageView(NamedTuple):
    """How `walk_storage` reads one form of a graph (FX nodes, the rules' facts, a node order's
    index arrays): the readers of a value, the value each reader makes, and what a reader
    is (the step's output, a backward node) or a value does (shares the storage walked,
    given the values sharing it found so far; writes its input in place)."""

    readers: Callable[[Any], Iterable[Any]]
    value: Callable[[Any], Any]
    is_output: Callable[[Any], bool]
    in_backward: Callable[[Any], bool]
    shares: Callable[[Any, set[Any]], bool]
    writes: Callable[[Any], bool]


class StorageWalk(NamedTuple):
    """What walking a value's storage found (`walk_storage`): its forward aliases (values
    sharing the storage, in the order met), the backward readers of it or an alias, the
    aliases those read, every forward reader, whether the step returns it (or an alias),
    the aliases that write into it in place (in the order met), and whether the first
    writer was met before the first output."""

    aliases: list[Any]
    readers: list[Any]
    read_aliases: list[Any]
    forward: list[Any]
    returned: bool
    writers: list[Any]
    written_first: bool


def walk_storage(value: Any, view: StorageView) -> StorageWalk:
    """The one walk over the forward readers that share `value`'s storage (views, getitems,
    in-place ops), depth first through each alias's readers, in `view`'s form of the graph.
    Backward readers and the step's output end a path; a forward reader whose value does not
    share the storage is recorded in `forward` and not followed."""
    aliases: list[Any] = []
    readers: list[Any] = []
    read_aliases: list[Any] = []
    forward: list[Any] = []
    writers: list[Any] = []
    returned = written_first = False
    todo, seen = [value], {value}
    while todo:
        at = todo.pop()
        for reader in view.readers(at):
            if view.is_output(reader):
                returned = True
                continue
            if view.in_backward(reader):
                readers.append(reader)
                if at != value and at not in read_aliases:
                    read_aliases.append(at)
                continue
            forward.append(reader)
            made = view.value(reader)
            if made in seen or not view.shares(made, seen):
                continue
            if view.writes(made):
                written_first = written_first or not (writers or returned)
                writers.append(made)
            seen.add(made)
            aliases.append(made)
            todo.append(made)
    return StorageWalk(aliases, readers, read_aliases, forward, returned, writers, written_first)


def fx_storage_view(
    node: torch.fx.Node | None, in_backward: Callable[[torch.fx.Node], bool]
) -> StorageView:
    """`node`'s storage on an FX graph, as `walk_storage` reads it: users sharing its storage
    (its fake tensors'), a user being backward as `in_backward` says (marked
    `autograd_backward`, or after the first backward node of a rematerialized graph)."""
    keys = storage_keys(node) if node is not None else set()
    return StorageView(
        readers=lambda n: n.users,
        value=lambda n: n,
        is_output=lambda n: n.op == "output",
        in_backward=in_backward,
        shares=lambda n, seen: bool(keys & storage_keys(n)),
        writes=lambda n: mutates(n.target),
    )


def needed_aliases(
    aliases: Sequence[Any], read: Iterable[Any], inputs: Callable[[Any], Iterable[Any]]
) -> list[Any]:
    """The aliases backward reads (`read`) and the aliases they are made from (`inputs`),
    in the order of `aliases`: the views an offload replays on a reloaded tensor."""
    members, needed = set(aliases), set()
    todo = list(read)
    while todo:
        alias = todo.pop()
        if alias not in needed:
            needed.add(alias)
            todo.extend(x for x in inputs(alias) if x in members)
    return [a for a in aliases if a in needed]


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
    # Whether it holds a parameter's unsharded value, the node FSDP without reshard after
    # forward keeps for backward as graph trainer finds it (`unshard_outputs`).
    unshard_output: bool = False


# (name, module, op, random, mutation, parent, users, gather[, storage[, inputs, alias,
# writes[, unshard_output]]]), in graph order: eager SAC's rows stop after `gather`.
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
        unshard_output = bool(row[12]) if len(row) > 12 else False
        layer = layer_of(module)
        if op in MATMUL_OPS:
            self.matmuls[layer] += 1
        k = self.seen[(module, op)]
        self.seen[(module, op)] += 1
        own = NodeKey(module, op, k)
        key, layer_key = own.in_module(layer_pattern(module)).text, own.text
        return OpFacts(
            name,
            module,
            op,
            layer,
            k,
            self.matmuls[layer],
            random,
            mutation,
            parent,
            users,
            key,
            layer_key,
            gather,
            storage,
            inputs,
            alias,
            writes,
            unshard_output,
        )


def op_facts(rows: Iterable[Row]) -> list[OpFacts]:
    """Facts of the forward and loss nodes of a graph, counted in graph order."""
    counter = OpCounter()
    return [counter.facts(row) for row in rows]


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
    view = fx_storage_view(node, lambda n: bool(n.meta.get("autograd_backward")))
    walk = walk_storage(node, view)
    fresh = not any(key in storage_keys(x) for x in storage_inputs(node))
    return Storage(size, contiguous, fresh, walk.returned, bool(walk.writers))


def fx_rows(gm: torch.fx.GraphModule, module_of: Callable[[torch.fx.Node], str]) -> list[Row]:
    """Rows of the forward and loss call nodes of a joint graph: every node that is neither
    a placeholder, the output, nor marked `meta["autograd_backward"]`."""
    gathers, kept = unshard_chains(gm), unshard_outputs(gm)
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
                node.name in kept,
            )
        )
    return rows


def alias_input(node: torch.fx.Node) -> str | None:
    """The input whose storage `node`'s output shares (a view of it, an in-place op on it, a
    getitem of a tuple of views), or None when the output is a new storage (a getitem of a
    multi-output op that makes its outputs: `storage_inputs`)."""
    keys = storage_keys(node)
    if keys and any(keys & storage_keys(x) for x in storage_inputs(node)):
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


def unshard_outputs(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The nodes holding parameters' unsharded values, found as graph trainer finds them
    (`fsdp_patterns.find_fsdp_unshard_outputs`, which its `default` policy saves when FSDP
    does not reshard after forward): from a parameter input (else from each of its users)
    along nodes that have one user and read nothing else, to the last all-gather on that
    run; from the all-gather's wait on along such nodes (through a split whose getitems all
    meet in one cat) to the last one before compute; then back over view ops. Found
    structurally, as there: a parameter read twice (a duplicate chain) is not found.

    The chains of `unshard_chains` are found by what they read instead, so every gathered
    parameter is on one; the workbench's presets decide whole chains."""
    kept: set[str] = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        gather = _last_gather_on_run(node)
        starts = [node] if gather is not None else list(node.users)
        for start in starts:
            if len(start.all_input_nodes) > 1:
                continue
            gather = _last_gather_on_run(start)
            value = _unsharded_value(gather) if gather is not None else None
            if value is not None:
                kept.add(value.name)
    return frozenset(kept)


def _sole_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """`node`'s one user when it has one and that user reads nothing else."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    return user if len(user.all_input_nodes) == 1 else None


def _last_gather_on_run(node: torch.fx.Node) -> torch.fx.Node | None:
    last = None
    while True:
        if node.op == "call_function" and op_name(node.target) == ALL_GATHER:
            last = node
        user = _sole_user(node)
        if user is None:
            return last
        node = user


def _unsharded_value(gather: torch.fx.Node) -> torch.fx.Node | None:
    """The last non-view node of the chain after `gather`'s wait (None without one wait)."""
    (wait,) = gather.users if len(gather.users) == 1 else (None,)
    if wait is None or op_name(wait.target) != WAIT:
        return None
    node = wait
    while True:
        user = _sole_user(node) or _split_cat(node)
        if user is None:
            break
        node = user
    while getattr(node.target, "is_view", False) and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node


def _split_cat(node: torch.fx.Node) -> torch.fx.Node | None:
    """The cat that all getitems of a split `node` feed alone (a gathered buffer rebuilt)."""
    if op_name(node.target) != "aten.split.Tensor" or not node.users:
        return None
    after = set()
    for getitem in node.users:
        if getitem.target is not operator.getitem or len(getitem.users) != 1:
            return None
        after |= set(getitem.users)
    (cat,) = after if len(after) == 1 else (None,)
    return cat if cat is not None and op_name(cat.target) == "aten.cat.default" else None
