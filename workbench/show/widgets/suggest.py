"""The explorer's Suggest button: the solver's cheapest policy for a memory budget, said as
edits on the user's own preset where that stays short, and the line that reports it.

Entry points: `suggestion(graph, current, budget_bytes, ...) -> (policy, message)`,
`rebased(graph, policy, base)`, `without_idle_overrides` (the rows that change nothing left
out) and `no_offload_words` (why a host budget moved nothing).
"""

from __future__ import annotations

import collections

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import BudgetKind, Estimate, Estimator
from workbench.decide.decider import decide, layer_key, node_keys, rules_of
from workbench.decide.facts import MIN_OFFLOAD_BYTES
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Action, Policy
from workbench.decide.tags import Refusal, Why
from workbench.errors import INT64_MAX, check_int
from workbench.search.solve import SOLVER_DEFER_LAYERS, SolveOptions, solve
from workbench.units import format_bytes, format_flops, format_seconds

__all__ = ["no_offload_words", "rebased", "suggestion", "without_idle_overrides"]


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


def _same_step(a: Estimate, b: Estimate) -> bool:
    """Whether two estimates are of one rematerialized step: the same schedule, peak and
    offloads."""
    return (a.order, a.peak_bytes, a.offloaded_bytes) == (b.order, b.peak_bytes, b.offloaded_bytes)


def without_idle_overrides(
    graph: JointGraph, policy: Policy, estimator: Estimator
) -> tuple[Policy, int]:
    """`policy` without the recompute overrides that change nothing: none of the nodes they
    tag is run again in backward (not read in backward after remat: a saved view keeps
    their output, say). Left out together when the step stays the same (`_same_step`),
    else one by one where it does; also how many were left out."""
    est = estimator.estimate(policy)
    redone = est.recompute_flops_by_node
    tagged: dict[str, set[str]] = {}
    for name, tag in decide(graph, policy).items():
        if tag.why is Why.OVERRIDE and isinstance(tag.detail, str):
            tagged.setdefault(tag.detail, set()).add(name)
    idle = [
        key
        for key, action in policy.overrides.items()
        if action == "recompute" and not tagged.get(key, set()) & set(redone)
    ]

    def without(keys: list[str], base: Policy) -> Policy:
        kept = {k: a for k, a in base.overrides.items() if k not in keys}
        return Policy(
            base.preset, list(base.selectors), kept, base.fsdp_reshard, offload=base.offload
        )

    if not idle:
        return policy, 0
    pruned = without(idle, policy)
    if _same_step(estimator.estimate(pruned), est):
        return pruned, len(idle)
    pruned, left = policy, 0
    for key in idle:
        trial = without([key], pruned)
        if _same_step(estimator.estimate(trial), est):
            pruned, left = trial, left + 1
    return pruned, left


def _refusal_label(why: Refusal) -> str:
    """The short form of an offload refusal for a count: `outside the layers`.

    >>> _refusal_label(Refusal.LAST_LAYER), _refusal_label(Refusal.TOO_SMALL)
    ('in the last layer', 'under the 4096-byte minimum')
    """
    if why is Refusal.TOO_SMALL:
        return f"under the {MIN_OFFLOAD_BYTES}-byte minimum"
    text = why.value.split(":")[0].split(" (")[0]
    verb, _, rest = text.partition(" ")
    return rest if verb in ("is", "has", "returns") and rest else text


