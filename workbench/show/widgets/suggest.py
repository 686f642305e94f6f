"""The explorer's Suggest button: the solver's cheapest policy for a memory budget, said as
edits on the user's own preset where that stays short, and the line that reports it.

Entry points: `suggestion(graph, current, budget_bytes, ...) -> (policy, message)` and
`rebased(graph, policy, base)`.
"""

from __future__ import annotations

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimator
from workbench.decide.decider import decide, layer_key, node_keys
from workbench.decide.policy import Action, Policy
from workbench.errors import INT64_MAX, check_int
from workbench.search.solve import SolveOptions, solve
from workbench.units import format_bytes, format_flops

__all__ = ["rebased", "suggestion"]


def rebased(graph: JointGraph, policy: Policy, base: Policy) -> Policy | None:
    """`policy`'s decisions as overrides on `base`'s preset and selectors (so a suggestion
    keeps the user's preset and lists what it changes) with `policy`'s FSDP choice and
    offload options, or None when the rules that depend on final decisions (layer
    boundaries) would make them differ."""
    want = decide(graph, policy)
    start = Policy(
        base.preset, list(base.selectors), fsdp_reshard=policy.fsdp_reshard, offload=policy.offload
    )
    have = decide(graph, start)
    keys = node_keys(graph)
    by_key: dict[str, list[str]] = {}
    for name in want:
        if name in keys:
            by_key.setdefault(keys[name], []).append(name)
    overrides: dict[str, Action] = {}
    for key, names in by_key.items():
        differ = [n for n in names if want[n].action != have[n].action]
        if not differ:
            continue
        if len({want[n].action for n in names}) == 1:
            overrides[key] = want[names[0]].action  # type: ignore[assignment]
            continue
        for n in differ:
            overrides[layer_key(graph.nodes[n], key)] = want[n].action  # type: ignore[assignment]
    result = Policy(
        base.preset, list(base.selectors), overrides, policy.fsdp_reshard, offload=policy.offload
    )
    got = decide(graph, result)
    same = all(got[n].action == d.action for n, d in want.items())
    return result if same else None


def suggestion(
    graph: JointGraph,
    current: Policy,
    budget_bytes: int,
    *,
    method: str,
    profile: str,
    estimator: Estimator,
    host_budget_bytes: int,
    has_fsdp: bool,
) -> tuple[Policy, str]:
    """The solver's policy for `budget_bytes` (on `current`'s preset unless that takes far
    more rows than the solver's own base) and the message line that says what it is."""
    options = SolveOptions(method=method, profile=profile,  # type: ignore[arg-type]
                           host_budget_bytes=host_budget_bytes)  # fmt: skip
    given: object = budget_bytes
    if isinstance(given, float) and given.is_integer():  # a slider's number
        given = int(given)
    budget = check_int("Suggest's budget_bytes", given, 1, INT64_MAX, "int64")
    solution = solve(graph, budget, options, estimator=estimator)
    rebase = rebased(graph, solution.policy, current)
    own = len(solution.policy.overrides) + len(solution.policy.selectors)
    if rebase is not None and len(rebase.overrides) <= 2 * own + 8:
        policy, note = rebase, ""
    else:
        policy = solution.policy
        note = f" (on {current.preset!r} it would take many more overrides)"
    choice = "reshard after forward" if solution.policy.fsdp_reshard else "keep unsharded"
    fsdp = f"; FSDP {choice}" if has_fsdp else ""
    offloaded = (
        f", offloads {format_bytes(solution.estimate.offloaded_bytes)} to host (budget "
        f"{format_bytes(host_budget_bytes)})"
        if host_budget_bytes
        else ", no offload (host budget 0)"
    )
    message = (
        f"suggested by {solution.method} for a budget of {format_bytes(budget_bytes)}: "
        f"peak {format_bytes(solution.estimate.peak_bytes)}, recompute "
        f"{format_flops(solution.estimate.recompute_flops)}{offloaded}{fsdp}; "
        f"preset {policy.preset!r}{note} with "
        f"{len(policy.selectors)} selectors and {len(policy.overrides)} overrides (listed "
        "under Policy); refine it by clicking ops"
    )
    return policy, message
