"""torch's remat pass replayed on node indices: the node order it would produce, no graph built.

Entry points: `replay(index, recompute) -> Flat`, `offload_order(index, flat, names,
options)` (the offload pass replayed on it) and `saved_bytes_by_node(graph, decisions)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from workbench.capture.graph import JointGraph
from workbench.decide.facts import StorageView, needed_aliases
from workbench.decide.offloadable import OffloadOptions, OffloadView, examine_offload
from workbench.decide.tags import RECOMPUTE, Refused, Tag
from workbench.errors import WorkbenchError
from workbench.rewrite.entries import OFFLOAD_STEPS, Csr, Flat
from workbench.rewrite.index import GraphIndex, graph_index
from workbench.rewrite.placement import Offloaded, Place, interleave_arrays, place_offloads_arrays

__all__ = [
    "offload_order",
    "recompute_flags",
    "recompute_flops_by_node",
    "replay",
    "saved_bytes_by_node",
]


def recompute_flags(index: GraphIndex, decisions: Mapping[str, Tag]) -> np.ndarray:
    """Per node: tagged for recompute."""
    flags = np.zeros(index.n, bool)
    index_of = index.index_of
    flags[[index_of[name] for name, tag in decisions.items() if tag.policy in RECOMPUTE]] = True
    return flags


def replay(
    index: GraphIndex, recompute: Sequence[bool] | np.ndarray, allow_random: bool = False
) -> Flat:
    """The node order `remat_using_tags_for_fwd_loss_bwd_graph` would produce: the forward as
    is, each backward node preceded by the recompute-tagged forward nodes it needs (in
    forward order, each copied once), then dead-code elimination with torch's own impurity
    test, and getitems raised to their producers. Random ops tagged recompute are refused
    as torch refuses them, unless `allow_random` (partitioner tags in the studies, whose
    pass replays RNG: their node order is only read for bytes). Only forward and loss nodes
    can be tagged. Array operations throughout, so a flip re-estimates in milliseconds."""
    a, space = index.arrays, index.space
    rec = np.asarray(recompute, bool)
    chosen = np.flatnonzero(rec)
    if not len(chosen):
        return index.identity_flat
    if not a.forward[chosen].all():
        bad = [index.names[i] for i in chosen if not a.forward[i]]
        raise WorkbenchError(
            f"only forward and loss nodes can be recomputed, not {', '.join(bad[:3])}"
        )
    random = [index.names[i] for i in chosen.tolist() if index.is_random[i]]
    if random and not allow_random:
        raise WorkbenchError(
            f"random ops cannot be recomputed by torch's remat pass: {', '.join(random[:3])}"
        )
    reader, read = _edges(index)
    wanted = a.backward[reader] & rec[read]  # backward nodes reading recomputed ones
    needing = np.unique(a.region[reader[wanted]])
    if not len(needing):
        return index.identity_flat
    if len(needing) > 1:
        raise WorkbenchError(
            f"{len(needing)} disjoint backward regions read recomputed nodes; torch's remat "
            "pass supports one: keep the recompute tags inside one backward region"
        )
    start, end = index.regions[int(needing[0])]
    remapped = np.zeros(space.replays, bool)  # entries reading copies: the region's, copies
    remapped[start:end] = remapped[space.copies :] = True
    entries = _with_copies(index, rec, reader[wanted], read[wanted])
    entries = _dead_code_eliminated(index, entries, rec, remapped)
    entries = _getitems_raised(index, entries, rec, remapped)
    return Flat(entries, *_inputs(index, entries, rec, remapped))


def _edges(index: GraphIndex) -> tuple[np.ndarray, np.ndarray]:
    """Every (reader, input) pair of the graph."""
    inputs = index.arrays.inputs
    return np.repeat(np.arange(index.n), np.diff(inputs.start)), inputs.items


def _with_copies(
    index: GraphIndex, rec: np.ndarray, backward: np.ndarray, needed: np.ndarray
) -> np.ndarray:
    """All entries in order with the recomputed copies inserted. A copy runs right before
    the first backward node that needs it, directly (`backward[k]` reads `needed[k]`) or
    through other copies: torch's pass copies what each backward node needs that no earlier
    one did, in forward order."""
    n = index.n
    never = n
    first = np.full(n, never, np.int64)
    np.minimum.at(first, needed, backward)
    first_of, flags = first.tolist(), rec.tolist()
    for u in np.flatnonzero(rec)[::-1].tolist():  # a node's users come after it
        f = first_of[u]
        if f == never:
            continue
        for y in index.args[u]:
            if flags[y] and first_of[y] > f:
                first_of[y] = f
    first = np.asarray(first_of, np.int64)
    copied = np.flatnonzero(first < never)
    # sort by (where it runs, copies before their backward node, node index)
    nodes = np.arange(n)
    keys = np.concatenate((nodes * 2 * n + n + nodes, first[copied] * 2 * n + copied))
    return np.concatenate((nodes, index.space.copy(copied)))[np.argsort(keys)]


def _inputs(
    index: GraphIndex, entries: np.ndarray, rec: np.ndarray, remapped: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The inputs of `entries` as (position, entry read): the recomputed copy where the
    reader is `remapped` and the input is recomputed."""
    space = index.space
    position, read = index.arrays.inputs.gather(space.original(entries))
    return position, read + space.copies * (remapped[entries[position]] & rec[read])


