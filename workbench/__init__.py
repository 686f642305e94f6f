"""SAC Workbench: graph-based selective activation checkpointing, traced, decided, measured.

Flow: `models.load_workload` -> `trace.trace` -> `JointGraph` -> policy -> remat -> estimate.
"""

from typing import Any

from workbench.errors import WorkbenchError
from workbench.graph import JointGraph, NodeInfo
from workbench.trace import trace
from workbench.workload import Workload

__all__ = ["JointGraph", "NodeInfo", "Workload", "WorkbenchError", "load_workload", "trace"]


def __getattr__(name: str) -> Any:
    """`workbench.load_workload` imports the model zoo on first use: tracing does not need it."""
    if name == "load_workload":
        from workbench.models import load_workload

        return load_workload
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
