"""nbval runs of the notebooks: the explorer autosaves into a temporary folder, so a test run
leaves no policy file behind for the next `make lab` session to restore; the kernels import
`studies` (not installed) from the repository's root, as `make lab`'s do.

Entry point: pytest loads this file for the notebooks folder; kernels inherit the variables.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(
        "SAC_WORKBENCH_AUTOSAVE_DIR", tempfile.mkdtemp(prefix="sac-workbench-autosave-")
    )
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
