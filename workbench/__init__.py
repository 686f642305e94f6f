"""SAC Workbench: graph-based selective activation checkpointing, traced, decided, measured.

Flow, one package per part of it, each importing only the ones before it: `capture` (workload ->
`trace` -> `JointGraph`) -> `decide` (`Policy` -> tags) -> `rewrite` (torch's remat pass, the
offload pass) -> `cost` (estimate, measure) -> `search` (solver, Pareto front) -> `interop`
(exports, torchtitan, eager baselines) -> `show` (pictures, the explorer); `cli`, the command
line, over them all.
"""

import importlib
from typing import TYPE_CHECKING, Any

from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    from workbench.capture.graph import JointGraph, NodeInfo
    from workbench.capture.models import load_workload
    from workbench.capture.trace import trace
    from workbench.capture.workload import Workload

__all__ = ["JointGraph", "NodeInfo", "Workload", "WorkbenchError", "load_workload", "trace"]

# Imported on first use, so that importing the package needs no torch: `python -m workbench`
# run by a Python without it says so in one line (`workbench.__main__`); the model zoo
# (`load_workload`) is not needed for tracing.
_LAZY = {
    "JointGraph": "workbench.capture.graph",
    "NodeInfo": "workbench.capture.graph",
    "Workload": "workbench.capture.workload",
    "load_workload": "workbench.capture.models",
    "trace": "workbench.capture.trace",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
