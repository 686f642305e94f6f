"""A rewritten graph as node indices: the vocabulary the index, the replayed remat pass and
the estimate share.

Entry points: `NodeOrder` (order and inputs), `Flat` (the same as arrays), `Csr` (per-node
lists as two arrays), `EntrySpace` (what each entry stands for) and `OFFLOAD_STEPS`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["OFFLOAD_STEPS", "Csr", "EntrySpace", "Flat", "NodeOrder"]

# A rewritten graph as indices: its node order and each entry's inputs (`EntrySpace` says
# what each entry stands for).
NodeOrder = tuple[list[int], dict[int, tuple[int, ...]]]
# The steps of one offload: the host copy, the free of the device original, the reload,
# the wait for it.
OFFLOAD_STEPS = ("offload", "free", "reload", "wait")


class EntrySpace(NamedTuple):
    """The entries of a rewritten graph of `n` traced nodes, and the one place their
    arithmetic lives: `i` is original node i, `copy(i)` its recomputed copy, `replayed(i)`
    forward view i replayed by the offload pass on a reloaded tensor, `offload(i, k)` step k
    (`OFFLOAD_STEPS`) of node i's offload. Each kind starts where the one before ends
    (`copies`, `replays`, `steps`, `size`); every method takes ints or arrays.

    >>> space = EntrySpace(10)
    >>> space.copy(3), space.replayed(3), space.offload(3, 2), space.size
    (13, 23, 44, 70)
    >>> space.node(44), space.step(44), space.node(23), space.is_copy(13), space.is_step(23)
    (3, 2, 3, True, False)
    """

    n: int

    @property
    def copies(self) -> int:
        """The first recomputed copy: originals are the entries below it."""
        return self.n

    @property
    def replays(self) -> int:
        """The first replayed view: originals and copies are the entries below it."""
        return 2 * self.n

    @property
    def steps(self) -> int:
        """The first offload step: every node's own entries are below it."""
        return 3 * self.n

    @property
    def size(self) -> int:
        """One past the last entry: arrays indexed by entry have this length."""
        return self.steps + len(OFFLOAD_STEPS) * self.n

    def copy(self, node: Any) -> Any:
        return self.copies + node

    def replayed(self, node: Any) -> Any:
        return self.replays + node

    def offload(self, node: Any, step: Any) -> Any:
        """The entry of step `step` (an index into `OFFLOAD_STEPS`) of node `node`'s offload."""
        return self.steps + len(OFFLOAD_STEPS) * node + step

    def original(self, entries: Any) -> Any:
        """The traced node of a node's own entries (below `steps`: originals, copies,
        replayed views)."""
        return entries % self.n

    def node(self, entries: Any) -> Any:
        """The traced node each entry stands for."""
        own = entries % self.n
        moved = (entries - self.steps) // len(OFFLOAD_STEPS)
        if isinstance(entries, np.ndarray):
            return np.where(entries < self.steps, own, moved)
        return own if entries < self.steps else moved

    def step(self, entries: Any) -> Any:
        """Which step (an index into `OFFLOAD_STEPS`) each offload entry is."""
        return (entries - self.steps) % len(OFFLOAD_STEPS)

    def is_copy(self, entries: Any) -> Any:
        return (entries >= self.copies) & (entries < self.replays)

    def is_step(self, entries: Any) -> Any:
        return entries >= self.steps


class Flat(NamedTuple):
    """A node order as arrays, so per-policy work is array operations: the entries in order,
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
