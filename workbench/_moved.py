"""The module names of the flat layout (`workbench.rules`, `workbench.policy`, ...) kept
importable for one release after the move to packages by pipeline stage, with a warning.

Entry point: `install()`, which `workbench/__init__.py` calls: an import finder that answers
an old name with the new module (a moved module or package, so there is one module object
and one class identity), or, for a module split in several, with a stand-in that looks each
name up in the new modules in turn.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

from workbench.decide import EMBEDDED

# Old module -> the new modules that hold its names, in the order to search them.
MOVED: dict[str, tuple[str, ...]] = {
    "workbench.rules": EMBEDDED,  # the rule files, in the order exports embed them
    "workbench.graph": ("workbench.capture.graph", "workbench.capture.ops"),
    "workbench.trace": ("workbench.capture.trace", "workbench.capture.tracing"),
    "workbench.parallel": ("workbench.capture.parallel",),
    "workbench.workload": ("workbench.capture.workload",),
    "workbench.models": ("workbench.capture.models",),
    "workbench.policy": ("workbench.decide.policy", "workbench.decide.decider"),
    "workbench.remat": ("workbench.rewrite.remat",),
    "workbench.offload": (
        "workbench.rewrite.offload",
        "workbench.rewrite.placement",
        "workbench.rewrite.host_ops",
    ),
    "workbench.index": ("workbench.rewrite.index", "workbench.rewrite.schedule"),
    "workbench.replay": ("workbench.cost.replay",),
    "workbench.estimate": ("workbench.cost.estimate",),
    "workbench.profiles": ("workbench.cost.profiles",),
    "workbench.measure": (
        "workbench.cost.measure",
        "workbench.interop.baselines",
        "workbench.capture.workload",
    ),
    "workbench.distributed_check": ("workbench.cost.ranks",),
    "workbench.solve": ("workbench.search.solve", "workbench.search.pareto"),
    "workbench.export": ("workbench.interop.export",),
    "workbench.titan": ("workbench.interop.titan", "workbench.interop.titan_offload"),
    "workbench.eager": ("workbench.interop.eager", "workbench.capture.workload"),
    "workbench.activations": ("workbench.interop.activations",),
    "workbench.explain": ("workbench.show.explain",),
    "workbench.viz": ("workbench.show.viz",),
    "workbench.widgets": ("workbench.show.widgets",),
}


def new_name(old: str) -> tuple[str, ...] | None:
    """The new modules behind an old name: itself moved, or a submodule of a moved package.

    >>> new_name("workbench.viz.style"), new_name("workbench.rewrite.index")
    (('workbench.show.viz.style',), None)
    """
    if old in MOVED:
        return MOVED[old]
    package, _, rest = old.rpartition(".")
    while package:
        if package in MOVED and len(MOVED[package]) == 1:
            return (f"{MOVED[package][0]}.{old[len(package) + 1 :]}",)
        package = package.rpartition(".")[0]
    return None


class _Split(types.ModuleType):
    """An old module whose names now live in several modules: found on first use."""

    def __init__(self, name: str, homes: Sequence[str]) -> None:
        super().__init__(name, f"Moved: its names are in {', '.join(homes)}.")
        self._homes = tuple(homes)

    def __getattr__(self, attr: str) -> Any:
        for home in self._homes:
            module = importlib.import_module(home)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(
            f"module {self.__name__!r} (moved to {', '.join(self._homes)}) "
            f"has no attribute {attr!r}"
        )


class _Loader(importlib.abc.Loader):
    def __init__(self, homes: tuple[str, ...]) -> None:
        self.homes = homes

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved to {' / '.join(self.homes)}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
        if len(self.homes) == 1:
            return importlib.import_module(self.homes[0])
        return _Split(spec.name, self.homes)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is the new one, or a stand-in that looks names up."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        homes = new_name(fullname) if fullname.startswith("workbench.") else None
        if homes is None:
            return None
        module = importlib.import_module(homes[0]) if len(homes) == 1 else None
        package = module is not None and hasattr(module, "__path__")
        return importlib.machinery.ModuleSpec(fullname, _Loader(homes), is_package=package)


def install() -> None:
    """Answer the old names from now on (once per interpreter)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # before the path finder: one module per file
