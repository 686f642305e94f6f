"""What is core and what is a study: the pipeline imports neither the studies nor the zoo."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE = [
    "workbench.trace",
    "workbench.policy",
    "workbench.remat",
    "workbench.estimate",
    "workbench.solve",
    "workbench.export",
]


@pytest.mark.parametrize("module", CORE)
def test_core_modules_import_no_study(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m.startswith('workbench.studies')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tracing_imports_no_model_zoo() -> None:
    code = (
        "import sys, workbench.trace; "
        "print(sorted(m for m in sys.modules if m.startswith('workbench.models')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_workload_is_the_same_type_everywhere() -> None:
    import workbench
    from workbench.models import Workload as FromZoo
    from workbench.workload import Workload

    assert FromZoo is Workload is workbench.Workload
    assert callable(workbench.load_workload)
