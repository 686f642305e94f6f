"""Policy search: the cheapest save/recompute/offload choice whose estimated peak fits a
memory budget (offload only within a host-memory budget).

Entry points: `solve(graph, budget_bytes, method=..., host_budget_bytes=0) -> Solution` and
`pareto(graph, n=20) -> list[Solution]`, a sweep from full recompute to no AC (on per-rank
graphs over both FSDP choices, `fsdp_choices(graph)`); `preset_points(graph)` for context.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimate, Estimator
from workbench.cost.profiles import DeviceProfile, get_profile
from workbench.decide.decider import node_keys, rules_of
from workbench.decide.engine import forced_save
from workbench.decide.offloadable import OffloadOptions, offload_refusal
from workbench.decide.plan import crosses_layer, last_layer
from workbench.decide.policy import Action, Policy
from workbench.decide.presets import OFFLOAD_PRESETS, PRESETS
from workbench.errors import WorkbenchError
from workbench.rewrite.index import GraphIndex

__all__ = [
    "METHODS",
    "OBJECTIVES",
    "Solution",
    "fsdp_choices",
    "pareto",
    "preset_points",
    "solve",
]

OBJECTIVES: tuple[str, ...] = ("recompute_time", "recompute_flops")
METHODS: tuple[str, ...] = ("greedy", "knapsack", "exact")
# Layer-relative keys the integer program of `exact` may hold (debug models: 110-160).
EXACT_KEY_LIMIT = 200
# The integer program stops within this relative gap of the optimum, or after this long.
MIP_GAP = 1e-3
MIP_SECONDS = 10.0
# Exact estimates tried per budget while the linear model's guess is repaired.
REPAIR_ROUNDS = 12
METHOD_ROUNDS = 4  # for `exact`, whose integer program takes seconds
# With a host budget: model caps tried above the budget's own, each saving more and
# offloading as few keys (largest first) as bring the exact peak within budget.
OFFLOAD_CAPS = 6
OFFLOAD_KEYS = 6  # largest keys offloaded one more at a time before trying all of them
# How the solver's offloads move: graph trainer's default deferral of one layer, so each
# device-to-host copy has the next layer's compute to hide behind (freed right after its
# last forward reader, a copy is mostly exposed), reloads one layer early.
SOLVER_DEFER_LAYERS = 1
GIB = 2**30

Progress = Callable[[int, int, "Solution"], None]


@dataclass
class Solution:
    """A policy found for a budget, its exact estimate, and how it was found."""

    policy: Policy
    estimate: Estimate
    method: str
    seconds: float
    budget_bytes: int | None
    profile: str
    objective: str
    host_budget_bytes: int = 0

    def cost(self) -> float:
        return _objective_value(self.estimate, self.objective, self.profile)

    def to_json(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "peak_bytes": est.peak_bytes,
            "recompute_flops": est.recompute_flops,
            "est_recompute_seconds": est.recompute_seconds[self.profile],
            "est_step_seconds": est.step_seconds[self.profile],
            "saved_activation_bytes": est.saved_activation_bytes,
            "policy": self.policy.to_json(),
            "method": self.method,
            "objective": self.objective,
            "profile": self.profile,
            "seconds": round(self.seconds, 3),
            "budget_bytes": self.budget_bytes,
            "fsdp_reshard": self.policy.fsdp_reshard,
            "host_budget_bytes": self.host_budget_bytes,
            "host_peak_bytes": est.host_peak_bytes,
            "offloaded_bytes": est.offloaded_bytes,
            "exposed_transfer_seconds": est.exposed_transfer_seconds.get(self.profile, 0.0),
        }


def _objective_value(est: Estimate, objective: str, profile: str) -> float:
    """Recompute FLOPs, or the time recompute and exposed offload copies add to a step."""
    if objective == "recompute_flops":
        return float(est.recompute_flops)
    return est.recompute_seconds[profile] + est.exposed_transfer_seconds.get(profile, 0.0)


# --- the linear model -------------------------------------------------------------------


@dataclass
class _Folded:
    """The linear model's tables with one node per key (see `_Model.folded`)."""

    nodes: list[str]
    candidates: list[str]
    source: list[int]
    users: list[tuple[int, ...]]
    cross: list[tuple[int, ...]]
    read_by_backward: list[bool]
    storages: list[tuple[int, ...]]
    sizes: list[int]
    cost: list[float]


