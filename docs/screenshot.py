"""Make docs/explorer.png: the policy explorer in a real JupyterLab, in headless Chromium.

Run by hand from the repository root (not part of the test suite):
`.venv/bin/python docs/screenshot.py [--out docs/explorer.png]`. Needs what the browser test
needs (Debian's `/usr/bin/chromium`, the playwright package; no browser download) and
follows its recipe (`tests/test_browser.py`): a JupyterLab server of its own on 127.0.0.1,
a notebook with the explorer (llama3-debug, 4 layers, 128 tokens, preset `default`), Run All,
open the folded layers, flip an op and find it, and a picture of the widget alone. Everything
it starts is stopped; its files go to a temporary folder.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
CELLS = [
    "from workbench.capture.models import load_workload\n"
    "from workbench.show.widgets import PolicyExplorer",
    'explorer = PolicyExplorer(load_workload("llama3-debug", layers=4, seq=128), "default",\n'
    '                          autosave="explorer.policy.json")\n'
    "explorer",
]
MAX_BYTES = 400_000  # keep the picture small enough for a README


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_notebook(path: Path) -> None:
    cells = [
        {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
        for src in CELLS
    ]
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook = {"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4,
                "nbformat_minor": 5}  # fmt: skip
    path.write_text(json.dumps(notebook))


def _start_lab(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A JupyterLab server serving the notebook; the server and the notebook's URL."""
    settings = tmp / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    root = tmp / "root"
    root.mkdir()
    _write_notebook(root / "explorer.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
    }
    lab_bin = Path(sys.executable).with_name("jupyter-lab")
    server = subprocess.Popen(
        [str(lab_bin), "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", "--allow-root"],
        env=env, stdout=(tmp / "lab.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            return server, f"{base}/lab/tree/explorer.ipynb?token={token}"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit(f"JupyterLab did not start; see {tmp / 'lab.log'}") from None
            time.sleep(0.5)


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


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
            page = browser.new_page(viewport={"width": 1400, "height": 2000})
            page.goto(url)
            page.wait_for_function(
                "window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel"
                "?.status === 'idle'", timeout=120_000,
            )  # fmt: skip
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
        server, url = _start_lab(Path(tmp))
        try:
            png = _shrink(capture(url))
        finally:
            _stop(server)
    Path(args.out).write_bytes(png)
    print(f"wrote {args.out} ({len(png):,} bytes)")


if __name__ == "__main__":
    main()
