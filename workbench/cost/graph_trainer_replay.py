"""Graph trainer's offload and remat passes replayed on node indices: the node order they make
of a cleaned graph for one policy, with no graph built (the `--passes graph-trainer` what-if).

Entry point: `replay_graph_trainer(index, decisions, options) -> Flat` on the index of a graph
after graph trainer's cleanup (`rewrite.graph_trainer.cleanup`). It equals, entry for entry
and input for input, `index.flat(index.order_of(run_passes(graph, decisions).gm))`:
the graph its `apply_cpu_offload_pass` (deferred frees and prefetched reloads included) and
then its `selective_activation_remat_pass` make. `Unreplayable` is raised where the replay
cannot say what they do; the caller then runs the passes (`cost.pass_stacks.PassStackEstimator`).
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.tags import RECOMPUTE, Tag
from workbench.errors import WorkbenchError
from workbench.rewrite.entries import EntrySpace, Flat
from workbench.rewrite.index import GraphIndex

__all__ = ["Unreplayable", "replay_graph_trainer"]

_GT = "torchtitan.experiments.graph_trainer"
_COPY, _FREE, _RELOAD, _WAIT = range(4)  # the offload steps (`entries.OFFLOAD_STEPS`)


def _kind(tag: Tag) -> int:
    """What graph trainer's passes do with a tag: 1 recompute (`must_recompute`), 2 offload
    (`apply_cpu_offload_pass` reads MUST_CPU_OFFLOAD only), 0 nothing."""
    policy = tag.policy
    return 1 if policy in RECOMPUTE else 2 if policy is CheckpointPolicy.MUST_CPU_OFFLOAD else 0


class Unreplayable(Exception):
    """The replay cannot say what graph trainer's passes make of this policy (the message
    says why): run them instead. Their own refusals (a view or a tuple tagged for offload,
    a random op tagged for recompute, two backward regions to recompute in) and a graph read
    out of order are among these, so running the passes says them in graph trainer's words."""


class _Offload(NamedTuple):
    """What `apply_cpu_offload_pass` reads of one value tagged MUST_CPU_OFFLOAD: the forward
    views it replays on the reload (graph order) and each one's inputs as entries, its first
    backward reader (directly or through those views) and the third input of the wait that
    frees it (`last_use_of_storage`; -1 for none)."""

    views: tuple[int, ...]
    view_inputs: tuple[tuple[int, ...], ...]
    first: int
    last_use: int


@dataclass
class _Facts:
    """Per-node facts of one cleaned graph as graph trainer's passes read them (from its
    own helpers, on the graph's nodes), built once per graph."""

    index: GraphIndex
    call: np.ndarray  # a call_function node
    backward: np.ndarray  # meta autograd_backward (`_is_backward_node`)
    layer: np.ndarray  # `_get_layer_id` (-1 outside the layers)
    non_ac: np.ndarray  # of an `lm_head` / `loss` module (`_NON_AC_MODULE_FQNS`)
    rng: np.ndarray  # `has_recomputable_rng_ops`' test of the target
    region: np.ndarray  # forward region of `defer_offload_waits` (-1: none)
    region_last: np.ndarray  # each forward region's last call node
    backward_calls: np.ndarray  # backward call nodes in order (`prefetch_reloads` anchors)
    reader: np.ndarray  # every (reader, input) pair of the graph, readers in order
    read: np.ndarray
    nested_getitem: bool  # a getitem of a getitem: `raise_getitems` is not replayed
    room: int  # sort keys a copy and the reload chains moved before it need
    nodes: list[fx.Node] = field(repr=False)
    offloads: dict[int, _Offload | None] = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return self.index.n

    @property
    def space(self) -> EntrySpace:
        return self.index.space

    def offload(self, i: int) -> _Offload | None:
        """`apply_cpu_offload_pass`'s facts of node `i` tagged MUST_CPU_OFFLOAD, None where
        it leaves the node alone (no backward reader, directly or through views)."""
        if i not in self.offloads:
            self.offloads[i] = _offload_facts(self, i)
        return self.offloads[i]


