"""Load on ``lcv serve``: concurrent clients posting real JPEGs, every answer checked, latency and requests/s.

    python benchmarks/serve_load.py model.pt2 --zip-path ../shared/data/cifar10-jpeg.zip

Starts the real server (a subprocess, a free port on 127.0.0.1), computes the offline prediction of every image
with ``load_package(...).predict``, then for each ``--clients`` count sends ``--requests`` requests (raw JPEG
bodies, cycling through ``--images`` CIFAR-10 test files) from that many threads, each with its own keep-alive
connection. An answer is wrong when its top-1 label differs from the offline one; the largest probability
difference is reported too (an int8 package computes a batch of one along another path than larger batches:
an activation that lands on the other side of a quantization step moves probabilities by ~1e-3; fp32 ~1e-6).
Writes ``benchmarks/results/serve-cpu.json`` (p50/p99 latency, requests/s, lost and wrong answers,
the load average: the clients, the HTTP server and the model share this machine's cores).
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SHARED_ZIP, print_table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def jpegs(zip_path: str, count: int, size: tuple[int, int] | None = None) -> list[bytes]:
    """``count`` test JPEGs spread over the classes; with ``size`` (width, height) each is upscaled (bicubic) and
    re-encoded at quality 95, so a 224-px package gets bodies of a photo's size to decode and resize."""
    with zipfile.ZipFile(zip_path) as archive:
        names = sorted(n for n in archive.namelist() if n.startswith("test/") and n.endswith(".jpg"))
        step = max(1, len(names) // count)
        bodies = [archive.read(name) for name in names[::step][:count]]
    if size is None:
        return bodies
    from PIL import Image

    resized = []
    for body in bodies:
        out = io.BytesIO()
        Image.open(io.BytesIO(body)).convert("RGB").resize(size, Image.Resampling.BICUBIC).save(
            out, "JPEG", quality=95
        )
        resized.append(out.getvalue())
    return resized


def start_server(package: str, args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "kernels", "vision"))}
    command = [sys.executable, "-m", "lcv_vision.cli", "serve", package, "--port", str(port)]
    command += ["--max-batch-size", str(args.max_batch_size), "--batch-timeout", str(args.batch_timeout)]
    command += ["--workers", str(args.workers)]
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"serve_load: the server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.read() == b"ok":
                    return process, port
        except OSError:
            time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit("serve_load: the server did not come up in 300 s")


def run_load(port: int, bodies: list[bytes], expected: list[dict], clients: int, requests: int) -> dict:
    local = threading.local()
    latencies: list[float] = []
    wrong = lost = 0
    mismatches: list[dict] = []
    differences: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal wrong, lost
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = bodies[i % len(bodies)]
        started = time.perf_counter()
        try:
            local.conn.request("POST", "/predict", body, {"Content-Type": "image/jpeg"})
            response = local.conn.getresponse()
            payload = response.read()
            elapsed = time.perf_counter() - started
            answer = json.loads(payload)
            ok = response.status == 200 and _same(answer, expected[i % len(bodies)])
            difference = _difference(answer, expected[i % len(bodies)]) if ok else 0.0
        except (OSError, http.client.HTTPException, ValueError):
            local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            with lock:
                lost += 1
            return
        with lock:
            latencies.append(elapsed)
            wrong += 0 if ok else 1
            differences.append(difference)
            if not ok and len(mismatches) < 3:
                mismatches.append(
                    {"image": i % len(bodies), "got": answer, "expected": expected[i % len(bodies)]}
                )

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    ms = np.array(latencies) * 1e3
    return {
        "clients": clients,
        "requests": requests,
        "lost": lost,
        "wrong": wrong,
        "requests_per_s": round(len(latencies) / wall, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 2) if len(ms) else None,
        "p99_ms": round(float(np.percentile(ms, 99)), 2) if len(ms) else None,
        "max_probability_difference": round(max(differences, default=0.0), 6),
        "answers_differing_by_over_1e-4": sum(d > 1e-4 for d in differences),
        "first_mismatches": mismatches,
    }


def _same(answer: dict, expected: dict) -> bool:
    """The same top-1 label as offline (what a client acts on)."""
    got = answer.get("predictions", [])
    return bool(got) and got[0]["label"] == expected["predictions"][0]["label"]


def _difference(answer: dict, expected: dict) -> float:
    """Largest probability difference over the top-k labels both name."""
    want = {p["label"]: p["probability"] for p in expected["predictions"]}
    return max(
        (abs(p["probability"] - want[p["label"]]) for p in answer["predictions"] if p["label"] in want),
        default=0.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("package", help="a .pt2 written by `lcv export`")
    parser.add_argument("--zip-path", default=str(SHARED_ZIP), help="CIFAR-10 JPEG zip (test/<class>/*.jpg)")
    parser.add_argument("--images", type=int, default=500, help="distinct JPEGs, cycled")
    parser.add_argument("--requests", type=int, default=2000, help="per client count")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-timeout", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=1, help="model worker processes (lcv serve --workers)")
    parser.add_argument("--out-name", default="serve-cpu")
    parser.add_argument(
        "--upscale",
        type=int,
        nargs=2,
        metavar=("WIDTH", "HEIGHT"),
        default=None,
        help="re-encode each JPEG at this size first (e.g. 320 256 for a 224-px package)",
    )
    args = parser.parse_args()
    if args.upscale and min(args.upscale) < 1:
        parser.error(f"--upscale needs a positive width and height; got {args.upscale[0]} {args.upscale[1]}")
    if (
        args.images < 1
        or args.requests < 1
        or min(args.clients) < 1
        or args.max_batch_size < 1
        or args.workers < 1
    ):
        parser.error("--images, --requests, --clients, --max-batch-size and --workers must be >= 1")

    from lcv_vision.deploy import load_package
    from lcv_vision.deploy.images import decode_image

    bodies = jpegs(args.zip_path, args.images, tuple(args.upscale) if args.upscale else None)
    model = load_package(args.package)
    expected = [model.predict([decode_image(body)], top_k=5)[0].as_dict() for body in bodies]
    load_before = os.getloadavg()
    process, port = start_server(args.package, args)
    try:
        rows = [run_load(port, bodies, expected, clients, args.requests) for clients in args.clients]
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    print_table(rows, ["clients", "requests", "lost", "wrong", "requests_per_s", "p50_ms", "p99_ms"])
    info = model.info
    path = write_results(
        args.out_name,
        {
            "package": {
                "recipe": info.recipe,
                "precision": info.precision,
                "quantization": info.quantization,
            },
            "images": f"{len(bodies)} CIFAR-10 test JPEGs from {os.path.basename(args.zip_path)}, raw bodies"
            + (f", upscaled to {args.upscale[0]}x{args.upscale[1]} (quality 95)" if args.upscale else ""),
            "mean_body_bytes": round(sum(map(len, bodies)) / len(bodies)),
            "max_batch_size": args.max_batch_size,
            "batch_timeout_s": args.batch_timeout,
            "workers": args.workers,
            "rows": rows,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "note": "clients, HTTP server and model worker share this machine's cores",
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
