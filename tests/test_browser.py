"""The explorer in a real JupyterLab in headless Chromium: open, run, click, see it change.

Needs Debian's chromium (`/usr/bin/chromium`) and the playwright package (no browser
download). Screenshots go to `out/browser/`. Every server started here is stopped.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from workbench.viz import svg_id

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
SHOTS = Path(__file__).resolve().parents[1] / "out" / "browser"

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK_CELLS = [
    "from workbench.models import load_workload\nfrom workbench.widgets import PolicyExplorer",
    'explorer = PolicyExplorer(load_workload("llama3-debug", layers=2, seq=256), "default",\n'
    '                          autosave="explorer.policy.json")\n'
    "explorer",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _notebook(path: Path) -> None:
    cells = [
        {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
        for src in NOTEBOOK_CELLS
    ]
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.write_text(json.dumps(
        {"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4, "nbformat_minor": 5}
    ))  # fmt: skip


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[str]:
    """A JupyterLab server on 127.0.0.1 serving a notebook with the explorer; its URL."""
    if not Path(CHROMIUM).exists():
        pytest.skip(
            "Debian's chromium is not installed: `make test` installs it when run as root "
            "(or: sudo apt-get install -y chromium)"
        )
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (no download)")
    lab_bin = Path(sys.executable).with_name("jupyter-lab")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    root = tmp_path / "root"
    root.mkdir()
    _notebook(root / "explorer.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
    }
    server = subprocess.Popen(
        [str(lab_bin), "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", "--allow-root"],
        env=env, stdout=(tmp_path / "lab.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start on 127.0.0.1 within 60 s")
                time.sleep(0.5)
        yield f"{base}/lab/tree/explorer.ipynb?token={token}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_click_flips_a_decision_and_the_peak_moves(lab: str) -> None:
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:  # launch() gives chromium a fresh, temporary profile
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(lab)
            page.wait_for_function(
                "window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel"
                "?.status === 'idle'", timeout=120_000,
            )  # fmt: skip
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            try:
                page.wait_for_selector(".sacwb-graph svg", timeout=120_000)
            except Exception:
                page.screenshot(path=str(SHOTS / "explorer-failed-to-render.png"))
                raise
            peak = page.locator(".sacwb-peak")
            before = peak.inner_text()
            page.screenshot(path=str(SHOTS / "explorer-overview.png"))

            # the overview folds identical layers: the box is `layers.0–1.feed_forward`
            box = (
                f'g.node[id^="{svg_id("m", "layers.0")}"][id$="{svg_id("", ".feed_forward")[1:]}"]'
            )
            page.locator(box).first.click()
            op = page.locator(f'[id="{svg_id("n", "mm_4")}"]')
            op.wait_for(timeout=60_000)
            op.click()
            page.wait_for_function(
                "([before]) => document.querySelector('.sacwb-peak').innerText !== before",
                arg=[before], timeout=60_000,
            )  # fmt: skip
            details = page.locator(".sacwb-details").inner_text()
            page.screenshot(path=str(SHOTS / "explorer-after-flip.png"))
            assert "MUST_RECOMPUTE" in details and "mm_4" in details
            assert peak.inner_text() != before
            message = page.locator(".sacwb-message").inner_text()
            assert "recomputed in every identical layer" in message
        finally:
            browser.close()
