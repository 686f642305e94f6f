"""SAC Workbench: graph-based selective activation checkpointing, traced, decided, measured.

Flow: `models.load_workload` -> `trace.trace` -> `JointGraph` -> policy -> remat -> estimate.
"""

from workbench.errors import WorkbenchError
from workbench.graph import JointGraph, NodeInfo
from workbench.models import Workload, load_workload
from workbench.trace import trace

__all__ = ["JointGraph", "NodeInfo", "Workload", "WorkbenchError", "load_workload", "trace"]
