"""Bitwise check of rematerialized per-rank graphs on a real process group (gloo on CPU).

Entry points: `check_ranks(spec, parallel, presets, ...) -> list[RankCheck]`, which spawns
one process per rank, and `check_rank(rank, presets)`, what each process runs: trace its
step once, remat per preset, run the graph (its collectives on the real group) and
compare loss and gradients with the same sharded model run eagerly.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workbench.errors import WorkbenchError
from workbench.models import load_workload
from workbench.parallel import Parallel, RankWorkload, device_mesh, eager_rank_step, shard_workload
from workbench.policy import parse_policy
from workbench.remat import remat

__all__ = ["RankCheck", "check_rank", "check_ranks"]


@dataclass(frozen=True)
class RankCheck:
    """One rank's comparison under one preset: names of outputs that differ in any bit,
    and the loss (every rank of a correct run computes the same one)."""

    rank: int
    preset: str
    mismatched: tuple[str, ...]
    loss: float

    @property
    def bitwise_equal(self) -> bool:
        return not self.mismatched


def check_rank(rank: RankWorkload, presets: list[str]) -> list[RankCheck]:
    """Trace this rank once (real mode), then per preset tag, remat with torch's pass and
    run; eager reference first, so both see the same parameters."""
    from workbench.parallel import trace_sharded

    eager = eager_rank_step(rank)
    graph = trace_sharded(rank, "real")
    assert graph.example_inputs is not None
    names = ["loss", *graph.param_names]
    checks = []
    for preset in presets:
        result = remat(graph, parse_policy(preset))  # the policy: its offload options too
        traced = result.run(graph.example_inputs)
        mismatched = tuple(
            name for name, a, b in zip(names, traced, eager, strict=True) if not torch.equal(a, b)
        )
        checks.append(RankCheck(dist.get_rank(), preset, mismatched, float(traced[0])))
    return checks


def _worker(
    index: int,
    port: int,
    queue: Any,
    spec: str,
    parallel: Parallel,
    presets: list[str],
    shape: dict[str, Any],
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", rank=index, world_size=parallel.world_size)
    try:
        workload = load_workload(spec, **shape)  # same seed: every rank builds the same model
        rank = shard_workload(workload, parallel, device_mesh(parallel))
        for check in check_rank(rank, presets):
            queue.put(check)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_ranks(
    spec: str,
    parallel: Parallel,
    presets: list[str],
    *,
    layers: int | None = None,
    seq: int | None = None,
    batch: int | None = None,
    dtype: str = "float32",
) -> list[RankCheck]:
    """Spawn `parallel.world_size` CPU processes on a gloo group; every rank checks every
    preset. Results sorted by rank, then preset order."""
    if dist.is_initialized():
        raise WorkbenchError(
            "check_ranks spawns its own process group: call it outside an initialised one"
        )
    for preset in presets:
        parse_policy(preset)  # fail here, not in every rank
    # forkserver with this module preloaded: torch is imported once, not once per rank,
    # and ranks fork from a process that never started a thread pool.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    queue = context.SimpleQueue()
    shape: dict[str, Any] = {"layers": layers, "seq": seq, "batch": batch, "dtype": dtype}
    mp.start_processes(
        _worker,
        args=(_free_port(), queue, spec, parallel, presets, shape),
        nprocs=parallel.world_size,
        join=True,
        start_method="forkserver",
    )
    results = [queue.get() for _ in range(parallel.world_size * len(presets))]
    order = {p: i for i, p in enumerate(presets)}
    return sorted(results, key=lambda c: (c.rank, order[c.preset]))