def _dead_code_eliminated(
    index: GraphIndex, entries: np.ndarray, rec: np.ndarray, remapped: np.ndarray
) -> np.ndarray:
    """torch's dead-code elimination: an entry stays if it is impure or a kept entry reads
    it. Unread entries go, then those only they read, and so on: on a DAG, the same as
    FX's reverse walk, in as many rounds as the longest chain of dying entries."""
    size = index.space.replays  # originals and copies
    impure = np.tile(index.arrays.impure, 2)
    position, read = _inputs(index, entries, rec, remapped)
    reads = Csr(np.searchsorted(position, np.arange(len(entries) + 1)), read)
    readers = np.bincount(read, minlength=size)
    place = np.zeros(size, np.int64)
    place[entries] = np.arange(len(entries))
    dead = np.zeros(size, bool)
    dying = entries[(readers[entries] == 0) & ~impure[entries]]
    while len(dying):
        dead[dying] = True
        _, freed = reads.gather(place[dying])
        readers -= np.bincount(freed, minlength=size)
        dying = np.unique(freed[(readers[freed] == 0) & ~impure[freed] & ~dead[freed]])
    return entries[~dead[entries]]


def _getitems_raised(
    index: GraphIndex, entries: np.ndarray, rec: np.ndarray, remapped: np.ndarray
) -> np.ndarray:
    """torch's `raise_getitems`: each getitem moves right after the node it unpacks
    (a getitem of a getitem, which aten graphs do not have, would stay in place)."""
    space, steps = index.space, len(entries)
    nodes = space.original(entries)
    raisable = index.arrays.raisable[nodes]
    if not raisable.any():
        return entries
    parent = index.arrays.inputs.items[index.arrays.inputs.start[nodes[raisable]]]
    parent = parent + space.copies * (remapped[entries[raisable]] & rec[parent])
    place = np.zeros(space.replays, np.int64)
    place[entries] = np.arange(steps)
    # sort by (the position it follows, getitems after their producer, own position)
    keys = np.arange(steps) * 2 * steps
    keys[raisable] = place[parent] * 2 * steps + steps + np.flatnonzero(raisable)
    return entries[np.argsort(keys)]


def saved_bytes_by_node(graph: JointGraph, decisions: Mapping[str, Tag] | None) -> dict[str, int]:
    """Saved activation bytes by forward node once `decisions` are rematerialized (the
    joint graph as traced when None): `GraphIndex.saved_by_node` of the replayed node order.
    Pictures and diffs read it, also for partitioner tags that recompute random ops."""
    index = graph_index(graph)
    if decisions is None:
        return index.saved_by_node(index.identity_flat)
    flags = recompute_flags(index, decisions)
    return index.saved_by_node(replay(index, flags, allow_random=True))


