"""The house: packages in the order data flows, each importing only the ones before it, no
cycle; what is core and what is a study (the core imports neither the studies nor the zoo;
no workbench module imports `studies`, which is not installed). Function size is ruff's
complexity rules (pyproject.toml), not a cap on lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = [
    "workbench.capture.trace",
    "workbench.decide.policy",
    "workbench.rewrite.remat",
    "workbench.cost.estimate",
    "workbench.search.solve",
    "workbench.interop.export",
]


@pytest.mark.parametrize("module", CORE)
def test_core_modules_import_no_study(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'studies'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tracing_imports_no_model_zoo() -> None:
    code = (
        "import sys, workbench.capture.trace; "
        "print(sorted(m for m in sys.modules if m.startswith('workbench.capture.models')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_workload_is_the_same_type_everywhere() -> None:
    import workbench
    from workbench.capture.models import Workload as FromZoo
    from workbench.capture.workload import Workload

    assert FromZoo is Workload is workbench.Workload
    assert callable(workbench.load_workload)


# --- the house: packages in the order data flows, each importing only the ones before it ---

PACKAGE = Path(__file__).resolve().parents[1] / "workbench"
# The packages in the order data flows; a module imports its own package and the ones before.
PACKAGES = ("capture", "decide", "rewrite", "cost", "search", "interop", "show")
BASE = {"workbench.errors", "workbench.files", "workbench.units"}  # what every package may import


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The workbench modules `path` imports, anywhere in it (function-level imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def test_no_import_cycle() -> None:
    modules = _modules()
    edges = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(edges[name]):
            if state.get(other) == 1:
                cycle = path[path.index(other) :] + [other]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])


def test_packages_import_only_downward() -> None:
    """capture <- decide <- rewrite <- cost <- search <- interop <- show; the top level (the
    cli package, the package itself) may import any of them, none of them the cli."""
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        package = _package(name)
        if package is None:
            continue
        for other in _imports(path, modules):
            if other in BASE or other == "workbench":
                continue
            theirs = _package(other)
            if theirs is None or PACKAGES.index(theirs) > PACKAGES.index(package):
                wrong.append(f"{name} imports {other}")
    assert wrong == []


def test_no_workbench_module_imports_a_study() -> None:
    """`studies` (the repository's, not installed) imports the workbench, never the reverse:
    not a flow package, not the cli; function-level imports count."""
    wrong = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            wrong += [f"{name} imports {n}" for n in names if n.split(".")[0] == "studies"]
    assert wrong == []
