"""Policy search for one budget: the cheapest save/recompute/offload choice whose estimated
peak fits a memory budget (offload only within a host-memory budget).

Entry points: `solve(graph, budget_bytes, SolveOptions(...)) -> Solution`, and `Solver` (the
searches of one graph, reused across budgets: `pareto`'s sweeps and `floor_search`'s
bisection); `fsdp_choices(graph)`, `preset_points(graph)` for context.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import BudgetKind, Estimate, Estimator, check_budget_kind
from workbench.cost.profiles import DeviceProfile, get_profile
from workbench.decide.decider import rules_of
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Action, Policy
from workbench.decide.presets import PRESETS
from workbench.errors import INT64_MAX, WorkbenchError, check_int
from workbench.search.model import LinearModel
from workbench.search.select import greedy_path, select_exact, select_greedy, select_knapsack

__all__ = [
    "METHODS",
    "OBJECTIVES",
    "SOLVER_DEFER_LAYERS",
    "Solution",
    "SolveOptions",
    "Solver",
    "fsdp_choices",
    "preset_points",
    "solve",
]

Method = Literal["greedy", "knapsack", "exact"]
Objective = Literal["recompute_time", "recompute_flops"]
METHODS: tuple[Method, ...] = get_args(Method)
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
# Layer-relative keys the integer program of `exact` may hold (debug models: 110-160).
EXACT_KEY_LIMIT = 200
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


@dataclass(kw_only=True, slots=True)
class SolveOptions:
    """How `solve`, `pareto` and `floor_search` search. Checked when made: a bad method,
    objective or host budget fails before anything is traced or estimated."""

    method: Method = "greedy"
    """`greedy` keeps the key that removes the most cost per byte, again and again;
    `knapsack` runs torch's `dp_knapsack`; `exact` an integer program over the
    layer-relative keys (graphs of at most `EXACT_KEY_LIMIT` keys)."""

    objective: Objective = "recompute_time"
    """What a solution minimises: the time recompute and exposed offload copies add to a
    step on `profile`, or the FLOPs recomputed."""

    profile: str | DeviceProfile = "h100"
    """The device whose times the objective counts: a built-in profile's name, a
    `DeviceProfile`, or the name of one the estimator handed to the search holds."""

    fsdp_reshard: bool | None = None
    """On graphs with FSDP parameter all-gathers: None searches both settings and keeps the
    better for each budget; True reshards after forward (FSDP's default); False keeps the
    gathered parameters from forward to backward."""

    host_budget_bytes: int = 0
    """Host memory offloaded activations may take; 0 never offloads. The cost then counts
    the copy time compute waits for (`Estimate.exposed_transfer_seconds`)."""

    budget_kind: BudgetKind = "allocated"
    """What the budget holds: `allocated`, the bytes the graph's tensors take
    (`Estimate.peak_bytes`, `torch.cuda.max_memory_allocated`), or `reserved`, what torch's
    caching allocator keeps for them (`Estimate.reserved_peak_bytes`,
    `max_memory_reserved`)."""

    def __post_init__(self) -> None:
        check_budget_kind(self.budget_kind)
        if self.method not in METHODS:
            raise WorkbenchError(
                f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}"
            )
        if self.objective not in OBJECTIVES:
            raise WorkbenchError(
                f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}"
            )
        check_int("host_budget_bytes", self.host_budget_bytes, 0, INT64_MAX, "0: no offload")

    @property
    def profile_name(self) -> str:
        """The name of `profile`."""
        return self.profile.name if isinstance(self.profile, DeviceProfile) else self.profile


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
    budget_kind: str = "allocated"

    def cost(self) -> float:
        return _objective_value(self.estimate, self.objective, self.profile)

    def to_json(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "peak_bytes": est.peak_bytes,
            "reserved_peak_bytes": est.reserved_peak_bytes,
            "budget_kind": self.budget_kind,
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


# --- one FSDP choice: the model, its calibration, and policies ---------------------------


@dataclass
class _Search:
    """What one FSDP choice's searches share: the estimator, the model and its calibration."""

    graph: JointGraph
    estimator: Estimator
    model: LinearModel
    objective: str
    profile: str
    floor: Estimate  # the lowest peak of the presets (full recompute's, or another's)
    floor_policy: Policy
    top: Estimate  # no AC
    presets: list[tuple[Policy, Estimate]]
    offset: float
    path: list[tuple[int, int, float]]
    fsdp_reshard: bool
    host_budget: int = 0
    budget_kind: BudgetKind = "allocated"

    def peak(self, est: Estimate) -> int:
        """The peak the budget holds: allocated or reserved bytes."""
        return est.budget_bytes(self.budget_kind)

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
        """`full` plus saves, or `none` plus recomputes (of the keys backward never reads
        too, as `full` recomputes them), whichever needs fewer overrides; with this search's
        FSDP choice."""
        keys = self.model.candidates
        saves = {keys[c] for c in chosen}
        if len(saves) <= len(keys) / 2:
            action: Action = "save"
            overrides = {k: action for k in sorted(saves)}
            return Policy("full", overrides=overrides, fsdp_reshard=self.fsdp_reshard)
        action = "recompute"
        recomputed = [k for k in keys if k not in saves] + self.model.unread
        overrides = {k: action for k in sorted(recomputed)}
        return Policy("none", overrides=overrides, fsdp_reshard=self.fsdp_reshard)

    def cost(self, est: Estimate) -> float:
        return _objective_value(est, self.objective, self.profile)


def _search(
    graph: JointGraph, estimator: Estimator, options: SolveOptions, fsdp_reshard: bool
) -> _Search:
    """The model for one FSDP choice, calibrated on the exact estimates of the presets."""
    profile, host_budget = options.profile_name, options.host_budget_bytes
    model = LinearModel(graph, estimator, options.objective, profile, fsdp_reshard)
    none = estimator.estimate(Policy("none", fsdp_reshard=fsdp_reshard))
    kind = options.budget_kind
    presets = [(p, estimator.estimate(p)) for p in _presets(fsdp_reshard, host_budget)]
    # the lowest peak known before searching: full recompute's is not always the lowest (its
    # recompute temporaries can outweigh what `default` or no AC keeps); the search may find
    # lower still, so budgets below it are searched too (`Solver.solve`)
    floor_policy, floor = min(presets, key=lambda pe: pe[1].budget_bytes(kind))
    everything = set(range(len(model.candidates)))
    top = estimator.estimate(_policy_of(model, everything, fsdp_reshard))
    # all saved activations are alive together where backward starts: the peak there is a
    # constant plus the saved bytes (the model's guess, corrected by exact estimates)
    offset = top.budget_bytes(kind) - model.evaluate(everything)[0]
    path = greedy_path(model)
    return _Search(
        graph,
        estimator,
        model,
        options.objective,
        profile,
        floor,
        floor_policy,
        none,
        presets,
        offset,
        path,
        fsdp_reshard,
        host_budget,
        kind,
    )


def fsdp_choices(graph: JointGraph) -> tuple[bool, ...]:
    """The FSDP settings a search tries: reshard after forward, and on graphs with FSDP
    parameter all-gathers also keep unsharded (it trades gathered bytes for collectives)."""
    if any(f.gather is not None for f in rules_of(graph).facts):
        return (True, False)
    return (True,)


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
        if host_budget != 0 or PRESETS[p].offloads is None
    ]


