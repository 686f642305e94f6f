"""`trace`, `verify` and `export`: the traced step summarised, a policy's remat checked bitwise
against it, and a policy as code.

Entry points: `cmd_trace`, `cmd_verify` and `cmd_export` (each `args -> Result`); `Export`,
the export's result (the code, or where it was written).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from workbench.capture.parallel import Parallel
from workbench.cli.args import (
    MAX_RANDOM,
    SEED_MAX,
    check_positive,
    kernels_from_args,
    parallel_from_args,
    shape_from_args,
    trace_from_args,
    trace_workload,
    workload_from_args,
)
from workbench.cli.fits import refuse_unfit, refuse_unfit_ranks
from workbench.cli.report import Report
from workbench.decide.policy import Policy, parse_policy
from workbench.errors import WorkbenchError, check_int
from workbench.files import check_writable

__all__ = ["Export", "cmd_export", "cmd_trace", "cmd_verify"]


def cmd_trace(args: argparse.Namespace) -> Report:
    graph, seconds = trace_from_args(args)
    return Report({**graph.summary(), "seconds": round(seconds, 3)})


def _refuse_titan_ranks(args: argparse.Namespace, parallel: Parallel | None) -> None:
    """verify's ranks run on gloo with the workbench's own sharding; a torchtitan model's
    rank is graph trainer's (`titan_rank`), which no gloo run reproduces yet."""
    if parallel is not None and args.model.startswith("torchtitan:"):
        raise WorkbenchError(
            f"verify with --fsdp/--tp/--ep: {args.model}'s rank is sharded by graph trainer's "
            "parallelize, which the gloo ranks of verify do not run yet; verify it on one "
            "device (no --fsdp/--tp/--ep) or estimate the rank"
        )


def cmd_verify(args: argparse.Namespace) -> Report:
    """Remat with torch's pass, run under no_grad, compare loss and grads bitwise with the
    traced graph's (all from one generator state, so dropout draws alike); before that, the
    traced graph against eager and eager against itself (`cost.reference`), so a mismatch
    says whose it is; refuses what cannot fit."""
    from workbench.cost.reference import policy_mismatches, reference_run
    from workbench.rewrite.remat import remat

    if args.mode != "real":
        raise WorkbenchError("verify runs the graph: use --mode real")
    if args.random is not None:
        return _verify_random(args)
    args.policy = args.policy or "default"
    policy = parse_policy(args.policy)
    parallel = parallel_from_args(args)
    _refuse_titan_ranks(args, parallel)
    if parallel is not None:
        return _verify_ranks(args, parallel)
    refuse_unfit(args, policy, "cpu")
    workload = workload_from_args(args, "real")
    graph, _ = trace_workload(workload, "real")
    result = remat(graph, policy)
    reference = reference_run(graph, workload)
    mismatched = policy_mismatches(graph, result.gm, reference)
    return Report(
        {
            "model": graph.model_name,
            "policy": policy.to_json(),
            "bitwise_equal": not mismatched,  # the policy's verdict: graph against graph
            "mismatched": mismatched,
            "before_policy": reference.to_json(),
            **result.report.to_json(),
            # what no request can change, and why: node -> reason
            "forced": {n: result.decisions[n].explanation for n in result.report.forced},
        }
    )


def _verify_random(args: argparse.Namespace) -> Report:
    """`--random N`: N seeded random policies of the model (`workbench.search.soundness`), each
    checked bitwise; the failures are listed with their policies, to reproduce one."""
    from workbench.search.soundness import run_soundness

    check_positive("--random", args.random, MAX_RANDOM, "each policy is a remat and a real run")
    check_int("--seed", args.seed, 0, SEED_MAX)
    if args.policy is not None:
        raise WorkbenchError("verify: give --policy or --random N, not both")
    parallel = parallel_from_args(args)
    _refuse_titan_ranks(args, parallel)
    if parallel is None:
        refuse_unfit(args, Policy("none"), "cpu")
        workload = workload_from_args(args, "real")
        graph, _ = trace_workload(workload, "real")
    else:  # the policies' node keys from one rank in fake mode: every rank has its graph
        workload = workload_from_args(args, "fake")
        graph, _ = trace_workload(workload, "fake", parallel, kernels="cpu")  # gloo: CPUs
    report = run_soundness(workload, graph, args.random, args.seed, parallel, shape_from_args(args))
    return Report(report.to_json())


def _verify_ranks(args: argparse.Namespace, parallel: Parallel) -> Report:
    """One gloo process per rank: each rank's remat'd graph against its eager step."""
    from workbench.cost.ranks import check_ranks

    policy = parse_policy(args.policy)
    refuse_unfit_ranks(workload_from_args(args, "fake"), parallel, policy)
    checks = check_ranks(args.model, parallel, [args.policy], **shape_from_args(args))
    errors = sorted({c.error for c in checks if c.error})
    if errors and all(c.error for c in checks):  # nothing was compared: say why in one line
        raise WorkbenchError(f"every rank failed: {errors[0]}")
    return Report(
        {
            "model": args.model,
            "policy": parse_policy(args.policy).to_json(),
            **parallel.to_json(),
            "bitwise_equal": all(c.bitwise_equal for c in checks),
            "mismatched": {str(c.rank): list(c.mismatched) for c in checks if c.mismatched},
        }
    )


@dataclass
class Export:
    """A policy as code: printed whole, or with `path` (`--out`) one line saying where."""

    format: str
    code: str
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        where = {} if self.path is None else {"path": self.path}
        return {"format": self.format, "code": self.code, **where}

    def __str__(self) -> str:
        if self.path is None:
            return self.code
        lines = self.code.count("\n") + 1
        return f"wrote the {self.format} export ({lines} lines) to {self.path}"


def cmd_export(args: argparse.Namespace) -> Export:
    from workbench.interop.export import FORMATS, export, torchtitan_options, write_export

    if args.format not in FORMATS:
        raise WorkbenchError(f"unknown format {args.format!r}; choose one of {', '.join(FORMATS)}")
    if args.torchtitan_version is not None and args.format != "torchtitan":
        raise WorkbenchError("--torchtitan-version goes with --format torchtitan only")
    policy = parse_policy(args.policy)
    if args.out is not None:
        check_writable(args.out, overwrite=args.overwrite)  # fail before tracing
    graph, _ = trace_workload(
        workload_from_args(args, "fake"),
        "fake",
        parallel_from_args(args),
        kernels_from_args(args, "fake"),
    )
    if args.format == "torchtitan":
        text = torchtitan_options(policy, graph, args.torchtitan_version)
    else:
        text = export(policy, args.format, graph=graph)
    if args.out is None:
        return Export(args.format, text)
    path = write_export(text, args.out, overwrite=args.overwrite)
    return Export(args.format, text, str(path))
