"""What an export says about the traced graph in its comments: the parallel setting's
meaning for the policy and the decisions forced whatever the policy asks.

Entry points: `comment(text)` (one safe comment line), `parallel_notes(policy, graph)` and
`forced_notes(policy, graph)`.
"""

from __future__ import annotations

from collections import Counter

from workbench.capture.graph import JointGraph
from workbench.decide.decider import decide, forced_by_reason
from workbench.decide.policy import Policy
from workbench.decide.tags import Why

__all__ = ["FORCED_NAMED", "comment", "forced_notes", "parallel_notes"]


def comment(text: str) -> str:
    """One comment line: control characters, backslashes and non-ASCII are escaped, so
    nothing in `text` can end the comment early."""
    return "# " + "".join(ch if " " <= ch <= "~" and ch != "\\" else ascii(ch)[1:-1] for ch in text)


def parallel_notes(policy: Policy, graph: JointGraph) -> list[str]:
    """What a per-rank graph's parallel setting means for `policy`: which collectives it
    saves and which it recomputes, and the FSDP reshard choice. Empty on one device."""
    if graph.world_size == 1:
        return []
    decisions = decide(graph, policy)
    saved: Counter[str] = Counter()
    redone: Counter[str] = Counter()
    for c in graph.collectives():
        tag = decisions.get(c.node)
        if tag is not None and c.kind != "wait":
            (redone if tag.recompute else saved)[f"{c.kind} ({c.mesh_dim or c.group})"] += 1
    fsdp = (
        "reshard after forward: FSDP all-gathers run again in backward"
        if policy.fsdp_reshard
        else "keep unsharded: gathered parameters stay from forward to backward"
    )
    config = graph.config
    return [
        f"Per-rank graph, fsdp {config.get('fsdp', 1)} x tp {config.get('tp', 1)} "
        f"(world size {graph.world_size}); FSDP: {fsdp}.",
        "Forward collectives saved: "
        + (", ".join(f"{n} {k}" for k, n in sorted(saved.items())) or "none")
        + ".",
        "Forward collectives recomputed in backward: "
        + (", ".join(f"{n} {k}" for k, n in sorted(redone.items())) or "none")
        + ".",
        "Eager SAC (policy_fn) sees no FSDP all-gathers: FSDP2's reshard_after_forward decides.",
    ]


FORCED_NAMED = 5  # forced nodes an export's comments name one by one


def forced_notes(policy: Policy, graph: JointGraph) -> list[str]:
    """What `decide` forces on the traced graph whatever the policy asks, by reason, and
    each save of the in-place rule (`Why.WRITTEN_INPUT`) with why: the comments of a
    `graph_pass` export, whose `tag_graph` forces the same in the training job."""
    decisions = decide(graph, policy)
    counts = forced_by_reason(decisions)
    if not counts:
        return []
    lines = [
        "Forced on this graph, whatever the policy asks: "
        + ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
        + "."
    ]
    written = [(n, d) for n, d in decisions.items() if d.why is Why.WRITTEN_INPUT]
    for name, tag in written[:FORCED_NAMED]:
        module = graph.nodes[name].module
        lines.append(f"Saved, written in place: {name} ({module}): {tag.detail_words}")
    if len(written) > FORCED_NAMED:
        lines.append(f"... and {len(written) - FORCED_NAMED} more saved for that reason.")
    return lines
