"""Before anything runs for real (`verify`, `measure`): the run estimated on fake tensors first,
and refused in one line when this machine cannot hold it.

Entry points: `refuse_unfit(args, policy, device)` (one process) and
`refuse_unfit_ranks(workload, parallel, policy)` (verify's gloo ranks, each its own process).
"""

from __future__ import annotations

import argparse

from workbench.capture.parallel import Parallel
from workbench.capture.trace import timed_trace, trace
from workbench.capture.workload import Workload
from workbench.cli.args import workload_from_args
from workbench.decide.policy import Policy

__all__ = ["refuse_unfit", "refuse_unfit_ranks"]


def refuse_unfit(args: argparse.Namespace, policy: Policy, device: str) -> None:
    """Estimate on fake tensors both the policy's graph and the eager step it is compared
    with (no AC), and refuse a peak the device cannot hold."""
    import torch

    from workbench.cost.estimate import Estimator
    from workbench.cost.measure import check_fits
    from workbench.cost.profiles import allocation_granularity

    # the real run's graph, on fake tensors: this CPU's kernels
    kernels = "cpu" if device == "cpu" else None
    fake = trace(workload_from_args(args, "fake"), "fake", kernels=kernels)
    estimator = Estimator(fake, profiles=(), optimizer="none")  # the run holds no optimizer
    granularity = allocation_granularity(device)
    peak = max(estimator.estimate(p, granularity).peak_bytes for p in (policy, Policy("none")))
    check_fits(peak, 0, torch.device(device), fake.model_name)


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
