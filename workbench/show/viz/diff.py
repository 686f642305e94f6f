"""What changed between two policies (or before and after remat), as a table and a picture.

Entry points: `diff(graph, decisions_a, decisions_b) -> PolicyDiff`, `remat_diff(graph,
result)`, and `PolicyDiff.markdown()` / `.render(graph, view="overview" | "layer:N")`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.cost.replay import recompute_flops_by_node, saved_bytes_by_node
from workbench.decide.decider import Decisions
from workbench.errors import WorkbenchError
from workbench.rewrite.remat import RematResult
from workbench.show.viz.network import DiffRow, original_of
from workbench.show.viz.render import View
from workbench.show.viz.style import signed
from workbench.units import format_bytes, format_flops

__all__ = [
    "COLUMNS",
    "PolicyDiff",
    "diff",
    "remat_diff",
]

COLUMNS = (
    "node",
    "module",
    "op",
    "before",
    "after",
    "Δ kept bytes",
    "Δ recompute FLOPs",
    "Δ offloaded bytes",
)


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

    @property
    def offloaded_bytes_delta(self) -> int:
        return sum(r.offloaded_bytes_delta for r in self.rows)

    @property
    def offloads(self) -> bool:
        """Whether any row moves to or from offload (only then do tables show offload)."""
        return any("offload" in (r.before, r.after) for r in self.rows)

    def totals(self) -> dict[str, int]:
        totals = {
            "changed": len(self.rows),
            "saved_bytes_delta": self.saved_bytes_delta,
            "recompute_flops_delta": self.recompute_flops_delta,
        }
        if self.offloads:
            totals["offloaded_bytes_delta"] = self.offloaded_bytes_delta
        return totals

    def table(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.rows]

    def markdown(self, limit: int | None = 50) -> str:
        """A plain Markdown table (no pandas), with a totals line; `limit` rows at most. The
        offload figures only when a row moves to or from offload."""
        columns = COLUMNS if self.offloads else COLUMNS[:-1]
        moved = f", offloaded {signed(format_bytes(self.offloaded_bytes_delta))}"
        head = [
            f"{self.before_name} → {self.after_name}: {len(self.rows)} activations changed, "
            f"kept for backward {signed(format_bytes(self.saved_bytes_delta))}, "
            f"recompute {signed(format_flops(self.recompute_flops_delta))}"
            + (moved if self.offloads else ""),
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
        ]
        shown = self.rows if limit is None else self.rows[:limit]
        body = [
            f"| {r.node} | {r.module or '(top level)'} | {r.op} | {r.before} | {r.after} | "
            f"{signed(format_bytes(r.saved_bytes_delta))} | "
            f"{signed(format_flops(r.recompute_flops_delta))} |"
            + (f" {signed(format_bytes(r.offloaded_bytes_delta))} |" if self.offloads else "")
            for r in shown
        ]
        if len(shown) < len(self.rows):
            body.append(f"| … {len(self.rows) - len(shown)} more |" + " |" * (len(columns) - 1))
        return "\n".join(head + body)

    def changes(self) -> dict[str, DiffRow]:
        return {r.node: r for r in self.rows}

    def render(
        self, graph: JointGraph, view: str = "overview", title: str = "", context: int | None = None
    ) -> View:
        """The overview (or `layer:N` / `module:PATH`) with changed boxes or ops outlined;
        with `context`, a layer or module cropped to its changed ops and the ops within
        `context` edges of them (a picture of what changed, not of the whole layer)."""
        from workbench.show.viz.hierarchy import expand, render_overview

        heading = title or (
            f"{graph.model_name}: {self.before_name} → {self.after_name}, "
            f"{len(self.rows)} activations changed"
        )
        if view == "overview":
            if context is not None:
                raise WorkbenchError("context crops a layer or module view, not the overview")
            return render_overview(graph, self.decisions, changes=self.changes(), title=heading)
        return expand(
            graph, self.decisions, view, changes=self.changes(), title=heading, context=context
        )


def _delta(
    graph: JointGraph, name: str, before: str, after: str, kept_delta: int, flops_delta: int
) -> DiffRow:
    info = graph.nodes[name]
    offloaded = (after == "offload") - (before == "offload")
    return DiffRow(
        node=name,
        module=info.module,
        op=info.op,
        layer=info.layer,
        before=before,
        after=after,
        bytes=info.bytes,
        flops=info.flops,
        saved_bytes_delta=kept_delta,
        recompute_flops_delta=flops_delta,
        offloaded_bytes_delta=info.bytes * offloaded,
    )


def _kept_rows(
    graph: JointGraph, before: dict[str, int], after: dict[str, int], skip: set[str]
) -> list[tuple[str, str, str, int]]:
    """Nodes (not in `skip`) whose kept bytes changed: (name, before, after, Δ bytes)."""
    rows = []
    for name in graph.nodes:
        delta = after.get(name, 0) - before.get(name, 0)
        if delta and name not in skip:
            state = ("not kept", "kept") if delta > 0 else ("kept", "not kept")
            rows.append((name, *state, delta))
    return rows


def _redone_rows(
    graph: JointGraph, before: dict[str, int], after: dict[str, int], skip: set[str]
) -> list[tuple[str, str, str, int]]:
    """Nodes (not in `skip`) whose recompute changed without a change of their own (a node
    tagged recompute that backward now needs, or no longer): (name, before, after, Δ FLOPs)."""
    rows = []
    for name in graph.nodes:
        if name in skip or (name in before, before.get(name)) == (name in after, after.get(name)):
            continue
        was, now = ("recomputed" if name in d else "not recomputed" for d in (before, after))
        rows.append((name, was, now, after.get(name, 0) - before.get(name, 0)))
    return rows


def diff(
    graph: JointGraph,
    decisions_a: Decisions,
    decisions_b: Decisions,
    names: tuple[str, str] = ("a", "b"),
) -> PolicyDiff:
    """Nodes whose decision (save, recompute, offload) differs, and nodes whose kept bytes or
    recompute FLOPs changed without a change of their own (the base of a view that is now
    saved, a node tagged recompute that backward now needs). Δ kept bytes is the change of
    `saved_bytes_by_node` (the estimate's saved activation bytes, offloaded ones included)
    at each node, Δ recompute FLOPs the change of `recompute_flops_by_node` (what backward
    runs again), so the rows add up to the estimates' differences; Δ offloaded bytes its
    bytes moved to host memory. MUST vs PREFER of the same action is no change."""
    kept_a, kept_b = (
        saved_bytes_by_node(graph, decisions_a),
        saved_bytes_by_node(graph, decisions_b),
    )
    redo_a, redo_b = (
        recompute_flops_by_node(graph, decisions_a),
        recompute_flops_by_node(graph, decisions_b),
    )
    rows, flipped = [], set()
    for name in graph.nodes:
        if name not in decisions_a or name not in decisions_b:
            continue
        before, after = decisions_a[name].action, decisions_b[name].action
        if before != after:
            delta = kept_b.get(name, 0) - kept_a.get(name, 0)
            redo = redo_b.get(name, 0) - redo_a.get(name, 0)
            rows.append(_delta(graph, name, before, after, delta, redo))
            flipped.add(name)
    for name, before, after, delta in _kept_rows(graph, kept_a, kept_b, flipped):
        redo = redo_b.get(name, 0) - redo_a.get(name, 0)
        rows.append(_delta(graph, name, before, after, delta, redo))
        flipped.add(name)
    for name, before, after, redo in _redone_rows(graph, redo_a, redo_b, flipped):
        rows.append(_delta(graph, name, before, after, 0, redo))
    order = {name: i for i, name in enumerate(graph.nodes)}
    rows.sort(key=lambda r: order[r.node])
    return PolicyDiff(rows, *names, decisions=decisions_b)


def remat_diff(graph: JointGraph, result: RematResult) -> PolicyDiff:
    """Before vs after torch's remat pass: activations no longer kept (recomputed, or not
    needed), newly kept ones, and every recomputed node with its FLOPs."""
    report = result.report
    before, after = report.saved_bytes_by_node_before, report.saved_bytes_by_node_after
    recomputed = {
        original_of(n.name) for n in result.gm.graph.nodes if original_of(n.name) is not None
    }
    rows = []
    for name, was, now, delta in _kept_rows(graph, before, after, set()):
        state = "recomputed" if name in recomputed and now == "not kept" else now
        flops = graph.nodes[name].flops if name in recomputed else 0
        rows.append(_delta(graph, name, was, state, delta, flops))
    shown = {r.node for r in rows}
    for name in graph.nodes:
        if name in recomputed and name not in shown:
            was = "kept" if name in before else "not kept"
            rows.append(_delta(graph, name, was, "recomputed", 0, graph.nodes[name].flops))
    order = {name: i for i, name in enumerate(graph.nodes)}
    rows.sort(key=lambda r: order[r.node])
    return PolicyDiff(rows, "before remat", "after remat", decisions=result.decisions)