def recompute_flops_by_node(
    graph: JointGraph, decisions: Mapping[str, Tag] | None
) -> dict[str, int]:
    """FLOPs backward runs again, by forward node, once `decisions` are rematerialized:
    `GraphIndex.recompute_flops_by_node` of the replayed node order, the estimate's figure
    (`Estimate.recompute_flops` is its total), never the FLOPs of every node tagged
    recompute. Pictures and diffs read it."""
    if decisions is None:
        return {}
    index = graph_index(graph)
    flags = recompute_flags(index, decisions)
    return index.recompute_flops_by_node(replay(index, flags, allow_random=True).entries)


def offload_order(
    index: GraphIndex, flat: Flat, names: Sequence[str], options: OffloadOptions
) -> tuple[Flat, dict[str, Refused]]:
    """The node order `offload.offload_pass` makes of a rematerialized one (`replay`'s) when
    it offloads the nodes `names`: the same skips for the same reasons (`examine_offload`,
    which the pass asks too: not a forward op, not one tensor, an alias, returned, written
    in place, not read in backward), `Offloaded` read off the node order, then THE placement
    (`place_offloads_arrays`, `interleave`); each wait for a reload is followed by the
    forward views backward reads, replayed on it, and backward readers read the reload.
    Returns the node order and the skipped names with why."""
    space, entries = index.space, flat.entries
    if not len(names):
        return flat, {}
    length = len(entries)
    nodes = space.original(entries)
    backward = np.where(entries < space.copies, index.arrays.backward[nodes], True)
    end = int(np.argmax(backward)) if backward.any() else length
    position = np.full(space.steps, -1, np.int64)
    position[entries] = np.arange(length)
    by_read = np.argsort(flat.read, kind="stable")
    start = np.searchsorted(flat.read[by_read], np.arange(space.steps + 1))
    readers_at = flat.reader[by_read]
    view = _offload_view(index, entries, position, start, readers_at, end)
    skipped: dict[str, Refused] = {}
    wanted: list[tuple[int, list[int], Offloaded]] = []  # node, needed aliases, facts
    for name in names:
        i = index.index_of.get(name, -1)
        found = examine_offload(i, view)
        if isinstance(found, Refused):
            skipped[name] = found
            continue
        p = int(position[i])
        last = _last_forward_use(index, found.forward, entries, start, readers_at, end)
        needed = needed_aliases(sorted(found.aliases), found.read_aliases, index.args.__getitem__)
        wanted.append((i, needed, Offloaded(p, max(p, last), min(found.readers))))
    if not wanted:
        return flat, skipped
    wanted.sort(key=lambda w: w[2].producer)
    layer = index.arrays.layer[nodes]
    places = place_offloads_arrays(backward, layer, [w[2] for w in wanted], options)
    return _interleaved(index, flat, end, wanted, places), skipped


def _offload_view(
    index: GraphIndex,
    entries: np.ndarray,
    position: np.ndarray,
    start: np.ndarray,
    readers_at: np.ndarray,
    end: int,
) -> OffloadView:
    """A rematerialized node order as `examine_offload` reads it: values are node indices,
    their readers positions in the node order (`readers_at[start[i] : start[i + 1]]`), forward
    every position before `end`; a value shares the storage walked where it has an output
    slot aliasing a value already found (`_aliases`)."""
    original = index.space.copies  # the entries below it are the traced nodes
    call, single, writes = index.offload_facts[:3]
    return OffloadView(
        forward_op=lambda i: i >= 0 and 0 <= int(position[i]) < end and bool(call[i]),
        one_tensor=lambda i: bool(single[i]),
        fresh=lambda i: bool(index.value_slots[i] >= 0),
        name=lambda i: index.names[i],
        storage=StorageView(
            readers=lambda i: readers_at[start[i] : start[i + 1]].tolist(),
            value=lambda q: int(entries[q]),
            is_output=lambda q: int(entries[q]) == index.output,
            in_backward=lambda q: q >= end,
            shares=lambda u, seen: u < original and _aliases(index, u, seen),
            writes=lambda u: bool(writes[u]),
        ),
    )