def _gt(module: str) -> Any:
    """A module of graph trainer; a one-line error without torchtitan."""
    try:
        return importlib.import_module(f"{_GT}.{module}")
    except ImportError as err:
        raise WorkbenchError(
            f"--passes graph-trainer replays torchtitan's graph trainer passes ({err}): "
            "pip install -e '.[torchtitan]'"
        ) from None


_FACTS: weakref.WeakKeyDictionary[JointGraph, _Facts] = weakref.WeakKeyDictionary()


def _facts(index: GraphIndex) -> _Facts:
    """The facts of `index`'s graph, built on first use and kept as long as it lives."""
    facts = _FACTS.get(index.graph)
    if facts is None or facts.index is not index:
        facts = _FACTS[index.graph] = _build(index)
    return facts


def _build(index: GraphIndex) -> _Facts:
    common = _gt("common_utils")
    remat = _gt("selective_activation_remat")
    nodes = list(index.graph.gm.graph.nodes)
    call = np.array([node.op == "call_function" for node in nodes], bool)
    backward = np.array([bool(common._is_backward_node(node)) for node in nodes], bool)
    layer = np.array([common._get_layer_id(node) for node in nodes], np.int64)
    non_ac = np.array(
        [common._get_module_fqn(node) in remat._NON_AC_MODULE_FQNS for node in nodes], bool
    )
    seeded = torch.Tag.nondeterministic_seeded
    rng = np.array([seeded in getattr(node.target, "tags", ()) for node in nodes], bool)
    region, region_last = _forward_regions(call, backward, layer)
    inputs = index.arrays.inputs
    getitem = np.array(index.is_getitem, bool)
    first_input = np.array([args[0] if args else 0 for args in index.args], np.int64)
    return _Facts(
        index=index,
        call=call,
        backward=backward,
        layer=layer,
        non_ac=non_ac,
        rng=rng,
        region=region,
        region_last=region_last,
        backward_calls=np.flatnonzero(call & backward),
        reader=np.repeat(np.arange(index.n), np.diff(inputs.start)),
        read=inputs.items,
        nested_getitem=bool((getitem & getitem[first_input]).any()),
        room=2 * int(np.diff(inputs.start)[call].max(initial=0)) + 2,
        nodes=nodes,
    )


