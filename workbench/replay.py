"""torch's remat pass replayed on node indices: the schedule it would produce, no graph built.

Entry points: `replay(index, recompute) -> Flat` and `kept_for_backward(graph, decisions)`,
the saved activation bytes per node that a policy leaves after remat.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from workbench.errors import WorkbenchError
from workbench.graph import JointGraph
from workbench.index import Csr, Flat, GraphIndex, graph_index
from workbench.rules import RECOMPUTE, Tag

__all__ = ["kept_for_backward", "recompute_flags", "replay"]


def recompute_flags(index: GraphIndex, decisions: Mapping[str, Tag]) -> np.ndarray:
    """Per node: tagged for recompute."""
    flags = np.zeros(index.n, bool)
    index_of = index.index_of
    flags[[index_of[name] for name, tag in decisions.items() if tag.policy in RECOMPUTE]] = True
    return flags


def replay(
    index: GraphIndex, recompute: Sequence[bool] | np.ndarray, allow_random: bool = False
) -> Flat:
    """The schedule `remat_using_tags_for_fwd_loss_bwd_graph` would produce: the forward as
    is, each backward node preceded by the recompute-tagged forward nodes it needs (in
    forward order, each copied once), then dead-code elimination with torch's own impurity
    test, and getitems raised to their producers. Random ops tagged recompute are refused
    as torch refuses them, unless `allow_random` (partitioner tags in the studies, whose
    pass replays RNG: their schedule is only read for bytes). Only forward and loss nodes
    can be tagged. Array operations throughout, so a flip re-estimates in milliseconds."""
    a, n = index.arrays, index.n
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
    remapped = np.zeros(2 * n, bool)  # entries reading copies: the region's nodes, copies
    remapped[start:end] = remapped[n:] = True
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
    return np.concatenate((nodes, n + copied))[np.argsort(keys)]


def _inputs(
    index: GraphIndex, entries: np.ndarray, rec: np.ndarray, remapped: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The inputs of `entries` as (position, entry read): the recomputed copy where the
    reader is `remapped` and the input is recomputed."""
    position, read = index.arrays.inputs.gather(entries % index.n)
    return position, read + index.n * (remapped[entries[position]] & rec[read])


def _dead_code_eliminated(
    index: GraphIndex, entries: np.ndarray, rec: np.ndarray, remapped: np.ndarray
) -> np.ndarray:
    """torch's dead-code elimination: an entry stays if it is impure or a kept entry reads
    it. Unread entries go, then those only they read, and so on: on a DAG, the same as
    FX's reverse walk, in as many rounds as the longest chain of dying entries."""
    n, impure = index.n, np.tile(index.arrays.impure, 2)
    position, read = _inputs(index, entries, rec, remapped)
    reads = Csr(np.searchsorted(position, np.arange(len(entries) + 1)), read)
    readers = np.bincount(read, minlength=2 * n)
    place = np.zeros(2 * n, np.int64)
    place[entries] = np.arange(len(entries))
    dead = np.zeros(2 * n, bool)
    dying = entries[(readers[entries] == 0) & ~impure[entries]]
    while len(dying):
        dead[dying] = True
        _, freed = reads.gather(place[dying])
        readers -= np.bincount(freed, minlength=2 * n)
        dying = np.unique(freed[(readers[freed] == 0) & ~impure[freed] & ~dead[freed]])
    return entries[~dead[entries]]


def _getitems_raised(
    index: GraphIndex, entries: np.ndarray, rec: np.ndarray, remapped: np.ndarray
) -> np.ndarray:
    """torch's `raise_getitems`: each getitem moves right after the node it unpacks
    (a getitem of a getitem, which aten graphs do not have, would stay in place)."""
    n, steps = index.n, len(entries)
    nodes = entries % n
    raisable = index.arrays.raisable[nodes]
    if not raisable.any():
        return entries
    parent = index.arrays.inputs.items[index.arrays.inputs.start[nodes[raisable]]]
    parent = parent + n * (remapped[entries[raisable]] & rec[parent])
    place = np.zeros(2 * n, np.int64)
    place[entries] = np.arange(steps)
    # sort by (the position it follows, getitems after their producer, own position)
    keys = np.arange(steps) * 2 * steps
    keys[raisable] = place[parent] * 2 * steps + steps + np.flatnonzero(raisable)
    return entries[np.argsort(keys)]


def kept_for_backward(graph: JointGraph, decisions: Mapping[str, Tag] | None) -> dict[str, int]:
    """Saved activation bytes by forward node once `decisions` are rematerialized (the
    joint graph as traced when None): `GraphIndex.saved_by_node` of the replayed schedule.
    Pictures and diffs read it, also for partitioner tags that recompute random ops."""
    index = graph_index(graph)
    if decisions is None:
        return index.saved_by_node(index.identity_flat)
    flags = recompute_flags(index, decisions)
    return index.saved_by_node(replay(index, flags, allow_random=True))
