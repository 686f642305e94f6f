"""The explorer in a real JupyterLab in headless Chromium: open, run, click, see it change.

Needs Debian's chromium (`/usr/bin/chromium`) and the playwright package (no browser
download). Screenshots go to `out/browser/`. Every server started here is stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

from jupyter_lab import CHROMIUM, CHROMIUM_FLAGS, LabDidNotStart, explorer_lab, open_notebook

from workbench.show.viz import svg_id

SHOTS = Path(__file__).resolve().parents[1] / "out" / "browser"

pytestmark = [pytest.mark.browser, pytest.mark.slow]


# The main explorer on the default autosave (in the served folder), then a per-rank one of
# the same model: opened after the first has edits, it must start from its own preset.
TWO_EXPLORERS = [
    "import os\n"
    'os.environ["SAC_WORKBENCH_AUTOSAVE_DIR"] = "."\n'
    "from workbench.capture.models import load_workload\n"
    "from workbench.capture.parallel import Parallel\n"
    "from workbench.capture.trace import trace\n"
    "from workbench.show.widgets import PolicyExplorer",
    'explorer = PolicyExplorer(load_workload("llama3-debug", layers=4, seq=128), "default")\n'
    "explorer",
    'sharded = load_workload("llama3-debug", layers=2, seq=128, device="meta")\n'
    'rank = PolicyExplorer(trace(sharded, "fake", Parallel(fsdp=2, tp=2)), "default")\n'
    "rank",
]


def _served(tmp_path: Path, cells: list[str] | None = None) -> Iterator[tuple[str, Path]]:
    if not Path(CHROMIUM).exists():
        pytest.skip(
            "Debian's chromium is not installed: `make test` installs it when run as root "
            "(or: sudo apt-get install -y chromium)"
        )
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (no download)")
    try:
        with explorer_lab(tmp_path, cells) as served:
            yield served
    except LabDidNotStart as err:
        pytest.fail(str(err))


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A JupyterLab server on 127.0.0.1 serving a notebook with the explorer; its URL and
    the folder it serves (the kernel's working folder)."""
    yield from _served(tmp_path)