def _forward_regions(
    call: np.ndarray, backward: np.ndarray, layer: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`defer_offload_waits`' regions: maximal runs of one layer id among the call nodes
    before the first backward call node; each node's region and each region's last node."""
    calls = np.flatnonzero(call)
    stop = np.flatnonzero(backward[calls])
    forward = calls[: stop[0]] if len(stop) else calls
    region = np.full(len(call), -1, np.int64)
    if not len(forward):
        return region, np.zeros(0, np.int64)
    starts = np.concatenate(([True], layer[forward][1:] != layer[forward][:-1]))
    region[forward] = np.cumsum(starts) - 1
    ends = np.append(np.flatnonzero(starts)[1:] - 1, len(forward) - 1)
    return region, forward[ends]


def _offload_facts(facts: _Facts, i: int) -> _Offload | None:
    """Node `i` as `apply_cpu_offload_pass` sees it, read with graph trainer's own helpers
    (its view list, its storage chain, its last-consumer rule)."""
    cpu = _gt("cpu_offload")
    node, space, position = facts.nodes[i], facts.space, facts.index.index_of
    if cpu._is_view(node):
        raise Unreplayable(f"{node.name} is a view: graph trainer's offload pass refuses it")
    if not isinstance(node.meta.get("val"), torch.Tensor):
        raise Unreplayable(f"{node.name} is not one tensor: graph trainer's pass cannot move it")
    views, redirects = cpu._collect_view_replay_info(node)
    readers = [u for u in node.users if facts.backward[position[u.name]]]
    readers += [u for _, u in redirects]
    if not readers:
        return None
    views = sorted(views, key=lambda v: position[v.name])
    # each replayed view reads the reload's wait (for the value) or an earlier replayed view
    replayed: dict[fx.Node, int] = {node: space.offload(i, _WAIT)}
    view_inputs = []
    for view in views:
        top = [a for a in (*view.args, *view.kwargs.values()) if isinstance(a, fx.Node)]
        if list(dict.fromkeys(top)) != view.all_input_nodes:
            raise Unreplayable(f"view {view.name} reads a tensor inside a list or dict")
        view_inputs.append(tuple(replayed.get(a, position[a.name]) for a in view.all_input_nodes))
        replayed[view] = space.replayed(position[view.name])
    chain, _ = cpu._get_storage_chain(node)
    last, at = node, i
    for user in chain:
        if position.get(user.name, -1) > at:
            last, at = user, position[user.name]
    last_use = cpu._find_last_tensor_consumer(last)
    return _Offload(
        views=tuple(position[v.name] for v in views),
        view_inputs=tuple(view_inputs),
        first=min(position[u.name] for u in readers),
        last_use=-1 if last_use is None else position[last_use.name],
    )


class _Steps(NamedTuple):
    """A node order while it is built: its entries in order, and every input as (reader entry,
    entry read), each reader's inputs together and in order."""

    entries: np.ndarray
    reader: np.ndarray
    read: np.ndarray

    def flat(self, space: EntrySpace) -> Flat:
        position = np.full(space.size, -1, np.int64)
        position[self.entries] = np.arange(len(self.entries))
        at = position[self.reader]
        order = np.argsort(at, kind="stable")
        return Flat(self.entries, at[order], self.read[order])


def replay_graph_trainer(
    index: GraphIndex, decisions: Mapping[str, Tag], options: OffloadOptions | None = None
) -> Flat:
    """The node order graph trainer's `apply_cpu_offload_pass` (with `options`' prefetch and
    defer, a defer of 0 run as 1, as `run_passes` runs it) and then its
    `selective_activation_remat_pass` make of `index`'s graph tagged with `decisions` (its
    call nodes, as `run_passes` tags them: recompute for PREFER/MUST_RECOMPUTE, offload for
    MUST_CPU_OFFLOAD). Array operations but for loops over the offloaded values and the
    recomputed nodes' tags, so a flip re-estimates in milliseconds.

    On entry: the index of a graph after graph trainer's cleanup. Returns the node order
    `index.order_of` reads of the graph its passes make. Raises `Unreplayable` where it
    cannot say."""
    facts = _facts(index)
    options = options or OffloadOptions()
    where = index.index_of
    nodes = np.fromiter((where.get(name, -1) for name in decisions), np.int64, len(decisions))
    kinds = np.fromiter(map(_kind, decisions.values()), np.int8, len(decisions))
    tagged = (nodes >= 0) & facts.call[nodes]  # its passes read call nodes' tags only
    recompute = np.zeros(index.n, bool)
    recompute[nodes[tagged & (kinds == 1)]] = True
    offloaded = np.sort(nodes[tagged & (kinds == 2)]).tolist()
    infos = {i: info for i in offloaded if (info := facts.offload(i)) is not None}
    steps = _offload_pass(facts, infos, options) if infos else None
    if not recompute.any():
        return index.identity_flat if steps is None else steps.flat(index.space)
    if steps is None:
        steps = _Steps(np.arange(index.n), facts.reader, facts.read)
    return _remat_pass(facts, steps, recompute, infos).flat(index.space)


# --- apply_cpu_offload_pass ----------------------------------------------------------------


class _Lists:
    """The entries graph trainer's offload pass puts right before or right after an original
    node, in order, and the list each is in (original nodes never move; the ones it inserts
    do: `append` and `prepend` as FX moves a node)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.before: dict[int, list[int]] = {}
        self.after: dict[int, list[int]] = {}
        self.where: dict[int, list[int]] = {}

    def add(self, side: dict[int, list[int]], node: int, entries: list[int]) -> None:
        held = side.setdefault(node, [])
        held.extend(entries)
        for entry in entries:
            self.where[entry] = held

    def move_after(self, anchor: int, entry: int) -> None:
        """`anchor.append(entry)`: right after the anchor (an original node or an entry)."""
        if anchor == entry:
            return
        self.where[entry].remove(entry)
        original = anchor < self.n
        held = self.after.setdefault(anchor, []) if original else self.where[anchor]
        held.insert(0 if original else held.index(anchor) + 1, entry)
        self.where[entry] = held

    def move_before(self, anchor: int, entry: int) -> None:
        """`anchor.prepend(entry)`: right before the anchor."""
        self.where[entry].remove(entry)
        original = anchor < self.n
        held = self.before.setdefault(anchor, []) if original else self.where[anchor]
        held.insert(len(held) if original else held.index(anchor), entry)
        self.where[entry] = held

    def order(self) -> np.ndarray:
        """Every entry in order: each original node with its lists around it."""
        n = self.n
        most = max(len(held) for held in (*self.before.values(), *self.after.values()))
        span = 2 * most + 2
        keys = [np.arange(n) * span + most]
        extra: list[int] = []
        for node, held in self.before.items():
            extra += held
            keys.append(node * span + most - len(held) + np.arange(len(held)))
        for node, held in self.after.items():
            extra += held
            keys.append(node * span + most + 1 + np.arange(len(held)))
        entries = np.concatenate((np.arange(n), np.array(extra, np.int64)))
        return entries[np.argsort(np.concatenate(keys), kind="stable")]


def _offload_pass(facts: _Facts, infos: dict[int, _Offload], options: OffloadOptions) -> _Steps:
    """`apply_cpu_offload_pass`: for each value (graph order) its copy and the wait that
    frees it right after it, its reload, the wait for it and its replayed views right before
    its first backward reader; then `defer_offload_waits` and `prefetch_reloads`."""
    space = facts.space
    lists = _Lists(facts.n)
    for i, info in infos.items():
        lists.add(lists.after, i, [space.offload(i, _COPY), space.offload(i, _FREE)])
        chain = [space.offload(i, _RELOAD), space.offload(i, _WAIT)]
        lists.add(lists.before, info.first, chain + [space.replayed(v) for v in info.views])
    _defer(facts, infos, lists, max(options.defer_layers, 1))
    if options.prefetch_layers > 0:
        _prefetch(facts, lists, options.prefetch_layers)
    return _Steps(lists.order(), *_offload_inputs(facts, infos))


def _defer(facts: _Facts, infos: dict[int, _Offload], lists: _Lists, layers: int) -> None:
    """`defer_offload_waits`: each freeing wait goes right after the last node of the forward
    region `layers` past its value's (never before its `last_use`'s, at the latest the last
    region's); a region that ends in an offloaded value ends in that value's freeing wait."""
    region, last = facts.region, facts.region_last
    for i, info in infos.items():
        at = int(region[i])
        if at < 0:
            continue
        used = int(region[info.last_use]) if info.last_use >= 0 else -1
        target = min(max(at + layers, used if used >= 0 else at), len(last) - 1)
        anchor = int(last[target])
        if anchor in infos:
            anchor = facts.space.offload(anchor, _FREE)
        lists.move_after(anchor, facts.space.offload(i, _FREE))


def _prefetch(facts: _Facts, lists: _Lists, layers: int) -> None:
    """`prefetch_reloads`: backward's regions are runs of one layer id among its call nodes
    (replayed views included, the offload ops not); each reload moves right before the first
    node of the layer `layers` earlier in backward's layer order (the first region's, past
    them), when that region comes before its own layer's first."""
    n, space = facts.n, facts.space
    placed = [(node, k, e) for node, held in lists.before.items() for k, e in enumerate(held)]
    views = [(node, k, e) for node, k, e in placed if space.replays <= e < space.steps]
    calls = facts.backward_calls
    if views:
        keys = np.concatenate((calls * (n + 1) + n, [node * (n + 1) + k for node, k, _ in views]))
        calls = np.concatenate((calls, [e for _, _, e in views]))[np.argsort(keys)]
    if not len(calls):
        return
    ids = facts.layer[space.node(calls)]
    starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    anchors, anchor_ids = calls[starts].tolist(), ids[starts].tolist()
    first: dict[int, int] = {}
    for k, lid in enumerate(anchor_ids):
        if lid != -1:
            first.setdefault(lid, k)
    in_order = sorted(first, key=first.__getitem__)
    rank = {lid: k for k, lid in enumerate(in_order)}
    reloads = sorted(p for p in placed if space.is_step(p[2]) and space.step(p[2]) == _RELOAD)
    for _, _, reload in reloads:
        lid = int(facts.layer[space.node(reload)])
        if lid not in first:
            continue
        ahead = rank[lid] - layers
        target = 0 if ahead < 0 else first[in_order[ahead]]
        if target < first[lid]:
            lists.move_before(anchors[target], reload)


