"""What a GPU step holds in the caching allocator beside its tensors: cuBLAS's workspaces.

cuBLAS and cuBLASLt each take a workspace through torch's caching allocator at a process's
first matmul on a stream, and keep it: blocks no graph node allocates, held in every later
step like the optimizer's state. Measured on an H200 with torch 2.11 (the snapshots of
tests/fixtures/gpu/h200-torch2.11): two 32 MiB blocks, and with them every measured
`max_memory_allocated` equals the estimate to the byte (`none`, `default`, `eager` on
llama3-debug). `CUBLAS_WORKSPACE_CONFIG` and `CUBLASLT_WORKSPACE_SIZE` change their sizes.

Entry points: `blas_workspaces(graph)`, `gpu_workspaces(kernels)` (an eager run's).
"""

from __future__ import annotations

from workbench.capture.graph import JointGraph
from workbench.capture.kernels import gpu_arch

__all__ = ["BLAS_WORKSPACES", "MATMUL_OPS", "blas_workspaces", "gpu_workspaces"]

MiB = 2**20
# cuBLAS's workspace, then cuBLASLt's, on Hopper and Blackwell (torch's default: 32 MiB each)
BLAS_WORKSPACES: tuple[int, ...] = (32 * MiB, 32 * MiB)
# ops that run through cuBLAS / cuBLASLt on a GPU
MATMUL_OPS: frozenset[str] = frozenset(
    f"aten.{op}.default"
    for op in ("mm", "bmm", "addmm", "baddbmm", "addbmm", "_grouped_mm", "_scaled_mm")
)


def gpu_workspaces(kernels: str) -> list[int]:
    """cuBLAS's workspace blocks for a step run with `kernels` (a GPU's, or `"cuda"`: a real
    trace there); none for the CPU's.

    >>> gpu_workspaces("h100"), gpu_workspaces("cpu")
    ([33554432, 33554432], [])
    """
    on_gpu = kernels == "cuda" or gpu_arch(kernels) is not None
    return list(BLAS_WORKSPACES) if on_gpu else []


def blas_workspaces(graph: JointGraph) -> list[int]:
    """The workspace blocks `graph`'s step holds: cuBLAS's and cuBLASLt's when it runs on a
    GPU (traced for one, or a real trace on CUDA) and has a matmul; none on a CPU.

    >>> from workbench.capture.models import load_workload
    >>> from workbench.capture.trace import trace
    >>> cpu = trace(load_workload("llama3-debug", layers=1, seq=16), "real")
    >>> blas_workspaces(cpu)
    []
    """
    kernels = graph.config.get("kernels")
    if not isinstance(kernels, str) or not any(info.op in MATMUL_OPS for info in graph.ops()):
        return []
    return gpu_workspaces(kernels)
