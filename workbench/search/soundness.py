"""Random policies checked bitwise against eager: the workbench's first promise, that a policy
it accepts changes memory and time, never the numbers, as a property anyone can run.

Entry points: `random_policy(graph, rng)` and `random_policies(graph, count, seed)` (any
preset, selectors, overrides, offload options, drawn from the graph's own nodes and biased
toward the storages written in place), `check_policies(workload, graph, policies)` (one
process) and `check_rank_policies(spec, parallel, policies, ...)` (one gloo process per rank).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.ops import layer_pattern
from workbench.capture.parallel import Parallel
from workbench.cost.ranks import check_ranks
from workbench.cost.reference import Reference, policy_mismatches, reference_run
from workbench.decide.decider import decide, forced_by_reason, rules_of
from workbench.decide.facts import OpFacts
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import ACTIONS, Policy, Selector
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError, describe
from workbench.rewrite.remat import remat

__all__ = [
    "PolicyCheck",
    "SoundnessReport",
    "check_policies",
    "check_rank_policies",
    "random_policies",
    "random_policy",
    "run_soundness",
]

MAX_SELECTORS = 3
MAX_OVERRIDES = 4


def random_policy(graph: JointGraph, rng: random.Random) -> Policy:
    """One policy of `graph`: a preset, up to three selectors and four overrides naming its
    own nodes (so each one applies), random offload options and, on a per-rank graph, a
    random FSDP choice. Half the requests name a node that reads or writes a storage
    written in place, where a recompute can go wrong; the rest any forward or loss node."""
    facts = rules_of(graph).facts
    writes = rules_of(graph).tables.writes
    touchy = [f for f in facts if f.name in writes.readers or f.name in writes.writes]

    def node() -> OpFacts:
        return rng.choice(touchy if touchy and rng.random() < 0.5 else facts)

    selectors = []
    for _ in range(rng.randint(0, MAX_SELECTORS)):
        f = node()
        modules = [f.module, layer_pattern(f.module), "**"]
        parent = f.module.rpartition(".")[0]
        if parent:
            modules.append(f"{layer_pattern(parent)}.**")
        overload = f.op.rpartition(".")[0]  # `aten.mm` of `aten.mm.default`; none for getitem
        ops = [f.op, f"{overload}.*"] if overload else [f.op]
        select = f"{rng.choice(modules)}::{rng.choice(ops)}"
        selectors.append(Selector(select, rng.choice(ACTIONS)))
    overrides = {}
    for _ in range(rng.randint(0, MAX_OVERRIDES)):
        f = node()
        overrides[rng.choice((f.key, f.layer_key))] = rng.choice(ACTIONS)
    budget = None
    if rng.random() < 0.3:
        sizes = [f.storage.bytes for f in facts if f.storage is not None]
        budget = rng.randint(1, max(2, sum(sizes) // 4))
    offload = OffloadOptions(budget, rng.randint(0, 2), rng.randint(0, 2))
    return Policy(
        preset=rng.choice(list(PRESETS)),
        selectors=selectors,
        overrides=overrides,
        fsdp_reshard=rng.random() < 0.5 if graph.world_size > 1 else True,
        offload=offload,
    )


def random_policies(graph: JointGraph, count: int, seed: int = 0) -> list[Policy]:
    """`count` random policies of `graph`, the same ones for the same seed."""
    if count < 1:
        raise WorkbenchError(f"the number of random policies must be positive, got {count}")
    rng = random.Random(seed)
    return [random_policy(graph, rng) for _ in range(count)]


@dataclass(frozen=True)
class PolicyCheck:
    """One policy against eager: the outputs (`loss`, parameter names) that differ in any
    bit, or the error that stopped it; `forced` counts its forced decisions by reason."""

    index: int
    policy: Policy
    mismatched: tuple[str, ...] = ()
    error: str | None = None
    forced: dict[str, int] = field(default_factory=dict)
    rank: int = 0

    @property
    def bitwise_equal(self) -> bool:
        return self.error is None and not self.mismatched

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "rank": self.rank,
            "policy": self.policy.to_json(),
            "bitwise_equal": self.bitwise_equal,
            "mismatched": list(self.mismatched),
            "error": self.error,
            "forced": self.forced,
        }


@dataclass
class SoundnessReport:
    """Every check of a run, with what reproduces it: the model, shape, seed and count."""

    model: str
    seed: int
    checks: list[PolicyCheck]
    seconds: float
    config: dict[str, Any] = field(default_factory=dict)
    reference: Reference | None = None  # the checks before any policy (one process only)

    @property
    def failures(self) -> list[PolicyCheck]:
        return [c for c in self.checks if not c.bitwise_equal]

    def to_json(self) -> dict[str, Any]:
        forced: dict[str, int] = {}
        first = {c.index: c for c in reversed(self.checks)}  # one check per policy
        for check in first.values():
            for why, n in check.forced.items():
                forced[why] = forced.get(why, 0) + n
        return {
            "model": self.model,
            **self.config,
            "seed": self.seed,
            "policies": len({c.index for c in self.checks}),
            "checks": len(self.checks),
            "bitwise_equal": not self.failures,
            "failures": [c.to_json() for c in self.failures],
            "forced_by_reason": forced,  # over the policies, each counted once
            **({"before_policy": self.reference.to_json()} if self.reference else {}),
            "seconds": round(self.seconds, 3),
        }


def check_policies(
    workload: Workload,
    graph: JointGraph,
    policies: Sequence[Policy],
    reference: Reference | None = None,
) -> list[PolicyCheck]:
    """Remat `graph` (traced in real mode from `workload`) with each policy, run it and
    compare loss and gradients bitwise with the traced graph's own, nothing rematerialized
    (`cost.reference`: whether that equals eager is checked once, apart, in `reference`). A
    policy the remat pass refuses or that fails to run is a failure with its error."""
    if graph.example_inputs is None:
        raise WorkbenchError("check_policies runs the graph: trace it in real mode")
    reference = reference or reference_run(graph, workload)
    checks = []
    for index, policy in enumerate(policies):
        try:
            result = remat(graph, policy)
            mismatched = tuple(policy_mismatches(graph, result.gm, reference))
            checks.append(
                PolicyCheck(index, policy, mismatched, forced=forced_by_reason(result.decisions))
            )
        except (WorkbenchError, RuntimeError) as err:
            checks.append(PolicyCheck(index, policy, error=describe(err)))
    return checks


def check_rank_policies(
    spec: str,
    parallel: Parallel,
    policies: Sequence[Policy],
    *,
    layers: int | None = None,
    seq: int | None = None,
    batch: int | None = None,
    dtype: str = "float32",
) -> list[PolicyCheck]:
    """Each policy on every rank of `parallel` (real gloo processes, `cost.ranks`), every
    rank's loss and gradients against its eager step."""
    ranks = check_ranks(
        spec, parallel, list(policies), layers=layers, seq=seq, batch=batch, dtype=dtype
    )
    return [
        PolicyCheck(c.index, policies[c.index], c.mismatched, c.error, rank=c.rank) for c in ranks
    ]


def run_soundness(
    workload: Workload,
    graph: JointGraph,
    count: int,
    seed: int,
    parallel: Parallel | None = None,
    shape: dict[str, Any] | None = None,
) -> SoundnessReport:
    """`count` random policies of `graph` (seeded), checked bitwise: in this process, or on
    gloo ranks when `parallel` is given (`graph` is then one rank's, for the node names)."""
    start = time.perf_counter()
    policies = random_policies(graph, count, seed)
    reference = None
    if parallel is None:
        reference = reference_run(graph, workload)
        checks = check_policies(workload, graph, policies, reference)
    else:
        checks = check_rank_policies(graph.model_name, parallel, policies, **(shape or {}))
        forced = [forced_by_reason(decide(graph, policy)) for policy in policies]
        checks = [dataclasses.replace(c, forced=forced[c.index]) for c in checks]
    config = {k: graph.config.get(k) for k in ("layers", "seq", "batch", "dtype")}
    if parallel is not None:
        config.update(parallel.used(("fsdp", "tp")))
    seconds = time.perf_counter() - start
    return SoundnessReport(graph.model_name, seed, checks, seconds, config, reference)