def _offload_inputs(facts: _Facts, infos: dict[int, _Offload]) -> tuple[np.ndarray, np.ndarray]:
    """The inputs after the offload pass: backward readers of a value read the wait for its
    reload, of one of its forward views the view replayed on it; the copy reads the value,
    the freeing wait the copy, the value and its `last_use`, the reload that wait, the wait
    for it the reload and the freeing wait, each replayed view its base as replayed."""
    n, space = facts.n, facts.space
    value = np.zeros(n, bool)
    value[list(infos)] = True
    view = np.zeros(n, bool)
    for info in infos.values():
        view[list(info.views)] = True
    reader, read = facts.reader, facts.read.copy()
    backward = facts.backward[reader]
    moved = backward & value[read]
    viewed = backward & view[read]
    read[moved] = space.offload(read[moved], _WAIT)
    read[viewed] = space.replayed(read[viewed])
    readers: list[int] = []
    reads: list[int] = []
    for i, info in infos.items():
        copy, free, reload, wait = (space.offload(i, k) for k in range(4))
        used = [info.last_use] if info.last_use not in (-1, i) else []
        for entry, inputs in ((copy, [i]), (free, [copy, i, *used]), (reload, [free])):
            readers += [entry] * len(inputs)
            reads += inputs
        readers += [wait, wait]
        reads += [reload, free]
        for v, view_inputs in zip(info.views, info.view_inputs, strict=True):
            readers += [space.replayed(v)] * len(view_inputs)
            reads += view_inputs
    return (
        np.concatenate((reader, np.array(readers, np.int64))),
        np.concatenate((read, np.array(reads, np.int64))),
    )


