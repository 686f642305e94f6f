"""Interactive widgets: the policy explorer."""

from workbench.show.widgets.explorer import PolicyExplorer

__all__ = ["PolicyExplorer"]
