"""The CUDA op set of the offload pass (torch's `ao::` ops), run on the CPU.

No GPU here, so torch's own `ao::offload` / `ao::reload` / `ao::wait_tensor` run with their
streams, events and pinned buffers replaced by stand-ins that make every copy as late as
the stream protocol allows: a copy on the transfer stream writes garbage at once and lands
only when the compute stream waits for its event. The wait registry that pairs each wait
with its copy and the `keepalive` frees are torch's code. A graph is then bitwise equal to
eager only if no reader runs before its reload's wait, and no offloaded original is freed
or written before its copy's wait: the ordering a real GPU run depends on. Real streams,
pinned memory and the caching allocator still need a GPU (test_offload.py's CUDA test).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_offload import CASES, POLICIES  # the policies the CPU ops are checked on

import workbench.rewrite.offload as offload
from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.measure import bitwise_mismatches
from workbench.decide.policy import Policy
from workbench.rewrite.host_ops import Ops, host_buffer_pool
from workbench.rewrite.placement import OFFLOAD_META, is_offload_node
from workbench.rewrite.remat import remat

Fixture = tuple[Workload, JointGraph]
AO = importlib.import_module("torch._functorch._activation_offloading.offload_ops")


@dataclass
class Event:
    """A transfer's completion: the copies recorded before it land when it is waited for."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class Streams:
    """One compute and one transfer stream as torch's ao ops drive them, on the CPU."""

    original_copy: Any
    on_transfer: bool = False
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    host_buffers: list[torch.Tensor] = field(default_factory=list)
    landed: int = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        if not self.on_transfer:
            return self.original_copy(dst, src, non_blocking)
        dst.fill_(float("nan") if dst.is_floating_point() else -1)  # not there yet
        self.pending.append((dst, src))
        return dst

    def record(self, event: Event) -> None:
        event.copies, self.pending = self.pending, []

    def wait(self, event: Event) -> None:
        for dst, src in event.copies:
            self.original_copy(dst, src)
            self.landed += 1
        event.copies = []


class Stream:
    def __init__(self, streams: Streams, transfer: bool) -> None:
        self.streams, self.transfer = streams, transfer

    def wait_stream(self, other: Stream) -> None:
        """Compute runs synchronously here: nothing to wait for."""

    def record_event(self, event: Event) -> None:
        self.streams.record(event)

    def wait_event(self, event: Event) -> None:
        self.streams.wait(event)


@pytest.fixture
def ao_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Streams]:
    """The pass uses torch's ao ops on CPU tensors; their streams are the stand-ins above."""
    importlib.import_module("torch._dynamo")  # subclasses torch.Event on import: before the patch
    streams = Streams(original_copy=torch.Tensor.copy_)
    compute, transfer = Stream(streams, False), Stream(streams, True)

    def set_stream(stream: Stream) -> None:
        streams.on_transfer = stream.transfer

    def pool_alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype)  # pinned on a GPU machine
        streams.host_buffers.append(buffer)
        return buffer

    ops = Ops(
        torch.ops.ao.offload.default, torch.ops.ao.reload.default, torch.ops.ao.wait_tensor.default
    )
    monkeypatch.setattr(offload, "ops_for", lambda device: ops)
    monkeypatch.setattr(AO, "_get_or_create_transfer_stream", lambda device: transfer)
    monkeypatch.setattr(AO, "_maybe_pool_alloc", pool_alloc)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.accelerator, "set_stream", set_stream)
    monkeypatch.setattr(torch, "Event", Event)
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda dst, src, non_blocking=False: streams.copy(dst, src, non_blocking),
    )
    yield streams
    assert not AO._wait_registry, "a copy the graph never waited for"
    AO._clear_wait_registry()


@pytest.mark.parametrize(("model", "name"), CASES)
def test_torchs_ao_ops_give_eagers_bits_with_every_copy_as_late_as_streams_allow(
    ao_on_cpu: Streams, small_graphs: dict[str, Fixture], model: str, name: str
) -> None:
    workload, graph = small_graphs[model]
    result = remat(graph, POLICIES[name])
    plan = result.gm.meta[OFFLOAD_META]
    assert plan.names
    targets = {n.target for n in result.gm.graph.nodes if is_offload_node(n)}
    assert {t.namespace for t in targets} == {"ao"}  # torch's ops, as on a GPU
    assert bitwise_mismatches(graph, result.gm, workload) == []
    # the graph ran once: each value copied out and back, every host buffer freed
    assert ao_on_cpu.landed == 2 * len(plan.names) and not ao_on_cpu.pending
    assert len(ao_on_cpu.host_buffers) == len(plan.names)
    assert all(b.untyped_storage().nbytes() == 0 for b in ao_on_cpu.host_buffers)


def test_a_reader_before_its_wait_reads_a_copy_not_yet_landed(
    ao_on_cpu: Streams, small_graphs: dict[str, Fixture]
) -> None:
    """The check can fail: a graph with one wait moved after the first backward reader
    (which then reads the reload itself) reads a copy that has not landed."""
    workload, graph = small_graphs["llama3-debug"]
    result = remat(graph, Policy("offload"))
    reload = next(n for n in result.gm.graph.nodes if n.target is torch.ops.ao.reload.default)
    (wait,) = reload.users
    reader = next(u for u in wait.users if u.op == "call_function")
    reader.replace_input_with(wait, reload)
    reader.append(wait)
    result.gm.recompile()
    assert bitwise_mismatches(graph, result.gm, workload) != []


def test_the_estimate_reads_a_graph_with_torchs_ops(
    ao_on_cpu: Streams, small_graphs: dict[str, Fixture]
) -> None:
    _, graph = small_graphs["dsv3-debug"]
    estimator = Estimator(graph, ("h100",))
    policy = POLICIES["early-late"]
    result = remat(graph, policy)
    assert any(n.target is torch.ops.ao.wait_tensor.default for n in result.gm.graph.nodes)
    full = estimate_remat(graph, result, estimator)
    assert full == estimator.estimate(policy)
    assert full.offloaded_bytes == result.gm.meta[OFFLOAD_META].offloaded_bytes > 0


def test_runs_on_a_gpu_share_torchs_pinned_buffer_pool() -> None:
    assert not AO._pool_enabled
    with host_buffer_pool(torch.device("cuda")):
        assert AO._pool_enabled  # ao::offload takes its buffers from the pool
    assert not AO._pool_enabled
    with host_buffer_pool(torch.device("cpu")):
        assert not AO._pool_enabled  # the workbench's own ops: plain buffers