# --- selective_activation_remat_pass -------------------------------------------------------


def _remat_pass(
    facts: _Facts, steps: _Steps, recompute: np.ndarray, infos: dict[int, _Offload]
) -> _Steps:
    """`selective_activation_remat_pass` on the offloaded node order: in the one backward region
    after the last `lm_head` / `loss` node whose nodes read recompute-tagged ones, each
    tagged node they need (directly or through other tagged nodes) is copied right before
    the first of them, in forward order; reload chains a copy reads move in front of it;
    every backward reader of a copied original reads its copy (a recomputed flex attention's
    subgraphs are read as the one subgraph: `GraphIndex.order_of`); originals nothing
    else reads go; getitems are raised to their producers."""
    if (recompute & facts.rng).any():
        raise Unreplayable("a random op is tagged for recompute: graph trainer's remat refuses")
    space, entries = facts.space, steps.entries
    position = np.full(space.size, -1, np.int64)
    position[entries] = np.arange(len(entries))
    backward = _backward(facts, entries)
    first = _first_readers(facts, steps, position, backward, recompute)
    if first is None:
        return steps
    copied = np.flatnonzero(first < len(entries))
    keys = _keys(facts, steps, position, first, copied, infos)
    reader, read = _remat_inputs(facts, steps, position, backward, copied, infos)
    gone = _erased(facts, copied, read)
    everything = np.concatenate((entries, space.copy(copied)))[np.argsort(keys)]
    everything = everything[~np.isin(everything, gone)]
    kept = np.concatenate((~np.isin(steps.reader, gone), np.ones(len(reader), bool)))
    reader = np.concatenate((steps.reader, reader))
    return _raised(facts, _Steps(everything, reader[kept], read[kept]))


