"""Screenshots of the notebooks as JupyterLab shows them: do tables and figures read well?

    .venv/bin/python scripts/render_notebooks.py [NOTEBOOK ...]     (or: make render)

Starts JupyterLab from this environment on 127.0.0.1 (a free port, a fresh token, its own
settings and workspace folders, with windowing off so that every cell is drawn), opens each
notebook (default: all of notebooks/*.ipynb) in headless Chromium, saves
``results/render/<notebook>.png`` (results/ is git-ignored), and stops the server it started.
JupyterLab shows the stored outputs; nothing is executed.

Needs Chromium: on Debian or Ubuntu ``apt-get update && apt-get install -y chromium``; another
binary can be named with ``CHROMIUM=/path/to/chrome``. Not part of CI.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "render"
WIDTH = 1400  # px; JupyterLab wraps printed lines wider than its cell area
HEIGHT = int(os.environ.get("RENDER_HEIGHT", 16000))  # px; the notebook panel is as tall as the
# window, so a tall window shows more of it (RENDER_HEIGHT=24000 for a longer notebook)
SETTLE_S = 25  # seconds Chromium lets JupyterLab run before the screenshot


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    sys.exit("no Chromium found: apt-get update && apt-get install -y chromium (or set CHROMIUM)")


def lab_settings(folder: Path) -> None:
    """User settings for the server: draw every cell (no windowing), no news pop-up."""
    tracker = folder / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    news = folder / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


def wait_until_up(url: str, server: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"JupyterLab exited with code {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    sys.exit(f"JupyterLab did not answer {url} within {timeout_s:.0f} s")


def screenshot(browser: str, url: str, path: Path, profile: Path) -> None:
    cmd = [
        browser,
        "--headless=new",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={WIDTH},{HEIGHT}",
        f"--virtual-time-budget={SETTLE_S * 1000}",
        f"--screenshot={path}",
        url,
    ]
    if os.geteuid() == 0:
        cmd.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    subprocess.run(cmd, check=True, capture_output=True, timeout=SETTLE_S + 120)


def cut_off(path: Path) -> bool:
    """True when the notebook seems to run past the bottom of the screenshot: the last rows
    above JupyterLab's status bar are not blank (needs Pillow, which matplotlib brings)."""
    try:
        from PIL import Image
    except ImportError:
        return False
    with Image.open(path) as im:
        gray = im.convert("L")
        width, height = gray.size
        band = gray.crop(
            (width // 4, height - 240, width - 60, height - 40)
        )  # above the status bar
        return band.getextrema()[0] < 200  # anything darker than a pale grey is content


def main(argv: list[str]) -> int:
    notebooks = [Path(a).resolve() for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    browser = chromium()
    OUT.mkdir(parents=True, exist_ok=True)
    port, token = free_port(), secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="render-notebooks-") as tmp:
        tmp = Path(tmp)
        lab_settings(tmp / "settings")
        env = {
            **os.environ,
            "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
        }
        cmd = [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={ROOT}",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")  # JupyterLab refuses to start as root without it
        log = (tmp / "lab.log").open("w")
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"JupyterLab (pid {server.pid}) on http://127.0.0.1:{port}")
        try:
            wait_until_up(f"http://127.0.0.1:{port}/api/status?token={token}", server)
            for nb in notebooks:
                rel = nb.relative_to(ROOT).as_posix()
                url = f"http://127.0.0.1:{port}/lab/tree/{rel}?reset&token={token}"
                path = OUT / f"{nb.stem}.png"
                screenshot(browser, url, path, tmp / "chromium")
                print(f"wrote {path.relative_to(ROOT)}")
                if cut_off(path):
                    print(f"  {nb.name} may run past {HEIGHT} px: set RENDER_HEIGHT higher")
        finally:
            server.terminate()  # the server this script started, and only it
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            log.close()
            print(f"stopped JupyterLab (pid {server.pid})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
