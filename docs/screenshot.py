"""Make docs/explorer.png: the policy explorer in a real JupyterLab, in headless Chromium.

Run by hand from the repository root (not part of the test suite):
`.venv/bin/python docs/screenshot.py [--out docs/explorer.png]`. Needs what the browser test
needs (Debian's `/usr/bin/chromium`, the playwright package; no browser download) and
runs its JupyterLab (`tests/jupyter_lab.py`): a JupyterLab server of its own on 127.0.0.1,
a notebook with the explorer (llama3-debug, 4 layers, 128 tokens, preset `default`), Run All,
open the folded layers, flip an op and find it, and a picture of the widget alone. Everything
it starts is stopped; its files go to a temporary folder.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the browser test's JupyterLab recipe

from jupyter_lab import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_FLAGS,
    LabDidNotStart,
    explorer_lab,
    open_notebook,
)

MAX_BYTES = 400_000  # keep the picture small enough for a README


def _shrink(png: bytes) -> bytes:
    """The PNG as is when small enough, else quantized to 256 colours (the widget's flat
    colours survive it)."""
    if len(png) <= MAX_BYTES:
        return png
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(256)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def capture(url: str) -> bytes:
    """Run the notebook, open layer 0 of the folded layers, recompute the feed-forward's
    first matmul in every layer, find it (selected, the picture centred on it), and return
    a PNG of the explorer down to its history plot (the export panel below is left out)."""
    from playwright.sync_api import sync_playwright

    from workbench.show.viz import svg_id

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = open_notebook(browser, url, 1400, 2000)
            page.evaluate("window.jupyterapp.commands.execute('application:toggle-left-area')")
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_selector(".sacwb-graph svg", timeout=180_000)
            frame = page.locator(f'g.cluster[id="{svg_id("g", "layers.0–3")}"] > text').first
            frame.click()
            page.wait_for_function(
                "document.querySelector('.sacwb-legend').innerText.includes('layer:0')",
                timeout=60_000,
            )
            page.locator(f'[id="{svg_id("n", "mm_4")}"]').click()  # recompute w1's matmul
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText"
                ".includes('recomputed in every identical layer')", timeout=60_000,
            )  # fmt: skip
            page.locator(".sacwb-search").fill("mm_4")  # select it and centre the picture on it
            page.locator(".sacwb-search").press("Enter")
            page.wait_for_function(
                "document.querySelector('.sacwb-message').innerText.includes('match 1 of')",
                timeout=60_000,
            )
            page.locator(".sacwb").scroll_into_view_if_needed()
            page.wait_for_timeout(500)  # let the picture settle after fitting itself
            top = page.locator(".sacwb").bounding_box()
            bottom = page.locator(".sacwb-history").bounding_box()
            assert top is not None and bottom is not None
            clip = {"x": top["x"], "y": top["y"], "width": top["width"],
                    "height": bottom["y"] + bottom["height"] - top["y"]}  # fmt: skip
            return page.screenshot(clip=clip, full_page=True)
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "explorer.png"))
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"{CHROMIUM} is missing: sudo apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="sac-screenshot-") as tmp:
        try:
            with explorer_lab(Path(tmp)) as (url, _):
                png = _shrink(capture(url))
        except LabDidNotStart as err:
            raise SystemExit(str(err)) from None
    Path(args.out).write_bytes(png)
    print(f"wrote {args.out} ({len(png):,} bytes)")


if __name__ == "__main__":
    main()
