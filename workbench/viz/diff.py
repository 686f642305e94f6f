"""What changed between two policies (or before and after remat), as a table and a picture.

Entry points: `diff(graph, decisions_a, decisions_b) -> PolicyDiff`, `remat_diff(graph,
result)`, and `PolicyDiff.markdown()` / `.render(graph, view="overview" | "layer:N")`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.graph import JointGraph
from workbench.policy import Decisions
from workbench.remat import RematResult
from workbench.viz.network import DiffRow, is_recompute, original_of, saved_names
from workbench.viz.render import View
from workbench.viz.style import human_bytes, human_flops, signed

COLUMNS = ("node", "module", "op", "before", "after", "Δ kept bytes", "Δ recompute FLOPs")


@dataclass
class PolicyDiff:
    """Changed activations in graph order; deltas are after minus before."""

    rows: list[DiffRow]
    before_name: str = "a"
    after_name: str = "b"
    decisions: Decisions | None = None  # the after side's, for colouring pictures

    @property
    def saved_bytes_delta(self) -> int:
        return sum(r.saved_bytes_delta for r in self.rows)

    @property
    def recompute_flops_delta(self) -> int:
        return sum(r.recompute_flops_delta for r in self.rows)

    def totals(self) -> dict[str, int]:
        return {
            "changed": len(self.rows),
            "saved_bytes_delta": self.saved_bytes_delta,
            "recompute_flops_delta": self.recompute_flops_delta,
        }

    def table(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.rows]

    def markdown(self, limit: int | None = 50) -> str:
        """A plain Markdown table (no pandas), with a totals line; `limit` rows at most."""
        head = [
            f"{self.before_name} → {self.after_name}: {len(self.rows)} activations changed, "
            f"kept for backward {signed(human_bytes(self.saved_bytes_delta))}, "
            f"recompute {signed(human_flops(self.recompute_flops_delta))}",
            "",
            "| " + " | ".join(COLUMNS) + " |",
            "|" + "---|" * len(COLUMNS),
        ]
        shown = self.rows if limit is None else self.rows[:limit]
        body = [
            f"| {r.node} | {r.module or '(top level)'} | {r.op} | {r.before} | {r.after} | "
            f"{signed(human_bytes(r.saved_bytes_delta))} | "
            f"{signed(human_flops(r.recompute_flops_delta))} |"
            for r in shown
        ]
        if len(shown) < len(self.rows):
            body.append(f"| … {len(self.rows) - len(shown)} more | | | | | | |")
        return "\n".join(head + body)

    def changes(self) -> dict[str, DiffRow]:
        return {r.node: r for r in self.rows}

    def render(self, graph: JointGraph, view: str = "overview", title: str = "") -> View:
        """The overview (or `layer:N` / `module:PATH`) with changed boxes or ops outlined."""
        from workbench.viz.hierarchy import expand, render_overview

        heading = title or (
            f"{graph.model_name}: {self.before_name} → {self.after_name}, "
            f"{len(self.rows)} activations changed"
        )
        if view == "overview":
            return render_overview(graph, self.decisions, changes=self.changes(), title=heading)
        return expand(graph, self.decisions, view, changes=self.changes(), title=heading)


def _delta(graph: JointGraph, name: str, before: str, after: str, kept: bool) -> DiffRow:
    info = graph.nodes[name]
    keeps = {"save": 1, "kept": 1}
    recomputes = {"recompute": 1, "recomputed": 1}
    return DiffRow(
        node=name,
        module=info.module,
        op=info.op,
        layer=info.layer,
        before=before,
        after=after,
        bytes=info.bytes,
        flops=info.flops,
        saved_bytes_delta=info.bytes * (keeps.get(after, 0) - keeps.get(before, 0)) * kept,
        recompute_flops_delta=info.flops * (recomputes.get(after, 0) - recomputes.get(before, 0)),
    )


def diff(
    graph: JointGraph,
    decisions_a: Decisions,
    decisions_b: Decisions,
    names: tuple[str, str] = ("a", "b"),
) -> PolicyDiff:
    """Nodes tagged save in one and recompute in the other. Δ kept bytes counts the node's
    output bytes only when backward reads it (otherwise it is never kept either way);
    Δ recompute FLOPs counts its FLOPs. MUST vs PREFER of the same action is no change."""
    saved = saved_names(graph)
    rows = []
    for name in graph.nodes:
        if name not in decisions_a or name not in decisions_b:
            continue
        a, b = is_recompute(decisions_a, name), is_recompute(decisions_b, name)
        if a != b:
            before, after = ("recompute", "save") if a else ("save", "recompute")
            rows.append(_delta(graph, name, before, after, name in saved))
    return PolicyDiff(rows, *names, decisions=decisions_b)


def remat_diff(graph: JointGraph, result: RematResult) -> PolicyDiff:
    """Before vs after torch's remat pass: activations no longer kept (recomputed, or not
    needed), newly kept ones, and every recomputed node with its FLOPs."""
    report = result.report
    before, after = set(report.saved_before), set(report.saved_after)
    recomputed = {
        original_of(n.name) for n in result.gm.graph.nodes if original_of(n.name) is not None
    }
    rows = []
    for name in graph.nodes:
        if name in before and name not in after:
            state = "recomputed" if name in recomputed else "not kept"
            rows.append(_delta(graph, name, "kept", state, True))
        elif name in after and name not in before:
            rows.append(_delta(graph, name, "not kept", "kept", True))
        elif name in recomputed and name not in before:
            rows.append(_delta(graph, name, "not kept", "recomputed", True))
    return PolicyDiff(rows, "before remat", "after remat", decisions=result.decisions)
