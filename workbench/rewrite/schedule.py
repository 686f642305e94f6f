"""A rewritten graph as node indices: the vocabulary the index, the replayed remat pass and
the estimate share.

Entry points: `Schedule` (order and inputs), `Flat` (the same as arrays), `Csr` (per-node
lists as two arrays), `OFFLOAD_STEPS` with `offload_entry` / `offload_step`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["OFFLOAD_STEPS", "Csr", "Flat", "Schedule", "offload_entry", "offload_step"]

# A rewritten graph as indices: its node order and each entry's inputs. Entries `i < n`
# are original nodes, `n + i` the recomputed copy of node i, `2n + i` forward view i
# replayed by the offload pass on a reloaded tensor, and `3n + 4i + k` step k of node i's
# offload (`OFFLOAD_STEPS`: the host copy, the free of the device original, the reload,
# the wait for it).
Schedule = tuple[list[int], dict[int, tuple[int, ...]]]
OFFLOAD_STEPS = ("offload", "free", "reload", "wait")


def offload_entry(n: int, node: Any, step: Any) -> Any:
    """The entry of step `step` (an index into `OFFLOAD_STEPS`) of node `node`'s offload in a
    graph of `n` nodes; ints or arrays."""
    return 3 * n + 4 * node + step


def offload_step(n: int, entries: Any) -> Any:
    """Which step (an index into `OFFLOAD_STEPS`) each offload entry is; ints or arrays."""
    return (entries - 3 * n) % 4


class Flat(NamedTuple):
    """A schedule as arrays, so per-policy work is array operations: the entries in order,
    and every input read as (reader's position, entry read), readers in order."""

    entries: np.ndarray
    reader: np.ndarray
    read: np.ndarray


class Csr(NamedTuple):
    """Per-node lists as two arrays: node i's items are `items[start[i] : start[i + 1]]`."""

    start: np.ndarray
    items: np.ndarray

    @classmethod
    def of(cls, lists: Sequence[Sequence[int]]) -> Csr:
        counts = np.fromiter((len(x) for x in lists), np.int64, len(lists))
        items = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(counts.sum()))
        return cls(np.concatenate(([0], np.cumsum(counts))), items)

    def gather(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The lists of `nodes`, concatenated: (position in `nodes` of each item, item)."""
        first, counts = self.start[nodes], self.start[nodes + 1] - self.start[nodes]
        position = np.repeat(np.arange(len(nodes)), counts)
        offsets = np.cumsum(counts) - counts
        return position, self.items[np.arange(len(position)) - np.repeat(offsets - first, counts)]
