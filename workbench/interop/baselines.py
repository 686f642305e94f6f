"""Graph SAC measured beside its baselines: no activation checkpointing, and eager SAC as
exported (the `policy_fn` export wrapped around every block or around chosen regions).

Entry points: `measure_policy(workload, policy, baselines=...)` (trace, remat, estimate,
refuse what cannot fit, run, check bitwise), `measure_eager(workload, policy=None)` and
`track_eager(workload, policy=None)` (the same eager step under torch's memory tracker).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.capture.ops import block_container
from workbench.capture.trace import trace
from workbench.capture.workload import Workload, eager_step
from workbench.cost.estimate import Estimate, Estimator, estimate_remat
from workbench.cost.measure import (
    Measurement,
    bitwise_mismatches,
    check_fits,
    device_of,
    held_bytes,
    measure_graph,
    measure_run,
    measured_counterpart,
)
from workbench.cost.profiles import allocation_granularity
from workbench.decide.policy import Policy
from workbench.interop.eager import apply_eager_sac, apply_eager_sac_to
from workbench.interop.trackers import TrackedStep, track_step
from workbench.rewrite.remat import remat


def eager_target(
    workload: Workload,
    policy: Policy | None = None,
    *,
    layers_attr: str | None = None,
    regions: Sequence[str] | None = None,
    graph: JointGraph | None = None,
) -> tuple[Workload, str]:
    """The workload an eager baseline runs, and its name: the workload itself for no AC
    (`policy=None`), else a copy whose model runs eager SAC with the exported policy_fn around
    every block, or around each submodule matching `regions` (`apply_eager_sac_to`, e.g.
    `["layers.*.attention", "layers.*.feed_forward"]`). `graph`: the workload's traced graph,
    for the export (`eager.load_policy_fn`). `layers_attr`: the blocks' container; by default
    the one `graph` traced (`model.layers`, `transformer.h`, ...), else `layers`."""
    if policy is None:
        return workload, "no AC"
    copied = copy.deepcopy(workload.model)
    # eager SAC cannot offload: it runs the policy with its offloads saved
    preset = f"{policy.preset}, offload saved" if policy.offloads else policy.preset
    if regions is None:
        blocks = layers_attr or _traced_blocks(graph)
        model = apply_eager_sac(copied, policy, blocks, graph=graph)
        name = f"eager SAC ({preset})"
    else:
        model = apply_eager_sac_to(copied, policy, regions, graph=graph)
        name = f"eager SAC ({preset}; {', '.join(regions)})"
    target = Workload(model, workload.inputs, workload.target, workload.loss_fn, workload.name)
    return target, name


def _traced_blocks(graph: JointGraph | None) -> str:
    """The container of the traced graph's blocks (`model.layers`, `transformer.h`, ...)."""
    modules = (info.module for info in graph.nodes.values()) if graph is not None else ()
    return block_container(modules) or "layers"


def measure_eager(
    workload: Workload,
    policy: Policy | None = None,
    *,
    layers_attr: str | None = None,
    regions: Sequence[str] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    graph: JointGraph | None = None,
) -> Measurement:
    """An eager train step (`eager_step`) of `eager_target`'s model: no AC, or eager SAC with
    the exported policy_fn (on a copy of the model)."""
    target, name = eager_target(
        workload, policy, layers_attr=layers_attr, regions=regions, graph=graph
    )
    held = [*target.model.parameters(), *target.model.buffers(), *target.inputs, target.target]
    return measure_run(name, lambda: eager_step(target), held, workload.tokens, warmup, repeats)


def track_eager(
    workload: Workload,
    policy: Policy | None = None,
    *,
    layers_attr: str | None = None,
    regions: Sequence[str] | None = None,
    graph: JointGraph | None = None,
) -> TrackedStep:
    """The step `measure_eager` measures, run once under torch's `MemTracker`
    (`workbench.interop.trackers.track_step`): its estimate of the same peak. It counts the
    tensors ops make; what kernels allocate inside themselves and what is made outside torch's
    dispatch (checkpoints' RNG-state stashes) a CPU measurement sees and it does not."""
    target, _ = eager_target(
        workload, policy, layers_attr=layers_attr, regions=regions, graph=graph
    )
    held = [*target.inputs, target.target]
    return track_step(lambda: eager_step(target), target.model, held=held)[1]


