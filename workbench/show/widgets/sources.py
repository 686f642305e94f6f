"""What an explorer opens on: a traced graph, a workload (traced here) or a model name.

Entry point: `load_source(source, kernels) -> (graph, workload or None)`.
"""

from __future__ import annotations

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.errors import WorkbenchError

__all__ = ["load_source"]


def load_source(
    source: JointGraph | Workload | str, kernels: str | None = None
) -> tuple[JointGraph, Workload | None]:
    """The graph to explore, and the workload when known (Run compares against eager). A
    workload built on the meta device is traced on fake tensors, for `kernels` (a GPU's
    name, by default an H100's: `workbench.capture.kernels`); another one for real."""
    if isinstance(source, JointGraph):
        return source, None
    if isinstance(source, str):
        source = load_workload(source)
    if isinstance(source, Workload):
        if any(p.is_meta for p in source.model.parameters()):
            return trace(source, mode="fake", kernels=kernels), source
        return trace(source, mode="real"), source
    raise WorkbenchError(
        f"PolicyExplorer takes a JointGraph, a Workload or a model name, "
        f"not {type(source).__name__}"
    )