@pytest.fixture
def two_explorers_lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The same, serving `TWO_EXPLORERS`."""
    yield from _served(tmp_path, TWO_EXPLORERS)


def _find(page: Page, scope: Locator, name: str) -> None:
    """Bring op `name` into view as a user would when it lies outside the panel: Find it
    (views keep labels legible, so a layer may be larger than the panel)."""
    scope.locator(".sacwb-search").fill(name)
    scope.locator(".sacwb-search").press("Enter")
    page.wait_for_function(
        "(name) => [...document.querySelectorAll('.sacwb-message')]"
        ".some(m => m.innerText.startsWith(name + ' ('))",
        arg=name,
        timeout=60_000,
    )


def _spread(page: Page, plot: int) -> float:
    """Horizontal spread in pixels of the estimated points of the history plot `plot`."""
    xs = page.evaluate(
        "(i) => [...document.querySelectorAll('.sacwb-history .sacwb-plot')[i]"
        ".querySelectorAll('circle')].map(m => Number(m.getAttribute('cx')))",
        plot,
    )
    return float(max(xs) - min(xs)) if xs else 0.0


def test_a_researchers_session_in_the_explorer(lab: tuple[str, Path]) -> None:
    """Open a folded layer, flip an op, search, Suggest, Run, export: each visible."""
    from playwright.sync_api import sync_playwright

    url, root = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:  # launch() gives chromium a fresh, temporary profile
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = open_notebook(browser, url, 1500, 1100)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            try:
                page.wait_for_selector(".sacwb-graph svg", timeout=180_000)
            except Exception:
                page.screenshot(path=str(SHOTS / "explorer-failed-to-render.png"))
                raise
            page.locator(".sacwb").scroll_into_view_if_needed()
            legend = page.locator(".sacwb-legend")
            assert "'layers.0–3 ×4': 4 identical layers" in legend.inner_text()
            page.screenshot(path=str(SHOTS / "explorer-overview.png"))
            message = page.locator(".sacwb-message")

            # 1. the folded layers' frame opens layer 0
            frame = page.locator(f'g.cluster[id="{svg_id("g", "layers.0–3")}"] > text').first
            frame.click()
            page.wait_for_function(
                "document.querySelector('.sacwb-legend').innerText.includes('layer:0')",
                timeout=60_000,
            )
            assert message.inner_text() == ""
            page.screenshot(path=str(SHOTS / "explorer-layer.png"))

            # 2. flip an op
            _find(page, page.locator(".sacwb"), "mm_4")
            page.locator(f'[id="{svg_id("n", "mm_4")}"]').click()
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText"
                ".includes('recomputed in every identical layer')",
                timeout=60_000,
            )
            assert "MUST_RECOMPUTE" in page.locator(".sacwb-details").inner_text()

            # 3. search opens and highlights the match
            page.locator(".sacwb-search").fill("wo")
            page.locator(".sacwb-search").press("Enter")
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText.includes('match 1 of')",
                timeout=60_000,
            )
            assert page.locator(".sacwb-graph g.sacwb-selected").count() == 1
            page.screenshot(path=str(SHOTS / "explorer-search.png"))

            # 4. the host budget beside Suggest reaches Python (then back to no offload)
            host = page.locator(".sacwb-host-budget")
            for gib, said in (("0.5", "may offload up to 512"), ("0", "do not offload")):
                host.fill(gib)
                host.dispatch_event("change")
                page.wait_for_function(
                    f"document.querySelector('.sacwb-message').innerText.includes('{said}')",
                    timeout=60_000,
                )

            # 5. Suggest for a budget: the solver's rows are listed
            page.eval_on_selector(
                ".sacwb-budget",
                "b => { b.value = Number(b.min) + 0.3 * (Number(b.max) - Number(b.min));"
                " b.dispatchEvent(new Event('input')); }",
            )
            page.locator(".sacwb-suggest-go").click()
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText.includes('suggested by')",
                timeout=120_000,
            )
            rows = page.locator(".sacwb-row-override, .sacwb-row-selector")
            assert rows.count() > 0
            page.locator(".sacwb-policy").scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "explorer-suggest.png"))

            # 6. Run: the measured point has its own plot; estimates still spread
            page.locator(".sacwb-run").click()
            page.wait_for_function(
                "document.querySelector('.sacwb-status').innerText.startsWith('measured on')",
                timeout=300_000,
            )
            assert page.locator(".sacwb-history .sacwb-plot").count() == 2
            assert page.locator(".sacwb-history .sacwb-plot rect.sacwb-point").count() == 1
            assert _spread(page, 0) > 100  # pixels: not one vertical line
            page.locator(".sacwb-history").scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "explorer-after-run.png"))

            # 7. export: torchtitan's flags go to a .sh file; Copy says what it did
            page.locator(".sacwb-export-format").select_option("torchtitan")
            page.wait_for_function(
                "document.querySelector('.sacwb-export-path').value.endsWith('.sh')",
                timeout=60_000,
            )
            page.locator(".sacwb-save").click()
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText"
                ".includes('saved the torchtitan export')",
                timeout=60_000,
            )
            (saved,) = root.glob("llama3_debug_*_sac_torchtitan.sh")  # named for the graph
            mark, options = saved.read_text().split("\n", 1)  # the workbench's mark first
            assert "sac-workbench-mark:" in mark
            assert options.startswith("# torchtitan graph_trainer options")
            wrap = page.eval_on_selector(".sacwb-code", "c => getComputedStyle(c).whiteSpace")
            assert wrap == "pre"  # scrolls sideways, never breaks a line mid-word
            side = page.eval_on_selector(".sacwb-side", "s => s.getBoundingClientRect().width")
            assert side <= 345  # long code lines scroll inside the panel, never widen it
            page.locator(".sacwb-copy").click()
            page.wait_for_function(
                "document.querySelector('.sacwb-copy-note').innerText !== ''", timeout=10_000
            )
            page.locator(".sacwb-export").scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "explorer-export.png"))

            # 8. the eager baselines, asked once: three rows beside the estimate
            page.locator(".sacwb-baselines").click()
            page.wait_for_selector(".sacwb-baselines-table", timeout=300_000)
            cells = page.locator(".sacwb-baselines-table td:first-child").all_inner_texts()
            assert cells == ["no AC", "eager SAC", "eager full AC"]
            side = page.eval_on_selector(".sacwb-side", "s => s.getBoundingClientRect().width")
            assert side <= 345
            page.locator(".sacwb-metrics").scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "explorer-baselines.png"))
        finally:
            browser.close()


def _run_cells(page: Page, action: str, index: int) -> None:
    """A notebook command (`notebook:run-all-above`, `notebook:run-cell`) at cell `index`."""
    page.evaluate(
        "([command, index]) => { const nb = window.jupyterapp.shell.currentWidget;"
        " nb.content.activeCellIndex = index; window.jupyterapp.commands.execute(command); }",
        [action, index],
    )


def test_offload_host_row_then_a_per_rank_explorer_and_a_busy_suggest(
    two_explorers_lab: tuple[str, Path],
) -> None:
    """Flip an op to offload: the host row shows its bytes. Then a per-rank explorer of the
    same model opens from its own preset, leaving the first's autosave alone; its Suggest
    shows a busy state while it solves."""
    from playwright.sync_api import sync_playwright

    url, root = two_explorers_lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = open_notebook(browser, url, 1500, 1100)
            _run_cells(page, "notebook:run-all-above", 2)  # the main explorer only
            page.wait_for_selector(".sacwb-graph svg", timeout=180_000)
            main = page.locator(".sacwb").nth(0)
            host = main.locator(".sacwb-host-peak")
            assert host.inner_text().startswith("0 B")

            # 1. open layer 0, flip mm_4 twice: save -> recompute -> offload
            main.locator(f'g.cluster[id="{svg_id("g", "layers.0–3")}"] > text').first.click()
            page.wait_for_function(
                "document.querySelector('.sacwb-legend').innerText.includes('layer:0')",
                timeout=60_000,
            )
            for said in ("recomputed in every", "offloaded in every"):
                _find(page, main, "mm_4")
                main.locator(f'[id="{svg_id("n", "mm_4")}"]').click()
                page.wait_for_function(
                    f"document.querySelector('.sacwb-message').innerText.includes('{said}')",
                    timeout=60_000,
                )
            page.wait_for_function(
                "document.querySelector('.sacwb-host-peak').innerText.includes('offloaded')",
                timeout=60_000,
            )
            assert not host.inner_text().startswith("0 B")
            main.locator(".sacwb-metrics").scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "explorer-host-row.png"))
            first = [p for p in root.glob("*.policy.json")]
            assert len(first) == 1 and "offload" in first[0].read_text()
            saved = first[0].read_bytes()

            # 2. the per-rank explorer, opened after: its own preset, no file touched
            _run_cells(page, "notebook:run-cell", 2)
            page.wait_for_function(
                "document.querySelectorAll('.sacwb .sacwb-graph svg').length === 2",
                timeout=240_000,
            )
            rank = page.locator(".sacwb").nth(1)
            title = rank.locator(".sacwb-policy .sacwb-title").inner_text()
            assert title == "Policy: preset default, 0 selectors, 0 overrides"
            assert "restored" not in rank.locator(".sacwb-message").inner_text()
            assert first[0].read_bytes() == saved
            names = sorted(p.name for p in root.iterdir() if ".policy" in p.name)
            assert len(names) == 2 and all(n.endswith(".policy.json") for n in names), names
            assert not [n for n in names if "stale" in n or ".policy.2." in n]

            # 3. Suggest on the rank: busy while it solves, then the solver's rows
            rank.locator(".sacwb-suggest").scroll_into_view_if_needed()
            rank.locator(".sacwb-suggest-go").click()
            busy = page.wait_for_function(
                "() => { const s = document.querySelectorAll('.sacwb-status')[1];"
                " const b = document.querySelectorAll('.sacwb-suggest-go')[1];"
                " return s.classList.contains('sacwb-busy') && b.disabled && s.innerText; }",
                polling=20,
                timeout=60_000,
            )
            assert "Suggest: solving for a budget of" in busy.json_value()
            page.screenshot(path=str(SHOTS / "explorer-suggest-busy.png"))
            page.wait_for_function(
                "document.querySelectorAll('.sacwb-message')[1].innerText.includes('suggested by')",
                timeout=120_000,
            )
            assert not rank.locator(".sacwb-suggest-go").is_disabled()
            assert "sacwb-busy" not in (rank.locator(".sacwb-status").get_attribute("class") or "")
        finally:
            browser.close()


# --- pictures stay legible: Fit, Go to peak, labels apart (issue 27, items 5-8) --------------

LEGIBLE_PX = 9  # explorer.js' LEGIBLE_PX: the smallest label Fit and focus shrink to
LABEL_PX = (
    "() => { const svg = document.querySelector('.sacwb-graph svg');"
    " const k = svg.getScreenCTM().a; return Math.min(...[...svg.querySelectorAll('g.node text')]"
    ".map(t => Number(t.getAttribute('font-size')) * k)); }"
)
OVERLAPS = (
    "(sel) => { const r = [...document.querySelectorAll(sel)].map(t => t.getBoundingClientRect());"
    " let n = 0; for (let i = 0; i < r.length; i++) for (let j = i + 1; j < r.length; j++)"
    " if (r[i].left < r[j].right && r[j].left < r[i].right && r[i].top < r[j].bottom"
    " && r[j].top < r[i].bottom) n++; return n; }"
)


def test_fitted_views_and_go_to_peak_stay_legible(lab: tuple[str, Path]) -> None:
    """A fitted attention module keeps its labels legible; Go to peak shows the peak op
    whole, legible and not blown up; the timeline's and history plot's labels never overlap;
    the legend shows every shade the view can."""
    from playwright.sync_api import sync_playwright

    url, _ = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = open_notebook(browser, url, 1500, 1100)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_selector(".sacwb-graph svg", timeout=180_000)
            page.locator(".sacwb").scroll_into_view_if_needed()
            legend = page.locator(".sacwb-legend")

            # 1. the attention module (60 ops), fitted: labels at a legible size
            page.locator(f'[id="{svg_id("m", "layers.0–3.attention")}"]').click()
            page.wait_for_function(
                "document.querySelector('.sacwb-legend').innerText"
                ".includes('module:layers.0.attention')",
                timeout=60_000,
            )
            page.locator(".sacwb-fit").click()
            fitted = page.evaluate(LABEL_PX)
            print(f"fitted attention module: smallest label {fitted:.1f} px")
            assert fitted >= LEGIBLE_PX - 0.5
            page.screenshot(path=str(SHOTS / "explorer-attention-fitted.png"))
            # every shade the view can show, MUST_RECOMPUTE's vermillion among them
            assert page.locator(".sacwb-legend-row").count() >= 7
            assert "MUST_RECOMPUTE" in legend.inner_text() and "forced" in legend.inner_text()

            # 2. Go to peak: the peak op whole in the panel, legible, not zoomed past 1.5x
            page.locator("button.sacwb-peak").click()
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText.startsWith('peak ')",
                timeout=60_000,
            )
            page.wait_for_selector(".sacwb-graph g.sacwb-selected", timeout=30_000)
            page.wait_for_timeout(500)
            inside = page.evaluate(
                "() => { const g = document.querySelector('.sacwb-graph')"
                ".getBoundingClientRect(); const n = document.querySelector("
                "'.sacwb-graph g.sacwb-selected').getBoundingClientRect(); return n.width > 0"
                " && n.left >= g.left && n.right <= g.right && n.top >= g.top"
                " && n.bottom <= g.bottom; }"
            )
            peak = page.evaluate(LABEL_PX)
            print(f"Go to peak: smallest label {peak:.1f} px")
            page.screenshot(path=str(SHOTS / "explorer-go-to-peak.png"))
            assert inside and LEGIBLE_PX - 0.5 <= peak <= 1.5 * 10 + 0.5

            # 3. labels apart: the timeline's peak and selected marks (the same op now), and
            # the history plot's y title and its ticks
            assert page.locator(".sacwb-timeline-plot text").count() >= 2
            assert page.evaluate(OVERLAPS, ".sacwb-timeline-plot text") == 0
            assert (
                page.evaluate(
                    OVERLAPS,
                    ".sacwb-scatter text.sacwb-axis-label-y, .sacwb-scatter text.sacwb-tick-y",
                )
                == 0
            )
            ticks = page.locator(".sacwb-scatter text.sacwb-tick-y").all_text_contents()
            assert ticks and all(t.split()[-1] in ("B", "KiB", "MiB", "GiB") for t in ticks)
        finally:
            browser.close()


# A pipelined job: the stages side by side above the explorer of stage 0.
PIPELINE_EXPLORER = [
    "import os\n"
    'os.environ["SAC_WORKBENCH_AUTOSAVE_DIR"] = "."\n'
    "from workbench.capture.models import load_workload\n"
    "from workbench.capture.stages import Pipeline\n"
    "from workbench.show.widgets import PolicyExplorer",
    'job = load_workload("llama3-debug", layers=2, batch=4, seq=32, device="meta")\n'
    "pp = PolicyExplorer.pipeline(job, Pipeline(pp=2, microbatches=4), budget_bytes=2**25)\n"
    "pp",
]


def _rank_peak(text: str) -> str:
    """`rank peak 21.3 MiB` of a stage cell's text."""
    return text.split("rank peak ", 1)[1].split("B", 1)[0]


