"""Choosing keys to save under the linear model: the cheapest set whose modelled saved
bytes stay within a cap, three ways.

Entry points: `greedy_path(model)` and `select_greedy` (cost removed per byte),
`select_knapsack` (torch's `dp_knapsack`), `select_exact` (an integer program, HiGHS).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from workbench.search.model import RECOMPUTED, SAVED, Folded, LinearModel

__all__ = [
    "MIP_GAP",
    "MIP_SECONDS",
    "greedy_path",
    "select_exact",
    "select_greedy",
    "select_knapsack",
]

# The integer program stops within this relative gap of the optimum, or after this long.
MIP_GAP = 1e-3
MIP_SECONDS = 10.0


def greedy_path(model: LinearModel) -> list[tuple[int, int, float]]:
    """From full recompute, keep the key that removes the most cost per byte, again and
    again (lazy re-evaluation): `(key, bytes, cost)` after each step, down to zero cost."""
    chosen: set[int] = set()
    base_bytes, base_cost = model.evaluate(chosen)
    heap: list[tuple[float, int]] = []
    for c in range(len(model.candidates)):
        heapq.heappush(heap, (-_ratio(model, chosen, c, base_bytes, base_cost), c))
    path: list[tuple[int, int, float]] = []
    while heap and base_cost > 0:
        _, c = heapq.heappop(heap)
        ratio = _ratio(model, chosen, c, base_bytes, base_cost)
        if heap and ratio < -heap[0][0]:
            heapq.heappush(heap, (-ratio, c))
            continue
        if ratio <= 0:
            continue
        chosen.add(c)
        base_bytes, base_cost = model.evaluate(chosen)
        path.append((c, base_bytes, base_cost))
    return path


def _ratio(model: LinearModel, chosen: set[int], c: int, bytes_: int, cost: float) -> float:
    """Cost removed per byte added by also keeping `c`; keeping for free ranks first."""
    new_bytes, new_cost = model.evaluate(chosen | {c})
    gain = cost - new_cost
    if gain <= 0:
        return 0.0
    return float("inf") if new_bytes <= bytes_ else gain / (new_bytes - bytes_)


def _fill(model: LinearModel, chosen: set[int], order: Sequence[int], cap: float) -> set[int]:
    """Keep more keys (in `order`) while the saved bytes stay within `cap`."""
    chosen = set(chosen)
    bytes_, cost = model.evaluate(chosen)
    for c in order:
        if c in chosen:
            continue
        new_bytes, new_cost = model.evaluate(chosen | {c})
        if new_cost < cost and new_bytes <= max(cap, bytes_):
            chosen.add(c)
            bytes_, cost = new_bytes, new_cost
    return chosen


def select_greedy(model: LinearModel, path: list[tuple[int, int, float]], cap: float) -> set[int]:
    """The longest prefix of the greedy path that fits, then whatever else still fits."""
    fitting = [k for k, (_, b, _) in enumerate(path) if b <= cap]
    last = fitting[-1] if fitting else -1
    prefix = {c for c, _, _ in path[: last + 1]}
    return _fill(model, prefix, [c for c, _, _ in path[last + 1 :]], cap)


def select_knapsack(model: LinearModel, order: Sequence[int], cap: float) -> set[int]:
    """torch's 0/1 knapsack (`dp_knapsack`) over each key's own bytes and cost saved from
    full recompute; then the linear model's real totals are repaired and filled. Items are
    the keys of the greedy path (`order`): the others never pay for themselves."""
    from torch._functorch._activation_checkpointing.knapsack import dp_knapsack

    empty: set[int] = set()
    base_bytes, base_cost = model.evaluate(empty)
    free, items, memory, gains = set(), [], [], []
    for c in order:
        new_bytes, new_cost = model.evaluate({c})
        gain = base_cost - new_cost
        if gain <= 0:
            continue
        if new_bytes <= base_bytes:
            free.add(c)
        else:
            items.append(c)
            memory.append((new_bytes - base_bytes) / max(cap - base_bytes, 1.0))
            gains.append(gain)
    chosen = set(free)
    if items and cap > base_bytes:
        _, kept, _ = dp_knapsack(memory, gains, 1.0)
        chosen |= {items[k] for k in kept}
    # keys interact (a chain kept twice counts once): drop the worst until it fits
    ranked = sorted(chosen - free, key=lambda c: gains[items.index(c)] / memory[items.index(c)])
    while ranked and model.evaluate(chosen)[0] > cap:
        chosen.discard(ranked.pop(0))
    return _fill(model, chosen, order, cap)


def select_exact(model: LinearModel | Folded, cap: float) -> set[int]:  # noqa: PLR0915
    """Integer program (scipy's HiGHS) over the linear model: minimum cost, bytes <= cap.

    Binary t[c] (key recomputed) and f[p] (node recomputed after the layer-boundary rule);
    continuous r[p] (reruns in backward), s[p] (saved) and y[g] (storage held), which take
    0/1 values at any optimum once t and f are integral."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    count, keys, storages = len(model.source), len(model.candidates), len(model.sizes)
    t0, f0, r0, s0, y0 = 0, keys, keys + count, keys + 2 * count, keys + 3 * count
    size = y0 + storages
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def row(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(lower)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    inf = np.inf
    fixed_bounds = [(0.0, 1.0)] * size
    for p in range(count):
        c = model.source[p]
        if c == SAVED:
            fixed_bounds[f0 + p] = (0.0, 0.0)
            tag: list[tuple[int, float]] = []
            tagged = 0.0
        elif c == RECOMPUTED:
            tag, tagged = [], 1.0
        else:
            tag, tagged = [(t0 + c, 1.0)], 0.0
        # f <= tag; f >= tag - sum(cross users' f); f + f[u] <= 1 for cross users u
        row([(f0 + p, 1.0)] + [(col, -v) for col, v in tag], -inf, tagged)
        cross = [(f0 + u, 1.0) for u in model.cross[p]]
        row([(f0 + p, 1.0)] + [(col, -v) for col, v in tag] + cross, -tagged, inf)
        for u in model.cross[p]:
            row([(f0 + p, 1.0), (f0 + u, 1.0)], -inf, 1.0)
        # reruns: r <= f; r >= f when backward reads p; r >= f + r[u] - 1 for users u
        row([(r0 + p, 1.0), (f0 + p, -1.0)], -inf, 0.0)
        if model.read_by_backward[p]:
            row([(r0 + p, 1.0), (f0 + p, -1.0)], 0.0, inf)
            row([(s0 + p, 1.0), (f0 + p, 1.0)], 1.0, inf)  # s >= 1 - f
        for u in model.users[p]:
            row([(r0 + p, 1.0), (f0 + p, -1.0), (r0 + u, -1.0)], -1.0, inf)
            row([(s0 + p, 1.0), (f0 + p, 1.0), (r0 + u, -1.0)], 0.0, inf)  # s >= r[u] - f
        for g in model.storages[p]:
            row([(y0 + g, 1.0), (s0 + p, -1.0)], 0.0, inf)
    # scaled to O(1) numbers: HiGHS's tolerances are absolute
    unit = max(cap, 1.0)
    row([(y0 + g, b / unit) for g, b in enumerate(model.sizes)], -inf, cap / unit)
    objective = np.zeros(size)
    costs = np.asarray(model.cost)
    objective[r0 : r0 + count] = 1e3 * costs / max(costs.sum(), 1e-30)
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lower), size)).tocsr()
    integrality = np.zeros(size)
    integrality[: keys + count] = 1
    bounds = Bounds([b[0] for b in fixed_bounds], [b[1] for b in fixed_bounds])
    result = milp(
        objective,
        constraints=LinearConstraint(matrix, lower, upper),
        integrality=integrality,
        bounds=bounds,
        options={"mip_rel_gap": MIP_GAP, "time_limit": MIP_SECONDS},
    )
    if result.x is None:
        return set()  # nothing fits the model's cap: the repair loop lowers or falls back
    return {c for c in range(keys) if result.x[t0 + c] < 0.5}
