"""``lcv serve``: a LitServe HTTP server for a ``.pt2`` package, with dynamic batching.

Why the images are checked in the HTTP process, not in ``LitAPI.decode_request``: LitServe 0.2.19 decodes a
whole batch in one ``try``, so one bad upload would fail every request batched with it. Here an ASGI middleware
reads the body (raw bytes or a multipart upload), decodes and sizes the image (the recipe's eval transform) in
a thread, answers a bad one at once with 400/413/415 and one JSON line, and passes a good one on as uint8
pixels; the model worker only stacks pixels into batches. LitServe alone would also answer a raw-bytes body
with 500 (it parses every non-form body as JSON).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import tempfile
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from lcv_vision.deploy.errors import DeployError, ImageRejectedError, import_extra
from lcv_vision.deploy.host_transform import HostTransform
from lcv_vision.deploy.images import DEFAULT_MAX_BYTES, decode_image
from lcv_vision.deploy.package import PackageInfo, load_package, read_metadata

__all__ = [
    "API_PATH",
    "ImageIntake",
    "build_server",
    "check_socket_folder",
    "serve",
    "stop_on_sigint_and_sigterm",
]

API_PATH = "/predict"

#: Multipart framing allowed on top of the image's own bytes.
_FORM_OVERHEAD = 64 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ImageIntake:
    """ASGI middleware: ``POST /predict`` bodies -> checked, preprocessed uint8 pixels (or a 4xx answer)."""

    def __init__(self, app: Any, transform: HostTransform, max_bytes: int, path: str = API_PATH) -> None:
        self.app = app
        self.transform = transform
        self.max_bytes = max_bytes
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") != self.path:
            await self.app(scope, receive, send)
            return
        try:
            data = await self._image_bytes(scope, receive)
            pixels = await asyncio.to_thread(self._pixels, data)
        except ImageRejectedError as err:
            await _answer(send, err.status, {"detail": str(err)})
            return
        body = json.dumps({"pixels": base64.b64encode(pixels.numpy().tobytes()).decode("ascii")}).encode()
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)

    async def _image_bytes(self, scope: Scope, receive: Receive) -> bytes:
        content_type = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
        limit = self.max_bytes + (_FORM_OVERHEAD if content_type.startswith("multipart/form-data") else 0)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ImageRejectedError("the client closed the connection before the body ended", 400)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ImageRejectedError(
                    f"the body is larger than the limit of {self.max_bytes:,} bytes", 413
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if content_type.startswith("multipart/form-data"):
            return await _uploaded_file(body, scope)
        return body

    def _pixels(self, data: bytes) -> torch.Tensor:
        return self.transform(decode_image(data, self.max_bytes, name="the posted image"))


async def _uploaded_file(body: bytes, scope: Scope) -> bytes:
    """The first file of a multipart form (python-multipart parses it, through Starlette)."""
    from starlette.datastructures import UploadFile
    from starlette.requests import Request

    async def once() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(scope, once).form()
    except AssertionError as err:  # Starlette's message when python-multipart is missing
        raise ImageRejectedError(
            f"multipart uploads need python-multipart on the server ({err})", 415
        ) from err
    except Exception as err:  # a malformed form
        raise ImageRejectedError(f"the multipart form cannot be read ({err})", 400) from err
    files = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
    if not files:
        raise ImageRejectedError("the multipart form has no file: upload the image as a file field", 400)
    return await files[0].read()


async def _answer(send: Send, status: int, payload: dict[str, str]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


SHUTDOWN_GRACE_S = 5
#: Longest path a Unix socket may have on Linux (``sun_path`` is 108 bytes with its NUL).
UNIX_SOCKET_PATH_MAX = 107
#: The name ``multiprocessing`` gives its manager's socket in its temp folder (``listener-`` and 8 characters).
_MANAGER_SOCKET_NAME = "listener-xxxxxxxx"


def check_socket_folder() -> None:
    """LitServe's ``multiprocessing`` manager listens on a Unix socket in ``multiprocessing``'s temp folder
    (``$TMPDIR/pymp-*``); one whose path leaves no room for the socket's name failed inside the manager process
    with a trace ("AF_UNIX path too long"). Say so in one line before anything starts. The folder is the one this
    Python picks (a newer Python falls back to a shorter one by itself), made here as the manager would."""
    from multiprocessing import util

    folder = util.get_temp_dir()
    length = len(os.fsencode(os.path.join(folder, _MANAGER_SOCKET_NAME)))
    if length > UNIX_SOCKET_PATH_MAX:
        raise DeployError(
            f"the temp folder {tempfile.gettempdir()} is too long a path for the server's Unix socket ({length} "
            f"of at most {UNIX_SOCKET_PATH_MAX} bytes with the socket's name): set TMPDIR to a shorter folder"
        )


#: Read by OpenMP when a process loads it: the spawned model workers see what build_server sets.
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def build_server(
    package: str | Path,
    max_batch_size: int = 8,
    batch_timeout: float = 0.01,
    top_k: int = 5,
    max_image_bytes: int | None = None,
    workers: int = 1,
) -> Any:
    """A ``litserve.LitServer`` for ``package`` (checked before any worker starts).

    Sets ``OMP_WAIT_POLICY=PASSIVE`` in this process's environment unless it is set, for the model workers the
    server spawns: their OpenMP threads then sleep between batches instead of spinning on the cores the HTTP
    server decodes on (224-px int8 ResNet-18, 8 clients on 2 cores, alternating runs: +3.5-6.4% requests/s;
    docs/deploy.md)."""
    os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")
    check_socket_folder()
    import_extra("litserve", "serve", "lcv serve")
    import_extra("multipart", "serve", "lcv serve (multipart uploads)")
    if max_batch_size < 1 or batch_timeout < 0 or workers < 1 or top_k < 1:
        raise DeployError("--max-batch-size, --workers and --top-k must be >= 1, --batch-timeout >= 0")
    load_package(package)  # the torch/CPU checks, in this process, as one line
    metadata = read_metadata(package)
    assert metadata is not None  # load_package just read the same archive
    info = PackageInfo.from_metadata(metadata)
    max_bytes = max_image_bytes if max_image_bytes is not None else DEFAULT_MAX_BYTES
    from lcv_vision.deploy.serve_api import ClassifierAPI, ClassifierServer  # import litserve, checked above

    api = ClassifierAPI(str(package), info, top_k, max_batch_size=max_batch_size, batch_timeout=batch_timeout)
    server = ClassifierServer(
        api,
        accelerator="cuda" if info.device == "cuda" else "cpu",
        devices=1,
        workers_per_device=workers,
        middlewares=[(ImageIntake, {"transform": info.transform, "max_bytes": max_bytes})],
    )
    # On Ctrl-C LitServe waits this long for open requests, then for its HTTP process (30 s each by default);
    # a classifier's request takes milliseconds, so a stop takes seconds, not a minute.
    server.uvicorn_graceful_timeout = SHUTDOWN_GRACE_S
    return server


def stop_on_sigint_and_sigterm() -> None:
    """SIGINT and SIGTERM to this process both start LitServe's graceful stop (it catches
    ``KeyboardInterrupt``).

    Why both, set here: ``docker stop`` and process managers send SIGTERM, whose default action ends this
    process at once and leaves its model workers and LitServe's manager running (with a forked HTTP process,
    that process too, holding the port). And a process started in the background by a non-interactive shell
    (``lcv serve ... &``) begins with SIGINT ignored, where Python installs no ``KeyboardInterrupt`` handler:
    ``kill -INT`` then never reached LitServe's stop (a forked HTTP process, with uvicorn's own handlers, did
    stop, and this process waited for ever). The HTTP server runs in a thread of this process, where uvicorn
    installs no handlers, so these are the server's only ones. A child forked later (LitServe's manager) keeps
    SIGTERM's default action."""
    server_pid = os.getpid()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and os.getpid() != server_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)


def serve(package: str | Path, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
    """Build the server and run it until interrupted; binds ``host`` only (127.0.0.1 unless told).

    ``kill -USR1 <pid>`` makes the server process (and each inference worker) print every thread's stack to
    its log, without stopping it: how to see where a server that does not answer, or does not stop, waits."""
    server = build_server(package, **options)
    from lcv_vision.deploy.serve_api import print_stacks_on_usr1  # build_server checked the litserve extra

    print_stacks_on_usr1()
    stop_on_sigint_and_sigterm()
    try:
        server.run(
            host=host,
            port=port,
            generate_client_file=False,
            num_api_servers=1,
            log_level="warning",
            api_server_worker_type="thread",  # see ClassifierServer: one process fewer on the cores
        )
    except KeyboardInterrupt:  # Ctrl-C / SIGINT is how a server is stopped, not an error
        pass