@pytest.fixture
def pipeline_lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The same, serving `PIPELINE_EXPLORER`."""
    yield from _served(tmp_path, PIPELINE_EXPLORER)


def test_a_click_on_a_stage_opens_it_and_a_flip_moves_its_peak(
    pipeline_lab: tuple[str, Path],
) -> None:
    """The strip shows one cell per stage; clicking stage 1 opens its graph (its cell
    outlined), and a flip there changes stage 1's policy and rank peak in the strip."""
    from playwright.sync_api import sync_playwright

    url, _ = pipeline_lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = open_notebook(browser, url, 1500, 1100)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_selector(".sacwb-stages svg", timeout=180_000)
            strip = page.locator(".sacwb-stages")
            assert strip.locator("g.stage-cell").count() == 2
            assert "stage 0 · rank 0 · open" in (strip.text_content() or "")
            cell = strip.locator('g.stage-cell[data-stage="1"]')
            before = _rank_peak(cell.text_content() or "")
            cell.click()
            page.wait_for_function(
                "document.querySelector('.sacwb-stages').textContent"
                ".includes('stage 1 · rank 1 · open')",
                timeout=60_000,
            )
            assert "stage 1 open" in page.locator(".sacwb-message").inner_text()
            # layers.1.feed_forward.w1: recomputing it lowers rank 1's peak by 96 KiB
            _find(page, page.locator(".sacwb"), "mm_4")
            page.locator(f'[id="{svg_id("n", "mm_4")}"]').click()
            page.wait_for_function(
                "document.querySelector('.sacwb-stages').textContent"
                ".includes('policy default + 1 edits')",
                timeout=60_000,
            )
            after = page.locator('.sacwb-stages g.stage-cell[data-stage="1"]').text_content()
            assert _rank_peak(after or "") != before
            page.screenshot(path=str(SHOTS / "explorer-stages.png"))
        finally:
            browser.close()


