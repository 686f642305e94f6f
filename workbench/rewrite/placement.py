"""Where an offloaded value's four steps go in a node order, the one placement rule, and
how an offloaded graph marks its nodes.

Entry points: `place_offloads(...)` and `interleave(...)` (the pass's form) and
`place_offloads_arrays` / `interleave_arrays` (the estimate's), `is_offload_node(node)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.fx as fx

from workbench.decide.offloadable import OffloadOptions
from workbench.errors import WorkbenchError

# gm.meta key holding the `OffloadReport` of a graph the pass rewrote; node.meta key marking a
# forward view the pass replayed on a reloaded tensor (its other meta is the original's).
OFFLOAD_META = "workbench_offload"
REPLAYED_VIEW = "workbench_offload_replayed_view"


def is_offload_node(node: fx.Node) -> bool:
    """A node the offload pass inserted (copy, reload or wait, on either op set)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        (target.namespace == "workbench" and target._opname in ("offload", "reload", "wait_tensor"))
        or target.namespace == "ao"
    )


class Offloaded(NamedTuple):
    """One offloaded storage in a node order: where it is made, last read in forward (the
    producer itself when nothing else reads it there) and first read in backward."""

    producer: int
    last_forward_use: int
    first_backward_use: int


class Place(NamedTuple):
    """Where its four steps go: the copy right after `copy_after`, the wait that frees the
    device original right after `free_after`, the reload right before `reload_before`, the
    wait for it right before `wait_before` (its first backward reader)."""

    copy_after: int
    free_after: int
    reload_before: int
    wait_before: int


NO_LAYER = -1  # `place_offloads_arrays`' layer id of nodes outside the layers


def place_offloads(
    backward: Sequence[bool],
    layer: Sequence[int | None],
    values: Sequence[Offloaded],
    options: OffloadOptions,
) -> list[Place]:
    """Where each value's copy, free, reload and wait go in a node order (positions into
    `backward` and `layer`, one entry per node that runs; layer ids are `rules.layer_of`'s,
    never negative, None outside the layers).

    Forward is every position before the first backward one, cut into regions: maximal runs
    of one layer id (nodes outside the layers between them form their own). With
    `defer_layers` M = 0 the device original is freed right after its last forward reader;
    with M > 0 at the end of the region M regions after the producer's (never before the
    last reader, at the latest at the end of forward). Backward layers are ordered by their
    first backward node; the reload goes before the first backward node of the layer
    `prefetch_layers` N before the producer's layer in that order (the first backward node
    when there is none that early), never after the first reader, and right before it when
    N = 0 or the producer is outside the layers. Counting from the producer's layer is
    graph trainer's rule (`apply_cpu_offload_pass`), so an exported policy runs where the
    estimate puts it (`workbench.interop.titan_offload.offload_passes` checks)."""
    ids = np.fromiter((NO_LAYER if x is None else x for x in layer), np.int64, len(layer))
    return place_offloads_arrays(np.asarray(backward, bool), ids, values, options)


def place_offloads_arrays(
    backward: np.ndarray, layer: np.ndarray, values: Sequence[Offloaded], options: OffloadOptions
) -> list[Place]:
    """`place_offloads` on arrays (the estimate's form): `layer` holds `NO_LAYER` where the
    list form holds None."""
    end = int(np.argmax(backward)) if backward.any() else len(backward)
    producer, last_use, q = np.array(values, np.int64).reshape(len(values), 3).T
    wrong = np.flatnonzero((producer >= end) | (q < end))
    if len(wrong):
        k = wrong[0]
        raise WorkbenchError(
            f"offloaded value at {producer[k]} must be made in forward (before {end}) and "
            f"read in backward, not first at {q[k]}"
        )
    free = np.maximum(producer, last_use)
    if options.defer_layers:
        # forward regions start where the layer id changes; each ends before the next
        starts = np.flatnonzero(np.diff(layer[:end])) + 1
        region_end = np.append(starts - 1, end - 1)
        region = np.searchsorted(starts, producer, side="right")
        target = np.minimum(region + options.defer_layers, len(region_end) - 1)
        free = np.maximum(free, region_end[target])
    reload = q
    ids, first, rank = _backward_layers(backward, layer, end)
    if options.prefetch_layers and len(ids):
        lid = layer[producer]
        k = np.minimum(np.searchsorted(ids, lid), len(ids) - 1)
        earlier = rank[k] - options.prefetch_layers
        start = np.where(earlier >= 0, first[np.maximum(earlier, 0)], end)
        reload = np.where(ids[k] == lid, np.minimum(q, start), q)
    rows = zip(producer.tolist(), free.tolist(), reload.tolist(), q.tolist(), strict=True)
    return [Place(*row) for row in rows]


def _backward_layers(
    backward: np.ndarray, layer: np.ndarray, end: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layers backward runs (ids sorted), their first backward nodes in the order
    backward reaches them, and each id's rank in that order."""
    ran = np.flatnonzero(backward[end:] & (layer[end:] != NO_LAYER)) + end
    ids, first = np.unique(layer[ran], return_index=True)
    by_first = np.argsort(first)
    rank = np.empty(len(ids), np.int64)
    rank[by_first] = np.arange(len(ids))
    return ids, ran[first][by_first], rank


StepKind = Literal["node", "offload", "free", "reload", "wait"]
STEP_KINDS: tuple[StepKind, ...] = ("node", "offload", "free", "reload", "wait")


class Step(NamedTuple):
    """One step of the offloaded order: `("node", position)` runs the node at that position
    of the input order; the others run that step of value `k` (index into `values`)."""

    kind: StepKind
    at: int


def interleave(length: int, places: Sequence[Place]) -> list[Step]:
    """The node order with the offload steps in it, as the pass builds the graph: after a
    node, the copies of values it produced, then the frees placed after it; before a node,
    the reloads placed before it, in the order backward first reads them (the transfer
    stream runs them in that order; graph trainer queues them so too), then the waits;
    otherwise in value order."""
    kinds, at = interleave_arrays(length, places)
    return [Step(STEP_KINDS[k], a) for k, a in zip(kinds.tolist(), at.tolist(), strict=True)]


def interleave_arrays(length: int, places: Sequence[Place]) -> tuple[np.ndarray, np.ndarray]:
    """`interleave` as two arrays (the estimate's form): each step's kind, an index into
    `STEP_KINDS`, and its position or value index. Sorted by (node position, group, first
    backward reader for reloads, value), the groups being reloads, waits, the node, copies,
    frees."""
    values = len(places)
    table = np.array(places, np.int64).reshape(values, 4)
    k = np.arange(values)
    span = length + 1  # room for the first-reader position of reloads

    def key(position: Any, group: int, reader: Any = 0, value: Any = 0) -> Any:
        return ((position * 5 + group) * span + reader) * (values + 1) + value

    keys = [key(np.arange(length), 2)]
    # offload, free, reload and wait, each after or before its anchor column
    keys += [key(table[:, 0], 3, 0, k), key(table[:, 1], 4, 0, k)]
    keys += [key(table[:, 2], 0, table[:, 3], k), key(table[:, 3], 1, 0, k)]
    kinds = np.repeat(np.arange(5), [length] + [values] * 4)
    at = np.concatenate((np.arange(length), np.tile(k, 4)))
    order = np.argsort(np.concatenate(keys), kind="stable")
    return kinds[order], at[order]
