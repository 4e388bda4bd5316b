"""Screenshots of TensorBoard for docs/monitoring.md, from real ``lcv fit --recipe digits-small`` runs.

    python docs/make_screenshots.py                  # two fits (learning rates 0.2 and 0.05), then shots
    python docs/make_screenshots.py --runs DIR        # the same, the logs kept in DIR; shots only if DIR has them

Needs a headless Chromium (Debian: ``apt-get install chromium``) and TensorBoard; no network. It trains in a
temporary folder (``make run``'s recipe, offline data), serves the logs with TensorBoard on 127.0.0.1, and
writes small PNGs into docs/images/: the first screen (Time Series), the Custom Scalars tab, the compile card
(Text tab) and the HParams table. Not part of ``make test``: it takes minutes and needs a browser.
"""

from __future__ import annotations

import argparse
import base64
import json
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
    "tensorboard_hparams.png": ("#hparams", (2600, 500)),
}
COLOURS = 64  # a palette this small keeps a dashboard PNG near 100 KB
#: Where TensorBoard keeps its settings in the browser (its Settings pane's open state among them).
SETTINGS_KEY = "_tb_global_settings"


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


class Chromium:
    """A headless Chromium driven over its DevTools pipe (``--remote-debugging-pipe``: JSON messages ended by a
    NUL byte on file descriptors 3 and 4), so that no client library is needed. The pipe lets the script do
    what a reader does first: close TensorBoard's Settings pane (a setting TensorBoard keeps in the page's
    local storage), then wait for the data and photograph the page."""

    def __init__(self, chrome: str, profile: Path) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        command = [
            chrome,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "about:blank",
        ]

        def child_fds() -> None:
            # The pipe's ends onto 3 and 4, where Chromium looks for them. Copies first (the lowest free
            # numbers, read end first), so that moving one cannot overwrite the other.
            read_end, write_end = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        # close_fds=False: the copies on 3 and 4 must survive into Chromium (the script's own descriptors
        # are not inheritable, so nothing else leaks)
        self._process = subprocess.Popen(
            command,
            close_fds=False,
            preexec_fn=child_fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._id = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: bool = False, **params: object) -> dict:
        """Send one command and return its result (events that arrive meanwhile are dropped)."""
        self._id += 1
        message: dict[str, object] = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed its DevTools pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def open(self, url: str, window: tuple[int, int], settle_s: float) -> None:
        width, height = window
        self.call(
            "Emulation.setDeviceMetricsOverride",
            True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.navigate", True, url=url)
        time.sleep(settle_s)  # TensorBoard fetches its data after the page has loaded

    def local_storage(self, key: str, value: object) -> None:
        self.call(
            "Runtime.evaluate",
            True,
            expression=f"localStorage.setItem({json.dumps(key)}, {json.dumps(json.dumps(value))})",
        )

    def screenshot(self, out: Path) -> None:
        data = self.call("Page.captureScreenshot", True, format="png")["data"]
        out.write_bytes(base64.b64decode(data))
        Image.open(out).convert("RGB").quantize(COLOURS).save(out, optimize=True)

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=30)
        os.close(self._to_chrome)
        os.close(self._from_chrome)


def shoot(chrome: str, base: str, out_dir: Path) -> None:
    """Every page of :data:`SHOTS`, with TensorBoard's Settings pane closed."""
    with tempfile.TemporaryDirectory() as profile:
        page = Chromium(chrome, Path(profile))
        try:
            page.open(f"{base}/", (1400, 1000), settle_s=5)
            page.local_storage(SETTINGS_KEY, {"timeSeriesSettingsPaneOpened": False})
            for name, (path, window) in SHOTS.items():
                page.open(f"{base}/{path}", window, settle_s=15)
                page.screenshot(out_dir / name)
                print(f"wrote {out_dir / name} ({(out_dir / name).stat().st_size // 1024} KB)")
        finally:
            page.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, help="the logs' folder: trained into when it has no logs yet")
    args = parser.parse_args(argv)
    chrome = browser()
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs if args.runs is not None else Path(tmp) / "runs"
        if not any(runs.glob("*/version_*")):
            if runs.name != "runs":  # lcv fit logs into ./runs of the folder it runs in
                raise SystemExit(f"--runs {runs}: to train into it, name the folder 'runs'")
            runs.mkdir(parents=True, exist_ok=True)
            train(runs)
        port = free_port()
        server = serve(runs, port)
        try:
            IMAGES.mkdir(parents=True, exist_ok=True)
            shoot(chrome, f"http://127.0.0.1:{port}", IMAGES)
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
