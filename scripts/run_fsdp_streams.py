"""One FSDP2 rank on one device (a one-process group): its eager step measured by torch
(`max_memory_allocated`, `max_memory_reserved` on a GPU) beside the workbench's replay of the
same step's tracked allocations through the caching-allocator model, with each stream's pools
(`reserved_by_stream`) and as one stream. The GPU check of `workbench.cost.allocator`'s
streams: FSDP2 allocates its all-gather buffers on its copy-in stream and the reduced
gradients on its reduce-scatter stream even at world size 1. Needs no tracer, so it runs on a
GPU whose torch is older than the workbench's.

    python scripts/run_fsdp_streams.py MODEL [--device cuda] [--layers N] [--seq S]
        [--batch B] [--expandable-segments] > OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from workbench.capture.models import load_workload
from workbench.cost.allocator import AllocatorConfig
from workbench.interop.trackers import replay_events, track_step


def _sharded(model: torch.nn.Module, device: str) -> None:
    """FSDP2 over a one-rank mesh, each block a unit and then the root; bf16 gathers and
    compute of fp32 shards, fp32 reduce (torchtitan's mixed precision)."""
    mesh = init_device_mesh(device, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.children():  # type: ignore[union-attr,operator]
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def run(a: argparse.Namespace) -> dict[str, Any]:
    workload = load_workload(
        a.model, dtype="float32", device=a.device, layers=a.layers, seq=a.seq, batch=a.batch
    )
    model, inputs, target = workload.model, workload.inputs, workload.target
    loss_fn = workload.loss_fn
    assert loss_fn is not None
    _sharded(model, a.device)

    def step() -> None:
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    step()  # FSDP2's lazy init and its streams; then every cached block handed back
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _, tracked = track_step(step, model, held=[*inputs, target])
    measured = (
        {
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
        }
        if cuda
        else None
    )
    config = AllocatorConfig(expandable_segments=a.expandable_segments)
    per_stream = replay_events(tracked.events, config)
    one_stream = replay_events([(key, size, 0) for key, size, _ in tracked.events], config)
    return {
        "model": a.model,
        "device": torch.cuda.get_device_name() if cuda else a.device,
        "torch": torch.__version__,
        "expandable_segments": a.expandable_segments,
        "streams": tracked.streams,
        "tracker_peak_bytes": tracked.peak_bytes,
        "est_allocated_bytes": per_stream.allocated_peak_bytes,
        "est_reserved_bytes": per_stream.reserved_peak_bytes,
        "est_reserved_by_stream": tracked.named_streams(per_stream),
        "est_reserved_one_stream_bytes": one_stream.reserved_peak_bytes,
        "measured": measured,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--expandable-segments", action="store_true")
    a = parser.parse_args(argv)
    if a.expandable_segments:  # before CUDA's allocator starts
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    backend = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        json.dump(run(a), sys.stdout, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