def _backward(facts: _Facts, entries: np.ndarray) -> np.ndarray:
    """Per position: a backward node (`_is_backward_node`): original ones as traced,
    replayed views, reloads and the waits for them."""
    space = facts.space
    result = np.ones(len(entries), bool)
    original = entries < space.copies
    result[original] = facts.backward[entries[original]]
    steps = space.is_step(entries)
    result[steps] = space.step(entries[steps]) >= _RELOAD
    return result


def _first_readers(
    facts: _Facts,
    steps: _Steps,
    position: np.ndarray,
    backward: np.ndarray,
    recompute: np.ndarray,
) -> np.ndarray | None:
    """Per node, the position its copy goes before (the node order's length where none):
    `_collect_backward_regions` and the earliest backward reader in the region that needs
    recompute, through tagged inputs. None where nothing is recomputed."""
    n, length = facts.n, len(steps.entries)
    marked = np.flatnonzero(facts.non_ac[facts.space.node(steps.entries)])
    inside = backward.copy()
    inside[: int(marked[-1]) + 1 if len(marked) else 0] = False
    run = np.cumsum(inside & ~np.concatenate(([False], inside[:-1]))) - 1
    at = position[steps.reader]
    tagged = np.zeros(len(steps.read), bool)
    original = steps.read < n
    tagged[original] = recompute[steps.read[original]]
    needs = tagged & inside[at]
    regions = np.unique(run[at[needs]])
    if not len(regions):
        return None
    if len(regions) > 1:
        raise Unreplayable(
            f"{len(regions)} disjoint backward regions read recompute-tagged nodes: graph "
            "trainer's remat pass supports one"
        )
    first = np.full(n, length, np.int64)
    np.minimum.at(first, steps.read[needs], at[needs])
    first_of, flags, args = first.tolist(), recompute.tolist(), facts.index.args
    for u in np.flatnonzero(recompute)[::-1].tolist():  # a node's users come after it
        f = first_of[u]
        if f == length:
            continue
        for y in args[u]:
            if flags[y] and first_of[y] > f:
                first_of[y] = f
    return np.asarray(first_of, np.int64)


def _keys(
    facts: _Facts,
    steps: _Steps,
    position: np.ndarray,
    first: np.ndarray,
    copied: np.ndarray,
    infos: dict[int, _Offload],
) -> np.ndarray:
    """Sort keys of the node order's entries, then of the copies: a copy goes right before its
    first reader, in forward order, after the reload chains moved in front of it for the
    offloaded values it reads (`ensure_offload_chain_before`)."""
    room = facts.room
    span = room * len(copied) + 1
    keys = np.arange(len(steps.entries)) * span + span - 1
    copies = first[copied] * span + np.arange(len(copied)) * room + room - 1
    if not infos:
        return np.concatenate((keys, copies))
    value = np.zeros(facts.n, bool)
    value[list(infos)] = True
    which, inputs = facts.index.arrays.inputs.gather(copied)
    reading = np.unique(which[value[inputs]])  # ranks of copies reading an offloaded value
    moved: dict[int, int] = {}
    for rank in reading.tolist():
        r = int(copied[rank])
        target, sub = int(first[r]), 0
        for a in facts.index.args[r]:
            if not value[a]:
                continue
            for entry in _chain(facts.space, a, target, position, moved):
                moved[entry] = target
                keys[position[entry]] = target * span + rank * room + sub
                sub += 1
    return np.concatenate((keys, copies))