def no_offload_words(
    graph: JointGraph,
    policy: Policy,
    budget_bytes: int,
    host_budget_bytes: int,
    profile: str,
    estimator: Estimator,
) -> str:
    """Why a suggestion offloads nothing although the host budget allows it, with numbers:
    the activations it recomputes that the offload rules refuse (by reason), and what
    offloading the others instead would do (the solver's test: fit the budget at less cost
    of recompute and exposed copies on `profile`)."""
    decisions = decide(graph, policy)
    rules, keys = rules_of(graph), node_keys(graph)
    refused: collections.Counter[str] = collections.Counter()
    movable: list[str] = []
    recomputed = [n for n, d in decisions.items() if d.recompute and n in keys]
    for name in recomputed:
        why = rules.offload_refusal(name, decisions, policy.preset)
        if why is None:
            movable.append(name)
        else:
            refused[_refusal_label(why.why)] += 1
    reasons = ", ".join(f"{count} {label}" for label, count in refused.most_common())
    reasons = f" (refused: {reasons})" if reasons else ""
    if not recomputed:
        return "it recomputes nothing: every activation fits on the device"
    if not movable:
        return f"none of the {len(recomputed)} activations it recomputes may be offloaded{reasons}"
    overrides = dict(policy.overrides)
    overrides |= {layer_key(graph.nodes[n], keys[n]): "offload" for n in movable}
    options = OffloadOptions(host_budget_bytes, defer_layers=SOLVER_DEFER_LAYERS)
    alternative = Policy(
        policy.preset,
        list(policy.selectors),
        overrides,  # type: ignore[arg-type]
        policy.fsdp_reshard,
        offload=options,
    )
    now, then = estimator.estimate(policy), estimator.estimate(alternative)

    def cost(est: Estimate) -> float:
        return est.recompute_seconds[profile] + est.exposed_transfer_seconds.get(profile, 0.0)

    moved = sum(graph.nodes[n].bytes for n in movable)
    head = (
        f"offloading instead the {len(movable)} of its {len(recomputed)} recomputed "
        f"activations the rules allow ({format_bytes(moved)}) gives peak "
        f"{format_bytes(then.peak_bytes)}"
    )
    if then.peak_bytes > budget_bytes:
        verdict = "over the budget: their device copies and reloads take room recompute does not"
    elif cost(then) >= cost(now):
        verdict = (
            f"within the budget, but recompute and exposed copies then take "
            f"{format_seconds(cost(then))} on {profile} against {format_seconds(cost(now))}: "
            "recomputing costs less"
        )
    else:
        verdict = (
            f"within the budget and {format_seconds(cost(then))} on {profile} against "
            f"{format_seconds(cost(now))}: cheaper, though the solver's search missed it; "
            "set those overrides to offload under Policy"
        )
    return f"{head}, {verdict}{reasons}"


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
    budget_kind: BudgetKind = "allocated",
) -> tuple[Policy, str]:
    """The solver's policy for `budget_bytes` (on `current`'s preset unless that takes far
    more rows than the solver's own base) and the message line that says what it is."""
    options = SolveOptions(
        method=method,  # type: ignore[arg-type]
        profile=profile,
        host_budget_bytes=host_budget_bytes,
        budget_kind=budget_kind,
    )
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
    policy, idle = without_idle_overrides(graph, policy, estimator)
    left_out = f"; {idle} overrides that would change nothing left out" if idle else ""
    choice = "reshard after forward" if solution.policy.fsdp_reshard else "keep unsharded"
    fsdp = f"; FSDP {choice}" if has_fsdp else ""
    offloaded = (
        f", offloads {format_bytes(solution.estimate.offloaded_bytes)} to host (budget "
        f"{format_bytes(host_budget_bytes)})"
        if host_budget_bytes
        else ", no offload (host budget 0)"
    )
    if host_budget_bytes and not solution.estimate.offloaded_bytes:
        why = no_offload_words(
            graph, policy, int(budget_bytes), host_budget_bytes, profile, estimator
        )
        offloaded += f": {why}"
    message = (
        f"suggested by {solution.method} for a budget of {format_bytes(budget_bytes)} "
        f"({budget_kind}): peak {format_bytes(solution.estimate.peak_bytes)} (reserved "
        f"{format_bytes(solution.estimate.reserved_peak_bytes)}), recompute "
        f"{format_flops(solution.estimate.recompute_flops)}{offloaded}{fsdp}; "
        f"preset {policy.preset!r}{note} with "
        f"{len(policy.selectors)} selectors and {len(policy.overrides)} overrides (listed "
        f"under Policy){left_out}; refine it by clicking ops"
    )
    return policy, message
