"""Shared fixtures: traced graphs are built once per test session (tracing takes seconds)."""

from __future__ import annotations

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace


@pytest.fixture(scope="session")
def llama_debug() -> tuple[Workload, JointGraph]:
    workload = load_workload("llama3-debug")
    return workload, trace(workload, mode="real")


@pytest.fixture(scope="session")
def dsv3_debug() -> tuple[Workload, JointGraph]:
    workload = load_workload("dsv3-debug")
    return workload, trace(workload, mode="real")


@pytest.fixture(scope="session")
def small_graphs() -> dict[str, tuple[Workload, JointGraph]]:
    """Both reference models shrunk to two layers and 32 tokens: fast to trace and run."""
    result = {}
    for model in ("llama3-debug", "dsv3-debug"):
        workload = load_workload(model, layers=2, seq=32)
        result[model] = (workload, trace(workload, mode="real"))
    return result


@pytest.fixture(scope="session")
def rank_debug() -> JointGraph:
    """llama3-debug, 2 layers, 128 tokens, FSDP2 x TP2, rank 0 on fake tensors: long enough
    a sequence that activations, not parameter state, set the peak."""
    from workbench.capture.parallel import Parallel

    workload = load_workload("llama3-debug", device="meta", layers=2, seq=128)
    return trace(workload, "fake", Parallel(fsdp=2, tp=2))


@pytest.fixture(scope="session")
def small_graphs_and_rank(
    small_graphs: dict[str, tuple[Workload, JointGraph]], rank_debug: JointGraph
) -> dict[str, JointGraph]:
    """`small_graphs`' two graphs and `rank_debug` (rank 0 of llama3-debug on FSDP2 x TP2):
    the graphs the what-if's exactness tests run on."""
    return {
        **{name: graph for name, (_, graph) in small_graphs.items()},
        "llama3-debug-fsdp2-tp2": rank_debug,
    }
