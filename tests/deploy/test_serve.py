"""``lcv serve``: the real server in a subprocess, good and bad requests over HTTP, a clean stop."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from lcv_kernels.tolerances import reduction_tolerance
from lcv_vision.deploy import load_package
from lcv_vision.deploy.export import InferenceModel, load_trained
from lcv_vision.deploy.images import decode_image

pytestmark = pytest.mark.xdist_group("deploy")

MAX_IMAGE_BYTES = 50_000
_REPOSITORY = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_server(package: Path, folder: Path) -> tuple[subprocess.Popen, str, io.TextIOWrapper]:
    """``lcv serve`` on a free port, in its own process group (LitServe starts worker processes), with SIGINT
    ignored at its start as ``lcv serve ... &`` in a script gets it; answers ``/health`` when returned."""
    port = _free_port()
    # The server's temp folder (what a stop leaves there is checked), linked from ``folder/tmp``: a short path,
    # as pytest's own folders can leave too little room for the Unix socket LitServe's manager makes there.
    scratch = Path(tempfile.mkdtemp(prefix="lcvs-"))
    (folder / "tmp").symlink_to(scratch, target_is_directory=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(_REPOSITORY / p) for p in ("", "kernels", "vision")),
        "TMPDIR": str(scratch),
    }
    command = [sys.executable, "-m", "lcv_vision.cli", "serve", str(package), "--port", str(port)]
    command += [
        "--max-batch-size",
        "4",
        "--batch-timeout",
        "0.005",
        "--max-image-bytes",
        str(MAX_IMAGE_BYTES),
    ]
    log = open(folder / "server.log", "w")
    process = subprocess.Popen(
        command,
        cwd=folder,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, (folder / "server.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.read() == b"ok":
                    break
        except OSError:
            time.sleep(0.5)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("the server did not answer /health in 180 s")
    return process, url, log


def _assert_a_clean_stop(folder: Path) -> None:
    said = (folder / "server.log").read_text()
    assert "Traceback" not in said, said[-3000:]  # a stop is not an error: no worker prints a trace
    # the folder AOTInductor unpacked the package into (the worker is stopped with SIGTERM) is gone
    left = [
        p.name
        for p in (folder / "tmp").rglob("*")
        if p.name.startswith(("aotinductor_", "lcv-serve-worker-"))
    ]
    assert not left, left
    shutil.rmtree((folder / "tmp").resolve(), ignore_errors=True)


@pytest.fixture(scope="module")
def server(fp32_package, tmp_path_factory):
    """The server the request tests share; stopped at the end as Ctrl-C does (SIGINT to the whole group)."""
    pytest.importorskip("litserve")
    folder = tmp_path_factory.mktemp("serve")
    process, url, log = _start_server(fp32_package, folder)
    yield url, folder, process.pid
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in the user's terminal sends
    try:
        process.wait(timeout=120)  # LitServe's own waits are bounded (SHUTDOWN_GRACE_S, then kills)
    except subprocess.TimeoutExpired:
        _dump_stacks_and_kill(process.pid, folder / "server.log")
        pytest.fail("lcv serve did not stop on Ctrl-C; its log and stacks:\n" + _log_tail(folder))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    _assert_a_clean_stop(folder)


def test_sigterm_to_the_server_process_stops_every_process_it_started(fp32_package, tmp_path):
    """``docker stop`` / ``systemctl stop``: SIGTERM to the server process alone. Its default action ended that
    process and left the model worker and LitServe's manager running (and, when the HTTP server was a forked
    process, that process serving the port); now it is the graceful stop."""
    pytest.importorskip("litserve")
    process, url, log = _start_server(fp32_package, tmp_path)
    group = process.pid
    try:
        workers = _workers(group)
        assert workers  # a worker to be stopped
        for worker in workers:  # its OpenMP threads sleep between batches (build_server sets it for them)
            assert b"OMP_WAIT_POLICY=PASSIVE" in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            _dump_stacks_and_kill(group, tmp_path / "server.log")
            pytest.fail("lcv serve did not stop on SIGTERM; its log and stacks:\n" + _log_tail(tmp_path))
        deadline = time.monotonic() + 30  # its children are reaped by then (or reparented: then they run on)
        while any(state != "Z" for state in _group_children(group).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not {p: s for p, s in _group_children(group).items() if s != "Z"}, "processes left running"
        with pytest.raises(OSError):  # nobody answers on the port any more
            urllib.request.urlopen(f"{url}/health", timeout=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        log.close()
    _assert_a_clean_stop(tmp_path)


#: The bottom frame of the main thread of the server process and of an inference worker: faulthandler dumps the
#: main thread last, so its bottom frame in the log says the process's dump is complete.
SERVER_BOTTOM_FRAME, WORKER_BOTTOM_FRAME = "in _run_module_as_main", "in spawn_main"


def _dump_stacks(pid: int, log: Path, bottom_frame: str, timeout: float) -> str:
    """SIGUSR1 to ``pid`` (``serve`` registers it with faulthandler), then what the process wrote to ``log``,
    read once ``bottom_frame`` is there: faulthandler writes a dump piece by piece, and two processes dumping
    at once interleave their words in the shared log, so callers signal one process at a time."""
    start = len(log.read_text())
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while bottom_frame not in log.read_text()[start:] and time.monotonic() < deadline:
        time.sleep(0.1)
    return log.read_text()[start:]


def _workers(group: int) -> list[int]:
    """The inference workers among the processes of group ``group`` (LitServe spawns them)."""
    found = []
    for pid in _group_children(group):
        with contextlib.suppress(OSError):  # it may have exited since
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
                found.append(pid)
    return found


def _dump_stacks_and_kill(group: int, log: Path) -> None:
    """Every thread's stack of the server process and of each worker into the log, one process after the
    other, then SIGKILL to the group: a stop that hangs in CI shows where it waits."""
    for pid, bottom_frame in [
        (group, SERVER_BOTTOM_FRAME),
        *((w, WORKER_BOTTOM_FRAME) for w in _workers(group)),
    ]:
        with contextlib.suppress(ProcessLookupError):
            _dump_stacks(pid, log, bottom_frame, timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


def _log_tail(folder: Path) -> str:
    return (folder / "server.log").read_text()[-12000:]


def _group_children(group: int) -> dict[int, str]:
    """The other processes of process group ``group``, each with its state letter (``Z``: exited, unreaped)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == group:
            continue
        try:
            if os.getpgid(int(entry)) == group:
                stat = Path(f"/proc/{entry}/stat").read_text()
                found[int(entry)] = stat.rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            continue
    return found