def _last_forward_use(
    index: GraphIndex,
    forward: list[int],
    entries: np.ndarray,
    start: np.ndarray,
    readers_at: np.ndarray,
    end: int,
) -> int:
    """`offload._last_forward_use` on the node order: the last forward reader's position
    (`forward`, of the value or an alias), or an asynchronous collective's wait; -1 for
    none."""
    until_wait = index.offload_facts[3]
    last = -1
    for q in forward:
        last = max(last, q)
        u = int(entries[q])
        # an asynchronous collective (a traced node) reads until its wait
        if u < index.space.copies and until_wait[u]:
            waits = readers_at[start[u] : start[u + 1]]
            last = max([last, *(int(w) for w in waits.tolist() if w < end)])
    return last


def _aliases(index: GraphIndex, u: int, of: set[int]) -> bool:
    """Node `u` has an output slot aliasing one of the nodes `of`."""
    args = index.args[u]
    return any(isinstance(s, tuple) and args[s[0]] in of for s in index.slots[u])


def _interleaved(
    index: GraphIndex,
    flat: Flat,
    end: int,
    wanted: list[tuple[int, list[int], Offloaded]],
    places: Sequence[Place],
) -> Flat:
    """The node order as `interleave` arranges it, with the offload steps' entries and inputs:
    the copy reads the value, the free the copy and the value, the reload the copy, the
    wait the reload and the copy, each replayed view its base as replayed; backward readers
    of a value or its views read the wait and the replayed views instead."""
    space = index.space
    kinds, at = interleave_arrays(len(flat.entries), places)
    value = np.array([w[0] for w in wanted], np.int64)
    node = kinds == 0
    entries = np.where(node, flat.entries[np.where(node, at, 0)], 0)
    step = ~node
    entries[step] = space.offload(value[at[step]], kinds[step] - 1)
    remap = np.arange(space.steps)
    for i, needed, _ in wanted:
        remap[i] = space.offload(i, OFFLOAD_STEPS.index("wait"))
        remap[needed] = space.replayed(np.asarray(needed, np.int64))
    # the views replayed after each wait: (step they follow, rank after it, entry, inputs)
    extra: list[tuple[int, int, int, list[int]]] = []
    for q in np.flatnonzero(kinds == 4).tolist():
        for j, a in enumerate(wanted[at[q]][1]):
            extra.append((q, j + 1, space.replayed(a), remap[list(index.args[a])].tolist()))
    room = max((j for _, j, _, _ in extra), default=0) + 1
    keys = np.concatenate((np.arange(len(kinds)) * room, [q * room + j for q, j, _, _ in extra]))
    order = np.argsort(keys)
    entries = np.concatenate((entries, [e for _, _, e, _ in extra]))[order].astype(np.int64)
    new_position = np.empty(len(order), np.int64)
    new_position[order] = np.arange(len(order))
    # inputs: nodes' from the node order (remapped in backward), then the steps', the views'
    reads = Csr(np.searchsorted(flat.reader, np.arange(len(flat.entries) + 1)), flat.read)
    nodes = np.flatnonzero(node)
    which, read = reads.gather(at[nodes])
    read = np.where(at[nodes][which] >= end, remap[read], read)
    reader = [new_position[nodes][which]]
    readers = [read]
    steps = np.flatnonzero(step)
    step_base = space.offload(value[at[steps]], 0)
    # offload reads the value (-1), free the copy and the value, reload the free's output,
    # wait the reload and the free's output: offsets from the value's first step entry
    inputs = {1: (-1,), 2: (0, -1), 3: (1,), 4: (2, 1)}
    for kind, offsets in inputs.items():
        these = kinds[steps] == kind
        for offset in offsets:
            target = value[at[steps][these]] if offset < 0 else step_base[these] + offset
            reader.append(new_position[steps][these])
            readers.append(target)
    first = len(kinds)
    for k, (_, _, _, args) in enumerate(extra):
        reader.append(np.full(len(args), new_position[first + k], np.int64))
        readers.append(np.asarray(args, np.int64))
    reader_all, read_all = np.concatenate(reader), np.concatenate(readers)
    # one entry's inputs come from one source, in order: a stable sort keeps that order
    by = np.argsort(reader_all, kind="stable")
    return Flat(entries, reader_all[by], read_all[by])
