"""Device profiles for roofline time estimates: matmul rate per dtype and memory bandwidth.

Entry point: `get_profile(name)` for `h100`, `h200`, `b200` (datasheet peaks) or `cpu` (this
machine's rates, measured once and cached in `~/.cache/sac-workbench/`).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from workbench.capture.degrees import Degrees
from workbench.errors import WorkbenchError
from workbench.files import MARK_KEY, read_file, write_file

# A nominal link rate for CPU processes (gloo over shared memory or TCP varies widely).
CPU_LINK_BYTES_PER_S = 10e9


# The CUDA context with lazy module loading (torch sets CUDA_MODULE_LOADING=LAZY unless the
# user does): 287,047,680 bytes measured in pytorch/pytorch#86509 (666,632,192 eager).
CUDA_CONTEXT_LAZY_BYTES = 287_047_680
# NCCL_BUFFSIZE's default, 4 MiB (NCCL docs, "Environment variables"): the Simple protocol's
# buffer of one ring connection per channel; Hopper runs 16 channels in torch's NCCL model
# (`torch._inductor.comm_analysis._GPU_NCHANNELS`). LL/LL128, tree and proxy buffers are not
# counted: a lower bound.
NCCL_BUFFSIZE = 4 * 2**20
HOPPER_NCCL_CHANNELS = 16
OUTSIDE_SOURCES = (
    "CUDA context 287,047,680 B (lazy loading, pytorch#86509); NCCL_BUFFSIZE 4 MiB x 16 "
    "channels per communicator (NCCL docs; torch comm_analysis), a lower bound"
)


@dataclass(frozen=True)
class DeviceProfile:
    """Rates a roofline needs. `matmul_flops_per_s` is keyed by dtype name; ops the flop
    counter does not count are memory-bound at `bytes_per_s`."""

    name: str
    description: str
    matmul_flops_per_s: dict[str, float]
    bytes_per_s: float
    # Collectives: bytes per second per direction and per rank, inside one node and across
    # nodes; a process group spans nodes when its ranks do not fit in `ranks_per_node`.
    intra_node_bytes_per_s: float = CPU_LINK_BYTES_PER_S
    inter_node_bytes_per_s: float = CPU_LINK_BYTES_PER_S
    ranks_per_node: int = 8
    links: str = "nominal 10 GB/s for CPU ranks (not measured)"
    # CPU offload: bytes per second per direction between device and host memory from a
    # reused pinned pool, as benchmarked; None: a memory copy at `bytes_per_s`, which counts
    # each byte read and written (the CPU).
    host_bytes_per_s: float | None = None
    # the same copies with a fresh pinned allocation each (None: as a reused pool)
    host_fresh_pinned_bytes_per_s: float | None = None
    # whether offloads copy into a reused pinned pool (graph trainer's `ao::wait_tensor`
    # returns its buffer to one) or allocate pinned memory each time
    host_pinned_reused: bool = True
    # what a copy reaches inside a training step, as a fraction of the benchmarked rate
    host_in_step_factor: float = 1.0
    # copies take HBM bandwidth from compute: each byte copied is read or written once
    host_hbm_contention: bool = False
    # GPU whose name torch reports (`torch.cuda.get_device_name`): torch's NCCL model
    # times collectives when it runs on that GPU; None for the CPU
    gpu_name: str | None = None
    # NCCL's per-step latency (torch's `comm_analysis` tables) added to the ring model
    nccl_latency: bool = False
    # Held by a running job outside the caching allocator: the CUDA context and each NCCL
    # communicator's buffers (`outside_allocator_bytes`)
    cuda_context_bytes: int = 0
    nccl_buffer_bytes: int = 0
    outside_sources: str = "none: CPU processes"
    # The device's memory as its driver reports it (None: not a fixed size, as a CPU's)
    memory_bytes: int | None = None

    def host_rate(self) -> float:
        """Bytes per second per direction a copy reaches in a step."""
        reused = self.host_bytes_per_s or self.bytes_per_s / 2
        fresh = self.host_fresh_pinned_bytes_per_s or reused
        return (reused if self.host_pinned_reused else fresh) * self.host_in_step_factor

    def spans_nodes(self, mesh_dim: str | None, degrees: Degrees) -> bool:
        """Whether a collective's group crosses nodes: when the consecutive ranks it strides
        over on the workbench's meshes (`Degrees.consecutive_ranks`) exceed the ranks per
        node."""
        return degrees.consecutive_ranks(mesh_dim) > self.ranks_per_node

    def outside_allocator_bytes(self, communicators: int) -> dict[str, int]:
        """What a rank holds beside the allocator's segments: the CUDA context and
        `communicators` NCCL communicators' buffers."""
        return {
            "cuda_context_bytes": self.cuda_context_bytes,
            "nccl_buffer_bytes": self.nccl_buffer_bytes * communicators,
        }

    def link_rate(self, spans_nodes: bool) -> float:
        return self.inter_node_bytes_per_s if spans_nodes else self.intra_node_bytes_per_s

    def matmul_rate(self, dtype: str | None) -> float:
        return self.matmul_flops_per_s.get(dtype or "float32", self.matmul_flops_per_s["float32"])

    def to_json(self) -> dict[str, object]:
        return asdict(self)


