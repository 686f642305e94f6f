"""torch's remat pass replayed on node indices: the schedule it would produce, no graph built.

Entry points: `replay(index, recompute) -> Schedule` and `kept_for_backward(graph,
decisions)`, the saved activation bytes per node that a policy leaves after remat.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from workbench.errors import WorkbenchError
from workbench.graph import JointGraph
from workbench.index import GraphIndex, Schedule, graph_index
from workbench.rules import Tag

__all__ = ["kept_for_backward", "recompute_flags", "replay"]


def recompute_flags(index: GraphIndex, decisions: Mapping[str, Tag]) -> list[bool]:
    """Per node: tagged for recompute."""
    flags = [False] * index.n
    for name, tag in decisions.items():
        if tag.recompute:
            flags[index.index_of[name]] = True
    return flags


def replay(index: GraphIndex, recompute: Sequence[bool], allow_random: bool = False) -> Schedule:
    """Node order and inputs of the graph `remat_using_tags_for_fwd_loss_bwd_graph` would
    produce: the forward as is, each backward node preceded by the recompute-tagged forward
    nodes it needs (in forward order, each copied once), then dead-code elimination with
    torch's own impurity test, and getitems raised to their producers. Random ops tagged
    recompute are refused as torch refuses them, unless `allow_random` (partitioner tags
    in the studies, whose pass replays RNG: their schedule is only read for bytes)."""
    n, args0 = index.n, index.args
    identity = index.identity()
    chosen = [i for i in range(n) if recompute[i]]
    if not chosen:
        return identity
    random = [index.names[i] for i in chosen if index.is_random[i]]
    if random and not allow_random:
        raise WorkbenchError(
            f"random ops cannot be recomputed by torch's remat pass: {', '.join(random[:3])}"
        )
    needing = {
        index.region_of[u]
        for i in chosen
        for u in index.users[i]
        if index.is_bwd[u] and u in index.region_of
    }
    if not needing:
        return identity
    if len(needing) > 1:
        raise WorkbenchError(
            f"{len(needing)} disjoint backward regions read recomputed nodes; torch's remat "
            "pass supports one: keep the recompute tags inside one backward region"
        )
    start, end = index.regions[needing.pop()]
    rec = bytearray(bool(r) for r in recompute)

    order = list(range(start))
    args = dict(zip(range(start), args0[:start], strict=True))
    done = bytearray(n)
    forward_inputs = index.forward_inputs
    for b in range(start, end):
        inputs = args0[b]
        stack = [x for x in forward_inputs[b] if rec[x]] if forward_inputs[b] else None
        if stack:
            deps: list[int] = []
            while stack:
                x = stack.pop()
                if done[x]:
                    continue
                done[x] = 1
                deps.append(x)
                stack.extend(y for y in args0[x] if rec[y] and not done[y])
            for d in sorted(deps):
                order.append(n + d)
                args[n + d] = tuple(n + y if rec[y] else y for y in args0[d])
            args[b] = tuple(n + x if rec[x] else x for x in inputs)
        else:
            args[b] = inputs
        order.append(b)
    order.extend(range(end, n))
    args.update(zip(range(end, n), args0[end:], strict=True))
    return _raise_getitems(index, _eliminate_dead_code(index, order, args), args), args


def _eliminate_dead_code(
    index: GraphIndex, order: list[int], args: dict[int, tuple[int, ...]]
) -> list[int]:
    n, impure = index.n, index.impure
    alive = bytearray(2 * n)
    for e in reversed(order):
        if alive[e] or impure[e % n]:
            alive[e] = 1
            for x in args[e]:
                alive[x] = 1
    return [e for e in order if alive[e]]


def _raise_getitems(
    index: GraphIndex, order: list[int], args: dict[int, tuple[int, ...]]
) -> list[int]:
    """torch's `raise_getitems`: each getitem moves right after the node it unpacks
    (a getitem of a getitem, which aten graphs do not have, would stay in place)."""
    n, raisable = index.n, index.raisable
    children: dict[int, list[int]] = defaultdict(list)
    kept: list[int] = []
    for e in order:
        if raisable[e if e < n else e - n]:
            children[args[e][0]].append(e)
        else:
            kept.append(e)
    raised: list[int] = []
    for e in kept:
        raised.append(e)
        if e in children:
            raised.extend(children[e])
    return raised


def kept_for_backward(graph: JointGraph, decisions: Mapping[str, Tag] | None) -> dict[str, int]:
    """Saved activation bytes by forward node once `decisions` are rematerialized (the
    joint graph as traced when None): `GraphIndex.saved_by_node` of the replayed schedule.
    Pictures and diffs read it, also for partitioner tags that recompute random ops."""
    index = graph_index(graph)
    if decisions is None:
        return index.saved_by_node(index.identity())
    flags = recompute_flags(index, decisions)
    return index.saved_by_node(replay(index, flags, allow_random=True))
