"""The index form of a JointGraph: nodes as integers, storages and aliases resolved once.

Entry points: `graph_index(graph) -> GraphIndex` (built once per graph, cached here) and,
on it, `saved_by_node(schedule)`: THE definition of the activations a step keeps for
backward, which the estimate, remat reports, pictures and the explorer all read.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (  # noqa: E501
    is_impure_node_for_dce,
)
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.errors import WorkbenchError
from workbench.graph import ORIGIN_KEY, JointGraph, Phase
from workbench.offload import REPLAYED_VIEW, is_offload_node
from workbench.rules import unshard_chains

__all__ = ["GraphIndex", "Schedule", "Slot", "Storages", "distinct_storage_bytes", "graph_index"]

# A node's output slots: an int is a fresh storage of that many bytes (0: no tensor), a
# pair (j, s) aliases slot s of the node's j-th input (views, getitem, in-place ops).
Slot = int | tuple[int, int]
# A rewritten graph as indices: its node order and each entry's inputs. Entries `i < n`
# are original nodes, `n + i` the recomputed copy of node i.
Schedule = tuple[list[int], dict[int, tuple[int, ...]]]

_FORWARD = ("forward", "loss")
SLOT_BITS = 12  # output slots per node at most 2**12: slot keys pack into one int


class Storages(NamedTuple):
    """Storage ids held by each schedule entry; each storage's owning entry, bytes, and the
    position in the schedule where it is allocated."""

    held_by: dict[int, tuple[int, ...]]
    owner: list[int]
    sizes: list[int]
    born: list[int]


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

    # --- schedules ---------------------------------------------------------------------

    def identity(self) -> Schedule:
        """The joint graph as traced (no remat)."""
        return list(range(self.n)), dict(enumerate(self.args))

    def schedule_of(self, gm: fx.GraphModule) -> Schedule:
        """The order and inputs of a graph produced from this one by torch's remat pass.

        Nodes map back through `meta[ORIGIN_KEY]` (the pass renames nodes); a copy of a
        forward node that runs in backward is its recomputed copy. The offload pass's copies,
        reloads and waits stand for the value they move, and the views it replays in backward
        for the forward views they replay: the schedule torch's pass made, as if the values
        stayed on the device (offload is not priced here yet)."""
        entry: dict[fx.Node, int] = {}
        order: list[int] = []
        args: dict[int, tuple[int, ...]] = {}
        for node in gm.graph.nodes:
            origin = node.meta.get(ORIGIN_KEY)
            if is_offload_node(node):  # stands for the value it copies: kept on the device
                entry[node] = entry[node.all_input_nodes[0]]
                continue
            if node.meta.get(REPLAYED_VIEW):  # stands for the forward view it replays
                entry[node] = self.origin_of[origin]
                continue
            i = self.output if node.op == "output" else self.origin_of.get(origin)
            if i is None or origin is None and node.op != "output":
                raise WorkbenchError(
                    f"node {node.name!r} does not come from the traced graph of "
                    f"{self.graph.model_name!r}: estimate graphs that torch's remat pass made "
                    "from it (workbench.remat.remat)"
                )
            if not self.is_bwd[i] and node.meta.get("autograd_backward", False):
                i += self.n
            entry[node] = i
            order.append(i)
            args[i] = tuple(entry[x] for x in node.all_input_nodes)
        return order, args

    # --- storages ----------------------------------------------------------------------

    @functools.cached_property
    def forward_inputs(self) -> tuple[tuple[int, ...], ...]:
        """Per node: its inputs from forward or loss, the only ones a policy can recompute."""
        return tuple(tuple(x for x in args if self.phase[x] in _FORWARD) for args in self.args)

    @functools.cached_property
    def raisable(self) -> bytes:
        """Per node: a getitem of a non-getitem, which torch's `raise_getitems` moves."""
        return bytes(
            getitem and not self.is_getitem[self.args[i][0]]
            for i, getitem in enumerate(self.is_getitem)
        )

    @functools.cached_property
    def _slot_plan(self) -> tuple[tuple[tuple[tuple[int, int], ...], ...], tuple[Any, ...]]:
        """Per node: its fresh slots as (slot, bytes) and its aliases as (slot, input, slot)."""
        fresh = tuple(
            tuple((s, b) for s, b in enumerate(slots) if isinstance(b, int) and b)
            for slots in self.slots
        )
        alias = tuple(
            tuple((s, a[0], a[1]) for s, a in enumerate(slots) if isinstance(a, tuple))
            for slots in self.slots
        )
        return fresh, alias

    def storages(self, schedule: Schedule) -> Storages:
        """The storages a schedule allocates: which each entry holds, their owners, sizes.

        Fresh slots get an id when their entry runs; aliases resolve through the entry's
        inputs, so a recomputed copy aliases its own inputs, not its original's. No storage
        stands behind an alias of a placeholder that shares another's (inputs are held for
        the whole step anyway)."""
        order, args = schedule
        n = self.n
        fresh_of, alias_of = self._slot_plan
        held_by: dict[int, tuple[int, ...]] = {}
        slot_storage: dict[int, int] = {}  # entry << SLOT_BITS | slot -> storage id
        owner: list[int] = []
        sizes: list[int] = []
        born: list[int] = []
        for p, e in enumerate(order):
            i = e if e < n else e - n
            fresh, alias = fresh_of[i], alias_of[i]
            if not alias:
                if not fresh:
                    continue
                if len(fresh) == 1:  # the common case: one new tensor
                    sid = len(owner)
                    owner.append(e)
                    sizes.append(fresh[0][1])
                    born.append(p)
                    slot_storage[e << SLOT_BITS | fresh[0][0]] = sid
                    held_by[e] = (sid,)
                    continue
            elif not fresh and len(alias) == 1:  # a view, getitem or in-place op
                s, j, t = alias[0]
                aliased = slot_storage.get(args[e][j] << SLOT_BITS | t)
                if aliased is not None:
                    slot_storage[e << SLOT_BITS | s] = aliased
                    held_by[e] = (aliased,)
                continue
            held = []
            for s, size in fresh:
                sid = len(owner)
                owner.append(e)
                sizes.append(size)
                born.append(p)
                slot_storage[e << SLOT_BITS | s] = sid
                held.append(sid)
            if alias:
                inputs = args[e]
                for s, j, t in alias:
                    aliased = slot_storage.get(inputs[j] << SLOT_BITS | t)
                    if aliased is not None:
                        slot_storage[e << SLOT_BITS | s] = aliased
                        held.append(aliased)
            if held:
                held_by[e] = tuple(held) if len(held) == 1 else tuple(dict.fromkeys(held))
        return Storages(held_by, owner, sizes, born)

    def saved_storages(self, schedule: Schedule, table: Storages) -> set[int]:
        """Storages of forward and loss nodes read by a backward node or a recomputed copy:
        what the step keeps from forward for backward, views followed to their base. Not
        the step's outputs (the loss is returned, not kept), inputs' storages (a view of a
        buffer or of the tokens is held by the caller anyway), nor the gathered parameter
        copies of FSDP unshard chains (parameters, not activations, whatever is kept)."""
        order, args = schedule
        n, phase, held_by = self.n, self.phase, table.held_by
        saved: set[int] = set()
        for e in order:
            if e >= n or phase[e] == "backward":
                for x in args[e]:
                    if x < n and phase[x] in _FORWARD:
                        saved.update(held_by.get(x, ()))
        saved.difference_update(*(held_by.get(x, ()) for x in args[self.output]))
        gathered, owner = self.gathered, table.owner
        return {
            sid
            for sid in saved
            if phase[owner[sid] % n] != "input" and owner[sid] % n not in gathered
        }

    def saved_by_node(self, schedule: Schedule) -> dict[str, int]:
        """Bytes kept for backward, by the forward node that allocated each storage (its
        base, for activations backward reads through views). The one definition of saved
        activation bytes: its total is `Estimate.saved_activation_bytes`."""
        table = self.storages(schedule)
        result: dict[str, int] = {}
        for sid in sorted(self.saved_storages(schedule, table)):
            name = self.names[table.owner[sid] % self.n]
            result[name] = result.get(name, 0) + table.sizes[sid]
        return result

    # --- readers -----------------------------------------------------------------------

    def read_directly(self, schedule: Schedule) -> set[str]:
        """Forward and loss nodes that a backward node or a recomputed copy of the schedule
        takes as an input: the values its forward region hands over to backward."""
        order, args = schedule
        n, phase = self.n, self.phase
        return {
            self.names[x]
            for e in order
            if e >= n or phase[e] == "backward"
            for x in args[e]
            if x < n and phase[x] in _FORWARD
        }

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
        # torch's pass also reads these AOTAutograd tags; graphs from workbench.trace have none.
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
                "workbench.trace.trace so every node carries a fake tensor"
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
