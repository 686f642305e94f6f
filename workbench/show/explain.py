"""`policy explain`: a policy's rules in words, where a workbench preset differs from
graph trainer's preset of the same name and why, and on a traced graph its decisions by reason.

Entry points: `explain(policy, graph=None) -> dict` (one JSON object) and `explain_text(result)`.
"""

from __future__ import annotations

import collections
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.decide.decider import Decisions, decide
from workbench.decide.engine import STEPS_OF
from workbench.decide.policy import Policy
from workbench.decide.presets import GRAPH_TRAINER, graph_trainer_preset, preset_record
from workbench.decide.tags import DECISIONS, Why
from workbench.errors import WorkbenchError
from workbench.interop.titan import (
    CPU_FORCED,
    NOT_REPRODUCED,
    compare,
    counterpart,
    differences_of,
    explained_by,
    graph_trainer_tags,
)
from workbench.interop.titan_offload import (
    OFFLOAD_PLACEMENT,
    STEP_NAMES,
    offload_mismatches,
    offload_passes,
)
from workbench.rewrite.placement import OFFLOAD_META

__all__ = ["explain", "explain_text", "steps"]


def steps(preset: str) -> tuple[str, ...]:
    """The deciding steps in words, in the order the engine takes them for the preset's
    dialect (`STEPS_OF`): the engine's own record, next to its code."""
    return tuple(step.words for step in STEPS_OF[preset_record(preset).dialect])


