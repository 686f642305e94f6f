"""`render` and `activations`: a policy's decisions drawn on the graph, and graph trainer's
per-activation table for it.

Entry points: `cmd_render` and `cmd_activations` (each `args -> Result`); `Activations`, the
table's result (graph trainer's log for people).
"""

from __future__ import annotations

import argparse
import time

from workbench.cli.args import check_passes, passes_json, prepared_from_args, trace_from_args
from workbench.cli.report import Report
from workbench.decide.policy import parse_policy
from workbench.files import check_writable

__all__ = ["Activations", "cmd_activations", "cmd_render"]


def cmd_render(args: argparse.Namespace) -> Report:
    """Draw one view of the policy's decisions to --out (.svg, .png, .pdf or .dot)."""
    from workbench.decide.decider import decide
    from workbench.show.viz import parse_view, render_view

    parse_view(args.view)  # fail before tracing
    check_writable(args.out, overwrite=args.overwrite)
    policy = parse_policy(args.policy)
    graph, _ = prepared_from_args(args)
    start = time.perf_counter()
    decisions = decide(graph, policy)
    view = render_view(graph, decisions, args.view, policy_name=args.policy, force=args.force)
    path = view.write(args.out, overwrite=args.overwrite)
    return Report(
        {
            **passes_json(args, graph, policy),
            "path": str(path),
            "view": args.view,
            "nodes": view.nodes,
            "edges": view.edges,
            "seconds": round(time.perf_counter() - start, 3),
        }
    )


class Activations(Report):
    """The table's rows and totals; a person reads graph trainer's log text (its `table`)."""

    def __str__(self) -> str:
        return str(self.data["table"])


def cmd_activations(args: argparse.Namespace) -> Activations:
    """graph trainer's activation-memory table for the policy: rows, totals and the log text."""
    from workbench.interop.activations import activation_log, activation_rows, totals
    from workbench.rewrite.graph_trainer import prepare

    policy = parse_policy(args.policy)
    check_passes(args)
    graph, _ = trace_from_args(args)  # one rank's graph under --fsdp/--tp
    graph = prepare(graph, args.passes, args.ep_overlap)
    rows = activation_rows(graph, policy)
    return Activations(
        {
            "model": graph.model_name,
            "policy": policy.to_json(),
            **passes_json(args, graph, policy),
            "total": totals(rows),
            "rows": [row.to_json() for row in rows],
            "table": activation_log(rows),
        }
    )