# --- a pipelined job as a new user drives it (issue 35) ---------------------------------------

# The job of issue 35's report: Llama3-8B, 4096 tokens, batch 8, 1F1B over two stages, 80 GiB.
PIPELINE_8B = [
    "import os\n"
    'os.environ["SAC_WORKBENCH_AUTOSAVE_DIR"] = "."\n'
    "from workbench.capture.models import load_workload\n"
    "from workbench.capture.stages import Pipeline\n"
    "from workbench.show.widgets import PolicyExplorer",
    'job = load_workload("llama3-8b", seq=4096, batch=8, device="meta")\n'
    'pp = PolicyExplorer.pipeline(job, Pipeline(pp=2, schedule="1F1B", microbatches=8),\n'
    "                             budget_bytes=80 * 2**30)\n"
    "pp",
]

IN_VIEW = (
    "() => { const g = document.querySelector('.sacwb-graph').getBoundingClientRect();"
    " const n = document.querySelector('.sacwb-graph g.sacwb-selected');"
    " if (!n) return false; const r = n.getBoundingClientRect(); return r.width > 0"
    " && r.left >= g.left - 1 && r.right <= g.right + 1 && r.top >= g.top - 1"
    " && r.bottom <= g.bottom + 1; }"
)


def _gib(text: str) -> float:
    """`75.3 GiB` -> 75.3."""
    number, unit = text.split()
    assert unit == "GiB", text
    return float(number)


