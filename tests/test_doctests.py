"""Every docstring example in the package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import workbench

PACKAGE = Path(workbench.__file__).parent
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(workbench.__path__, "workbench.")
    if info.name != "workbench.__main__"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_every_module_is_walked() -> None:
    """Each stage is a package with an `__init__`: no module escapes the walk above."""
    files = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in PACKAGE.rglob("*.py")
    }
    assert files - set(MODULES) == {"workbench", "workbench.__main__"}
