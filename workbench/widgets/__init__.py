"""Interactive widgets: the policy explorer."""

from workbench.widgets.explorer import PolicyExplorer

__all__ = ["PolicyExplorer"]
