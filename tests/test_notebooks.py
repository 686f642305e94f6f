"""The notebooks as a new user meets them: every figure shown, pictures readable when the
notebook is untrusted, and `make lab` trusted working copies apart from the test run's files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.cost.profiles import PROFILES
from workbench.decide.presets import PRESETS
from workbench.interop.export import FORMATS
from workbench.show.viz import render_view

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_computed_figure_is_shown(path: Path) -> None:
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        calls_a_plot = re.search(r"\bplot_\w+\(", source)
        if cell["cell_type"] != "code" or not calls_a_plot or "# NBVAL_SKIP" in source:
            continue
        kinds = {k for out in cell["outputs"] for k in out.get("data", {})}
        assert "image/png" in kinds, f"{path.name}: a cell plots but shows no figure: {source!r}"


def test_views_carry_a_text_fallback(small_graphs: dict[str, tuple[Workload, JointGraph]]) -> None:
    view = render_view(small_graphs["llama3-debug"][1], None, "overview")
    text = repr(view)
    assert text.startswith(f"Graphviz picture: {view.nodes} nodes") and "jupyter trust" in text


def test_the_explorer_in_the_notebook_autosaves_where_tests_point_it() -> None:
    source = (ROOT / "notebooks" / "sac_llama3.ipynb").read_text()
    assert "PolicyExplorer(" in source and "autosave=" not in source
    conftest = (ROOT / "notebooks" / "conftest.py").read_text()
    assert "SAC_WORKBENCH_AUTOSAVE_DIR" in conftest


def _saved_explorers(path: Path) -> list[dict[str, object]]:
    """The explorer states a notebook saved with its outputs (widget metadata)."""
    metadata = json.loads(path.read_text()).get("metadata", {})
    saved = metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    states = [model.get("state", {}) for model in saved.get("state", {}).values()]
    return [state for state in states if "presets" in state]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_saved_explorers_list_todays_choices(path: Path) -> None:
    """What a reader sees before running anything: the saved explorer's menus must be the
    registries' (a stale one listed presets that no longer exist and lacked new ones).
    Re-execute the notebook when a registry changes."""
    for state in _saved_explorers(path):
        assert state["presets"] == list(PRESETS), f"{path.name}: re-execute it"
        assert state["profiles"] == list(PROFILES), f"{path.name}: re-execute it"
        assert state["export_formats"] == list(FORMATS), f"{path.name}: re-execute it"


def test_the_main_notebook_saves_its_explorer() -> None:
    assert _saved_explorers(ROOT / "notebooks" / "sac_llama3.ipynb")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_lab_opens_trusted_working_copies() -> None:
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "lab"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "jupyter trust out/lab/*.ipynb" in dry
    assert dry.rstrip().splitlines()[-1].endswith("out/lab/sac_llama3.ipynb")


def test_the_pipeline_bars_keep_their_legend_off_the_bars() -> None:
    """Section 4's legend sat on bar 0 (`loc="lower left"` inside the axes): it is the
    figure's now, under the plots, where constrained layout keeps room for it."""
    cells = json.loads((ROOT / "notebooks" / "pipeline.ipynb").read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if ".bar(" in "".join(c["source"]))
    assert 'layout="constrained"' in source and 'loc="outside lower center"' in source
    assert "ax.legend(" not in source and "axes[0].legend(" not in source
