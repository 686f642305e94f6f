"""Checks a command makes before its slow part (tracing, spawning ranks), so that a bad
flag fails in a second with one line: counts of work, budgets, flags that need a model, and
whether verify's ranks fit this machine.

Entry points: `flag` (an error names the flag), `check_positive`, `check_passes`,
`check_budget`, `check_host_budget`, `refuse_graph_flags_without_model`,
`refuse_unfit_ranks`; the bounds `MAX_*`.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from workbench.capture.parallel import Parallel
from workbench.capture.trace import timed_trace
from workbench.capture.workload import Workload
from workbench.decide.policy import Policy
from workbench.errors import INT64_MAX, WorkbenchError, check_int

# Bounds on counts of work a flag asks for, each far above what a study needs and low enough
# that a typo cannot ask for days of work (the reason is said in the error).
MAX_RUNS = 1000  # --repeat, --warmup: each is a whole train step
MAX_FLIPS = 100_000  # bench whatif --flips: each flip is one what-if
MAX_FULL_PATH = 1000  # each runs torch's remat pass and a full estimate
MAX_RANDOM = 10_000  # verify --random: each policy is a remat and a real run
SEED_MAX = 2**64 - 1  # what torch.manual_seed takes


def check_positive(flag: str, value: int, high: int = MAX_RUNS, why: str = "") -> None:
    check_int(flag, value, 1, high, why or "each one is a timed run")


def refuse_graph_flags_without_model(args: argparse.Namespace) -> None:
    """`policy explain` without --model: flags that describe a model's graph mean nothing."""
    if args.model is not None:
        return
    given = [f"--{n}" for n in ("layers", "seq", "batch") if getattr(args, n) is not None]
    given += [f"--{n}" for n in ("fsdp", "tp", "ep", "cp") if getattr(args, n, 1) != 1]
    given += ["--mode"] if args.mode != "real" else []
    given += ["--dtype"] if args.dtype != "float32" else []
    if given:
        raise WorkbenchError(
            f"policy explain: {', '.join(given)} describe a model's graph: give --model "
            "too, or leave them out for the policy's rules alone"
        )


def refuse_unfit_ranks(workload: Workload, parallel: Parallel, policy: Policy) -> None:
    """Before spawning: as many ranks as this machine can run (`check_rank_count`), then one
    rank traced in fake mode (the checks `trace` makes: degrees that divide the model, the
    factory's TP plan), its estimated peak times the ranks against free memory."""
    import torch

    from workbench.cost.estimate import Estimator
    from workbench.cost.measure import check_fits
    from workbench.cost.ranks import check_rank_count

    check_rank_count(parallel)
    rank, _ = timed_trace(workload, "fake", parallel, kernels="cpu")  # ranks run on this CPU
    estimator = Estimator(rank, profiles=(), optimizer="none")
    peak = max(estimator.estimate(p).peak_bytes for p in (policy, Policy("none")))
    what = f"{rank.model_name!r} on {parallel.world_size} ranks (each its own process)"
    check_fits(peak * parallel.world_size, 0, torch.device("cpu"), what)


def check_host_budget(args: argparse.Namespace) -> None:
    """Before tracing: a bad host budget is refused at once, not after a whole front."""
    check_int("--host-budget-bytes", args.host_budget_bytes, 0, INT64_MAX, "0: no offload; int64")


def check_budget(args: argparse.Namespace) -> None:
    """Before tracing: --budget-bytes or --budget-frac in range."""
    if args.budget_bytes is not None:
        check_int("--budget-bytes", args.budget_bytes, 1, INT64_MAX, "int64")
    elif not 0 < args.budget_frac <= 1:
        raise WorkbenchError(f"--budget-frac must be in (0, 1], got {args.budget_frac}")


@contextlib.contextmanager
def flag(name: str) -> Iterator[None]:
    """A WorkbenchError raised inside names the flag whose value caused it."""
    try:
        yield
    except WorkbenchError as err:
        raise WorkbenchError(f"{name}: {err}") from None


def check_passes(args: argparse.Namespace) -> None:
    """Before tracing: `--passes` names a pipeline (and graph trainer's is importable)."""
    from workbench.rewrite.graph_trainer import check_pipeline

    with flag("--passes"):
        check_pipeline(args.passes)
    if getattr(args, "ep_overlap", False) and args.passes != "graph-trainer":
        raise WorkbenchError(
            f"--ep-overlap runs graph trainer's EP-overlap passes, which --passes "
            f"{args.passes} does not run: add --passes graph-trainer"
        )