class _Model:
    """Saved bytes and recompute cost of a set of saved keys, without the memory timeline.

    Mirrors `decide` + torch's remat pass on forward nodes: every candidate key not saved
    is recomputed (preset `full`), getitems and waits follow the op they unpack or end,
    FSDP unshard chains follow `fsdp_reshard` (recomputed, or saved), a recomputed node with
    a recomputed user in another layer is saved; a recomputed node runs again in backward
    when backward or another rerun node reads it; a kept node read that way is saved.
    Bytes are storages (views cost their base once); the peak is not modelled here.
    """

    def __init__(
        self,
        graph: JointGraph,
        estimator: Estimator,
        objective: str,
        profile: str,
        fsdp_reshard: bool = True,
    ):
        keys = node_keys(graph)
        est = estimator.index
        self.nodes = [est.index_of[name] for name in keys]
        self.key_of = list(keys.values())
        position = {i: p for p, i in enumerate(self.nodes)}
        facts = {f.name: f for f in rules_of(graph).facts}  # the rules' view (workbench.decide)
        fixed = {f.key for f in facts.values() if forced_save(f) is not None}
        # waits and getitems follow the op they end or unpack; FSDP unshard chains follow
        # their all-gather, which the policy's `fsdp_reshard` decides: none is a choice here
        followers = {f.key for f in facts.values() if f.parent is not None}
        chains = {f.key for f in facts.values() if f.gather is not None}
        self.candidates = sorted(
            set(keys.values()) - fixed - followers - chains - self._unread(graph, est)
        )
        key_index = {k: c for c, k in enumerate(self.candidates)}
        # `source[p]`: the candidate whose tag node p follows (-1: always saved)
        # (-2: recomputed whatever the choice: unread nodes, and reshard-after-forward chains)
        chain_source = -2 if fsdp_reshard else -1
        self.source: list[int] = []
        for name in keys:
            leader = facts[name]
            while leader.parent in facts and leader.gather is None and leader.key not in fixed:
                leader = facts[leader.parent]
            if leader.key in fixed:
                self.source.append(-1)
            elif leader.gather is not None:
                self.source.append(chain_source)
            else:
                self.source.append(key_index.get(leader.key, -2))
        self.users = [tuple(position[u] for u in est.users[i] if u in position) for i in self.nodes]
        self.cross = [
            tuple(u for u in self.users[p] if crosses_layer(est.layer[i], est.layer[self.nodes[u]]))
            for p, i in enumerate(self.nodes)
        ]
        self.read_by_backward = [any(est.is_bwd[u] for u in est.users[i]) for i in self.nodes]
        self.storages, self.sizes = self._storages(est, position)
        # keys with a node the rules may offload (`offload_refusal`), and the bytes of
        # the storages each candidate's nodes make: what offloading it would move
        last = last_layer(list(facts.values()))
        movable = {f.key for f in facts.values() if offload_refusal(f, last) is None}
        self.offloadable = [key in movable for key in self.candidates]
        self.key_bytes = [0] * len(self.candidates)
        for g, (p, _) in enumerate(self.storage_owner):
            if self.source[p] >= 0:
                self.key_bytes[self.source[p]] += self.sizes[g]
        flops = np.asarray([est.flops[i] for i in self.nodes], dtype=float)
        seconds = np.asarray([estimator.seconds[profile][i] for i in self.nodes], dtype=float)
        primary, secondary = (seconds, flops) if objective == "recompute_time" else (flops, seconds)
        # ties in the objective (FLOP-free elementwise ops) are broken by the other measure
        scale = primary.sum() / secondary.sum() if secondary.sum() > 0 else 0.0
        self.cost = (primary + 1e-6 * scale * secondary).tolist()

    @staticmethod
    def _unread(graph: JointGraph, est: GraphIndex) -> set[str]:
        """Keys none of whose nodes feed backward, even through forward ops: never saved."""
        keys = node_keys(graph)
        feeds = [False] * est.n
        for i in reversed(range(est.n)):
            feeds[i] = any(est.is_bwd[u] or feeds[u] for u in est.users[i])
        read = {k for name, k in keys.items() if feeds[est.index_of[name]]}
        return set(keys.values()) - read

    def _storages(
        self, est: GraphIndex, position: dict[int, int]
    ) -> tuple[list[tuple[int, ...]], list[int]]:
        """Each node's storages (fresh ones of forward nodes; inputs are held anyway)."""
        root: dict[tuple[int, int], int | None] = {}
        self.storage_owner: list[tuple[int, int]] = []  # (node position, output slot)
        sizes: list[int] = []
        storages: list[tuple[int, ...]] = []
        for i in range(est.n):
            if est.is_bwd[i]:
                continue
            for s, slot in enumerate(est.slots[i]):
                if isinstance(slot, int):
                    if slot == 0 or i not in position:
                        root[(i, s)] = None
                    else:
                        root[(i, s)] = len(sizes)
                        sizes.append(slot)
                        self.storage_owner.append((position[i], s))
                else:
                    root[(i, s)] = root.get((est.args[i][slot[0]], slot[1]))
        for i in self.nodes:
            ids = {root.get((i, s)) for s in range(len(est.slots[i]))}
            storages.append(tuple(sorted(x for x in ids if x is not None)))
        return storages, sizes

    def folded(self) -> _Folded:
        """One node per key: the nodes of identical layers merged, bytes and costs summed.

        Layer-boundary edges become edges between keys (the graph may gain cycles, which
        the integer program does not mind); this is what keeps `exact` small."""
        keys = list(dict.fromkeys(self.key_of))
        index = {k: q for q, k in enumerate(keys)}
        members: list[list[int]] = [[] for _ in keys]
        for p, key in enumerate(self.key_of):
            members[index[key]].append(p)
        folded_storage: dict[tuple[int, int], int] = {}
        sizes: list[int] = []
        for g, (p, slot) in enumerate(self.storage_owner):
            sid = folded_storage.setdefault((index[self.key_of[p]], slot), len(sizes))
            if sid == len(sizes):
                sizes.append(0)
            sizes[sid] += self.sizes[g]

        def merged(table: list[tuple[int, ...]], ps: list[int]) -> tuple[int, ...]:
            return tuple(sorted({index[self.key_of[u]] for p in ps for u in table[p]}))

        return _Folded(
            nodes=keys,
            candidates=self.candidates,
            source=[self.source[ps[0]] for ps in members],
            users=[merged(self.users, ps) for ps in members],
            cross=[merged(self.cross, ps) for ps in members],
            read_by_backward=[any(self.read_by_backward[p] for p in ps) for ps in members],
            storages=[
                tuple(
                    sorted(
                        {
                            folded_storage[
                                (
                                    index[self.key_of[self.storage_owner[g][0]]],
                                    self.storage_owner[g][1],
                                )
                            ]
                            for p in ps
                            for g in self.storages[p]
                        }
                    )
                )
                for ps in members
            ],
            sizes=sizes,
            cost=[sum(self.cost[p] for p in ps) for ps in members],
        )

    def evaluate(self, saved: Sequence[bool] | set[int]) -> tuple[int, float]:
        """(saved bytes, recompute cost) with the candidates in `saved` kept."""
        chosen = saved if isinstance(saved, set) else {c for c, s in enumerate(saved) if s}
        count = len(self.nodes)
        final = [False] * count
        rerun = [False] * count
        held: set[int] = set()
        cost = 0.0
        source, users, cross = self.source, self.users, self.cross
        for p in reversed(range(count)):
            c = source[p]
            tagged = c == -2 or (c >= 0 and c not in chosen)
            recompute = tagged and not any(final[u] for u in cross[p])
            final[p] = recompute
            demanded = self.read_by_backward[p] or any(rerun[u] for u in users[p])
            if not demanded:
                continue
            if recompute:
                rerun[p] = True
                cost += self.cost[p]
            else:
                held.update(self.storages[p])
        return sum(self.sizes[s] for s in held), cost


