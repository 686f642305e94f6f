"""Interactive widgets: the policy explorer and the plain-Python session it shows.

Entry points: `PolicyExplorer` (the anywidget, imported on first use) and `ExplorerModel`
(`workbench.show.widgets.model`), which needs no Jupyter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.show.widgets.model import ExplorerModel

if TYPE_CHECKING:
    from workbench.show.widgets.explorer import PolicyExplorer

__all__ = ["ExplorerModel", "PolicyExplorer"]


def __getattr__(name: str) -> Any:
    """`PolicyExplorer` on first use: importing the model loads no widget library."""
    if name == "PolicyExplorer":
        from workbench.show.widgets.explorer import PolicyExplorer

        return PolicyExplorer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
