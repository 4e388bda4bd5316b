"""Screenshots of TensorBoard for docs/monitoring.md, from real ``lcv fit --recipe digits-small`` runs.

    python docs/make_screenshots.py                  # two fits (learning rates 0.2 and 0.05), then shots
    python docs/make_screenshots.py --runs DIR        # shots of logs that exist (DIR holds digits-small/...)

Needs a headless Chromium (Debian: ``apt-get install chromium``) and TensorBoard; no network. It trains in a
temporary folder (``make run``'s recipe, offline data), serves the logs with TensorBoard on 127.0.0.1, and
writes small PNGs into docs/images/: the first screen (Time Series), the Custom Scalars tab, the compile card
(Text tab) and the HParams table. Not part of ``make test``: it takes minutes and needs a browser.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
LEARNING_RATES = ("0.2", "0.05")
#: image name -> (TensorBoard's page: its dashboards are chosen by the URL fragment, window width and height).
#: ``fastChart=false``: the Time Series charts drawn as SVG (headless Chromium draws no WebGL lines).
SHOTS = {
    "tensorboard_first_screen.png": ("?fastChart=false#timeseries", (1400, 1000)),
    "tensorboard_custom_scalars.png": ("#custom_scalars", (1400, 1000)),
    "tensorboard_compile_card.png": ("#text", (1400, 1500)),
    "tensorboard_hparams.png": ("#hparams", (2200, 600)),
}
COLOURS = 64  # a palette this small keeps a dashboard PNG near 100 KB


def train(runs: Path) -> None:
    """``lcv fit --recipe digits-small`` once per learning rate, as ``make run`` does, logging under ``runs``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "kernels", "vision"))}
    for lr in LEARNING_RATES:
        command = [
            sys.executable,
            "-m",
            "lcv_vision.cli",
            "fit",
            "--recipe",
            "digits-small",
            "--model.lr",
            lr,
        ]
        subprocess.run(command, cwd=runs.parent, env=env, check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(logdir: Path, port: int) -> subprocess.Popen[bytes]:
    """TensorBoard on 127.0.0.1, once it answers."""
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--load_fast", "false"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as response:
                if response.read().strip() not in (b"", b"[]"):
                    return server
        except OSError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError(f"TensorBoard did not serve {logdir} on port {port} within 90 s")


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("no headless Chromium found: install it (Debian: apt-get install chromium) and rerun")


def shoot(chrome: str, url: str, window: tuple[int, int], out: Path) -> None:
    """One page, rendered headless (the virtual time budget lets TensorBoard's scripts load the data)."""
    width, height = window
    command = [
        chrome,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        "--virtual-time-budget=20000",
        f"--screenshot={out}",
        url,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=180)
    Image.open(out).convert("RGB").quantize(COLOURS).save(out, optimize=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, help="existing logs (skip training)")
    args = parser.parse_args(argv)
    chrome = browser()
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs
        if runs is None:
            runs = Path(tmp) / "runs"
            runs.mkdir()
            train(runs)
        port = free_port()
        server = serve(runs, port)
        try:
            IMAGES.mkdir(parents=True, exist_ok=True)
            for name, (page, window) in SHOTS.items():
                shoot(chrome, f"http://127.0.0.1:{port}/{page}", window, IMAGES / name)
                print(f"wrote {IMAGES / name} ({(IMAGES / name).stat().st_size // 1024} KB)")
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