# --- selection under the linear model ----------------------------------------------------


def _greedy_path(model: _Model) -> list[tuple[int, int, float]]:
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


def _ratio(model: _Model, chosen: set[int], c: int, bytes_: int, cost: float) -> float:
    """Cost removed per byte added by also keeping `c`; keeping for free ranks first."""
    new_bytes, new_cost = model.evaluate(chosen | {c})
    gain = cost - new_cost
    if gain <= 0:
        return 0.0
    return float("inf") if new_bytes <= bytes_ else gain / (new_bytes - bytes_)


def _fill(model: _Model, chosen: set[int], order: Sequence[int], cap: float) -> set[int]:
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


def _select_greedy(model: _Model, path: list[tuple[int, int, float]], cap: float) -> set[int]:
    """The longest prefix of the greedy path that fits, then whatever else still fits."""
    fitting = [k for k, (_, b, _) in enumerate(path) if b <= cap]
    last = fitting[-1] if fitting else -1
    prefix = {c for c, _, _ in path[: last + 1]}
    return _fill(model, prefix, [c for c, _, _ in path[last + 1 :]], cap)


def _select_knapsack(model: _Model, order: Sequence[int], cap: float) -> set[int]:
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


def _select_exact(model: _Model | _Folded, cap: float) -> set[int]:
    """Integer program (scipy's HiGHS) over the linear model: minimum cost, bytes <= cap.

    Binary t[c] (key recomputed) and f[p] (node recomputed after the layer-boundary rule);
    continuous r[p] (reruns in backward), s[p] (saved) and y[g] (storage held), which take
    0/1 values at any optimum once t and f are integral."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    count, keys, storages = len(model.nodes), len(model.candidates), len(model.sizes)
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
        if c == -1:
            fixed_bounds[f0 + p] = (0.0, 0.0)
            tag: list[tuple[int, float]] = []
            tagged = 0.0
        elif c == -2:
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


# --- budgets, exact estimates and repair -------------------------------------------------


@dataclass
class _Search:
    """What one graph's searches share: the estimator, the model and its calibration."""

    graph: JointGraph
    estimator: Estimator
    model: _Model
    objective: str
    profile: str
    floor: Estimate  # the lowest peak: full recompute's (or no AC's, on tiny graphs)
    floor_policy: Policy
    top: Estimate  # no AC
    presets: list[tuple[Policy, Estimate]]
    offset: float
    path: list[tuple[int, int, float]]
    fsdp_reshard: bool
    host_budget: int = 0

    def offload_policy(
        self, chosen: set[int], offloaded: Sequence[int], preset: str | None = None
    ) -> Policy:
        """`full` plus the saved keys `chosen`, those in `offloaded` offloaded instead (where
        the rules refuse, as in the last layer, they stay saved), within the host budget; or,
        with `preset`, that preset with the keys `offloaded` offloaded."""
        keys, moved = self.model.candidates, set(offloaded)
        overrides: dict[str, Action] = {keys[c]: "offload" for c in sorted(moved)}
        if preset is None:
            overrides = {keys[c]: overrides.get(keys[c], "save") for c in sorted(chosen)}
        return Policy(
            preset or "full",
            overrides=overrides,
            fsdp_reshard=self.fsdp_reshard,
            offload=_offload_options(self.host_budget),
        )

    def policy(self, chosen: set[int]) -> Policy:
        """`full` plus saves, or `none` plus recomputes, whichever needs fewer overrides;
        with this search's FSDP choice."""
        keys = self.model.candidates
        saves = {keys[c] for c in chosen}
        if len(saves) <= len(keys) / 2:
            action: Action = "save"
            overrides = {k: action for k in sorted(saves)}
            return Policy("full", overrides=overrides, fsdp_reshard=self.fsdp_reshard)
        action = "recompute"
        overrides = {k: action for k in keys if k not in saves}
        return Policy("none", overrides=overrides, fsdp_reshard=self.fsdp_reshard)

    def cost(self, est: Estimate) -> float:
        return _objective_value(est, self.objective, self.profile)