# Dense datasheet peaks (SXM parts). fp32 matmul uses the non-tensor-core rate: torch does
# not allow TF32 matmuls by default. These are upper bounds, so times are lower bounds.
H100 = DeviceProfile(
    name="h100",
    description="NVIDIA H100 SXM datasheet peaks: bf16 989 TFLOP/s, fp32 67 TFLOP/s, 3.35 TB/s",
    matmul_flops_per_s={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    bytes_per_s=3.35e12,
    # NVLink 4 (H100 SXM datasheet: 900 GB/s bidirectional, so 450 GB/s each way) among the
    # 8 GPUs of an HGX/DGX node; across nodes one ConnectX-7 InfiniBand NDR400 port per GPU
    # (400 Gb/s = 50 GB/s each way, DGX H100 user guide).
    intra_node_bytes_per_s=450e9,
    inter_node_bytes_per_s=50e9,
    ranks_per_node=8,
    links="NVLink4 450 GB/s per direction in a node of 8, InfiniBand NDR400 50 GB/s per GPU across",
    # Host link as measured (DESIGN.md, "Published anchors: host link"): 53.1 GB/s from a
    # reused pinned pool against 11.2 GB/s with fresh pinned allocations; in a real step a
    # device-to-host copy reached 32.3 GB/s where ~52 GB/s was benchmarked (32.3 / 52).
    host_bytes_per_s=53.1e9,
    host_fresh_pinned_bytes_per_s=11.2e9,
    host_in_step_factor=32.3 / 52,
    host_hbm_contention=True,
    gpu_name="H100",
    nccl_latency=True,
    cuda_context_bytes=CUDA_CONTEXT_LAZY_BYTES,
    nccl_buffer_bytes=NCCL_BUFFSIZE * HOPPER_NCCL_CHANNELS,
    outside_sources=OUTSIDE_SOURCES,
    # nvidia-smi's memory.total of an H100 80GB HBM3: 81559 MiB (modal-labs/modal-client#2797)
    memory_bytes=81559 * 2**20,
)
# The same compute as the H100, with HBM3e's bandwidth.
H200 = replace(
    H100,
    name="h200",
    description="NVIDIA H200 SXM datasheet peaks: bf16 989 TFLOP/s, fp32 67 TFLOP/s, 4.8 TB/s",
    bytes_per_s=4.8e12,
    gpu_name="H200",
    memory_bytes=141 * 10**9,  # H200 datasheet: 141 GB HBM3e
)  # same NVLink 4 (900 GB/s bidirectional, H200 datasheet) and NDR400 links as the H100
# Blackwell, from NVIDIA's Blackwell datasheet ("Individual Blackwell GPU Specifications",
# HGX B200 column): FP16/BF16 Tensor Core 4.5 PFLOPS quoted with sparsity, so 2.25 dense (as
# pytorch/pytorch#193471 enters it in inductor's device table and torchtitan's
# `get_peak_flops` counts it); FP32 75 TFLOPS (dense); 180 GB HBM3e at 7.7 TB/s (the driver's
# bus width and clock give 7.672 TB/s, pytorch/ao#4002). NVLink 5: 1.8 TB/s bidirectional per
# GPU, so 900 GB/s each way, among the 8 GPUs of an HGX/DGX B200; across nodes one
# ConnectX-7 400 Gb/s port per GPU (DGX B200 user guide), 50 GB/s each way. torch's NCCL model
# gives Blackwell 32 channels (`comm_analysis._GPU_NCHANNELS`).
BLACKWELL_NCCL_CHANNELS = 32
B200 = DeviceProfile(
    name="b200",
    description="NVIDIA B200 (HGX) datasheet peaks: bf16 2,250 TFLOP/s, fp32 75 TFLOP/s, 7.7 TB/s",
    matmul_flops_per_s={"bfloat16": 2250e12, "float16": 2250e12, "float32": 75e12},
    bytes_per_s=7.7e12,
    intra_node_bytes_per_s=900e9,
    inter_node_bytes_per_s=50e9,
    ranks_per_node=8,
    links="NVLink5 900 GB/s per direction in a node of 8, 400 Gb/s (50 GB/s) per GPU across",
    gpu_name="B200",
    nccl_latency=True,
    # the CUDA context as measured with lazy loading in pytorch#86509 (not on a B200)
    cuda_context_bytes=CUDA_CONTEXT_LAZY_BYTES,
    nccl_buffer_bytes=NCCL_BUFFSIZE * BLACKWELL_NCCL_CHANNELS,
    outside_sources=(
        "CUDA context 287,047,680 B (lazy loading, pytorch#86509, not measured on a B200); "
        "NCCL_BUFFSIZE 4 MiB x 32 channels per communicator (NCCL docs; torch comm_analysis "
        "for Blackwell), a lower bound"
    ),
    # nvidia-smi's memory.total of a B200: 183359 MiB (NVIDIA/TensorRT-LLM#10278); torch's
    # `total_memory` (cudaGetDeviceProperties) is 178.35 GiB (pytorch/ao#4002), what
    # torchtitan's memory percentages are of
    memory_bytes=183359 * 2**20,
)


# CUDA's caching allocator rounds every block up to a multiple of this; the CPU's does not.
CUDA_ALLOC_GRANULARITY = 512


def allocation_granularity(device: torch.device | str) -> int:
    """What one allocation of `device` is rounded up to, as `max_memory_allocated` counts."""
    return CUDA_ALLOC_GRANULARITY if torch.device(device).type == "cuda" else 1


def round_up(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity


def _cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "sac-workbench" / "cpu-profile.json"


def _machine_key() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}|{os.cpu_count()}|{torch.__version__}|{torch.get_num_threads()}"


def _best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu_profile() -> DeviceProfile:
    """Time a 1024³ matmul per dtype and a 64 MiB copy on this CPU (about a second)."""
    n = 1024
    rates = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        rates[name] = 2 * n**3 / _best_seconds(functools.partial(torch.mm, a, b))
    src = torch.empty(16 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / _best_seconds(lambda: dst.copy_(src))
    return DeviceProfile(
        name="cpu",
        description=(
            f"this CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads), measured: "
            f"fp32 matmul {rates['float32'] / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s"
        ),
        matmul_flops_per_s=rates,
        bytes_per_s=bandwidth,
    )


def cpu_profile(refresh: bool = False) -> DeviceProfile:
    """This CPU's profile: measured on first use, then read from the cache file."""
    path, key = _cache_path(), _machine_key()
    if not refresh and path.exists():
        try:
            data = json.loads(read_file(path, f"CPU profile cache {str(path)!r}", 2**20))
            data.pop(MARK_KEY, None)
            if data.pop("machine") == key:
                return DeviceProfile(**data)
        except (ValueError, KeyError, TypeError, AttributeError, WorkbenchError):
            pass  # a stale, damaged or special (a pipe, a device) cache is measured again
    profile = measure_cpu_profile()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps({**profile.to_json(), "machine": key}), overwrite=True)
    except (OSError, WorkbenchError):
        pass  # a read-only home still gets a profile, just not a cached one
    return profile


PROFILES: dict[str, Callable[[], DeviceProfile]] = {
    "h100": lambda: H100,
    "h200": lambda: H200,
    "cpu": cpu_profile,
    "b200": lambda: B200,
}


def get_profile(profile: str | DeviceProfile) -> DeviceProfile:
    if isinstance(profile, DeviceProfile):
        return profile
    if profile not in PROFILES:
        raise WorkbenchError(
            f"unknown device profile {profile!r}; choose one of {', '.join(PROFILES)} "
            "or pass a workbench.cost.profiles.DeviceProfile"
        )
    return PROFILES[profile]()