def _chain(
    space: EntrySpace, value: int, target: int, position: np.ndarray, moved: dict[int, int]
) -> list[int]:
    """`ensure_offload_chain_before`: the wait for `value`'s reload, and the reload if the
    wait moves, where they sit (or were moved) after position `target`, in node order."""
    wait, reload = space.offload(value, _WAIT), space.offload(value, _RELOAD)
    if moved.get(wait, int(position[wait])) <= target:
        return []
    if moved.get(reload, int(position[reload])) <= target:
        return [wait]
    return [reload, wait]


def _remat_inputs(
    facts: _Facts,
    steps: _Steps,
    position: np.ndarray,
    backward: np.ndarray,
    copied: np.ndarray,
    infos: dict[int, _Offload],
) -> tuple[np.ndarray, np.ndarray]:
    """The copies' readers, and every input after the remat pass: the node order's (a backward
    reader of a copied original reads the copy), then the copies' (a copied input's copy,
    an offloaded value's reload wait, else the original)."""
    n, space = facts.n, facts.space
    is_copied = np.zeros(n, bool)
    is_copied[copied] = True
    read = steps.read.copy()
    redirect = backward[position[steps.reader]] & (read < n)
    redirect[redirect] = is_copied[read[redirect]]
    read[redirect] = space.copy(read[redirect])
    value = np.zeros(n, bool)
    value[list(infos)] = True
    which, inputs = facts.index.arrays.inputs.gather(copied)
    mapped = np.where(is_copied[inputs], space.copy(inputs), inputs)
    mapped = np.where(value[inputs], space.offload(inputs, _WAIT), mapped)
    return space.copy(copied[which]), np.concatenate((read, mapped))


def _erased(facts: _Facts, copied: np.ndarray, read: np.ndarray) -> np.ndarray:
    """The copied originals nothing reads any more, and those only they read (graph trainer
    erases them in reverse order in one pass, as a node's users come after it)."""
    n = facts.n
    is_copied = np.zeros(n, bool)
    is_copied[copied] = True
    readers = np.bincount(read[read < n], minlength=n)
    gone = np.zeros(n, bool)
    dying = copied[readers[copied] == 0]
    inputs = facts.index.arrays.inputs
    while len(dying):
        gone[dying] = True
        _, freed = inputs.gather(dying)
        readers -= np.bincount(freed, minlength=n)
        dying = np.unique(freed[is_copied[freed] & (readers[freed] == 0) & ~gone[freed]])
    return np.flatnonzero(gone)


def _raised(facts: _Facts, steps: _Steps) -> _Steps:
    """`raise_getitems`: each getitem (original or copy) right after the node it unpacks,
    getitems of one node in their order; then a check that every input runs before its
    reader (graph trainer's remat pass does not lint its graph)."""
    if facts.nested_getitem:
        raise Unreplayable("a getitem of a getitem: raise_getitems is not replayed for it")
    space, entries = facts.space, steps.entries
    length = len(entries)
    flat = steps.flat(space)
    getitem = np.array(facts.index.is_getitem, bool)
    is_getitem = np.flatnonzero((entries < space.replays) & getitem[entries % facts.n])
    position = np.full(space.size, -1, np.int64)
    position[entries] = np.arange(length)
    parent = position[flat.read[np.searchsorted(flat.reader, is_getitem)]]
    keys = np.arange(length) * 2 * length
    keys[is_getitem] = parent * 2 * length + length + is_getitem
    order = entries[np.argsort(keys)]
    position[order] = np.arange(length)
    made = position[steps.read]
    late = (made < 0) | (made >= position[steps.reader])
    if late.any():
        k = int(np.argmax(late))
        raise Unreplayable(
            f"graph trainer's passes would read entry {int(steps.read[k])} before it runs "
            f"(in entry {int(steps.reader[k])})"
        )
    return _Steps(order, steps.reader, steps.read)
