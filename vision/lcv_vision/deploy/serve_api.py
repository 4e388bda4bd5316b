"""The ``LitAPI`` and ``LitServer`` of ``lcv serve``: batches of checked uint8 pixels through the package.

A module of its own, imported only by :func:`lcv_vision.deploy.serve.build_server`: it imports litserve (an
optional extra) at module level, and LitServe's workers are spawned processes that must find the class by
its module path."""

import base64
import faulthandler
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.util import Finalize
from types import FrameType
from typing import Any

import litserve as ls
import torch
from fastapi import Request

from lcv_vision.deploy.package import DeployedModel, PackageInfo, load_package

__all__ = ["ClassifierAPI", "ClassifierServer", "WORKER_MONITOR_THREAD", "print_stacks_on_usr1"]

WORKER_MONITOR_THREAD = "litserve-monitoring"  # the name LitServe 0.2 gives its worker-watching thread


def print_stacks_on_usr1() -> None:
    """``kill -USR1 <pid>`` prints each thread's stack of this process to stderr and changes nothing else (where
    stderr is a file: a notebook's is not, and there this does nothing)."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR1 (Windows), or no file descriptor behind stderr
        pass


@contextmanager
def _temp_folder(folder: str) -> Iterator[None]:
    """``TMPDIR`` is ``folder`` inside the block (read by the C++ loader that unpacks a package)."""
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = previous


class ClassifierAPI(ls.LitAPI):
    """Requests arrive as ``{"pixels": base64 of uint8 (3, H, W)}``, made by ``ImageIntake``."""

    def __init__(self, package: str, info: PackageInfo, top_k: int, **batching: Any) -> None:
        super().__init__(api_path="/predict", **batching)
        self.package = package
        self.shape = (3, *info.input_size)
        self.top_k_count = top_k
        self.model: DeployedModel | None = None
        self.scratch = ""  # the worker's own temp folder, made by setup

    def setup(self, device: str) -> None:
        # Ctrl-C reaches the whole process group: the server process stops this worker itself (SIGTERM, then
        # SIGKILL), so the worker ignores SIGINT rather than print a KeyboardInterrupt trace from its queue wait.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print_stacks_on_usr1()
        # AOTInductor unpacks the package (2-5 MB) into a folder of the temp folder and removes it only when the
        # model is destroyed; LitServe stops a worker with SIGTERM, whose default action destroys nothing. So the
        # package is unpacked into a folder of this worker's own, which the SIGTERM handler removes.
        self.scratch = tempfile.mkdtemp(prefix="lcv-serve-worker-")
        with _temp_folder(self.scratch):
            self.model = load_package(self.package)
        signal.signal(signal.SIGTERM, self._stop)
        Finalize(None, shutil.rmtree, args=(self.scratch,), kwargs={"ignore_errors": True}, exitpriority=0)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # end as SIGTERM's default would have

    # LitServe picks how to read a body by this annotation (hence no postponed annotations in this module):
    # ``Request`` = the JSON body, which arrives here as a dict.
    def decode_request(self, request: Request) -> torch.Tensor:
        pixels = base64.b64decode(request["pixels"])
        return torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(self.shape)

    def batch(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(inputs)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        assert self.model is not None  # set by setup, which LitServe runs first
        return self.model(x if x.ndim == 4 else x.unsqueeze(0))

    def unbatch(self, output: torch.Tensor) -> list[torch.Tensor]:
        return list(output)

    def encode_response(self, logits: torch.Tensor) -> dict[str, Any]:
        assert self.model is not None
        row = logits if logits.ndim == 2 else logits.unsqueeze(0)
        return self.model.top_k(row, self.top_k_count)[0].as_dict()


class ClassifierServer(ls.LitServer):
    """A ``LitServer`` whose HTTP server is a thread of the server process, stopped by that process, and whose
    stop prints no trace.

    Why a thread (``run(api_server_worker_type="thread")``, see :func:`lcv_vision.deploy.serve.serve`): one
    process fewer beside the model worker, and a stop of a few seconds; requests/s were the same as with a
    forked HTTP process within this machine's noise (4 alternating pairs, docs/deploy.md). LitServe 0.2 stops
    its HTTP workers with ``terminate()``, which a thread does not have: it logged an error and the thread kept
    the process alive. Here the uvicorn server is told to exit and joined.

    LitServe's monitor thread checks a shutdown event held by its ``multiprocessing`` manager every two
    seconds. On Ctrl-C LitServe shuts the manager down with that event unset, so a monitor that wakes before
    the process exits calls into a closed pipe and logs "Monitoring worker crashed" with a ``BrokenPipeError``
    trace (seen on a loaded machine). Here the monitor is let finish first. (These overrides use LitServe 0.2
    internals, hence the <0.3 bound in pyproject.toml.)
    """

    def _start_server(self, *args: Any, **kwargs: Any) -> Any:
        workers = super()._start_server(*args, **kwargs)
        # A thread's target is its uvicorn server's bound ``run``: the object whose ``should_exit`` stops it.
        self._http_threads = {
            thread: getattr(getattr(thread, "_target", None), "__self__", None)
            for thread in workers.values()
            if isinstance(thread, threading.Thread)
        }
        return workers

    def _stop_http_threads(self) -> None:
        """uvicorn's own graceful exit: stop accepting, let open requests finish (``uvicorn_graceful_timeout``)."""
        threads = getattr(self, "_http_threads", {})
        for server in threads.values():
            if server is not None:
                server.should_exit = True
        for thread, server in threads.items():
            thread.join(timeout=self.uvicorn_graceful_timeout + 2)
            if thread.is_alive() and server is not None:
                server.force_exit = True  # open connections did not close in time: end without waiting
                thread.join(timeout=5)

    def _perform_graceful_shutdown(
        self, manager: Any, uvicorn_workers: Any, shutdown_reason: str = "normal"
    ) -> None:
        self._stop_http_threads()
        processes = {k: w for k, w in dict(uvicorn_workers).items() if not isinstance(w, threading.Thread)}
        # The monitor reads ``self._shutdown_event`` afresh each round, so a local event that is already set
        # ends it without a call to the manager. (Setting the manager's event from here can deadlock: Ctrl-C
        # interrupted this thread inside that event's ``wait()``, and the manager still serves that call on
        # this thread's connection.)
        stopped = threading.Event()
        stopped.set()
        self._shutdown_event = stopped
        for thread in threading.enumerate():
            if thread.name == WORKER_MONITOR_THREAD and thread is not threading.current_thread():
                thread.join(timeout=self.monitor_internal + 5)  # it sleeps monitor_internal s between rounds
        super()._perform_graceful_shutdown(manager, processes, shutdown_reason)