def fsdp_choices(graph: JointGraph) -> tuple[bool, ...]:
    """The FSDP settings a search tries: reshard after forward, and on graphs with FSDP
    parameter all-gathers also keep unsharded (it trades gathered bytes for collectives)."""
    if any(f.gather is not None for f in rules_of(graph).facts):
        return (True, False)
    return (True,)


def _search(
    graph: JointGraph,
    objective: str,
    profile: str,
    estimator: Estimator | None,
    fsdp_reshard: bool = True,
    host_budget: int = 0,
) -> _Search:
    if objective not in OBJECTIVES:
        raise WorkbenchError(f"unknown objective {objective!r}; choose one of {OBJECTIVES}")
    own = {p.name for p in estimator.profiles} if estimator is not None else set()
    name = profile if profile in own else get_profile(profile).name  # a custom one it holds
    if estimator is None:
        estimator = Estimator(graph, (profile,))
    elif estimator.graph is not graph:
        raise WorkbenchError("the estimator was built for another graph: pass one built on it")
    if name not in {p.name for p in estimator.profiles}:
        raise WorkbenchError(
            f"the estimator has no profile {name!r} (it has "
            f"{', '.join(p.name for p in estimator.profiles) or 'none'}): build it with "
            f"Estimator(graph, profiles=[{name!r}])"
        )
    model = _Model(graph, estimator, objective, name, fsdp_reshard)
    floor_policy = Policy("full", fsdp_reshard=fsdp_reshard)
    none = estimator.estimate(Policy("none", fsdp_reshard=fsdp_reshard))
    floor = estimator.estimate(floor_policy)
    if none.peak_bytes < floor.peak_bytes:  # recompute temporaries outweigh the savings
        floor_policy, floor = Policy("none", fsdp_reshard=fsdp_reshard), none
    everything = set(range(len(model.candidates)))
    top = estimator.estimate(_policy_of(model, everything, fsdp_reshard))
    # all saved activations are alive together where backward starts: the peak there is a
    # constant plus the saved bytes (the model's guess, corrected by exact estimates)
    offset = top.peak_bytes - model.evaluate(everything)[0]
    path = _greedy_path(model)
    presets = [(p, estimator.estimate(p)) for p in _presets(fsdp_reshard, host_budget or 0)]
    return _Search(
        graph,
        estimator,
        model,
        objective,
        name,
        floor,
        floor_policy,
        none,
        presets,
        offset,
        path,
        fsdp_reshard,
        host_budget,
    )


