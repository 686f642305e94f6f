"""What the explorer's panel says, each figure the quantity it names (issue 27): autosaves
named for their graph (and earlier versions' files taken over only where they apply), Run's
measured and estimated peak of one quantity, the host row, Suggest's busy state and why a
host budget moved nothing, search ranked by what a user means, export messages that say
what happened, and glyphs the browser's font has."""

from __future__ import annotations

import doctest
import os
import re
from pathlib import Path

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.cost.estimate import Estimator
from workbench.decide.policy import Policy
from workbench.show.widgets import ExplorerModel, suggest
from workbench.show.widgets.panels import metrics_panel, search_matches
from workbench.show.widgets.session import graph_key, legacy_autosave
from workbench.show.widgets.suggest import no_offload_words
from workbench.units import format_bytes

Fixture = tuple[Workload, JointGraph]
WIDGETS = Path(__file__).resolve().parents[1] / "workbench" / "show" / "widgets"
DEJAVU = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")


@pytest.fixture
def small(small_graphs: dict[str, Fixture]) -> Fixture:
    return small_graphs["llama3-debug"]


@pytest.fixture(scope="module")
def peaky() -> Fixture:
    """256 tokens: activations, not parameters, set the peak, so offload could matter."""
    workload = load_workload("llama3-debug", layers=2, seq=256)
    return workload, trace(workload, mode="real")


@pytest.fixture
def autosave_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SAC_WORKBENCH_AUTOSAVE_DIR", str(tmp_path))
    return tmp_path


# --- 1. one autosave per graph ---------------------------------------------------------------


def test_graph_key_names_model_shape_sharding_and_mode(
    small: Fixture, rank_debug: JointGraph
) -> None:
    one, rank = graph_key(small[1]), graph_key(rank_debug)
    assert one.startswith("llama3-debug-layers2-seq32-batch2-float32-real-")
    assert rank.startswith("llama3-debug-layers2-seq128-batch2-float32-fsdp2-tp2-")
    assert "-fake-" in rank and one != rank
    assert re.fullmatch(r"[A-Za-z0-9._-]+", one) and graph_key(small[1]) == one


def test_an_explorer_on_another_graph_starts_from_its_preset_and_leaves_files_alone(
    small: Fixture, rank_debug: JointGraph, autosave_dir: Path
) -> None:
    workload, graph = small
    main = ExplorerModel(graph, "eager", workload=workload)
    main.flip("mm_4")
    saved = main.autosave.path.read_bytes()
    rank = ExplorerModel(rank_debug, "default")
    assert rank.policy == Policy("default") and rank.message == ""
    assert rank.autosave.path != main.autosave.path
    rank.set_preset("full")
    assert main.autosave.path.read_bytes() == saved  # the first explorer's file, untouched
    main.reset()
    assert "changed outside" not in main.message and main.autosave.path.exists()
    names = sorted(p.name for p in autosave_dir.iterdir())
    assert names == sorted(
        [f"{graph_key(graph)}.policy.json", f"{graph_key(rank_debug)}.policy.json"]
    )
    again = ExplorerModel(graph, "eager", workload=workload)  # the same graph goes on
    assert again.policy == main.policy and "restored" in again.message


