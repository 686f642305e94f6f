"""What deciding derives from a graph's facts alone, once per graph: `DecideTables`.

Entry points: `decide_tables(facts)`, `layer_boundaries`, `last_layer` (each in a dialect's
reading of layers, `presets.DIALECTS`) and `replayed_by` (which recompute-tagged nodes torch's
remat pass copies into backward).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from torch.utils.checkpoint import CheckpointPolicy

from workbench.decide.facts import OpFacts
from workbench.decide.presets import DIALECTS, WORKBENCH, Dialect, DialectRules
from workbench.decide.tags import Tag


class DecideTables(NamedTuple):
    """What deciding derives from the facts alone, built once per graph (`decide_tables`) so
    that re-deciding after a flip only touches the nodes a policy can change: the
    overridden ones, the followers, and the nodes with a user across a layer boundary;
    and so that the offload rules look a node up without a pass over the graph."""

    by_name: dict[str, OpFacts]
    last_layers: dict[Dialect, int | None]  # `last_layer`, per dialect
    by_key: dict[str, list[str]]  # `OpFacts.key` -> nodes
    by_layer_key: dict[str, list[str]]  # `OpFacts.layer_key` -> nodes
    leaders: list[tuple[str, str, bool]]  # (node, its leader, on an unshard chain), in order
    boundaries: dict[Dialect, list[tuple[str, tuple[str, ...]]]]  # each layer-boundary walk
    writes: WriteTables  # the in-place rule's storages, writes and readers
    # (preset, selectors, fsdp_reshard) -> tags before overrides, followers and boundaries,
    # and those tags once followers took their leader's
    request_memo: dict[tuple[Any, ...], tuple[dict[str, Tag], dict[str, Tag]]]
    followers: dict[str, tuple[str, ...]]  # node -> the getitems and waits that unpack it
    # graph trainer's dialect: (preset, selectors, keep unsharded) -> `TitanRequests`
    titan_memo: dict[tuple[Any, ...], TitanRequests]


class TitanRequests(NamedTuple):
    """Graph trainer's per-node tags under one preset, selector list and FSDP keep
    (`engine._titan_requests`): what the preset's rule answered for each node it was asked
    of, and the last overrides decided with the tags they gave, which the next decision
    starts from."""

    answers: dict[str, CheckpointPolicy]
    overrides: dict[str, str]
    tags: dict[str, Tag]


REQUEST_MEMO = 8  # request tables the decide tables remember (one per preset and selector list)


class WriteTables(NamedTuple):
    """What the in-place rule reads, from the facts alone: each node's position in graph
    order, the storage each node's output lives in (named by the node or graph input that
    made it: `alias` followed to its end), the writes into each storage in graph order, and
    the nodes that read a written storage (the only ones the rule can force), in order."""

    position: dict[str, int]
    root: dict[str, str]
    writes: dict[str, list[tuple[int, str]]]  # storage -> [(position, writer)]
    readers: tuple[str, ...]


def write_tables(facts: Sequence[OpFacts]) -> WriteTables:
    """The `WriteTables` of these facts (graph order)."""
    position: dict[str, int] = {}
    root: dict[str, str] = {}
    writes: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for i, f in enumerate(facts):
        position[f.name] = i
        root[f.name] = f.name if f.alias is None else root.get(f.alias, f.alias)
        for x in f.writes:
            writes[root.get(x, x)].append((i, f.name))
    readers = tuple(f.name for f in facts if any(root.get(x, x) in writes for x in f.inputs))
    return WriteTables(position, root, dict(writes), readers)


def decide_tables(facts: Sequence[OpFacts]) -> DecideTables:
    """The tables `decide_ops` reads for these facts (graph order)."""
    by_name = {f.name: f for f in facts}
    by_key: dict[str, list[str]] = collections.defaultdict(list)
    by_layer_key: dict[str, list[str]] = collections.defaultdict(list)
    leaders = []
    followers: dict[str, list[str]] = collections.defaultdict(list)
    for f in facts:
        by_key[f.key].append(f.name)
        by_layer_key[f.layer_key].append(f.name)
        leader = f.gather if f.gather not in (None, f.name) else f.parent
        if leader is not None and leader in by_name:
            leaders.append((f.name, leader, leader == f.gather))
        if f.parent is not None:
            followers[f.parent].append(f.name)
    return DecideTables(
        by_name,
        {dialect: last_layer(facts, dialect) for dialect in DIALECTS},
        dict(by_key),
        dict(by_layer_key),
        leaders,
        {dialect: layer_boundaries(facts, by_name, rules) for dialect, rules in DIALECTS.items()},
        write_tables(facts),
        {},
        {parent: tuple(names) for parent, names in followers.items()},
        {},
    )


def layer_boundaries(
    facts: Sequence[OpFacts], by_name: Mapping[str, OpFacts], rules: DialectRules
) -> list[tuple[str, tuple[str, ...]]]:
    """The nodes with users that cross a layer boundary (`rules.crosses`), and those users,
    in the order the dialect's layer-boundary rule walks them: the workbench's in reverse
    graph order, so a user's final tag is known before its inputs are judged; graph
    trainer's forward."""
    walk = reversed(facts) if rules.walk_reversed else facts
    result = []
    for f in walk:
        users = tuple(u for u in f.users if u in by_name and rules.crosses(f, by_name[u]))
        if users:
            result.append((f.name, users))
    return result


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


def last_layer(facts: Sequence[OpFacts], dialect: Dialect = WORKBENCH) -> int | None:
    """The layer whose activations are never offloaded: backward reads them at once, as the
    dialect reads layers. Graph trainer has none when the graph holds fewer than two."""
    rules = DIALECTS[dialect]
    layers = {layer for f in facts if (layer := rules.layer(f)) is not None}
    if len(layers) < rules.min_layers:
        return None
    return max(layers, default=None)