@pytest.fixture
def pipeline_8b_lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The same, serving `PIPELINE_8B`."""
    yield from _served(tmp_path, PIPELINE_8B)


def test_a_pipelined_job_finds_ops_in_every_stage_and_suggests_per_gpu(
    pipeline_8b_lab: tuple[str, Path],
) -> None:
    """Switch stages, Find, Go to peak: the op is in the panel after each, whatever the stage
    (each stage's session once numbered its focus requests from 0, and the front end dropped
    the ones it had seen). Suggest under a per-GPU budget: every rank's pipelined peak in
    the strip within it. And the page as a new user meets it: Run disabled on fake tensors
    saying why, the tool bar one row, the side panels as tall as the picture's column."""
    from playwright.sync_api import sync_playwright

    url, _ = pipeline_8b_lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = open_notebook(browser, url, 1500, 1100)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_selector(".sacwb-stages svg", timeout=300_000)
            page.locator(".sacwb").scroll_into_view_if_needed()
            message = page.locator(".sacwb-message")
            run = page.locator(".sacwb-run")
            assert run.is_disabled() and "fake tensors" in (run.get_attribute("title") or "")
            bar = page.eval_on_selector(".sacwb-toolbar", "t => t.getBoundingClientRect().height")
            assert bar < 40, bar  # one row
            heights = page.evaluate(
                "() => ['.sacwb-side', '.sacwb-left'].map(s =>"
                " document.querySelector(s).getBoundingClientRect().height)"
            )
            assert heights[0] <= heights[1] + 1, heights

            # 1. stage 1, then stage 0 (the order of the report): Find lands in each, then
            # Go to peak in stage 0 and back in stage 1 (each stage's session once counted
            # its requests from 0: the second stage's first ones were dropped as seen)
            def open_stage(stage: int) -> None:
                page.locator(f'.sacwb-stages g.stage-cell[data-stage="{stage}"]').click()
                page.wait_for_function(
                    "(s) => document.querySelector('.sacwb-stages').textContent"
                    ".includes(`stage ${s} · rank ${s} · open`)",
                    arg=stage,
                    timeout=120_000,
                )

            def in_view(what: str) -> None:
                page.wait_for_timeout(700)
                page.screenshot(path=str(SHOTS / f"explorer-{what.replace(' ', '-')}.png"))
                assert page.evaluate(IN_VIEW), f"{what}: the op is out of view"

            for stage, first_layer in ((1, 16), (0, 0)):
                open_stage(stage)
                page.locator(".sacwb-search").fill("wo")
                page.locator(".sacwb-search").press("Enter")
                page.wait_for_function(
                    "(m) => document.querySelector('.sacwb-message').innerText.includes(m)",
                    arg=f"layers.{first_layer}.attention.wo): match 1 of",
                    timeout=60_000,
                )
                in_view(f"stage {stage} find")
            for stage in (0, 1):
                if stage == 1:
                    open_stage(1)
                page.locator("button.sacwb-peak").click()
                page.wait_for_function(
                    "document.querySelector('.sacwb-message').innerText.startsWith('peak ')",
                    timeout=60_000,
                )
                in_view(f"stage {stage} peak")
            rows = page.locator(".sacwb-legend-row").all_inner_texts()
            assert any("dashed outline" in r for r in rows), rows

            # 2. Suggest for a per-GPU budget: the slider's stops are per GPU
            note = page.locator(".sacwb-budget-note").inner_text()
            assert note.startswith("per GPU"), note
            page.eval_on_selector(
                ".sacwb-budget",
                "b => { b.value = Math.round(0.2 * Number(b.max));"
                " b.dispatchEvent(new Event('input')); }",
            )
            budget = _gib(page.locator(".sacwb-budget-text").inner_text())
            page.locator(".sacwb-suggest-go").click()
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText.includes('per GPU over')",
                timeout=180_000,
            )
            said = message.inner_text()
            assert said.startswith("one policy per stage within"), said
            cells = page.locator(".sacwb-stages g.stage-cell").all_text_contents()
            peaks = [_gib(_rank_peak(cell) + "B") for cell in cells]
            assert len(peaks) == 2 and max(peaks) <= budget, (peaks, budget)
            strip = page.locator(".sacwb-stages").text_content() or ""
            assert "1 microbatches" not in strip and " ms on " not in strip
            page.locator(".sacwb-history").scroll_into_view_if_needed()
            assert page.locator(".sacwb-history-key .sacwb-key-row").count() == 4
            plot = page.locator(".sacwb-history .sacwb-subtitle").first.inner_text()
            assert plot.startswith("per GPU over the schedule"), plot
            page.screenshot(path=str(SHOTS / "explorer-stages-suggest.png"))
        finally:
            browser.close()