def test_an_earlier_versions_autosave_is_taken_over_only_where_it_applies(
    small: Fixture, rank_debug: JointGraph, autosave_dir: Path
) -> None:
    workload, graph = small
    legacy = legacy_autosave(graph.model_name)
    assert legacy == autosave_dir / "llama3-debug.policy.json"
    foreign = Policy("eager", overrides={"layers.7.attention::aten.mm.default#0": "save"})
    foreign.save(legacy)
    original = legacy.read_bytes()
    ex = ExplorerModel(graph, "default", workload=workload)
    assert ex.policy == Policy("default") and "is left as it is" in ex.message
    assert "1 of its entries do not match" in ex.message
    assert legacy.read_bytes() == original  # kept for the graph it was made for
    assert not list(autosave_dir.glob("*.stale*"))
    ex.autosave.path.unlink()
    mine = Policy("eager", overrides={"layers.*.feed_forward.w1::aten.mm.default#0": "recompute"})
    mine.save(legacy, overwrite=True)
    taken = ExplorerModel(graph, "default", workload=workload)
    assert taken.policy == mine and "restored llama3-debug.policy.json" in taken.message
    assert not legacy.exists() and Policy.load(taken.autosave.path) == mine
    rank = ExplorerModel(rank_debug, "default")  # taken once: no other graph gets it
    assert rank.policy == Policy("default")
    taken.autosave.path.unlink()
    os.mkfifo(legacy)  # not a file: never read (a read would block)
    fifo = ExplorerModel(graph, "full", workload=workload)
    assert fifo.policy == Policy("full") and fifo.message == "" and legacy.is_fifo()


# --- 2. like with like ----------------------------------------------------------------------


def test_run_compares_one_quantity_and_says_how_the_panel_differs(
    small: Fixture, tmp_path: Path
) -> None:
    workload, graph = small
    ex = ExplorerModel(graph, "offload", workload=workload, autosave=tmp_path / "p.json")
    panel = ex.metrics
    result = ex.run(repeats=1)
    # the panel: device bytes with AdamW state; Run: the graph's own, device + host on CPU
    assert result["estimated_device_peak_bytes"] + result["optimizer_bytes"] == panel["peak_bytes"]
    assert result["estimated_host_peak_bytes"] == panel["host_peak_bytes"] > 0
    assert result["estimated_peak_bytes"] >= result["estimated_device_peak_bytes"]
    assert abs(result["peak_bytes"] - result["estimated_peak_bytes"]) <= 0.03 * result["peak_bytes"]
    assert "device + host copies" in result["peak_counts"]
    assert f"adds AdamW state {format_bytes(result['optimizer_bytes'])}" in ex.status
    assert "counts host copies apart" in ex.status
    assert f"estimated {format_bytes(result['estimated_peak_bytes'])}" in ex.status


# --- 4. the host row and why nothing offloads -------------------------------------------------


def test_the_host_row_is_the_estimates_host_peak(small: Fixture, tmp_path: Path) -> None:
    workload, graph = small
    ex = ExplorerModel(graph, "default", workload=workload, autosave=tmp_path / "p.json")
    assert ex.metrics["host_peak_bytes"] == 0 and ex.metrics["host_text"].startswith("0 B")
    assert "with optimizer state" in ex.metrics["peak_counts"]
    ex.flip("mm_4")
    ex.flip("mm_4")  # save -> recompute -> offload
    assert ex.decisions["mm_4"].offload
    est = ex.estimate
    assert ex.metrics["host_peak_bytes"] == est.host_peak_bytes > 0
    assert ex.metrics["host_text"].startswith(format_bytes(est.host_peak_bytes))
    without = metrics_panel(
        Estimator(graph, ["h100"], optimizer="none").estimate(Policy("full")), "h100"
    )
    assert "without optimizer state" in without["peak_counts"]


def test_suggest_says_why_a_host_budget_moved_nothing(
    small: Fixture, peaky: Fixture, tmp_path: Path
) -> None:
    workload, graph = peaky
    ex = ExplorerModel(graph, "eager", workload=workload, autosave=tmp_path / "p.json")
    low = ex.budget_range["min"]
    assert "Suggest searches no lower budget" in ex.budget_range["note"]
    assert format_bytes(low) in ex.budget_range["note"]
    ex.set_host_budget(2**30)
    ex.suggest(low)  # the slider's minimum: full recompute's peak
    assert "offloads 0 B to host (budget 1.0 GiB): " in ex.message
    words = no_offload_words(graph, ex.policy, low, 2**30, "h100", ex.estimator)
    assert words in ex.message and words.startswith("offloading instead the ")
    assert "over the budget" in words and re.search(r"refused: .*\d+ in the last layer", words)
    # the number it names is the estimate of that policy
    peak = re.search(r"gives peak ([\d.]+ [KMG]?i?B)", words)
    assert peak and peak.group(1) != format_bytes(low)
    small_graph = small[1]
    fits = ExplorerModel(small_graph, "none", autosave=tmp_path / "q.json")
    fits.set_host_budget(2**30)
    fits.suggest(fits.budget_range["max"])
    assert "it recomputes nothing: every activation fits on the device" in fits.message
    assert doctest.testmod(suggest).failed == 0