def _offload_options(host_budget: int | None) -> OffloadOptions:
    """The offload options of every policy the solver writes: within `host_budget` (None: no
    limit), deferred by `SOLVER_DEFER_LAYERS`; with 0 nothing offloads and the options stay
    the defaults, so such policies keep their plain (v1/v2) form."""
    if host_budget == 0:
        return OffloadOptions()
    return OffloadOptions(budget_bytes=host_budget, defer_layers=SOLVER_DEFER_LAYERS)


def _presets(fsdp_reshard: bool, host_budget: int | None = 0) -> list[Policy]:
    """The named presets; those that offload only with a host budget (None: no limit),
    deferred as the solver's own offloads."""
    offload = _offload_options(host_budget)
    return [
        Policy(p, fsdp_reshard=fsdp_reshard, offload=offload)
        for p in PRESETS
        if host_budget != 0 or p not in OFFLOAD_PRESETS
    ]


def _policy_of(model: _Model, chosen: set[int], fsdp_reshard: bool) -> Policy:
    overrides: dict[str, Action] = {model.candidates[c]: "save" for c in sorted(chosen)}
    return Policy("full", overrides=overrides, fsdp_reshard=fsdp_reshard)


_Best = tuple[float, Policy, Estimate]


def _repair(
    search: _Search,
    select: Callable[[float], set[int]],
    budget: int,
    cap: float,
    rounds: int = REPAIR_ROUNDS,
) -> tuple[_Best, float]:
    """Move the model's byte cap by each exact estimate's miss (bisecting once a cap that
    fits and one that does not are known); the best fitting policy and its cap. The best
    preset that fits (at least full recompute) is the answer when nothing better fits."""
    # a preset that fits is a policy too: the search starts from the best of them
    best: _Best = min(
        ((search.cost(e), p, e) for p, e in search.presets if e.peak_bytes <= budget),
        key=lambda b: b[0],
    )
    seen: dict[frozenset[int], Estimate] = {}
    fits, overshoots = -np.inf, np.inf  # largest cap known to fit, smallest known not to
    fitting_cap = cap
    for _ in range(rounds):
        chosen = frozenset(select(cap))
        if chosen not in seen:
            seen[chosen] = search.estimator.estimate(search.policy(set(chosen)))
        est = seen[chosen]
        step = budget - est.peak_bytes
        if step >= 0:
            if search.cost(est) < best[0]:
                best = (search.cost(est), search.policy(set(chosen)), est)
                fitting_cap = cap
            fits = max(fits, cap)
            if step < 1e-3 * budget:
                break
        else:
            overshoots = min(overshoots, cap)
        if np.isfinite(fits) and np.isfinite(overshoots):
            if overshoots - fits < 1e-4 * budget:
                break
            proposal = cap + step
            cap = proposal if fits < proposal < overshoots else (fits + overshoots) / 2
        else:
            cap += step
    return best, fitting_cap