def _policy_of(model: LinearModel, chosen: set[int], fsdp_reshard: bool) -> Policy:
    overrides: dict[str, Action] = {model.candidates[c]: "save" for c in sorted(chosen)}
    return Policy("full", overrides=overrides, fsdp_reshard=fsdp_reshard)


# --- budgets, exact estimates and repair -------------------------------------------------

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
    # a preset that fits is a policy too: the search starts from the best of them; where
    # none fits, from the lowest peak known (infinite cost: replaced by any policy that fits)
    fitting = [(search.cost(e), p, e) for p, e in search.presets if search.peak(e) <= budget]
    best: _Best = min(
        fitting, key=lambda b: b[0], default=(math.inf, search.floor_policy, search.floor)
    )
    seen: dict[frozenset[int], Estimate] = {}
    fits, overshoots = -np.inf, np.inf  # largest cap known to fit, smallest known not to
    fitting_cap = cap
    for _ in range(rounds):
        chosen = frozenset(select(cap))
        if chosen not in seen:
            seen[chosen] = search.estimator.estimate(search.policy(set(chosen)))
        est = seen[chosen]
        step = budget - search.peak(est)
        if best[0] == math.inf and search.peak(est) < search.peak(best[2]):
            best = (math.inf, search.policy(set(chosen)), est)  # nothing fits: the lowest
        if step >= 0:
            if search.cost(est) < best[0]:
                best = (search.cost(est), search.policy(set(chosen)), est)
                fitting_cap = cap
            fits = max(fits, cap)
            if step < 1e-3 * budget:
                break
        else:
            overshoots = min(overshoots, cap)
        if fits > -np.inf and overshoots < np.inf:  # Python ints beyond int64 compare too
            if overshoots - fits < 1e-4 * budget:
                break
            proposal = cap + step
            cap = proposal if fits < proposal < overshoots else (fits + overshoots) / 2
        else:
            cap += step
    return best, fitting_cap