# Two explorers on one model, two graphs (two sequence lengths): each saves every export.
TWO_GRAPHS = [
    "import os\n"
    'os.environ["SAC_WORKBENCH_AUTOSAVE_DIR"] = "."\n'
    "from workbench.capture.models import load_workload\n"
    "from workbench.show.widgets import PolicyExplorer",
    'short = PolicyExplorer(load_workload("llama3-debug", layers=2, seq=32, device="meta"))\nshort',
    'long = PolicyExplorer(load_workload("llama3-debug", layers=2, seq=64, device="meta"))\nlong',
]


@pytest.fixture
def two_graphs_lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The same, serving `TWO_GRAPHS`."""
    yield from _served(tmp_path, TWO_GRAPHS)


def test_two_graphs_of_one_model_save_every_export(two_graphs_lab: tuple[str, Path]) -> None:
    """A second explorer on the same model but another graph proposed the first one's four
    file names, and every Save was refused: each graph's names are its own now, safe on
    every OS and importable."""
    from playwright.sync_api import sync_playwright

    url, root = two_graphs_lab
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = open_notebook(browser, url, 1500, 1100)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(
                "document.querySelectorAll('.sacwb .sacwb-graph svg').length === 2",
                timeout=240_000,
            )
            for index in (0, 1):
                widget = page.locator(".sacwb").nth(index)
                widget.locator(".sacwb-export").scroll_into_view_if_needed()
                for fmt in ("graph_pass", "torchtitan", "json", "policy_fn"):  # another first
                    widget.locator(".sacwb-export-format").select_option(fmt)
                    page.wait_for_function(
                        "([i, f]) => document.querySelectorAll('.sacwb-message')[i]"
                        ".innerText.startsWith(`export format ${f}`)",
                        arg=[index, fmt],
                        timeout=60_000,
                    )
                    widget.locator(".sacwb-save").click()
                    page.wait_for_function(
                        "([i, f]) => document.querySelectorAll('.sacwb-message')[i]"
                        ".innerText.startsWith(`saved the ${f} export`)",
                        arg=[index, fmt],
                        timeout=60_000,
                    )
            names = sorted(p.name for p in root.iterdir() if "_sac_" in p.name)
            assert len(names) == 8, names
            assert all(":" not in n and "-" not in n for n in names), names
            assert all(n.split(".")[0].isidentifier() for n in names if n.endswith(".py")), names
        finally:
            browser.close()


# --- one set of listeners per live view (issue 34, item 5) -----------------------------------

# One explorer displayed in ten cells: ten views of one widget.
REDISPLAYED = [
    "import os\n"
    'os.environ["SAC_WORKBENCH_AUTOSAVE_DIR"] = "."\n'
    "from IPython.display import display\n"
    "from workbench.capture.models import load_workload\n"
    "from workbench.show.widgets import PolicyExplorer\n"
    'explorer = PolicyExplorer(load_workload("llama3-debug", layers=2, seq=32), "default")',
    *["display(explorer)"] * 10,
]

# Counts, kept by the page itself, of the window and document listeners and the resize
# observers that the explorer's module adds (code loaded from a blob: URL, as anywidget loads
# a widget's ES module), each forgotten when it is removed or its AbortSignal aborts.
COUNT_PAGE_LISTENERS = """(() => {
  const counts = { window: 0, document: 0, observers: 0 };
  window.__pageListeners = counts;
  const fromWidget = () => {
    const limit = Error.stackTraceLimit;
    Error.stackTraceLimit = 50;
    const stack = new Error().stack || "";
    Error.stackTraceLimit = limit;
    return stack.includes("blob:");
  };
  const added = [];
  const add = EventTarget.prototype.addEventListener;
  const remove = EventTarget.prototype.removeEventListener;
  const captures = (options) => (typeof options === "boolean" ? options : !!options?.capture);
  EventTarget.prototype.addEventListener = function (type, listener, options) {
    const kind = this === window ? "window" : this === document ? "document" : "";
    if (kind && listener && fromWidget()) {
      const entry = { target: this, type, listener, capture: captures(options), kind, live: true };
      const forget = () => {
        if (entry.live) { entry.live = false; counts[kind] -= 1; }
      };
      entry.forget = forget;
      added.push(entry);
      counts[kind] += 1;
      options?.signal?.addEventListener("abort", forget, { once: true });
    }
    return add.call(this, type, listener, options);
  };
  EventTarget.prototype.removeEventListener = function (type, listener, options) {
    for (const e of added) {
      if (e.live && e.target === this && e.type === type && e.listener === listener
          && e.capture === captures(options)) e.forget();
    }
    return remove.call(this, type, listener, options);
  };
  const Observer = window.ResizeObserver;
  window.ResizeObserver = class extends Observer {
    constructor(callback) { super(callback); this.ours = fromWidget(); this.watching = false; }
    observe(target, options) {
      if (this.ours && !this.watching) { this.watching = true; counts.observers += 1; }
      return super.observe(target, options);
    }
    disconnect() {
      if (this.watching) { this.watching = false; counts.observers -= 1; }
      return super.disconnect();
    }
  };
})();"""

LISTENERS = (
    "() => ({ module: { ...window.__sacwbListeners }, page: { ...window.__pageListeners } })"
)


@pytest.fixture
def redisplayed_lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The same, serving `REDISPLAYED`."""
    yield from _served(tmp_path, REDISPLAYED)