def _searches(
    graph: JointGraph,
    objective: str,
    profile: str,
    estimator: Estimator | None,
    fsdp_reshard: bool | None,
    host_budget: int = 0,
) -> list[_Search]:
    """One search per FSDP choice: the given one, or each of `fsdp_choices(graph)`."""
    if host_budget < 0:
        raise WorkbenchError(f"host budget must be 0 (no offload) or more bytes, got {host_budget}")
    choices = fsdp_choices(graph) if fsdp_reshard is None else (fsdp_reshard,)
    if estimator is None:
        estimator = Estimator(graph, (profile,))
    return [
        _search(graph, objective, profile, estimator, choice, host_budget) for choice in choices
    ]


def _solve_best(searches: list[_Search], budget: int, method: str) -> Solution:
    """The best solution for `budget` over the searches' FSDP choices: least cost, then
    lowest peak, then the first choice (reshard after forward, FSDP's default)."""
    floor = min(s.floor.peak_bytes for s in searches)
    if budget < floor:
        raise WorkbenchError(
            f"budget {budget} bytes ({budget / GIB:.4g} GiB) is below what full recompute "
            f"reaches: the smallest feasible budget for {searches[0].graph.model_name!r} is "
            f"{floor} bytes ({floor / GIB:.4g} GiB)"
        )
    found = [_solve_budget(s, budget, method) for s in searches if s.floor.peak_bytes <= budget]
    return min(
        found,
        key=lambda sol: (sol.cost(), sol.estimate.peak_bytes, found.index(sol)),
    )


def _solve_budget(search: _Search, budget: int, method: str) -> Solution:
    """Search the model's byte cap whose policy has the best exact estimate within budget
    (at least the search's floor)."""
    start = time.perf_counter()
    model, order = search.model, [c for c, _, _ in search.path]
    if method == "greedy":

        def select(cap: float) -> set[int]:
            return _select_greedy(model, search.path, cap)
    elif method == "knapsack":

        def select(cap: float) -> set[int]:
            return _select_knapsack(model, order, cap)
    else:
        folded = model.folded()

        def select(cap: float) -> set[int]:
            return _select_exact(folded, cap)

    rounds = REPAIR_ROUNDS if method != "exact" else METHOD_ROUNDS
    best, cap = _repair(search, select, budget, budget - search.offset, rounds)
    if search.host_budget > 0:
        best = _offloaded(search, select, budget, cap, best)
    _, policy, est = best
    return Solution(
        policy=policy,
        estimate=est,
        method=method,
        seconds=time.perf_counter() - start,
        budget_bytes=budget,
        profile=search.profile,
        objective=search.objective,
        host_budget_bytes=search.host_budget,
    )


def _offloaded(
    search: _Search, select: Callable[[float], set[int]], budget: int, cap: float, best: _Best
) -> _Best:
    """Offload as a third choice. Bases: the presets that do not offload, and keeping more
    (the model's choice at `OFFLOAD_CAPS` caps from the fitting one up to keeping
    everything); on each, offload the fewest keys the rules may offload, largest first
    (`_Model.key_bytes`), that
    bring the exact peak within budget: one more at a time up to `OFFLOAD_KEYS`, then all
    (the peak does not fall monotonically with their number, so no bisection). The model
    does not see offload; exact estimates, which price the exposed copy time in the cost,
    decide. The best of these and `best`."""
    model = search.model
    everything = set(range(len(model.candidates)))
    bases: list[tuple[str | None, set[int]]] = [
        (p.preset, everything) for p, _ in search.presets if p.preset not in OFFLOAD_PRESETS
    ]
    top = model.evaluate(everything)[0]
    bases += [
        (None, select(float(c))) for c in np.linspace(max(cap, 0.0), max(top, cap), OFFLOAD_CAPS)
    ]
    for preset, chosen in bases:
        movable = [c for c in chosen if model.offloadable[c]]
        order = sorted(movable, key=lambda c: (-model.key_bytes[c], c))
        counts = [*range(min(OFFLOAD_KEYS, len(order)) + 1), len(order)]
        for count in dict.fromkeys(counts):
            policy = search.offload_policy(chosen, order[:count], preset)
            est = search.estimator.estimate(policy)
            if est.peak_bytes <= budget:
                if search.cost(est) < best[0]:
                    best = (search.cost(est), policy, est)
                break
    return best


