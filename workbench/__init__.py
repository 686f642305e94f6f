"""SAC Workbench: graph-based selective activation checkpointing, traced, decided, measured.

Flow, one package per part of it, each importing only the ones before it: `capture` (workload ->
`trace` -> `JointGraph`) -> `decide` (`Policy` -> tags) -> `rewrite` (torch's remat pass, the
offload pass) -> `cost` (estimate, measure) -> `search` (solver, Pareto front) -> `interop`
(exports, torchtitan, eager baselines) -> `show` (pictures, the explorer); `cli`, the command
line, over them all.
"""

from typing import Any

from workbench.capture.graph import JointGraph, NodeInfo
from workbench.capture.trace import trace
from workbench.capture.workload import Workload
from workbench.errors import WorkbenchError

__all__ = ["JointGraph", "NodeInfo", "Workload", "WorkbenchError", "load_workload", "trace"]


def __getattr__(name: str) -> Any:
    """`workbench.load_workload` imports the model zoo on first use: tracing does not need it."""
    if name == "load_workload":
        from workbench.capture.models import load_workload

        return load_workload
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