def _solve_budget(search: _Search, budget: int, method: str) -> Solution:
    """Search the model's byte cap whose policy has the best exact estimate within budget
    (at least the search's floor)."""
    start = time.perf_counter()
    model, order = search.model, [c for c, _, _ in search.path]
    if method == "greedy":

        def select(cap: float) -> set[int]:
            return select_greedy(model, search.path, cap)
    elif method == "knapsack":

        def select(cap: float) -> set[int]:
            return select_knapsack(model, order, cap)
    else:
        folded = model.folded()

        def select(cap: float) -> set[int]:
            return select_exact(folded, cap)

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
        budget_kind=search.budget_kind,
    )


def _offloaded(
    search: _Search, select: Callable[[float], set[int]], budget: int, cap: float, best: _Best
) -> _Best:
    """Offload as a third choice. Bases: the presets that do not offload, and keeping more
    (the model's choice at `OFFLOAD_CAPS` caps from the fitting one up to keeping
    everything); on each, offload the fewest keys the rules may offload, largest first
    (`LinearModel.key_bytes`), that bring the exact peak within budget: one more at a time
    up to `OFFLOAD_KEYS`, then all (the peak does not fall monotonically with their number,
    so no bisection). The model does not see offload; exact estimates, which price the
    exposed copy time in the cost, decide. The best of these and `best`."""
    model = search.model
    everything = set(range(len(model.candidates)))
    bases: list[tuple[str | None, set[int]]] = [
        (p.preset, everything) for p, _ in search.presets if PRESETS[p.preset].offloads is None
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
            if search.peak(est) <= budget:
                if search.cost(est) < best[0]:
                    best = (search.cost(est), policy, est)
                break
    return best


class Solver:
    """The searches of one graph under `options`, one per FSDP choice (`fsdp_choices`, or the
    one the options fix), built once and asked for as many budgets as wanted.

    Raises WorkbenchError where the options cannot apply: `exact` on a graph of more than
    `EXACT_KEY_LIMIT` keys, a profile neither built in nor held by `estimator`, an
    estimator built on another graph."""

    def __init__(
        self,
        graph: JointGraph,
        options: SolveOptions | None = None,
        estimator: Estimator | None = None,
    ) -> None:
        options = SolveOptions() if options is None else options
        if not isinstance(options, SolveOptions):
            raise TypeError(
                f"options must be a SolveOptions (e.g. SolveOptions(method='greedy')), "
                f"got {options!r}"
            )
        self.graph, self.options = graph, options
        if options.method == "exact":
            size = len(set(rules_of(graph).keys.values()))
            if size > EXACT_KEY_LIMIT:
                raise WorkbenchError(
                    f"method 'exact' solves an integer program over every layer-relative key: "
                    f"{graph.model_name!r} has {size}, above the limit of {EXACT_KEY_LIMIT}; "
                    "use method='greedy' (or 'knapsack')"
                )
        name = options.profile_name
        if estimator is None:
            estimator = Estimator(graph, (options.profile,))
        elif estimator.graph is not graph:
            raise WorkbenchError("the estimator was built for another graph: pass one built on it")
        held = [p.name for p in estimator.profiles]
        if name not in held:
            get_profile(options.profile)  # an unknown name: the error lists the profiles
            raise WorkbenchError(
                f"the estimator has no profile {name!r} (it has {', '.join(held) or 'none'}): "
                f"build it with Estimator(graph, profiles=[{name!r}])"
            )
        self.estimator = estimator
        choices = fsdp_choices(graph) if options.fsdp_reshard is None else (options.fsdp_reshard,)
        self._searches = [_search(graph, estimator, options, choice) for choice in choices]

    @property
    def floor_bytes(self) -> int:
        """The lowest peak of the presets (over the FSDP choices): a budget at or above it is
        feasible; the search may reach lower (`solve` tries any budget)."""
        return min(s.peak(s.floor) for s in self._searches)

    @property
    def top_bytes(self) -> int:
        """No AC's peak (the highest FSDP choice's): above it every budget costs nothing."""
        return max(s.peak(s.top) for s in self._searches)

    def solve(self, budget_bytes: int) -> Solution:
        """The best solution for `budget_bytes` over the FSDP choices: least cost, then
        lowest peak, then the first choice (reshard after forward, FSDP's default). Raises
        WorkbenchError where no policy the search tries fits, naming the lowest peak it found."""
        start = time.perf_counter()
        budget = check_int("budget_bytes", budget_bytes, 1, INT64_MAX, "int64")
        method = self.options.method
        kind = self.options.budget_kind
        tried = [_solve_budget(s, budget, method) for s in self._searches]
        found = [sol for sol in tried if sol.estimate.budget_bytes(kind) <= budget]
        if not found:
            lowest = min(sol.estimate.budget_bytes(kind) for sol in tried)
            raise WorkbenchError(
                f"budget {budget} bytes ({budget / GIB:.4g} GiB) is below every peak the "
                f"search reaches: the smallest feasible budget found for "
                f"{self.graph.model_name!r} is {lowest} bytes ({lowest / GIB:.4g} GiB)"
            )
        best = min(
            found, key=lambda sol: (sol.cost(), sol.estimate.budget_bytes(kind), found.index(sol))
        )
        return dataclasses.replace(best, seconds=time.perf_counter() - start)


def solve(
    graph: JointGraph,
    budget_bytes: int,
    options: SolveOptions | None = None,
    *,
    estimator: Estimator | None = None,
) -> Solution:
    """The policy with the least recompute cost whose estimated peak is <= `budget_bytes`.

    Keys are layer-relative (`layers.*`), so one choice covers every identical layer. The
    linear model (`LinearModel`: saved bytes, recompute cost) ranks choices; exact estimates
    (`Estimator.estimate`) check the peak and steer the model's cap until it fits. The
    `options` (`SolveOptions`) say how: the method, the objective and its device profile,
    the FSDP choice (searched by default on graphs with FSDP parameter all-gathers:
    `Solution.policy.fsdp_reshard` holds the one taken) and the host budget offload may
    use. `seconds` counts the model's building too. Raises WorkbenchError below full
    recompute's peak, and where `Solver` does."""
    start = time.perf_counter()
    solution = Solver(graph, options, estimator).solve(budget_bytes)
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
