"""`make lab`'s set-up: torchtitan installed without its training-only requirements and
without pip's red dependency ERROR (issue 27, item 13), the reason for triton said."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _install_lines(*variables: str) -> list[str]:
    """The commands `make` would run to (re)install the venv, without running them."""
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", ".venv/.installed", *variables],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "pip install" in line or "echo" in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_torchtitan_is_installed_last_without_its_requirements() -> None:
    """pip checks the requirements of what it installs unless --no-deps: torchtitan goes
    last with --no-deps, after what its models import, so no install follows it."""
    lines = _install_lines()
    installs = [line for line in lines if "pip install" in line]
    titan = next(line for line in installs if "torchtitan==" in line)
    assert "install --no-deps torchtitan==" in titan
    assert titan.rstrip("; \\&").endswith("torchtitan==0.3.0")
    after = "".join(lines[lines.index(titan) :]).split("--no-deps torchtitan==0.3.0", 1)[1]
    assert "pip install" not in after
    assert "spmd_types" in titan and "triton" in titan  # its requirements, on the line before
    assert "triton ~285 MB, imported by torchtitan even on CPU" in "\n".join(lines)
    assert "without its training-only requirements" in "\n".join(lines)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_torchtitan_can_be_left_out() -> None:
    lines = _install_lines("TORCHTITAN=")
    assert "torchtitan and triton not installed" in "\n".join(lines)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_front_end_linter_installs_from_the_lock_file_once() -> None:
    """biome comes from package-lock.json by `npm ci`, again only when the lock changes; the
    JS/CSS check runs in `make lint` (hence `make test`)."""
    install = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "node_modules/.installed"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "npm ci" in install and "touch node_modules/.installed" in install
    makefile = (ROOT / "Makefile").read_text()
    assert "$(NPM_STAMP): package.json package-lock.json" in makefile
    assert "biome check --error-on-warnings" in makefile
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "jslint" in lint


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_without_npm_the_front_end_check_is_skipped_in_one_line() -> None:
    out = subprocess.run(
        ["make", "--no-print-directory", "jslint", "NPM=/no/such/npm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("NOTE: npm is not installed")


def test_transformers_is_a_pinned_test_extra_that_brings_no_torch() -> None:
    """`make test` installs `.[test]` after the CPU torch: the pinned transformers (issue 37)
    must not ask pip for a torch of its own (a CUDA wheel from the index), and
    environment.yml keeps the same pin."""
    import importlib.metadata

    extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    test_extra = extras.split("test = [", 1)[1].split("]", 1)[0]
    assert re.findall(r'"(transformers[^"]*)"', test_extra) == ["transformers==5.24.0"]
    assert "transformers=5.24.0" in (ROOT / "environment.yml").read_text()
    try:
        requires = importlib.metadata.requires("transformers") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("transformers is not installed")
    unconditional = [r for r in requires if ";" not in r]
    assert not any(r.split()[0].lower().startswith("torch") for r in unconditional), requires


def test_the_expected_warnings_are_filtered_each_by_name(pytestconfig: pytest.Config) -> None:
    """`make test` ends without the warnings it expects (torch's `jit.script_method`
    deprecation met on importing torchtitan, torchtitan's float32 CPU autocast): pyproject.toml
    filters each by its message, category and the module that raises it, and nothing else."""
    import warnings

    import torch
    from _pytest.warnings import parse_warning_filter

    lines = pytestconfig.getini("filterwarnings")  # pyproject.toml's, as pytest reads them
    assert len(lines) == 2 and all(
        line.count(":") == 3 and line.startswith("ignore:") for line in lines
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for line in lines:
            warnings.filterwarnings(*parse_warning_filter(line, escape=False))

        def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return x

        torch.jit.script_method(forward)  # as importing torchtitan meets it
        moe = {"__name__": "torchtitan.models.common.moe", "torch": torch}
        exec("with torch.autocast(device_type='cpu', dtype=torch.float32): pass", moe)
        assert not [str(w.message) for w in seen]
        exec("with torch.autocast(device_type='cpu', dtype=torch.float32): pass", {"torch": torch})
        assert len(seen) == 1  # the same warning raised elsewhere still shows
