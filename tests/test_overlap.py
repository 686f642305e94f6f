"""Three streams: a hand-built two-stream schedule worked out by hand, collective times by
hand, and FSDP prefetch, bucketing and sunk waits on a per-rank llama3-debug graph."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimator
from workbench.cost.overlap import (
    Event,
    OverlapOptions,
    collective_time,
    nccl_model_applies,
    walk_streams,
)
from workbench.cost.profiles import H100, get_profile
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError

CLOCK = np.array([0.0, 1.0, 2.0, 3.0, 4.0])  # compute: one second per position


def test_a_wait_stalls_compute_only_until_its_collective_ends() -> None:
    events = [
        Event(0, "comm", "a", 1.5),  # 0 -> 1.5
        Event(1, "wait", "a"),  # compute reaches it at 1: stalls 0.5
        Event(1, "comm", "b", 1.0),  # issued at 1.5 (after the stall): 1.5 -> 2.5
        Event(3, "wait", "b"),  # compute reaches it at 3.5: no stall
        Event(0, "copy", "c", 5.0),  # host stream, apart from comm: 0 -> 5
        Event(4, "wait", "c"),  # compute at 4.5: stalls 0.5
    ]
    assert walk_streams(CLOCK, events) == {"a": 0.5, "b": 0.0, "c": 0.5}


def test_one_stream_runs_its_work_in_issue_order() -> None:
    events = [Event(0, "comm", "a", 2.0), Event(0, "comm", "b", 2.0), Event(1, "wait", "b")]
    assert walk_streams(CLOCK, events) == {"b": 3.0}  # b starts when a ends, at 2


def test_a_cap_on_copies_in_flight_stalls_the_issue() -> None:
    events = [Event(0, "copy", "a", 2.0), Event(1, "copy", "b", 2.0), Event(4, "wait", "b")]
    assert walk_streams(CLOCK, events) == {"b": 0.0}  # queued behind a: 2 -> 4
    capped = walk_streams(CLOCK, events, max_copies_in_flight=1)
    assert capped == {"b": 1.0}  # issued only at 2, when a ends; ends at 4, waited at 5


def test_collective_time_by_hand() -> None:
    # ring all-gather of 1 GB in 2 ranks on NVLink: half the buffer at 450 GB/s, plus
    # NCCL's Ring/Simple base latency 8.4 us and one NVLink step of 3.4 us
    expected = 0.5 * 1e9 / 450e9 + (8.4 + 3.4) * 1e-6
    if not nccl_model_applies(H100):
        assert collective_time(H100, "all_gather", 10**9, 2, False) == pytest.approx(expected)
    cpu = replace(H100, name="plain", nccl_latency=False, gpu_name=None)
    assert collective_time(cpu, "all_reduce", 10**9, 4, True) == pytest.approx(
        2 * 3 / 4 * 1e9 / 50e9
    )
    assert collective_time(H100, "all_gather", 10**9, 1, False) == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_torch_nccl_model_needs_the_profiles_gpu() -> None:
    assert not nccl_model_applies(H100)
    assert not nccl_model_applies(get_profile("h200"))


@pytest.mark.parametrize(
    "options", [{"prefetch": -1}, {"prefetch": True}, {"max_copies_in_flight": 0}]
)
def test_bad_overlap_options(options: dict[str, object]) -> None:
    with pytest.raises(WorkbenchError):
        OverlapOptions(**options)  # type: ignore[arg-type]


def test_per_rank_streams(rank_debug: JointGraph) -> None:
    def run(**options: object) -> tuple[int, float, float, float]:
        estimator = Estimator(rank_debug, ("h100",), overlap=OverlapOptions(**options))  # type: ignore[arg-type]
        est = estimator.estimate(Policy("default"))
        assert est.exposed_comm_seconds["h100"] <= est.comm_seconds["h100"] + 1e-12
        step = est.compute_seconds["h100"] + est.exposed_comm_seconds["h100"]
        assert est.step_seconds["h100"] == pytest.approx(step)
        return (
            est.peak_bytes,
            est.comm_seconds["h100"],
            est.exposed_comm_seconds["h100"],
            est.compute_seconds["h100"],
        )

    peak, comm, exposed, compute = run()
    assert comm > 0 and exposed > 0
    # prefetch: all-gathers go out earlier, so their outputs live longer and wait less
    peak2, comm2, exposed2, compute2 = run(prefetch=2)
    assert peak2 > peak and exposed2 < exposed and (comm2, compute2) == (comm, compute)
    # buckets: one latency per layer's FSDP collectives instead of one per parameter
    _, comm_b, exposed_b, _ = run(bucket_layers=True)
    assert comm_b < comm and exposed_b < exposed
    # waits at the first real reader: reduce-scatters overlap the rest of backward
    _, _, exposed_s, _ = run(sink_waits=True)
    assert exposed_s < exposed


def test_prefetch_moves_only_fsdp_all_gathers(rank_debug: JointGraph) -> None:
    from workbench.decide.decider import decide

    estimator = Estimator(rank_debug, ("h100",), overlap=OverlapOptions(prefetch=2))
    flat = estimator.order_for(decide(rank_debug, Policy("default")))
    moved = estimator.streams.issue_positions(flat.entries)
    nodes = estimator.index.space.node(flat.entries[list(moved)]).tolist()
    streams = estimator.streams
    assert moved and all(streams.kind[i] == "all_gather" and i in streams.fsdp for i in nodes)
    tp = [i for i, (_, dim) in streams.group.items() if dim == "tp"]
    assert tp and not set(tp) & set(nodes)  # TP's gathers read activations: never moved
    assert all(q < p for p, q in moved.items())
