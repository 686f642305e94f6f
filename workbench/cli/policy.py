"""`policy explain`: a policy's rules in words, where they differ from graph trainer's, and
with --model its decisions on that graph by reason.

Entry points: `cmd_policy_explain(args)` and `Explanation`, its result (prose for people,
`workbench.show.explain.explain_text`).
"""

from __future__ import annotations

import argparse

from workbench.cli.args import refuse_graph_flags_without_model, trace_from_args
from workbench.cli.report import Report
from workbench.decide.policy import parse_policy

__all__ = ["Explanation", "cmd_policy_explain"]


class Explanation(Report):
    """`explain`'s object; a person reads it as prose."""

    def __str__(self) -> str:
        from workbench.show.explain import explain_text

        return explain_text(self.data)


def cmd_policy_explain(args: argparse.Namespace) -> Explanation:
    """The policy's rules in words and where it differs from graph trainer's; with --model,
    its decisions by reason and mismatches with graph trainer's tagging of that graph."""
    from workbench.show.explain import explain

    policy = parse_policy(args.policy)
    refuse_graph_flags_without_model(args)
    graph = trace_from_args(args)[0] if args.model is not None else None
    return Explanation(explain(policy, graph))
