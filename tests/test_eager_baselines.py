"""Eager baselines as eager runs them (issue 33, item 3): no AC, eager SAC and eager full AC in
module wrappers, with FSDP2 and TP where sharded, run under torch's memory trackers; checked
against the CPU's measured peak and ordered on a fake per-rank job."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from workbench.capture.models import load_workload
from workbench.capture.parallel import Parallel
from workbench.cost.allocator import AllocatorConfig, replay_allocator
from workbench.cost.workspaces import BLAS_WORKSPACES
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.interop import eager_runs
from workbench.interop.baselines import eager_target, measure_eager, track_eager
from workbench.interop.eager_runs import (
    BASELINE_KINDS,
    BaselineOptions,
    EagerBaseline,
    apply_baseline_ac,
    eager_run,
    estimate_baselines,
    measure_baseline,
    sac_rule,
)
from workbench.interop.trackers import module_path, replay_events, track_step

HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
REAL = BaselineOptions(mode="real", optimizer="none")  # as `measure` runs a step: no optimizer
# What a CPU checkpoint stashes outside torch's dispatch: the CPU generator's state.
RNG_STATE_BYTES = torch.get_rng_state().numel()


def small(seq: int, layers: int = 2, device: str = "cpu") -> Any:
    return load_workload("llama3-debug", layers=layers, seq=seq, batch=2, device=device)


def test_no_ac_tracker_equals_the_measured_cpu_peak() -> None:
    """Real mode, no AC: torch's MemTracker sees every byte the CPU allocator held at the
    peak (here in the loss's backward)."""
    workload = small(256)
    (tracked,) = estimate_baselines(workload, real(kinds=("none",)))
    measured = measure_baseline(workload, "none", REAL)
    assert tracked.peak_bytes == measured.peak_bytes
    assert tracked.tracked.peak_phase == "backward" and tracked.allocator is None
    # with AdamW (the estimate's default) its state is held through the step: 2 x fp32 params
    (adamw,) = estimate_baselines(workload, BaselineOptions(mode="real", kinds=("none",)))
    params = sum(p.numel() for p in workload.model.parameters())
    assert adamw.tracked.peak_breakdown["Optstate"] == 8 * params


def real(**options: Any) -> BaselineOptions:
    return BaselineOptions(mode="real", optimizer="none", **options)


@pytest.mark.parametrize(("kind", "stashes"), [("sac", 2), ("full", 1)])
def test_checkpointed_tracker_misses_only_the_rng_stashes(kind: str, stashes: int) -> None:
    """With checkpoints the measured CPU peak is above the tracker's by the RNG states that
    live checkpoints stashed (`preserve_rng_state`, torchtitan's default): `torch.get_rng_state()`
    makes them outside torch's dispatch, so no tracker sees them. Both layers' checkpoints are
    alive at eager SAC's peak (layer 1's backward), one at full AC's (layer 0's). On a GPU the
    stash is host memory, not the device's."""
    workload = small(256)
    (tracked,) = estimate_baselines(workload, real(kinds=(kind,)))
    measured = measure_baseline(workload, kind, REAL)  # type: ignore[arg-type]
    assert measured.peak_bytes - tracked.peak_bytes == stashes * RNG_STATE_BYTES
    assert tracked.tracked.peak_phase == "backward"


def test_kernel_scratch_is_the_difference_at_the_embedding_backward() -> None:
    """At a short sequence every baseline peaks at the embedding's backward, whose kernel copies
    the token ids (a strided view of the batch) into a contiguous int64 tensor inside itself:
    8 x batch x seq bytes the CPU allocator holds and no dispatched op made."""
    workload = small(32)
    for baseline in estimate_baselines(workload, real()):
        measured = measure_baseline(workload, baseline.kind, REAL)
        assert baseline.tracked.peak_module == "tok_embeddings"
        assert measured.peak_bytes - baseline.peak_bytes == 8 * 2 * 32, baseline.name


def test_sharded_fake_baselines_run_in_order() -> None:
    """One rank of FSDP 2 x TP 2 on fake tensors: FSDP2 units under FSDPMemTracker, bf16
    gathers of fp32 shards, AdamW's two fp32 moments, the GPU's attention kernels and cuBLAS's
    workspaces; full AC
    holds less than eager SAC, eager SAC less than no AC, allocated and reserved alike."""
    workload = small(1024, device="meta")
    options = BaselineOptions(parallel=Parallel(fsdp=2, tp=2))
    none, sac, full = estimate_baselines(workload, options)
    assert [b.name for b in (none, sac, full)] == list(BASELINE_KINDS.values())
    assert full.peak_bytes < sac.peak_bytes < none.peak_bytes
    assert full.reserved_peak_bytes < sac.reserved_peak_bytes < none.reserved_peak_bytes  # type: ignore[operator]
    for b in (none, sac, full):
        parts = b.tracked.peak_breakdown
        assert b.tracked.tracker == "FSDPMemTracker" and b.kernels == "h100"
        assert parts["OptState"] == 2 * parts["Sharded Param"] > 0
        assert sum(parts.values()) + sum(BLAS_WORKSPACES) == b.peak_bytes  # cuBLAS's beside
        assert b.to_json()["workspace_bytes"] == sum(BLAS_WORKSPACES)
        assert b.reserved_peak_bytes >= b.allocator.allocated_peak_bytes >= b.peak_bytes  # type: ignore[union-attr,operator]
    assert any("_scaled_dot_product_cudnn_attention" in n for n in none.notes)
    assert sac.rule == sac_rule() and full.rule == eager_runs.FULL_AC
    # per FSDP unit, its forward and backward peaks
    assert {"layers.0", "layers.1"} <= set(none.tracked.module_peaks)
    _check_fsdp_streams(none)


def _check_fsdp_streams(baseline: EagerBaseline) -> None:
    """FSDP2's allocations on its own streams: each all-gather's buffers on its copy-in
    stream (the largest a layer's bf16 gather of its TP shard), the reduced gradients on its
    reduce-scatter stream (the fp32 shards' bytes), all freed within the step (the step drops
    its gradients); the pools each stream reserved add up to the reserved peak."""
    tracked = baseline.tracked
    assert tracked.streams[0] == "default"
    number = {name: n for n, name in enumerate(tracked.streams)}
    born: dict[int, tuple[int, int]] = {}
    for key, size, stream in tracked.events:
        if size > 0:
            born[key] = (size, stream)
        else:
            born.pop(key, None)
    allocated = [(size, stream) for key, size, stream in tracked.events if size > 0]
    gathers = [size for size, stream in allocated if stream == number["all_gather_copy_in"]]
    layer = sum(p.numel() for p in small(1024, device="meta").model.layers["0"].parameters())
    gathered = 2 * layer // 2  # bf16 bytes of the layer's TP 2 shard, FSDP's padding aside
    assert gathered <= max(gathers) < 2 * gathered
    left = {stream for _, stream in born.values()}
    assert not left & {number["all_gather_copy_in"], number["reduce_scatter"]}
    reduced = [size for size, stream in allocated if stream == number["reduce_scatter"]]
    assert sum(reduced) == tracked.peak_breakdown["Sharded Param"]
    by_stream = baseline.reserved_by_stream
    assert set(by_stream) == {"default", "all_gather_copy_in", "reduce_scatter"}
    assert sum(by_stream.values()) == baseline.reserved_peak_bytes
    assert baseline.to_json()["allocator"]["reserved_by_stream"] == by_stream


def test_unsharded_fake_baselines_without_torchtitan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchtitan, eager SAC is the workbench's `eager` preset as policy_fn."""
    monkeypatch.setattr(eager_runs, "sac_rule", lambda: eager_runs.WORKBENCH_SAC)
    workload = small(1024, device="meta")
    none, sac, full = estimate_baselines(workload, BaselineOptions(kernels="b200"))
    assert sac.rule == eager_runs.WORKBENCH_SAC and none.tracked.tracker == "MemTracker"
    assert full.peak_bytes < sac.peak_bytes < none.peak_bytes
    data = sac.to_json()
    assert list(data)[:6] == [
        "name",
        "peak_bytes",
        "reserved_peak_bytes",
        "peak_module",
        "peak_phase",
        "peak_breakdown",
    ]
    assert data["kind"] == "sac" and data["kernels"] == "b200" and data["allocator"]["segments"] > 0


@pytest.mark.skipif(not HAVE_TORCHTITAN, reason="torchtitan is not installed")
def test_torchtitan_model_runs_its_flex_attention() -> None:
    """torchtitan's Llama3 on fake tensors keeps FlexAttention (its higher-order op passes
    through the tracker) and recomputes it under eager SAC's wrappers."""
    workload = load_workload("torchtitan:llama3/debugmodel", layers=2, seq=256, device="meta")
    none, sac, full = estimate_baselines(workload)
    assert full.peak_bytes < sac.peak_bytes < none.peak_bytes
    assert any("flex" in n.lower() for n in none.notes)


def test_apply_baseline_ac_wraps_each_block() -> None:
    model = small(16).model
    assert apply_baseline_ac(model, "none") == eager_runs.NO_AC
    assert apply_baseline_ac(model, "full") == eager_runs.FULL_AC
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.layers.children())
    with pytest.raises(WorkbenchError, match="no container of blocks at 'blocks'"):
        apply_baseline_ac(small(16).model, "sac", "blocks")


