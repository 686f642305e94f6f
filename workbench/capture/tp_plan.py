"""A user's tensor-parallel plan, checked before torch applies it: torch only warns about a
module path that names nothing, and the rank then runs without its collectives.

Entry point: `check_tp_plan(plan, model, name)`.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from workbench.errors import WorkbenchError

__all__ = ["check_tp_plan"]


def check_tp_plan(plan: Any, model: nn.Module, name: str) -> None:
    """A dict {module path: ParallelStyle} whose every path (fnmatch patterns per component,
    as `parallelize_module` reads them) names a module, or a callable: torch only warns
    about a path that names nothing, and the rank then runs without collectives."""
    if callable(plan):
        return
    if not isinstance(plan, dict):
        raise WorkbenchError(
            f"the tensor-parallel plan of {name!r} is a {type(plan).__name__}: give a dict "
            "{module path: ParallelStyle} or a callable(model, tp_mesh)"
        )
    paths = [path for path, _ in model.named_modules() if path]
    for key, style in plan.items():
        if not isinstance(key, str) or not isinstance(style, ParallelStyle):
            raise WorkbenchError(
                f"the tensor-parallel plan of {name!r} maps {key!r} to {style!r}: each entry "
                "is a module path (str) and a ParallelStyle such as ColwiseParallel()"
            )
        parts = key.split(".")
        if not any(
            len(p) == len(parts) and all(map(fnmatch.fnmatchcase, p, parts))
            for p in (path.split(".") for path in paths)
        ):
            shown = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
            raise WorkbenchError(
                f"the tensor-parallel plan of {name!r} names {key!r}, which is no module of "
                f"the model (its modules: {shown})"
            )
