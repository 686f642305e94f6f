"""Bitwise check of rematerialized per-rank graphs on a real process group (gloo on CPU).

Entry points: `check_ranks(spec, parallel, policies, ...) -> list[RankCheck]`, which spawns
one process per rank, and `check_rank(rank, policies)`, what each process runs: trace its
step once, remat per policy, run the graph (its collectives on the real group) and
compare loss and gradients with the same sharded model run eagerly.
"""

from __future__ import annotations

import json
import os
import queue
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from workbench.capture.models import load_workload
from workbench.capture.parallel import (
    Parallel,
    RankWorkload,
    device_mesh,
    eager_rank_step,
    shard_workload,
)
from workbench.cost.measure import bitwise_equal
from workbench.decide.policy import Policy, parse_policy
from workbench.errors import WorkbenchError, describe, torch_logs_held
from workbench.rewrite.remat import remat

__all__ = ["RANKS_PER_CORE", "RankCheck", "check_rank", "check_rank_count", "check_ranks"]

QUEUE_POLL_SECONDS = 1.0  # how often the parent looks whether the ranks still run
# Ranks are CPU processes, each with its own copy of torch, its model shard and gloo's
# threads; past a few per core they only queue for the cores (and a typo such as --fsdp 1000
# would start a thousand processes).
RANKS_PER_CORE = 4


def check_rank_count(parallel: Parallel) -> None:
    """Refuse more ranks than this machine runs at once (`RANKS_PER_CORE` per core), and
    EP: the reference MoE's all-to-alls move the static token counts of a fake trace."""
    if parallel.ep > 1:
        raise WorkbenchError(
            f"verify with --ep {parallel.ep}: the reference MoE's all-to-alls move the static "
            "token counts a fake trace assumes (--ep-imbalance), not a router's, so gloo ranks "
            "would not agree on them; verify with --fsdp/--tp and estimate the EP rank"
        )
    cores = os.cpu_count() or 1
    if parallel.world_size > RANKS_PER_CORE * cores:
        raise WorkbenchError(
            f"{parallel.world_size} ranks ({parallel.describe(('fsdp', 'tp'))}) would be "
            f"{parallel.world_size} processes on {cores} cores: the bitwise check runs at most "
            f"{RANKS_PER_CORE} per core ({RANKS_PER_CORE * cores} here); estimate, solve and "
            "trace take any degree (one rank's graph)"
        )


@dataclass(frozen=True)
class RankCheck:
    """One rank's comparison under one policy (`index` into the list checked, `policy` its
    preset name, file or JSON text): names of outputs that differ in any bit, the loss
    (every rank of a correct run computes the same one), or the error that stopped it."""

    rank: int
    index: int
    policy: str
    mismatched: tuple[str, ...]
    loss: float
    error: str | None = None

    @property
    def bitwise_equal(self) -> bool:
        return self.error is None and not self.mismatched


def _label(policy: str | Policy) -> str:
    return policy if isinstance(policy, str) else json.dumps(policy.to_json())


def check_rank(rank: RankWorkload, policies: Sequence[str | Policy]) -> list[RankCheck]:
    """Trace this rank once (real mode), then per policy tag, remat with torch's pass and
    run; eager reference first, so both see the same parameters. A policy the remat pass
    refuses is a check with its error, not the end of the others."""
    from workbench.capture.parallel import trace_sharded

    eager = eager_rank_step(rank)
    graph = trace_sharded(rank, "real", "cpu")
    assert graph.example_inputs is not None
    names = ["loss", *graph.param_names]
    checks = []
    for index, spec in enumerate(policies):
        policy = spec if isinstance(spec, Policy) else parse_policy(spec)
        try:
            traced = remat(graph, policy).run(graph.example_inputs)  # its offload options too
        except (WorkbenchError, RuntimeError) as err:
            checks.append(RankCheck(dist.get_rank(), index, _label(spec), (), 0.0, describe(err)))
            continue
        mismatched = tuple(
            name for name, a, b in zip(names, traced, eager, strict=True) if not bitwise_equal(a, b)
        )
        checks.append(RankCheck(dist.get_rank(), index, _label(spec), mismatched, float(traced[0])))
    return checks


def _worker(
    index: int,
    port: int,
    results: Any,
    spec: str,
    parallel: Parallel,
    policies: Sequence[str | Policy],
    shape: dict[str, Any],
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", rank=index, world_size=parallel.world_size)
    try:
        with torch_logs_held():  # a failing rank's error goes to the parent in one line
            workload = load_workload(spec, **shape)  # same seed: every rank, same model
            rank = shard_workload(workload, parallel, device_mesh(parallel))
            for check in check_rank(rank, policies):
                results.put(check)
    except KeyboardInterrupt as err:  # raised by user code: an error like any other
        raise RuntimeError("KeyboardInterrupt raised in the rank") from err
    finally:
        dist.destroy_process_group()


def _rank_error(err: Exception) -> str:
    """The last line of a rank's traceback (`TypeError: ...`), or how it ended."""
    if isinstance(err, mp.ProcessRaisedException):
        lines = [line for line in str(err).splitlines() if line.strip()]
        last = lines[-1] if lines else "(no message)"
        return last.removeprefix("workbench.errors.WorkbenchError: ")
    return str(err)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_ranks(
    spec: str,
    parallel: Parallel,
    policies: Sequence[str | Policy],
    *,
    layers: int | None = None,
    seq: int | None = None,
    batch: int | None = None,
    dtype: str = "float32",
) -> list[RankCheck]:
    """Spawn `parallel.world_size` CPU processes on a gloo group; every rank checks every
    policy (a preset name, a policy file or a `Policy`). Results sorted by rank, then
    policy order."""
    if dist.is_initialized():
        raise WorkbenchError(
            "check_ranks spawns its own process group: call it outside an initialised one"
        )
    check_rank_count(parallel)
    for policy in policies:
        if not isinstance(policy, Policy):
            parse_policy(policy)  # fail here, not in every rank
    # forkserver with this module preloaded: torch is imported once, not once per rank,
    # and ranks fork from a process that never started a thread pool.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    results_queue = context.Queue()
    shape: dict[str, Any] = {"layers": layers, "seq": seq, "batch": batch, "dtype": dtype}
    ranks = mp.start_processes(
        _worker,
        args=(_free_port(), results_queue, spec, parallel, list(policies), shape),
        nprocs=parallel.world_size,
        join=False,
        start_method="forkserver",
    )
    # Read while the ranks run: a rank blocks on a full pipe until its results are read.
    expected = parallel.world_size * len(policies)
    results: list[RankCheck] = []
    try:
        while len(results) < expected:
            try:
                results.append(results_queue.get(timeout=QUEUE_POLL_SECONDS))
            except queue.Empty:
                if ranks.join(timeout=0):  # every rank ended (a failed one raises here)
                    break
        ranks.join()
    except ProcessException as err:  # torch stopped the other ranks already
        raise WorkbenchError(f"rank {err.error_index} failed: {_rank_error(err)}") from None
    if len(results) < expected:
        raise WorkbenchError(f"the ranks sent {len(results)} of {expected} checks and ended")
    return sorted(results, key=lambda c: (c.rank, c.index))