def test_eager_run_refuses_what_it_cannot_run() -> None:
    workload = small(16, device="meta")
    with pytest.raises(WorkbenchError, match="unknown baseline 'half'; choose one of none"):
        with eager_run(workload, "half"):  # type: ignore[arg-type]
            pass
    with pytest.raises(WorkbenchError, match="lives on the meta device"):
        with eager_run(workload, "none", BaselineOptions(mode="real")):
            pass
    sharded = BaselineOptions(mode="real", parallel=Parallel(fsdp=2))
    with pytest.raises(WorkbenchError, match="run on fake tensors"):
        estimate_baselines(small(16), sharded)
    with pytest.raises(WorkbenchError, match="FSDP2 and TP only"):
        estimate_baselines(workload, BaselineOptions(parallel=Parallel(fsdp=2, ep=2)))
    with pytest.raises(WorkbenchError, match="give mode='real'"):
        measure_baseline(workload, "none", BaselineOptions())


def test_eager_run_steps_alike_and_holds_its_state() -> None:
    """A step hands its gradients back and leaves `.grad` empty: repeated runs start alike."""
    workload = small(16)
    options = BaselineOptions(mode="real", optimizer="sgd", kinds=("full",))
    with eager_run(workload, "full", options) as run:
        first, second = run.step(), run.step()
        assert all(p.grad is None for p in run.model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        held = run.held()
        params = list(run.model.parameters())
        assert len(held) == 2 * len(params) + len(list(run.model.buffers())) + 2  # + momenta
        assert run.notes() and run.kernels == "cpu"
    assert not hasattr(workload.model.layers["0"], "_checkpoint_wrapped_module")


def test_track_step_counts_a_small_step() -> None:
    """MemTracker on a two-layer MLP: the peak it reports is the running sum of the sequence
    it recorded, and that sequence replays through the allocator model."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    x = torch.randn(32, 64)

    def run() -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    _, tracked = track_step(run, model, held=[x])
    live = np.cumsum([size for _, size, _ in tracked.events])
    assert tracked.peak_bytes == live.max() and tracked.tracker == "MemTracker"
    assert tracked.peak_breakdown["Parameter"] == 4 * sum(p.numel() for p in model.parameters())
    replay = tracked.replay()
    assert replay.allocated_peak_bytes >= tracked.peak_bytes and replay.reserved_peak_bytes > 0
    assert set(tracked.to_json()) >= {"peak_bytes", "peak_breakdown", "peak_module"}
    # no stream but the default one
    assert tracked.streams == ["default"] and {s for _, _, s in tracked.events} == {0}
    assert replay.reserved_by_stream == {0: replay.reserved_peak_bytes}
    assert tracked.named_streams(replay) == {"default": replay.reserved_peak_bytes}


def test_replay_events_is_the_allocator_on_the_same_sequence() -> None:
    """Alloc/free events give what `replay_allocator` gives for the same storages' lives."""
    sizes = [3 * 2**20, 700, 25 * 2**20, 5 * 2**20]
    events = [(0, sizes[0], 0), (1, sizes[1], 0), (0, -sizes[0], 0), (2, sizes[2], 0)]
    events += [(3, sizes[3], 0), (1, -sizes[1], 0), (2, -sizes[2], 0), (3, -sizes[3], 0)]
    config = AllocatorConfig(expandable_segments=True)
    ours = replay_events(events, config)
    born, freed = np.array([0, 1, 2, 3]), np.array([1, 3, 3, 3])
    theirs = replay_allocator(np.array(sizes), born, freed, 4, config)
    assert ours.reserved_peak_bytes == theirs.reserved_peak_bytes
    assert ours.allocated_peak_bytes == theirs.allocated_peak_bytes
    assert ours.reserved_timeline[-1] == ours.reserved_peak_bytes


def test_module_path_strips_the_root_and_the_wrapper() -> None:
    assert module_path("Llama3.layers.3._checkpoint_wrapped_module.feed_forward.w2") == (
        "layers.3.feed_forward.w2"
    )


def test_measure_shows_the_tracker_beside_each_measured_baseline() -> None:
    """`measure --baselines`: the same eager step measured and tracked (`track_eager`); both
    peak at the embedding's backward, where its kernel's contiguous copy of the token ids is
    the one difference (8 x batch x seq bytes)."""
    workload = small(64)
    for policy in (None, Policy("eager")):
        target, name = eager_target(workload, policy)
        assert (target is workload) == (policy is None) and name.startswith(("no AC", "eager"))
        tracked = track_eager(workload, policy)
        measured = measure_eager(workload, policy, warmup=0, repeats=1)
        assert measured.peak_bytes - tracked.peak_bytes == 8 * 2 * 64
        assert tracked.peak_module == "tok_embeddings"


def test_dtensor_reading_shapes_is_not_counted() -> None:
    """Under TP, DTensor's sharding propagation runs ops on tensors of the global shape to
    read output metadata; the tracker counts only the rank's local tensors (a column-parallel
    projection over 8 ranks: its output shard, never the whole)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from workbench.capture.parallel import fake_process_group

    with fake_process_group(Parallel(tp=8)) as mesh, FakeTensorMode() as fake_mode:
        projection = nn.Linear(1024, 8192, bias=False)
        parallelize_module(projection, mesh["tp"], ColwiseParallel(use_local_output=False))
        x = torch.empty(4096, 1024, requires_grad=True)

        def step() -> None:
            projection(x).to_local().float().sum().backward()

        _, tracked = track_step(step, projection, held=[x])
    assert fake_mode is not None
    shard = 4096 * 8192 // 8 * 4  # one fp32 output shard
    weight, grads = 1024 * 8192 // 8 * 4, 2 * 1024 * 8192 // 8 * 4
    assert tracked.peak_bytes < weight + grads + x.numel() * 4 + 3 * shard
    assert tracked.peak_bytes < 4096 * 8192 * 4  # less than one global output
