"""The index form of a JointGraph: nodes as integers, storages and aliases resolved once.

Entry points: `graph_index(graph) -> GraphIndex` (built once per graph, cached here) and,
on it, `saved_by_node(order)`: THE definition of the activations a step keeps for
backward, which the estimate, remat reports, pictures and the explorer all read.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.fx as fx
from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (  # noqa: E501
    is_impure_node_for_dce,
)
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.capture.graph import LOSS_MODULE, ORIGIN_KEY, JointGraph, Phase
from workbench.capture.ops import WAIT, mutates, op_name, reads_until_wait
from workbench.decide.facts import unshard_chains
from workbench.errors import WorkbenchError
from workbench.rewrite.entries import Csr, EntrySpace, Flat, NodeOrder
from workbench.rewrite.placement import NO_LAYER, REPLAYED_VIEW, is_offload_node

__all__ = [
    "GraphIndex",
    "NodeArrays",
    "Slot",
    "Storages",
    "distinct_storage_bytes",
    "graph_index",
]

# A node's output slots: an int is a fresh storage of that many bytes (0: no tensor), a
# pair (j, s) aliases slot s of the node's j-th input (views, getitem, in-place ops).
Slot = int | tuple[int, int]
_FORWARD = ("forward", "loss")


class NodeArrays(NamedTuple):
    """Per-node facts as arrays, for the passes that replay torch's remat pass on them."""

    inputs: Csr  # each node's inputs (`GraphIndex.args`)
    forward: np.ndarray  # a forward or loss node
    backward: np.ndarray  # marked autograd_backward (`GraphIndex.is_bwd`)
    region: np.ndarray  # the backward region holding the node (`regions`), -1 outside
    impure: np.ndarray  # kept by dead-code elimination whatever reads it
    raisable: np.ndarray  # a getitem of a non-getitem, which torch's `raise_getitems` moves
    layer: np.ndarray  # `GraphIndex.layer`, `offload.NO_LAYER` outside the layers


class Storages(NamedTuple):
    """The storages a node order allocates, by id in allocation order: the entry that owns
    each, its bytes and the position where it is allocated; and which values hold them, as
    (holder's position, storage) pairs (a value holding one storage twice is listed twice)."""

    holder: np.ndarray
    held: np.ndarray
    owner: np.ndarray
    sizes: np.ndarray
    born: np.ndarray


class _Tables(NamedTuple):
    """Per-node arrays built once per graph, read by every node order's storage walk."""

    slot_start: np.ndarray  # node i's slots are keys slot_start[i] .. slot_start[i + 1] - 1
    fresh: Csr  # each node's keys of fresh slots holding bytes, in slot order
    fresh_bytes: np.ndarray  # by key
    alias: Csr  # each node's keys of alias slots
    alias_input: np.ndarray  # by key: which input of the node the slot aliases
    alias_slot: np.ndarray  # by key: which slot of that input
    forward: np.ndarray  # by entry (7n): an original forward or loss node
    reads_saved: np.ndarray  # by entry (7n): a backward node, a copy, a replay, an offload step
    kept: np.ndarray  # by node: an owner whose storages may count as saved activations


