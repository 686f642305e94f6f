"""A JupyterLab server of its own serving a notebook with the explorer, for the browser test
and `docs/screenshot.py`: one recipe (settings without the news popup, a free port, a
token, the repository's code on the kernel's path), started and always stopped.

Entry point: `explorer_lab(folder) -> (notebook URL, served folder)`, a context manager.
"""

from __future__ import annotations

import contextlib
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Four layers fold into one `layers.0–3 ×4` frame; 128 tokens leave room for Suggest.
EXPLORER_CELLS = [
    "from workbench.capture.models import load_workload\n"
    "from workbench.show.widgets import PolicyExplorer",
    'explorer = PolicyExplorer(load_workload("llama3-debug", layers=4, seq=128), "default",\n'
    '                          autosave="explorer.policy.json")\n'
    "explorer",
]
START_SECONDS = 60


def open_notebook(
    browser: Any, url: str, width: int, height: int, init_script: str | None = None
) -> Any:
    """A new page of `browser` (playwright's) at `url`, `width` x `height` pixels, once the
    notebook's kernel is idle: the point where a test or a screenshot starts clicking.
    `init_script` runs in the page before any of its own scripts."""
    page = browser.new_page(viewport={"width": width, "height": height})
    if init_script:
        page.add_init_script(init_script)
    page.goto(url)
    page.wait_for_function(
        "window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel"
        "?.status === 'idle'",
        timeout=120_000,
    )
    return page


class LabDidNotStart(RuntimeError):
    """The server exited or did not answer within `START_SECONDS`; the log is named."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_notebook(path: Path, sources: list[str]) -> None:
    cells = [
        {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
        for src in sources
    ]
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.write_text(
        json.dumps(
            {"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4, "nbformat_minor": 5}
        )
    )


@contextlib.contextmanager
def explorer_lab(folder: Path, cells: list[str] | None = None) -> Iterator[tuple[str, Path]]:
    """Serve `folder/root/explorer.ipynb` (written here, of `cells`: `EXPLORER_CELLS` by
    default) on 127.0.0.1; yield its URL and the folder it serves (the kernel's working
    folder); stop the server on the way out."""
    settings = folder / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    root = folder / "root"
    root.mkdir()
    _write_notebook(root / "explorer.ipynb", cells or EXPLORER_CELLS)
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "JUPYTERLAB_SETTINGS_DIR": str(folder / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(folder / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(folder / "runtime"),
    }
    lab_bin = Path(sys.executable).with_name("jupyter-lab")
    log = folder / "lab.log"
    server = subprocess.Popen(
        [
            str(lab_bin),
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--allow-root",
        ],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise LabDidNotStart(
                        f"JupyterLab did not start on 127.0.0.1 within {START_SECONDS} s; see {log}"
                    ) from None
                time.sleep(0.5)
        yield f"{base}/lab/tree/explorer.ipynb?token={token}", root
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