def post(url: str, body: bytes, content_type: str = "application/octet-stream") -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/predict", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        text = err.read().decode()
        assert "\n" not in text.strip(), text
        return err.code, json.loads(text)


def multipart(data: bytes, filename: str) -> tuple[bytes, str]:
    boundary = "lcv-test-boundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


def encoded(image: np.ndarray, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format=fmt, **options)
    return out.getvalue()


@pytest.fixture(scope="module")
def probability_tolerance(digits_checkpoint, digits_test_set) -> float:
    """What another batch composition changes in a probability. Each layer's fan-in is summed in another
    order: the logits move by at most ``reduction_tolerance`` of the chain's total length at their scale
    (as test_export's ``logits_tolerance``), and a softmax probability by at most half of that
    (``|dp_i| <= 2 p_i (1 - p_i) max|dz|``)."""
    trained = load_trained(digits_checkpoint)
    fan_ins = [
        m.weight[0].numel() for m in trained.network.modules() if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    with torch.no_grad():
        logits = InferenceModel(trained.network, trained.mean, trained.std).eval()(digits_test_set[0][:12])
    atol, rtol = reduction_tolerance(torch.float32, sum(fan_ins))
    return 0.5 * (atol + rtol * float(logits.abs().max()))


def assert_same(answer: dict, expected: dict, tolerance: float) -> None:
    """Labels equal; probabilities within what another batch composition changes (fp32 logits)."""
    assert [p["label"] for p in answer["predictions"]] == [p["label"] for p in expected["predictions"]]
    for got, want in zip(answer["predictions"], expected["predictions"]):
        assert abs(got["probability"] - want["probability"]) <= tolerance


def test_answers_equal_offline_predictions(server, fp32_package, digits_test_set, probability_tolerance):
    url, folder, _ = server
    model = load_package(fp32_package)
    digits = [image.permute(1, 2, 0).numpy() for image in digits_test_set[0][:12]]
    bodies = [encoded(d, "PNG") for d in digits[:4]] + [encoded(d, "JPEG", quality=95) for d in digits[4:8]]
    bodies += [encoded(d, "WEBP", lossless=True) for d in digits[8:]]
    expected = [model.predict([decode_image(body)], top_k=5)[0].as_dict() for body in bodies]
    for body, want in zip(bodies[:2], expected[:2]):  # raw bytes, then a multipart upload
        assert_same(post(url, body)[1], want, probability_tolerance)
        form, content_type = multipart(body, "digit.png")
        status, answer = post(url, form, content_type)
        assert status == 200
        assert_same(answer, want, probability_tolerance)
    with ThreadPoolExecutor(8) as pool:  # concurrent: batched by the server
        answers = list(pool.map(lambda body: post(url, body), bodies * 2))
    for (status, answer), want in zip(answers, expected * 2):
        assert status == 200
        assert_same(answer, want, probability_tolerance)
    assert not (folder / "client.py").exists()


def _bad_requests(digit: np.ndarray) -> list[tuple[str, bytes, int, str]]:
    jpeg = encoded(digit, "JPEG")
    sixteen_bit = io.BytesIO()
    Image.fromarray(digit[..., 0].astype(np.uint16) * 257).save(sixteen_bit, format="PNG")
    frames = [Image.fromarray(digit), Image.fromarray(255 - digit)]
    animated = io.BytesIO()
    frames[0].save(animated, format="PNG", save_all=True, append_images=frames[1:])
    cmyk = io.BytesIO()
    Image.fromarray(digit).convert("CMYK").save(cmyk, format="JPEG")
    noise = np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)
    return [
        ("not an image", b"hello, this is text", 415, "not an image"),
        ("no body", b"", 400, "empty"),
        ("truncated", jpeg[: len(jpeg) // 2], 400, "truncated"),
        ("too large", encoded(noise, "PNG"), 413, "larger than the limit"),
        ("16-bit", sixteen_bit.getvalue(), 415, "16-bit"),
        ("animated", animated.getvalue(), 415, "animated"),
        ("CMYK", cmyk.getvalue(), 415, "CMYK"),
    ]


def test_bad_requests_get_a_4xx_line_and_the_server_keeps_serving(
    server, fp32_package, digits_test_set, probability_tolerance
):
    url, _, _ = server
    digit = digits_test_set[0][0].permute(1, 2, 0).numpy()
    for name, body, status, words in _bad_requests(digit):
        got, answer = post(url, body)
        assert (got, list(answer)) == (status, ["detail"]), name
        assert words in answer["detail"], (name, answer)
    good = encoded(digit, "PNG")
    status, answer = post(url, good)
    assert status == 200
    expected = load_package(fp32_package).predict([decode_image(good)])[0].as_dict()
    assert_same(answer, expected, probability_tolerance)


def test_usr1_prints_each_threads_stack_and_the_server_keeps_serving(server, digits_test_set):
    """``kill -USR1`` (docs/deploy.md) on the server process and its inference worker: each writes its threads'
    stacks to the log, and neither stops: a request still gets its answer."""
    url, folder, pid = server
    workers = _workers(pid)
    assert len(workers) == 1, _group_children(pid)
    for target, bottom_frame, a_frame in (
        (pid, SERVER_BOTTOM_FRAME, "litserve/server.py"),
        (workers[0], WORKER_BOTTOM_FRAME, "in inference_worker"),
    ):
        dumped = _dump_stacks(target, folder / "server.log", bottom_frame, timeout=60)
        assert bottom_frame in dumped and a_frame in dumped, dumped[-3000:]
        assert dumped.count("Current thread") == 1, dumped[-3000:]
    digit = digits_test_set[0][0].permute(1, 2, 0).numpy()
    assert post(url, encoded(digit, "PNG"))[0] == 200
    assert all(_group_children(pid).get(p, "Z") != "Z" for p in workers)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_users_omp_wait_policy_stands(fp32_package, monkeypatch):
    pytest.importorskip("litserve")
    from lcv_vision.deploy.serve import WAIT_POLICY_ENV, build_server

    monkeypatch.setenv(WAIT_POLICY_ENV, "ACTIVE")
    build_server(fp32_package)
    assert os.environ[WAIT_POLICY_ENV] == "ACTIVE"
    monkeypatch.delenv(WAIT_POLICY_ENV)
    build_server(fp32_package)
    assert os.environ[WAIT_POLICY_ENV] == "PASSIVE"


@pytest.mark.parametrize("room", [0, 1])
def test_a_temp_folder_too_long_for_the_managers_socket_is_one_line(
    fp32_package, monkeypatch, tmp_path, room
):
    """LitServe's manager listens on ``$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``; a longer path failed with a
    trace inside the manager process ("AF_UNIX path too long", a CI run whose pytest folders were deep)."""
    pytest.importorskip("litserve")
    from lcv_vision.deploy.errors import DeployError
    from lcv_vision.deploy.serve import UNIX_SOCKET_PATH_MAX, build_server

    suffix = len("/pymp-xxxxxxxx/listener-xxxxxxxx")
    folder = tmp_path / "t"
    folder = folder.with_name("t" * (UNIX_SOCKET_PATH_MAX - suffix - len(str(tmp_path)) - 1 + room))
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    # multiprocessing keeps the folder it made first: this test wants one made under ``folder``, and the worker's
    # own back afterwards (``setitem`` restores it, or removes the key if there was none).
    monkeypatch.setitem(multiprocessing.current_process()._config, "tempdir", None)
    if room:
        with pytest.raises(DeployError, match="set TMPDIR to a shorter folder"):
            build_server(fp32_package)
        return
    build_server(fp32_package)
    with socket.socket(socket.AF_UNIX) as longest:  # the longest name the manager may use binds
        path = folder / "pymp-xxxxxxxx" / "listener-xxxxxxxx"
        path.parent.mkdir()
        longest.bind(str(path))


def test_a_stop_lets_the_worker_monitor_finish_before_the_manager_goes(fp32_package):
    """LitServe's monitor polls an event held by its manager; the stop must not close the manager under it.

    LitServe's own stop shuts the manager down with the event unset, so a monitor that wakes afterwards
    logs "Monitoring worker crashed" (a BrokenPipe trace: seen once in a CI run beside a CPU hog). Here the
    monitor polls every 10 ms, so on that code it would wake after the stop every time."""
    pytest.importorskip("litserve")
    from lcv_vision.deploy.serve import build_server
    from lcv_vision.deploy.serve_api import WORKER_MONITOR_THREAD

    server = build_server(fp32_package)
    server.monitor_internal = 0.01
    server.inference_workers = []  # no worker process: the monitor has nothing to watch but the event
    manager = server._init_manager(1)
    records = _Records()
    litserve_logger = logging.getLogger("litserve")
    litserve_logger.addHandler(records)
    try:
        server._start_worker_monitoring(manager, {})
        (monitor,) = [t for t in threading.enumerate() if t.name == WORKER_MONITOR_THREAD]
        server._perform_graceful_shutdown(manager, {}, "keyboard_interrupt")
        monitor.join(timeout=30)
        assert not monitor.is_alive()
    finally:
        litserve_logger.removeHandler(records)
        manager.shutdown()
    assert not [m for m in records.messages if "crashed" in m], records.messages


def test_stacks_on_usr1_is_skipped_where_stderr_has_no_file_descriptor(monkeypatch):
    """``serve()`` called from a notebook, whose stderr is no file: the stack printing is skipped, not a crash."""
    pytest.importorskip("litserve")
    from lcv_vision.deploy.serve_api import print_stacks_on_usr1

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    print_stacks_on_usr1()