def _check_method(method: str, graph: JointGraph) -> None:
    if method not in METHODS:
        raise WorkbenchError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "exact":
        size = len(set(node_keys(graph).values()))
        if size > EXACT_KEY_LIMIT:
            raise WorkbenchError(
                f"method 'exact' solves an integer program over every layer-relative key: "
                f"{graph.model_name!r} has {size}, above the limit of {EXACT_KEY_LIMIT}; "
                "use method='greedy' (or 'knapsack')"
            )


def solve(
    graph: JointGraph,
    budget_bytes: int,
    objective: str = "recompute_time",
    method: str = "greedy",
    profile: str | DeviceProfile = "h100",
    estimator: Estimator | None = None,
    fsdp_reshard: bool | None = None,
    host_budget_bytes: int = 0,
) -> Solution:
    """The policy with the least recompute cost whose estimated peak is <= `budget_bytes`.

    Keys are layer-relative (`layers.*`), so one choice covers every identical layer. The
    linear model (saved bytes, recompute cost) ranks choices; exact estimates
    (`Estimator.estimate`) check the peak and steer the model's cap until it fits. Methods:
    `greedy` (cost removed per byte), `knapsack` (torch's `dp_knapsack`), `exact` (integer
    program, small graphs only). On graphs with FSDP parameter all-gathers the FSDP choice
    is a decision too: `fsdp_reshard=None` searches both settings and returns the better
    (`Solution.policy.fsdp_reshard`); True or False fixes it. With `host_budget_bytes` > 0
    kept activations may also be offloaded to at most that many host bytes; the cost then
    counts the copy time compute waits for (`Estimate.exposed_transfer_seconds`); 0: no
    offload. Raises WorkbenchError below full recompute's peak.
    """
    start = time.perf_counter()
    _check_method(method, graph)
    name = profile.name if isinstance(profile, DeviceProfile) else profile
    searches = _searches(graph, objective, name, estimator, fsdp_reshard, host_budget_bytes)
    solution = _solve_best(searches, int(budget_bytes), method)
    solution.seconds = time.perf_counter() - start
    return solution


def preset_points(
    graph: JointGraph,
    profile: str = "h100",
    estimator: Estimator | None = None,
    fsdp_reshard: bool = True,
) -> dict[str, Estimate]:
    """Estimates of the named presets (with that FSDP choice; the offload presets too,
    unbounded), to place beside a front."""
    estimator = estimator or Estimator(graph, (profile,))
    return {p.preset: estimator.estimate(p) for p in _presets(fsdp_reshard, None)}


def pareto(
    graph: JointGraph,
    budgets: Sequence[int] | None = None,
    n: int = 20,
    method: str = "greedy",
    profile: str = "h100",
    objective: str = "recompute_time",
    progress: Progress | None = None,
    estimator: Estimator | None = None,
    fsdp_reshard: bool | None = None,
    host_budget_bytes: int = 0,
) -> list[Solution]:
    """Solutions for `budgets` (default: `n` evenly spaced from full recompute's peak to no
    AC's), smallest budget first. Where a larger budget's solution costs more than a
    smaller one's, the smaller one's is kept: the front never gets worse with memory.
    Each point takes the better FSDP choice for its budget, and offloads within
    `host_budget_bytes`, as `solve` does."""
    _check_method(method, graph)
    if n < 2 and budgets is None:
        raise WorkbenchError(f"n must be at least 2 points, got {n}")
    searches = _searches(graph, objective, profile, estimator, fsdp_reshard, host_budget_bytes)
    if budgets is None:
        low = min(s.floor.peak_bytes for s in searches)
        high = max(s.top.peak_bytes for s in searches)
        budgets = [int(b) for b in np.linspace(low, max(high, low), n)]
    solutions: list[Solution] = []
    ordered = sorted(int(b) for b in budgets)
    for k, budget in enumerate(ordered):
        solution = _solve_best(searches, budget, method)
        if solutions and solutions[-1].cost() < solution.cost():
            previous = solutions[-1]
            solution.policy, solution.estimate = previous.policy, previous.estimate
        solutions.append(solution)
        if progress is not None:
            progress(k + 1, len(ordered), solution)
    return solutions
