"""The solver's linear model: the saved bytes and recompute cost of a set of saved keys,
from the rules' own steps and the index's storages, without the memory timeline.

Entry point: `LinearModel(graph, estimator, objective, profile, fsdp_reshard)`, whose
`evaluate(saved)` the selection methods call thousands of times; `recomputed(saved)` names
the nodes torch's remat pass would copy into backward, `folded()` merges identical layers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimator
from workbench.decide.decider import rules_of
from workbench.decide.engine import forced_save, save_layer_boundaries, save_written_inputs
from workbench.decide.offloadable import offload_refusal
from workbench.decide.presets import WORKBENCH
from workbench.decide.tables import last_layer
from workbench.decide.tags import Tag, Why
from workbench.rewrite.index import GraphIndex

__all__ = ["RECOMPUTED", "SAVED", "Folded", "LinearModel"]

# `LinearModel.source` of a node no choice moves: always saved (a forced save, an unshard
# chain kept unsharded), or always recomputed (a key backward never reads, an unshard
# chain resharded after forward).
SAVED = -1
RECOMPUTED = -2

# The two tags the engine's steps are handed: a request to save or to recompute.
_TAGS = (
    Tag(CheckpointPolicy.MUST_SAVE, Why.OVERRIDE),
    Tag(CheckpointPolicy.PREFER_RECOMPUTE, Why.PRESET, "full"),
)


@dataclass
class Folded:
    """The linear model's tables with one node per key (`LinearModel.folded`)."""

    nodes: list[str]
    candidates: list[str]
    source: list[int]
    users: list[tuple[int, ...]]
    cross: list[tuple[int, ...]]
    read_by_backward: list[bool]
    storages: list[tuple[int, ...]]
    sizes: list[int]
    cost: list[float]