def _settle(page: Page, views: int) -> dict[str, dict[str, int]]:
    """The listener counts once `views` explorer views are drawn, the kernel is idle and the
    views removed have run their cleanup (a count that stays too high fails the test with
    the counts, after a few seconds)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.wait_for_function(
        "(n) => document.querySelectorAll('.sacwb .sacwb-graph svg').length === n"
        " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
        " === 'idle'",
        arg=views,
        timeout=180_000,
    )
    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function(
            "(n) => window.__sacwbListeners?.views === n", arg=views, timeout=10_000
        )
    page.wait_for_timeout(500)
    counts: dict[str, dict[str, int]] = page.evaluate(LISTENERS)
    assert counts["module"]["views"] == views, counts
    return counts


def test_each_live_view_holds_one_set_of_listeners(redisplayed_lab: tuple[str, Path]) -> None:
    """The explorer displayed in ten cells holds ten sets of listeners (window, resize
    observer, model handlers); re-running cells swaps views without adding any, and clearing
    outputs removes every listener of the views that went."""
    from playwright.sync_api import sync_playwright

    url, _ = redisplayed_lab
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = open_notebook(browser, url, 1500, 1100, COUNT_PAGE_LISTENERS)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            ten = _settle(page, 10)
            print("ten views:", ten)
            module, seen = ten["module"], ten["page"]
            per_view = module["model"] // 10
            assert per_view > 20 and module["model"] == 10 * per_view  # one handler a traitlet
            assert module["window"] == module["observers"] == 10 and module["document"] == 0
            assert seen == {"window": 10, "document": 0, "observers": 10}

            # a request from one view (anywidget's invoke) reaches Python and comes back
            first = page.locator(".sacwb").nth(0)
            first.locator(".sacwb-search").fill("mm_4")
            first.locator(".sacwb-search").press("Enter")
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText.startsWith('mm_4 (')",
                timeout=60_000,
            )
            assert page.evaluate(LISTENERS) == ten  # no view added a listener to search

            # re-running five cells: five views removed, five new ones
            for cell in range(1, 6):
                _run_cells(page, "notebook:run-cell", cell)
            assert _settle(page, 10) == ten

            # clearing every output: no view left, no listener left
            page.evaluate("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
            none = _settle(page, 0)
            assert none["page"] == {"window": 0, "document": 0, "observers": 0}, none
            assert set(none["module"].values()) == {0}, none

            # one cell again: one set
            _run_cells(page, "notebook:run-cell", 3)
            one = _settle(page, 1)
            assert one["page"] == {"window": 1, "document": 0, "observers": 1}, one
            assert one["module"] == {**module, **{k: v // 10 for k, v in module.items()}}, one
        finally:
            browser.close()