@dataclass
class PolicyMeasurement:
    """Graph SAC measured beside its estimate, with the bitwise check against eager."""

    graph_sac: Measurement
    estimate: Estimate
    bitwise_equal: bool
    mismatched: list[str]
    baselines: list[Measurement] = field(default_factory=list)
    # torch's tracker on each baseline's step, in `baselines` order (`track_eager`)
    tracked: list[TrackedStep] = field(default_factory=list)

    @property
    def estimated_peak_bytes(self) -> int:
        """The estimate of what `graph_sac.peak_bytes` counts (`measured_counterpart`)."""
        return measured_counterpart(self.estimate, self.graph_sac.device)[0]

    def to_json(self) -> dict[str, Any]:
        """Measured and estimated peak of the same quantity, `peak_counts` saying what it
        counts, and the estimate's device and host parts."""
        return {
            "peak_bytes": self.graph_sac.peak_bytes,
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "peak_counts": measured_counterpart(self.estimate, self.graph_sac.device)[1],
            "estimated_device_peak_bytes": self.estimate.peak_bytes,
            "estimated_host_peak_bytes": self.estimate.host_peak_bytes,
            "step_seconds": self.graph_sac.step_seconds,
            "tokens_per_second": self.graph_sac.tokens_per_second,
            "bitwise_equal": self.bitwise_equal,
            "mismatched": self.mismatched,
            "device": self.graph_sac.device,
            "baselines": [
                {**b.to_json(), **_tracked_json(t)}
                for b, t in zip(self.baselines, self.tracked, strict=True)
            ],
        }


def measure_policy(
    workload: Workload,
    policy: Policy,
    *,
    baselines: bool = False,
    layers_attr: str | None = None,
    warmup: int = 1,
    repeats: int = 5,
    graph: JointGraph | None = None,
    estimator: Estimator | None = None,
) -> PolicyMeasurement:
    """Trace, remat with torch's pass, estimate, refuse what cannot fit, run, and compare
    loss and gradients bitwise with a plain eager step. `graph` and `estimator`: already
    built ones of this workload, so they are not built again."""
    graph = graph if graph is not None else trace(workload, mode="real")
    assert graph.example_inputs is not None
    device = device_of(graph.example_inputs)
    result = remat(graph, policy)
    # a graph run holds no optimizer state: compare it with the graph's own bytes
    if estimator is None or estimator.optimizer_bytes:
        estimator = Estimator(graph, profiles=(), optimizer="none")
    granularity = allocation_granularity(device)
    est = estimate_remat(graph, result, estimator, granularity)
    eager_peak = estimator.estimate(Policy("none"), granularity).peak_bytes  # the comparison
    peak = measured_counterpart(est, device)[0]
    check_fits(max(peak, eager_peak), held_bytes(graph.example_inputs), device, workload.name)
    measured = measure_graph(
        graph, result.gm, name=f"graph SAC ({policy.preset})", warmup=warmup, repeats=repeats
    )
    mismatched = bitwise_mismatches(graph, result.gm, workload)
    others, tracked = [], []
    for eager_policy in (None, policy) if baselines else ():
        others.append(
            measure_eager(
                workload,
                eager_policy,
                layers_attr=layers_attr,
                warmup=warmup,
                repeats=repeats,
                graph=graph,
            )
        )
        tracked.append(track_eager(workload, eager_policy, layers_attr=layers_attr, graph=graph))
    return PolicyMeasurement(measured, est, not mismatched, mismatched, others, tracked)


def _tracked_json(tracked: TrackedStep) -> dict[str, Any]:
    """The tracker's estimate beside a measured baseline's peak."""
    return {
        "tracker_peak_bytes": tracked.peak_bytes,
        "tracker_peak_module": tracked.peak_module,
        "tracker_peak_phase": tracked.peak_phase,
    }