@dataclass(frozen=True)
class GraphIndex:
    """Per-node tables of one graph, by node index in graph order. Never changes."""

    graph: JointGraph
    n: int
    names: tuple[str, ...]
    index_of: dict[str, int]
    origin_of: dict[Any, int]
    args: tuple[tuple[int, ...], ...]
    users: tuple[tuple[int, ...], ...]
    phase: tuple[Phase, ...]
    is_bwd: tuple[bool, ...]
    is_getitem: tuple[bool, ...]
    is_random: tuple[bool, ...]
    impure: tuple[bool, ...]
    layer: tuple[int | None, ...]
    module: tuple[str, ...]
    op: tuple[str, ...]
    flops: tuple[int, ...]
    slots: tuple[tuple[Slot, ...], ...]
    output: int
    placeholder_category: dict[int, str]
    regions: tuple[tuple[int, int], ...]
    region_of: dict[int, int]
    gathered: frozenset[int]  # nodes of FSDP unshard chains (`rules.unshard_chains`)
    foreign_tags: tuple[str, ...]

    # --- node orders -------------------------------------------------------------------

    def identity(self) -> NodeOrder:
        """The joint graph as traced (no remat)."""
        return list(range(self.n)), dict(enumerate(self.args))

    def order_of(self, gm: fx.GraphModule) -> NodeOrder:
        """The order and inputs of a graph produced from this one by torch's remat pass
        and the offload pass.

        Nodes map back through `meta[ORIGIN_KEY]` (the pass renames nodes); a copy of a
        forward node that runs in backward is its recomputed copy or a view the offload pass
        replays on a reloaded tensor (marked `REPLAYED_VIEW`). The
        offload pass's copies, frees, reloads and waits are the steps of the value they move
        (`OFFLOAD_STEPS`). Raises `WorkbenchError` for a node read before it runs."""
        space = self.space
        entry: dict[fx.Node, int] = {}
        order: list[int] = []
        args: dict[int, tuple[int, ...]] = {}
        for node in gm.graph.nodes:
            if is_offload_node(node):
                first = entry[node.all_input_nodes[0]]
                i = int(space.node(first))
                name = node.target._opname  # type: ignore[union-attr]
                if name == "offload":
                    kind = 0
                elif name == "reload":
                    kind = 2
                else:  # a wait: of the host copy (frees the original) or of the reload
                    kind = 1 if space.step(first) == 0 else 3
                e = space.offload(i, kind)
            else:
                origin = node.meta.get(ORIGIN_KEY)
                e = self.output if node.op == "output" else self.origin_of.get(origin)  # type: ignore[assignment]
                if e is None or origin is None and node.op != "output":
                    raise WorkbenchError(
                        f"node {node.name!r} does not come from the traced graph of "
                        f"{self.graph.model_name!r}: estimate graphs that torch's remat pass "
                        "made from it (workbench.rewrite.remat.remat)"
                    )
                if not self.is_bwd[e] and node.meta.get("autograd_backward", False):
                    e = space.replayed(e) if node.meta.get(REPLAYED_VIEW) else space.copy(e)
            if e in args and node.op == "get_attr":
                entry[node] = e  # a subgraph read again (graph trainer's remat copies them)
                continue
            if e in args:
                raise WorkbenchError(
                    f"node {node.name!r} maps to an entry already in the node order: the "
                    "graph was not made by workbench.rewrite.remat.remat"
                )
            entry[node] = e
            order.append(e)
            unmade = [x.name for x in node.all_input_nodes if x not in entry]
            if unmade:
                raise WorkbenchError(
                    f"node {node.name!r} reads {', '.join(unmade)} before it runs: the graph "
                    "cannot run in its order"
                )
            args[e] = tuple(entry[x] for x in node.all_input_nodes)
        return order, args

    @functools.cached_property
    def space(self) -> EntrySpace:
        """What each entry of a node order of this graph stands for (`EntrySpace`)."""
        return EntrySpace(self.n)

    # --- storages ----------------------------------------------------------------------

    @functools.cached_property
    def arrays(self) -> NodeArrays:
        """Per-node facts as arrays (built on first use)."""
        region = np.full(self.n, -1, np.int64)
        for r, (start, end) in enumerate(self.regions):
            region[start:end] = r
        getitem = np.array(self.is_getitem, bool)
        first_input = np.array([args[0] if args else 0 for args in self.args], np.int64)
        return NodeArrays(
            inputs=Csr.of(self.args),
            forward=np.array([p in _FORWARD for p in self.phase], bool),
            backward=np.array(self.is_bwd, bool),
            region=region,
            impure=np.array(self.impure, bool),
            raisable=getitem & ~getitem[first_input],
            layer=np.array([NO_LAYER if x is None else x for x in self.layer], np.int64),
        )

    @functools.cached_property
    def offload_facts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per node, what the offload pass checks: an op call, returning one tensor, writing
        its input in place, reading its input until a wait (`rules.reads_until_wait`)."""
        nodes = list(self.graph.gm.graph.nodes)
        call = np.array([node.op == "call_function" for node in nodes], bool)
        single = np.array([isinstance(node.meta.get("val"), torch.Tensor) for node in nodes])
        writes = np.array([mutates(node.target) for node in nodes], bool)
        until_wait = np.array([reads_until_wait(node.target) for node in nodes], bool)
        return call, single.astype(bool), writes, until_wait

    @functools.cached_property
    def value_slots(self) -> np.ndarray:
        """Per node, the key of the fresh slot holding its output's storage: its own first
        slot when fresh, for a getitem its tuple's slot when that is fresh (a getitem of a
        multi-output op owns the storage the op made for it), else -1 (a view or alias of
        another node's storage). What an offload moves and how many bytes."""
        start, keys = self._tables.slot_start, np.full(self.n, -1, np.int64)
        for i, slots in enumerate(self.slots):
            slot = slots[0] if slots else None
            if isinstance(slot, int):
                keys[i] = start[i]
            elif slot is not None and self.is_getitem[i]:
                tuple_slot = self.slots[self.args[i][0]][slot[1]]  # a getitem reads its tuple
                keys[i] = start[self.args[i][0]] + slot[1] if isinstance(tuple_slot, int) else -1
        return keys

    @functools.cached_property
    def identity_flat(self) -> Flat:
        """The joint graph as traced, as arrays (read-only: every caller shares them)."""
        flat = self.flat(self.identity())
        for array in flat:
            array.flags.writeable = False
        return flat

    @functools.cached_property
    def _loss_side(self) -> np.ndarray:
        """Per node: the loss's, not the model's: its forward (phase `loss`) and its backward,
        the backward nodes of the loss module or the root that read no backward node of the
        model (autograd runs the loss's backward first; the root's later backward nodes are
        the model's collectives and gradient sums)."""
        loss = np.array([p == "loss" for p in self.phase], bool)
        for i in range(self.n):
            if self.phase[i] == "backward" and self.module[i] in ("", LOSS_MODULE):
                loss[i] = all(loss[j] or self.phase[j] != "backward" for j in self.args[i])
        return loss

    @functools.cached_property
    def _model_backward(self) -> np.ndarray:
        """By entry: the model's backward, its nodes and the recomputed copies and replayed
        views of its forward's (not the loss's, nor an offload step)."""
        of_model = ~self._loss_side
        backward = self._tables.reads_saved[: self.n]  # of originals: the backward nodes
        steps = np.zeros(self.space.size - self.space.steps, bool)
        return np.concatenate((backward & of_model, of_model, of_model, steps))

    @functools.cached_property
    def _tables(self) -> _Tables:
        counts = np.fromiter((len(slots) for slots in self.slots), np.int64, self.n)
        slot_start = np.concatenate(([0], np.cumsum(counts)))
        flat = [slot for slots in self.slots for slot in slots]
        fresh_bytes = np.array([s if isinstance(s, int) else 0 for s in flat], np.int64)
        is_alias = np.array([isinstance(s, tuple) for s in flat], bool)
        pairs = [s if isinstance(s, tuple) else (-1, -1) for s in flat]
        alias_input, alias_slot = np.array(pairs, np.int64).reshape(-1, 2).T
        node_of = np.repeat(np.arange(self.n), counts)
        fresh, alias = np.flatnonzero(fresh_bytes), np.flatnonzero(is_alias)
        bounds = np.arange(self.n + 1)
        others = self.space.size - self.n  # copies, replayed views, offload steps
        forward = np.array([p in _FORWARD for p in self.phase] + [False] * others, bool)
        backward = np.array([p == "backward" for p in self.phase] + [True] * others, bool)
        kept = np.array(
            [p != "input" and i not in self.gathered for i, p in enumerate(self.phase)], bool
        )
        return _Tables(
            slot_start=slot_start,
            fresh=Csr(np.searchsorted(node_of[fresh], bounds), fresh),
            fresh_bytes=fresh_bytes,
            alias=Csr(np.searchsorted(node_of[alias], bounds), alias),
            alias_input=np.ascontiguousarray(alias_input),
            alias_slot=np.ascontiguousarray(alias_slot),
            forward=forward,
            reads_saved=backward,
            kept=kept,
        )

    def flat(self, order: NodeOrder | Flat) -> Flat:
        """`order` as arrays."""
        if isinstance(order, Flat):
            return order
        sequence, args = order
        entries = np.array(sequence, np.int64)
        counts = np.fromiter((len(args[e]) for e in sequence), np.int64, len(sequence))
        read = np.fromiter(itertools.chain.from_iterable(args[e] for e in sequence), np.int64)
        return Flat(entries, np.repeat(np.arange(len(sequence)), counts), read)

    def storages(self, flat: Flat) -> Storages:
        """The storages a node order allocates and the values that hold them.

        Fresh slots get an id when their entry runs, in order; aliases resolve through the
        entry's inputs (pointer jumping over slot keys: originals' keys, then copies',
        replays', and one per offload step), so a recomputed copy aliases its own inputs,
        not its original's. An offload's host copy and a reload are fresh storages of the
        value's bytes; the waits alias their first input. No storage stands behind an alias
        of a slot without one: a non-tensor, or a placeholder that shares another's storage
        (inputs are held for the whole step anyway)."""
        t, space = self._tables, self.space
        entries = flat.entries
        regular = ~space.is_step(entries)
        nodes = space.node(entries)
        total = int(t.slot_start[-1])
        base, missing = self._slot_keys(total)
        key_shift = (entries // space.copies) * total  # by position, for regular entries

        at = np.flatnonzero(regular)
        fresh_pos, fresh_keys = t.fresh.gather(nodes[at])
        fresh_pos = at[fresh_pos]
        owner_keys = fresh_keys + key_shift[fresh_pos]
        sizes = t.fresh_bytes[fresh_keys]
        alias_pos, alias_keys = t.alias.gather(nodes[at])
        alias_pos = at[alias_pos]
        alias_input, alias_slot = t.alias_input[alias_keys], t.alias_slot[alias_keys]
        alias_own = alias_keys + key_shift[alias_pos]
        steps = np.flatnonzero(~regular)
        if len(steps):  # host copies and reloads hold fresh storages; the waits alias them
            kind = space.step(entries[steps])
            made, waits = steps[kind % 2 == 0], steps[kind % 2 == 1]
            value = t.fresh_bytes[np.maximum(self.value_slots[nodes[made]], 0)]
            fresh_pos = np.concatenate((fresh_pos, made))
            owner_keys = np.concatenate((owner_keys, base[entries[made]]))
            sizes = np.concatenate((sizes, value))
            alias_pos = np.concatenate((alias_pos, waits))
            zeros = np.zeros(len(waits), np.int64)
            alias_input = np.concatenate((alias_input, zeros))
            alias_slot = np.concatenate((alias_slot, zeros))
            alias_own = np.concatenate((alias_own, base[entries[waits]]))
            by_position = np.argsort(fresh_pos, kind="stable")
            fresh_pos, owner_keys = fresh_pos[by_position], owner_keys[by_position]
            sizes = sizes[by_position]
        first_read = np.searchsorted(flat.reader, np.arange(len(entries)))
        target = flat.read[first_read[alias_pos] + alias_input]
        target_keys = base[target] + alias_slot

        root = np.full(missing + 1, missing, np.int64)
        root[owner_keys] = owner_keys
        root[alias_own] = target_keys
        while True:
            jumped = root[root]
            if np.array_equal(jumped, root):
                break
            root = jumped
        sid_of = np.full(missing + 1, -1, np.int64)
        sid_of[owner_keys] = np.arange(len(owner_keys))
        aliased = sid_of[root[alias_own]]
        found = aliased >= 0
        return Storages(
            holder=np.concatenate((fresh_pos, alias_pos[found])),
            held=np.concatenate((np.arange(len(owner_keys)), aliased[found])),
            owner=entries[fresh_pos],
            sizes=sizes,
            born=fresh_pos,
        )

    def _slot_keys(self, total: int) -> tuple[np.ndarray, int]:
        """Per entry, its first slot key (the key of its slot s is `base[e] + s`), and one
        past every key. A node's own entries (the original, its copy, its replayed view)
        each have the node's slots (`total` in all); an offload step has one key."""
        starts = self._tables.slot_start[:-1]
        own = (starts, starts + total, starts + 2 * total)
        steps = len(own) * total + np.arange(self.space.size - self.space.steps)
        return np.concatenate((*own, steps)), len(own) * total + len(steps)

    def saved_mask(self, flat: Flat, table: Storages) -> np.ndarray:
        """Per storage: kept for backward. Storages of forward and loss nodes read by a
        backward node or a recomputed copy: what the step keeps from forward for backward,
        views followed to their base. Not the step's outputs (the loss is returned, not
        kept), inputs' storages (a view of a buffer or of the tokens is held by the caller
        anyway), nor the gathered parameter copies of FSDP unshard chains (parameters, not
        activations, whatever is kept)."""
        t = self._tables
        read_by_backward = np.zeros(self.space.size, bool)
        read_by_backward[self._read_by_backward(flat)] = True
        saved = np.zeros(len(table.sizes), bool)
        saved[table.held[read_by_backward[flat.entries[table.holder]]]] = True
        return saved & ~self.returned_mask(flat, table) & t.kept[self.space.node(table.owner)]

    def returned_mask(self, flat: Flat, table: Storages) -> np.ndarray:
        """Per storage: held by a value the step returns (its gradients and the loss)."""
        entries = flat.entries
        returned = np.zeros(self.space.size, bool)
        returned[flat.read[entries[flat.reader] == self.output]] = True
        mask = np.zeros(len(table.sizes), bool)
        mask[table.held[returned[entries[table.holder]]]] = True
        return mask

    def saved_by_node(self, order: NodeOrder | Flat) -> dict[str, int]:
        """Bytes kept for backward, by the forward node that allocated each storage (its
        base, for activations backward reads through views). The one definition of saved
        activation bytes: its total is `Estimate.saved_activation_bytes`."""
        flat = self.flat(order)
        table = self.storages(flat)
        saved = np.flatnonzero(self.saved_mask(flat, table))
        result: dict[str, int] = {}
        owners, sizes = self.space.node(table.owner[saved]).tolist(), table.sizes[saved].tolist()
        for i, size in zip(owners, sizes, strict=True):
            name = self.names[i]
            result[name] = result.get(name, 0) + size
        return result

    def recompute_flops_by_node(self, entries: np.ndarray) -> dict[str, int]:
        """FLOPs backward runs again, by traced node: each recomputed copy among a node order's
        `entries` counts its original's FLOPs, and only those (a node tagged recompute that
        no backward node needs is not run again). The one definition of recompute FLOPs:
        its total is `Estimate.recompute_flops`, and pictures sum it per box."""
        result: dict[str, int] = {}
        for i in self.space.original(entries[self.space.is_copy(entries)]).tolist():
            name = self.names[i]
            result[name] = result.get(name, 0) + self.flops[i]
        return result

    # --- per node, for a model of the pass that needs no node order (the solver's) -----

    def activation_storages(self, name: str) -> tuple[int, ...]:
        """The storages `name`'s output holds that count as saved activations when backward
        reads it from forward, by id (`storage_bytes`, `storage_owner`): `saved_mask`'s rule
        on the traced graph, views resolved to their base; never a graph input's storage, a
        returned one or an FSDP-gathered parameter copy."""
        held = self._activation_storages[0]
        i = self.index_of[name]
        return tuple(held.items[held.start[i] : held.start[i + 1]].tolist())

    def storage_bytes(self, storage: int) -> int:
        """The bytes of a storage of `activation_storages`."""
        return int(self._activation_storages[1][storage])

    def storage_owner(self, storage: int) -> str:
        """The node whose output allocates a storage of `activation_storages`."""
        return self.names[int(self._activation_storages[2][storage])]

    def read_in_backward(self, name: str, *, live: bool = False) -> bool:
        """Whether a backward node takes `name`'s output as an input; with `live`, one that
        dead-code elimination keeps (torch's remat pass drops the backward nodes nothing
        needs, such as autograd's leftover detaches, and what only they read)."""
        i = self.index_of[name]
        keep = self._kept_by_dce if live else self.is_bwd
        return any(self.is_bwd[u] and keep[u] for u in self.users[i])

    @functools.cached_property
    def _activation_storages(self) -> tuple[Csr, np.ndarray, np.ndarray]:
        """Per node, the storages `saved_mask` may count that its value holds; each
        storage's bytes and owner, on the traced graph."""
        flat = self.identity_flat
        table = self.storages(flat)
        may = ~self.returned_mask(flat, table) & self._tables.kept[table.owner]
        pairs = np.stack((table.holder, table.held), axis=1)[may[table.held]]
        pairs = np.unique(pairs, axis=0).reshape(-1, 2)  # by holder, then storage
        start = np.searchsorted(pairs[:, 0], np.arange(self.n + 1))
        return Csr(start, pairs[:, 1]), table.sizes, table.owner

    @functools.cached_property
    def _kept_by_dce(self) -> tuple[bool, ...]:
        """Per node: impure, or read by a node that is (what dead-code elimination keeps)."""
        kept = list(self.impure)
        for i in reversed(range(self.n)):
            kept[i] = kept[i] or any(kept[u] for u in self.users[i])
        return tuple(kept)

    # --- readers -----------------------------------------------------------------------

    def read_directly(self, order: NodeOrder | Flat) -> set[str]:
        """Forward and loss nodes that a backward node or a recomputed copy of the node order
        takes as an input: the values its forward region hands over to backward."""
        read = self._read_by_backward(self.flat(order))
        return {self.names[x] for x in np.unique(read).tolist()}

    def _read_by_backward(self, flat: Flat) -> np.ndarray:
        """Original forward and loss entries read by a backward node or a recomputed copy
        (with repeats)."""
        t = self._tables
        read = flat.read[t.reads_saved[flat.entries[flat.reader]]]
        return read[t.forward[read]]

    def backward_inputs(self, flat: Flat) -> np.ndarray:
        """Entries the model's backward takes from before it (with repeats): the forward
        values its nodes and recomputed copies read (what forward saved) and the loss's
        gradient of the model's output (`_loss_side`). What the loss's own backward reads
        is its own."""
        read = flat.read[self._model_backward[flat.entries[flat.reader]]]
        read = read[read < self.n]  # originals, not copies, replays or offload steps
        return read[self._tables.forward[read] | self._loss_side[read]]

    def backward_readers(self, name: str) -> list[str]:
        """Backward ops that read `name`'s output, directly or through forward views of its
        storage (a matmul's output is often read by backward only via its `_unsafe_view`)."""
        readers: set[str] = set()
        todo, seen = [self.index_of[name]], set()
        while todo:
            i = todo.pop()
            for u in self.users[i]:
                if self.phase[u] == "backward":
                    readers.add(self.names[u])
                elif u not in seen and any(
                    isinstance(slot, tuple) and self.args[u][slot[0]] == i for slot in self.slots[u]
                ):
                    seen.add(u)
                    todo.append(u)
        return sorted(readers)


def distinct_storage_bytes(nodes: Iterable[fx.Node]) -> int:
    """Bytes of the distinct storages behind `nodes`' outputs (from their fake tensors),
    views and aliases of one tensor counted once, graph inputs' storages not at all (they
    are held anyway). The same rule as `saved_by_node`, for graphs without an index: the
    forward and backward graphs of AOTAutograd's partitioner (the studies)."""
    inputs: set[Any] = set()
    storages: dict[Any, int] = {}
    for node in nodes:
        for value in _values(node):
            key = StorageWeakRef(value.untyped_storage())
            if node.op == "placeholder":
                inputs.add(key)
            else:
                storages.setdefault(key, int(value.untyped_storage().nbytes()))
    return sum(size for key, size in storages.items() if key not in inputs)


def _values(node: fx.Node) -> list[torch.Tensor]:
    value = node.meta.get("val")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


_INDEXES: weakref.WeakKeyDictionary[JointGraph, GraphIndex] = weakref.WeakKeyDictionary()


def graph_index(graph: JointGraph) -> GraphIndex:
    """The index form of `graph`, built on first use and kept as long as the graph lives."""
    if graph not in _INDEXES:
        _INDEXES[graph] = _build(graph)
    return _INDEXES[graph]


def _build(graph: JointGraph) -> GraphIndex:
    nodes = list(graph.gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    infos = [graph.nodes[node.name] for node in nodes]
    kinds = {spec.placeholder: spec.kind for spec in graph.inputs}
    chains = unshard_chains(graph.gm)
    regions = _regions([bool(node.meta.get("autograd_backward", False)) for node in nodes])
    return GraphIndex(
        graph=graph,
        n=len(nodes),
        names=tuple(node.name for node in nodes),
        index_of={node.name: i for i, node in enumerate(nodes)},
        origin_of={node.meta.get(ORIGIN_KEY): i for i, node in enumerate(nodes)},
        args=tuple(tuple(position[x] for x in node.all_input_nodes) for node in nodes),
        users=tuple(tuple(position[u] for u in node.users) for node in nodes),
        phase=tuple(info.phase for info in infos),
        is_bwd=tuple(bool(node.meta.get("autograd_backward", False)) for node in nodes),
        is_getitem=tuple(
            node.op == "call_function" and node.target is operator.getitem for node in nodes
        ),
        is_random=tuple(info.is_random for info in infos),
        impure=tuple(
            node.op in ("placeholder", "output") or is_impure_node_for_dce(node) for node in nodes
        ),
        layer=tuple(info.layer for info in infos),
        module=tuple(info.module for info in infos),
        op=tuple(info.op for info in infos),
        flops=tuple(info.flops for info in infos),
        slots=_all_slots(nodes),
        output=next(i for i, node in enumerate(nodes) if node.op == "output"),
        placeholder_category={
            i: "parameters" if kinds.get(node.name) == "param" else "inputs"
            for i, node in enumerate(nodes)
            if node.op == "placeholder"
        },
        regions=tuple(regions),
        region_of={b: r for r, (s, e) in enumerate(regions) for b in range(s, e)},
        gathered=frozenset(position[node] for node in nodes if node.name in chains),
        # torch's pass also reads these AOTAutograd tags; workbench traces have none.
        foreign_tags=tuple(
            sorted({k for n in nodes for k in ("ac_graph_id", "partitioner_tag") if k in n.meta})
        ),
    )


def _regions(is_bwd: Iterable[bool]) -> list[tuple[int, int]]:
    """Maximal runs of autograd_backward nodes, as torch's pass finds them."""
    regions, start, i = [], None, 0
    for i, bwd in enumerate(is_bwd):
        if bwd and start is None:
            start = i
        elif not bwd and start is not None:
            regions.append((start, i))
            start = None
    if start is not None:
        regions.append((start, i + 1))
    return regions


def _storage_keys(node: fx.Node) -> list[Any]:
    """The storage behind each output slot of `node` (None for non-tensor slots)."""
    value = node.meta.get("val")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [
        StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None for v in values
    ]


def _slots_of(node: fx.Node, keys: dict[fx.Node, list[Any]]) -> tuple[Slot, ...]:
    """Fresh storage, or alias of a direct input's slot, from the fake tensors' storages."""
    value = node.meta["val"]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    held = {
        key: (j, s)
        for j, x in reversed(list(enumerate(node.all_input_nodes)))
        for s, key in enumerate(keys[x])
        if key is not None
    }
    slots: list[Slot] = []
    for tensor, key in zip(values, keys[node], strict=True):
        if key is None:
            slots.append(0)
        elif key in held:
            slots.append(held[key])
        elif node.op == "call_function" and node.target is operator.getitem:
            slots.append((0, int(node.args[1])))  # type: ignore[arg-type]
        elif node.op == "call_function" and op_name(node.target) == WAIT:
            # `wait_tensor` returns its input as it is (its fake kernel returns a new
            # tensor): a collective's output and its wait are one storage
            slots.append((0, 0))
        else:
            slots.append(int(tensor.untyped_storage().nbytes()))
    return tuple(slots)


def _all_slots(nodes: list[fx.Node]) -> tuple[tuple[Slot, ...], ...]:
    keys: dict[fx.Node, list[Any]] = {}
    placeholder_storages: set[Any] = set()
    slots: list[tuple[Slot, ...]] = []
    for node in nodes:
        if node.op == "output":
            slots.append(())
            continue
        if "val" not in node.meta:
            raise WorkbenchError(
                f"node {node.name!r} ({node.target}) has no recorded output "
                "(meta['val']): the memory simulator cannot size it; trace the step with "
                "workbench.capture.trace.trace so every node carries a fake tensor"
            )
        keys[node] = _storage_keys(node)
        if node.op == "placeholder":  # inputs may share a storage (token ids and targets)
            key, value = keys[node][0], node.meta["val"]
            fresh = key is not None and key not in placeholder_storages
            placeholder_storages.add(key)
            slots.append((int(value.untyped_storage().nbytes()) if fresh else 0,))
            continue
        slots.append(_slots_of(node, keys))
    return tuple(slots)