class LinearModel:
    """Saved bytes and recompute cost of a set of saved keys (the `candidates` kept, every
    other key recomputed: `Policy("full", overrides={key: "save"})`), without the memory
    timeline.

    Tags come from the rules (`rules_of(graph)`): the forced saves (`forced_save`), the FSDP
    choice on unshard chains, followers after their leaders (`DecideTables.leaders`), then
    the engine's own layer-boundary and in-place steps (`save_layer_boundaries`,
    `save_written_inputs`) on the decide tables. So `tags(saved)` is exactly what `decide` gives.
    Recomputation then follows torch's remat pass: a recomputed node is copied into
    backward when a backward node that dead-code elimination keeps reads it, or another
    copy does; with no backward node reading a recomputed one the pass changes nothing.
    So `recomputed(saved)` is exactly the set of nodes the pass copies, and the saved
    bytes of `evaluate` are exactly `Estimate.saved_activation_bytes` of that policy
    (`GraphIndex.activation_storages`: views cost their base once). The peak is not
    modelled; the cost is the recomputed nodes' time or FLOPs (`objective`).
    """

    def __init__(
        self,
        graph: JointGraph,
        estimator: Estimator,
        objective: str,
        profile: str,
        fsdp_reshard: bool = True,
    ):
        rules, index = rules_of(graph), estimator.index
        facts, self.tables = rules.facts, rules.tables
        self.names = [f.name for f in facts]
        self.key_of = [f.key for f in facts]
        position = {name: p for p, name in enumerate(self.names)}
        self.users = [tuple(position[u] for u in f.users if u in position) for f in facts]
        self.read_by_backward = [index.read_in_backward(n, live=True) for n in self.names]
        # without a recomputed node read by backward, torch's pass leaves the graph as is
        self._read_any = [p for p, n in enumerate(self.names) if index.read_in_backward(n)]
        forced = {f.name for f in facts if forced_save(f) is not None}
        # followers take their leader's decision and parameter all-gathers the FSDP
        # choice: none is a choice here, nor a key whose nodes never feed backward
        decided = forced | {name for name, _, _ in self.tables.leaders}
        fixed = {f.key for f in facts if f.name in decided or f.gather is not None}
        read = {k for k, feeds in zip(self.key_of, self._feeds_backward(), strict=True) if feeds}
        self.unread = sorted(set(self.key_of) - read - fixed)  # recomputed as `full` does
        self.candidates = sorted(read - fixed)
        choice = {k: c for c, k in enumerate(self.candidates)}
        self.source = [choice.get(key, RECOMPUTED) for key in self.key_of]
        for p, f in enumerate(facts):
            if f.name in forced:
                self.source[p] = SAVED
            elif f.gather == f.name:
                self.source[p] = RECOMPUTED if fsdp_reshard else SAVED
        for name, leader, _ in self.tables.leaders:  # graph order: leaders come first
            if name not in forced:
                self.source[position[name]] = self.source[position[leader]]
        self.cross: list[tuple[int, ...]] = [()] * len(facts)  # users across a layer boundary
        for name, users in self.tables.boundaries[WORKBENCH]:
            self.cross[position[name]] = tuple(position[u] for u in users)
        involved = {n for name, users in self.tables.boundaries[WORKBENCH] for n in (name, *users)}
        self._boundary_nodes = sorted(((n, position[n]) for n in involved), key=lambda x: x[1])
        self._write_readers = [position[n] for n in self.tables.writes.readers]
        self.storages, self.sizes, self.storage_owner = _storages(index, self.names)
        # keys with a node the rules may offload (`offload_refusal`), and the bytes of
        # the storages each candidate's nodes make: what offloading it would move
        last = last_layer(facts)
        movable = {f.key for f in facts if offload_refusal(f, last) is None}
        self.offloadable = [key in movable for key in self.candidates]
        self.key_bytes = [0] * len(self.candidates)
        for owner, size in zip(self.storage_owner, self.sizes, strict=True):
            if owner is not None and self.source[owner] >= 0:
                self.key_bytes[self.source[owner]] += size
        rows = [index.index_of[n] for n in self.names]
        flops = np.asarray([graph.nodes[n].flops for n in self.names], dtype=float)
        seconds = np.asarray(estimator.seconds[profile], dtype=float)[rows]
        primary, secondary = (seconds, flops) if objective == "recompute_time" else (flops, seconds)
        # ties in the objective (FLOP-free elementwise ops) are broken by the other measure
        scale = primary.sum() / secondary.sum() if secondary.sum() > 0 else 0.0
        self.cost = (primary + 1e-6 * scale * secondary).tolist()

    def _feeds_backward(self) -> list[bool]:
        """Per node: read by backward, directly or through forward nodes (the facts' users
        in reverse graph order)."""
        feeds = [False] * len(self.names)
        for p in self._read_any:
            feeds[p] = True
        for p in reversed(range(len(feeds))):
            feeds[p] = feeds[p] or any(feeds[u] for u in self.users[p])
        return feeds

    def tags(self, saved: Collection[int]) -> list[bool]:
        """Per node (graph order): tagged recompute once the candidates in `saved` are kept,
        as `decide` tags that policy."""
        source = self.source
        flags = [c == RECOMPUTED or (c >= 0 and c not in saved) for c in source]
        if self._boundary_nodes:
            tags = {name: _TAGS[flags[p]] for name, p in self._boundary_nodes}
            save_layer_boundaries(tags, self.tables.boundaries[WORKBENCH])
            for name, p in self._boundary_nodes:
                flags[p] = tags[name].recompute
        if any(flags[p] for p in self._write_readers):
            tags = dict(zip(self.names, [_TAGS[f] for f in flags], strict=True))
            save_written_inputs(tags, self.tables)
            for p in self._write_readers:
                flags[p] = tags[self.names[p]].recompute
        return flags

    def replay(self, flags: Sequence[bool]) -> tuple[list[int], set[int]]:
        """torch's remat pass on these tags (`tags`): the nodes it copies into backward,
        latest first, and the storages backward or the copies read from forward."""
        if not any(flags[p] for p in self._read_any):  # the pass changes nothing
            return [], {s for p in self._read_any for s in self.storages[p]}
        users, read = self.users, self.read_by_backward
        rerun = [False] * len(flags)
        copied: list[int] = []
        held: set[int] = set()
        for p in reversed(range(len(flags))):
            if read[p] or any(rerun[u] for u in users[p]):
                if flags[p]:
                    rerun[p] = True
                    copied.append(p)
                else:
                    held.update(self.storages[p])
        return copied, held

    def evaluate(self, saved: Collection[int]) -> tuple[int, float]:
        """(saved bytes, recompute cost) with the candidates in `saved` kept."""
        copied, held = self.replay(self.tags(saved))
        return sum(self.sizes[s] for s in held), sum(self.cost[p] for p in copied)

    def recomputed(self, saved: Collection[int]) -> set[str]:
        """The nodes torch's remat pass copies into backward with the candidates in `saved`
        kept."""
        copied, _ = self.replay(self.tags(saved))
        return {self.names[p] for p in copied}

    def folded(self) -> Folded:
        """One node per key: the nodes of identical layers merged, bytes and costs summed.

        Layer-boundary edges become edges between keys (the graph may gain cycles, which
        the integer program does not mind); this is what keeps `exact` small. The in-place
        rule is left to the exact estimates that check its answers."""
        keys = list(dict.fromkeys(self.key_of))
        index = {k: q for q, k in enumerate(keys)}
        members: list[list[int]] = [[] for _ in keys]
        for p, key in enumerate(self.key_of):
            members[index[key]].append(p)
        # storages of one key's nodes merge in the order each node makes them
        made: dict[int | None, int] = {}
        fold: list[int] = []
        sizes: list[int] = []
        merged_ids: dict[tuple[int, int], int] = {}
        for owner, size in zip(self.storage_owner, self.sizes, strict=True):
            rank = made[owner] = made.get(owner, -1) + 1
            at = (-1 - len(fold), 0) if owner is None else (index[self.key_of[owner]], rank)
            sid = merged_ids.setdefault(at, len(sizes))
            if sid == len(sizes):
                sizes.append(0)
            sizes[sid] += size
            fold.append(sid)

        def merged(table: list[tuple[int, ...]], ps: list[int]) -> tuple[int, ...]:
            return tuple(sorted({index[self.key_of[u]] for p in ps for u in table[p]}))

        return Folded(
            nodes=keys,
            candidates=self.candidates,
            source=[self.source[ps[0]] for ps in members],
            users=[merged(self.users, ps) for ps in members],
            cross=[merged(self.cross, ps) for ps in members],
            read_by_backward=[any(self.read_by_backward[p] for p in ps) for ps in members],
            storages=[
                tuple(sorted({fold[s] for p in ps for s in self.storages[p]})) for ps in members
            ],
            sizes=sizes,
            cost=[sum(self.cost[p] for p in ps) for ps in members],
        )


def _storages(
    index: GraphIndex, names: Sequence[str]
) -> tuple[list[tuple[int, ...]], list[int], list[int | None]]:
    """Each node's storages that count as saved activations (`activation_storages`, ids
    renumbered from 0), their bytes, and the position of the node making each (None: not
    one of `names`)."""
    position = {name: p for p, name in enumerate(names)}
    renumber: dict[int, int] = {}
    storages: list[tuple[int, ...]] = []
    sizes: list[int] = []
    owners: list[int | None] = []
    for name in names:
        ids = []
        for s in index.activation_storages(name):
            if s not in renumber:
                renumber[s] = len(sizes)
                sizes.append(index.storage_bytes(s))
                owners.append(position.get(index.storage_owner(s)))
            ids.append(renumber[s])
        storages.append(tuple(ids))
    return storages, sizes, owners
