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


def replay(index: GraphIndex, recompute: Sequence[bool]) -> Schedule:
    """Node order and inputs of the graph `remat_using_tags_for_fwd_loss_bwd_graph` would
    produce: the forward as is, each backward node preceded by the recompute-tagged forward
    nodes it needs (in forward order, each copied once), then dead-code elimination with
    torch's own impurity test, and getitems raised to their producers."""
    n, args0 = index.n, index.args
    identity = index.identity()
    chosen = [i for i in range(n) if recompute[i]]
    if not chosen:
        return identity
    random = [index.names[i] for i in chosen if index.is_random[i]]
    if random:
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

    def mapped(xs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n + x if recompute[x] else x for x in xs)

    order = list(range(start))
    args = {i: args0[i] for i in range(start)}
    done = bytearray(n)
    for b in range(start, end):
        deps: list[int] = []
        stack = [x for x in args0[b] if recompute[x] and not done[x]]
        while stack:
            x = stack.pop()
            if done[x]:
                continue
            done[x] = 1
            deps.append(x)
            stack.extend(y for y in args0[x] if recompute[y] and not done[y])
        for d in sorted(deps):
            order.append(n + d)
            args[n + d] = mapped(args0[d])
        order.append(b)
        args[b] = mapped(args0[b])
    for i in range(end, n):
        order.append(i)
        args[i] = args0[i]
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
    n, is_getitem = index.n, index.is_getitem
    children: dict[int, list[int]] = defaultdict(list)
    for e in order:
        if is_getitem[e % n] and not is_getitem[args[e][0] % n]:
            children[args[e][0]].append(e)
    raised: list[int] = []
    for e in order:
        if is_getitem[e % n] and not is_getitem[args[e][0] % n]:
            continue
        raised.append(e)
        raised.extend(children.get(e, ()))
    return raised


def kept_for_backward(graph: JointGraph, decisions: Mapping[str, Tag] | None) -> dict[str, int]:
    """Saved activation bytes by forward node once `decisions` are rematerialized (the
    joint graph as traced when None): `GraphIndex.saved_by_node` of the replayed schedule."""
    index = graph_index(graph)
    if decisions is None:
        return index.saved_by_node(index.identity())
    return index.saved_by_node(replay(index, recompute_flags(index, decisions)))