def _decisions_by_reason(decisions: Decisions) -> dict[str, dict[str, int]]:
    """Per `Why` (preset, random op, layer boundary, ...): how many nodes saved / recomputed /
    offloaded (saved in host memory)."""
    counts: dict[Why, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for tag in decisions.values():
        counts[tag.why][tag.action] += 1
    return {why.value: {k: counts[why][k] for k in DECISIONS} for why in Why if why in counts}


def _written_in_place(graph: JointGraph, decisions: Decisions) -> list[dict[str, str]]:
    """The nodes the in-place rule saved (`Why.WRITTEN_INPUT`), each with why."""
    return [
        {"node": n, "module": graph.nodes[n].module, "op": graph.nodes[n].op, "why": t.detail_words}
        for n, t in decisions.items()
        if t.why is Why.WRITTEN_INPUT
    ]


def _against_graph_trainer(
    graph: JointGraph, policy: Policy, memory_policy: str, decisions: Decisions
) -> dict[str, Any]:
    """What `compare` checked on this graph: graph trainer's own tagging (with the policy's
    FSDP choice as its config) against the decisions, node by node, and what it found."""
    reshard = "default" if policy.fsdp_reshard else "never"
    try:
        mismatches = compare(graph, policy, memory_policy)
    except WorkbenchError as err:  # torchtitan not installed: say so, explain the rest
        return {"memory_policy": memory_policy, "skipped": str(err)}
    keys = [explained_by(m, policy.preset) for m in mismatches]
    return {
        "memory_policy": memory_policy,
        "fsdp_reshard_after_forward": reshard,
        "nodes_compared": len(decisions),
        "mismatches": len(mismatches),
        "by_difference": dict(collections.Counter(keys)),
        "cpu_forced": [
            m.node for m, k in zip(mismatches, keys, strict=True) if k == CPU_FORCED.key
        ],
        "rows": [{**m.to_json(), "difference": k} for m, k in zip(mismatches, keys, strict=True)],
    }


def _offload_placement(policy: Policy, graph: JointGraph | None) -> dict[str, Any] | None:
    """Where the offload pass puts its steps against graph trainer's `apply_cpu_offload_pass`:
    the documented differences and, with a graph, what was compared on it (both passes on
    the graph rematerialized by the policy's decisions) and found, with the offloaded sets
    of graph trainer's own tagging, the decisions and the pass; without one, nothing is
    claimed (`checked` None)."""
    if not policy.offloads:
        return None
    result: dict[str, Any] = {
        "options": policy.offload._asdict(),
        "differences": [d.to_json() for d in OFFLOAD_PLACEMENT],
        "checked": None,
    }
    if graph is None:
        return result
    try:
        passes = offload_passes(graph, policy)
        theirs = graph_trainer_tags(graph, "sac_and_offload", policy.fsdp_reshard)
    except WorkbenchError as err:
        result["checked"] = {"skipped": str(err)}
        return result
    decided = [n for n, t in decide(graph, policy).items() if t.offload]
    tagged = [n for n, t in theirs.items() if t is CheckpointPolicy.MUST_CPU_OFFLOAD]
    passed = passes.workbench.meta[OFFLOAD_META].names
    mismatches = offload_mismatches(passes)
    result["checked"] = {
        "graph": graph.model_name,
        "steps": list(STEP_NAMES),
        "values_compared": len(passes.layers),
        "steps_compared": len(passes.layers) * len(STEP_NAMES),
        "mismatches": len(mismatches),
        "by_difference": dict(collections.Counter(m.difference for m in mismatches)),
        "graph_trainer_refused": passes.refused,
        "offloaded": {
            "graph_trainer_tagging": len(tagged),
            "workbench_decisions": len(decided),
            "workbench_pass": len(passed),
        },
        "only_graph_trainer": sorted(set(tagged) - set(passed)),
        "only_workbench": sorted(set(passed) - set(tagged)),
        "skipped_by_pass": {
            name: why.words for name, why in passes.workbench.meta[OFFLOAD_META].skipped.items()
        },
    }
    return result


def explain(policy: Policy | str, graph: JointGraph | None = None) -> dict[str, Any]:
    """The policy's rules in words and, for a workbench preset, the rules where graph
    trainer's preset of the same name (`sac_and_offload` for `offload`) differs and why;
    for a policy that offloads, where its copies go against graph trainer's offload pass;
    with a graph, its decisions by reason and (where graph trainer has a counterpart) the
    mismatches with graph trainer's own tagging of that graph, each named by the difference
    that explains it."""
    policy = policy if isinstance(policy, Policy) else Policy(policy)
    preset = policy.preset
    record = preset_record(preset)
    graph_trainers = record.dialect == GRAPH_TRAINER
    memory_policy = counterpart(preset)
    result: dict[str, Any] = {
        "policy": policy.to_json(),
        "preset": preset,
        "kind": "graph trainer's" if graph_trainers else "workbench",
        "rule": record.description,
        "steps": list(steps(preset)),
        "selectors": [{"select": s.select, "action": s.action} for s in policy.selectors],
        "overrides": dict(sorted(policy.overrides.items())),
        "graph_trainer_counterpart": memory_policy,
        "differences": [d.to_json() for d in differences_of(preset)],
        "cpu_forced_rule": CPU_FORCED.to_json() if preset in CPU_FORCED.presets else None,
        "not_reproduced": list(NOT_REPRODUCED) if graph_trainers else [],
        # where the pass puts the copies, against graph trainer's apply_cpu_offload_pass
        "offload_placement": _offload_placement(policy, graph),
    }
    if graph is not None:
        result["model"] = graph.model_name
        decisions = decide(graph, policy)
        result["decisions_by_reason"] = _decisions_by_reason(decisions)
        result["written_in_place"] = _written_in_place(graph, decisions)
        if memory_policy is not None:
            result["graph_trainer"] = _against_graph_trainer(
                graph, policy, memory_policy, decisions
            )
    return result


def explain_text(result: dict[str, Any]) -> str:
    """What a person reads: `explain`'s result as numbered rules and short lines."""
    preset, counterpart_name = result["preset"], result["graph_trainer_counterpart"]
    lines = [f"policy: {preset} ({result['kind']} preset)", f"rule: {result['rule']}", "then:"]
    lines += [f"  {i}. {step}" for i, step in enumerate(result["steps"], start=1)]
    lines += [f"selector {s['select']}: {s['action']}" for s in result["selectors"]]
    lines += [f"override {key}: {action}" for key, action in result["overrides"].items()]
    if counterpart_name is None:
        lines.append("graph trainer (torchtitan 0.3.0) has no memory policy of this name")
    elif result["kind"] == "graph trainer's":
        lines.append(f"graph trainer's `{counterpart_name}`, node for node, but for:")
        lines += [f"  - {rule}" for rule in result["not_reproduced"]]
    else:
        lines.append(
            f"differs from graph trainer's `{counterpart_name}` "
            f"(`{graph_trainer_preset(counterpart_name)}` here) in "
            f"{len(result['differences'])} rules:"
        )
        for d in result["differences"]:
            lines.append(f"  - {d['rule']}: here {d['workbench']}; there {d['graph_trainer']}")
            lines.append(f"    why: {d['why']}")
    if result["offload_placement"] is not None:
        lines += _placement_lines(result["offload_placement"])
    if result["cpu_forced_rule"] is not None:
        forced = result["cpu_forced_rule"]
        lines.append(f"forced on the CPU: {forced['rule']}: {forced['why']}")
    if "model" not in result:
        return "\n".join(lines)
    lines.append(f"on {result['model']}, decisions by reason:")
    for why, counts in result["decisions_by_reason"].items():
        line = f"  {why:<18} {counts['save']:>5} save {counts['recompute']:>5} recompute"
        lines.append(line + (f" {counts['offload']:>5} offload" if counts["offload"] else ""))
    for row in result["written_in_place"]:
        lines.append(f"  saved, written in place: {row['node']} ({row['module']}): {row['why']}")
    against = result.get("graph_trainer")
    if against is None:
        return "\n".join(lines)
    if "skipped" in against:
        lines.append(f"against graph trainer's own tagging: skipped ({against['skipped']})")
        return "\n".join(lines)
    by = ", ".join(f"{k} {n}" for k, n in against["by_difference"].items()) or "none"
    lines.append(
        f"against graph trainer's own `{against['memory_policy']}` tagging of this graph "
        f"(fsdp_reshard_after_forward {against['fsdp_reshard_after_forward']}): "
        f"{against['nodes_compared']} forward and loss nodes compared, "
        f"{against['mismatches']} mismatches ({by})"
    )
    if against["cpu_forced"]:
        lines.append(f"  CPU-forced: {', '.join(against['cpu_forced'])}")
    return "\n".join(lines)


def _placement_lines(placement: dict[str, Any]) -> list[str]:
    """The offload placement in words: what was compared and found, or that nothing was."""
    options, checked = placement["options"], placement["checked"]
    head = (
        f"offload steps (prefetch {options['prefetch_layers']}, defer {options['defer_layers']}) "
        "against graph trainer's apply_cpu_offload_pass: "
    )
    if checked is None:
        lines = [head + "not compared (give a model to run both passes on its graph)"]
    elif "skipped" in checked:
        lines = [head + f"skipped ({checked['skipped']})"]
    else:
        by = ", ".join(f"{k} {n}" for k, n in checked["by_difference"].items()) or "none"
        sets = checked["offloaded"]
        lines = [
            head + f"compared on {checked['graph']} rematerialized by this policy: "
            f"{checked['values_compared']} values offloaded by the workbench's pass, "
            f"{checked['steps_compared']} steps ({', '.join(checked['steps'])}), "
            f"{checked['mismatches']} placed apart ({by})",
            f"  offloaded: graph trainer's tagging {sets['graph_trainer_tagging']}, the "
            f"workbench's decisions {sets['workbench_decisions']}, its pass "
            f"{sets['workbench_pass']}; only graph trainer's: "
            f"{', '.join(checked['only_graph_trainer']) or 'none'}; only the workbench's: "
            f"{', '.join(checked['only_workbench']) or 'none'}",
        ]
        if checked["graph_trainer_refused"]:
            lines.append(
                f"  graph trainer's pass refused the graph: {checked['graph_trainer_refused']}"
            )
    n = len(placement["differences"])
    lines.append(f"documented placement differences ({n}):")
    for d in placement["differences"]:
        lines.append(f"  - {d['rule']}: here {d['workbench']}; there {d['graph_trainer']}")
        lines.append(f"    why: {d['why']}")
    return lines