# --- 3. Suggest is busy while it solves ------------------------------------------------------


def test_suggest_and_sweep_show_a_busy_state(small: Fixture, tmp_path: Path) -> None:
    workload, graph = small
    ex = ExplorerModel(graph, "eager", workload=workload, autosave=tmp_path / "p.json")
    seen: list[tuple[bool, str]] = []
    ex.on_change = lambda: seen.append((ex.running, ex.status))
    ex.suggest((ex.budget_range["min"] + ex.budget_range["max"]) // 2)
    assert seen and seen[0][0] and seen[0][1].startswith("Suggest: solving for a budget of")
    assert not ex.running and ex.status == ""
    seen.clear()
    ex.sweep(points=2)
    assert seen[0] == (True, "Sweep: solving 2 budgets…") and not ex.running
    with pytest.raises(Exception, match="budget"):
        ex.suggest(1)  # below the floor: refused, and no longer busy
    assert not ex.running and ex.status == ""


# --- 9. search and export messages -----------------------------------------------------------


def test_find_puts_the_op_a_user_means_first(small: Fixture) -> None:
    graph = small[1]
    found = search_matches(graph, "wo")
    first = graph.nodes[found[0]]
    assert first.module == "layers.0.attention.wo" and first.op == "aten.mm.default"
    wo_ops = [n for n in found if graph.nodes[n].module.endswith(".wo")]
    computing = [n for n in wo_ops if graph.nodes[n].flops]
    assert wo_ops[: len(computing)] == computing  # the matmuls, then their views
    assert graph.nodes[search_matches(graph, "mm")[0]].op == "aten.mm.default"


def test_export_messages_follow_the_format_and_count_saves(small: Fixture, tmp_path: Path) -> None:
    workload, graph = small
    ex = ExplorerModel(graph, "eager", workload=workload, autosave=tmp_path / "p.json")
    target = ex.save_export()
    assert ex.message.startswith(f"saved the policy_fn export to {target} at ")
    assert "replaced" not in ex.message
    ex.set_export_format("graph_pass")
    assert ex.message == f"export format graph_pass: not saved yet; Save writes {ex.export_path}"
    ex.save_export()
    ex.save_export()
    assert ex.message.startswith("saved the graph_pass export to ")
    assert "(save 2 of this file: replaced the copy saved at " in ex.message


# --- 10. glyphs the browser's font draws -----------------------------------------------------


def test_every_glyph_the_front_end_shows_is_in_dejavu_sans() -> None:
    """Debian's chromium with fonts-dejavu-core draws a box for a character DejaVu Sans
    lacks (the hourglass Run once showed)."""
    ttlib = pytest.importorskip("fontTools.ttLib")
    if not DEJAVU.exists():
        pytest.skip(f"{DEJAVU} is not installed (apt-get install fonts-dejavu-core)")
    cmap = ttlib.TTFont(str(DEJAVU)).getBestCmap()
    sources = [*WIDGETS.glob("*.js"), *WIDGETS.glob("*.css"), *WIDGETS.glob("*.py")]
    missing = {
        f"{path.name}: {ch!r} (U+{ord(ch):04X})"
        for path in sources
        for ch in path.read_text()
        if ord(ch) > 127 and ord(ch) not in cmap
    }
    assert not missing, sorted(missing)
