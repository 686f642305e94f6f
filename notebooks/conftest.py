"""nbval runs of the notebooks: the explorer autosaves into a temporary folder, so a test run
leaves no policy file behind for the next `make lab` session to restore.

Entry point: pytest loads this file for the notebooks folder; kernels inherit the variable.
"""

from __future__ import annotations

import os
import tempfile

import pytest


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(
        "SAC_WORKBENCH_AUTOSAVE_DIR", tempfile.mkdtemp(prefix="sac-workbench-autosave-")
    )
