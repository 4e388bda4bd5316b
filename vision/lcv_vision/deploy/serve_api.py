"""The ``LitAPI`` of ``lcv serve``: stacks checked uint8 pixels into batches and runs the package.

A module of its own, imported only by :func:`lcv_vision.deploy.serve.build_server`: it imports litserve (an
optional extra) at module level, and LitServe's workers are spawned processes that must find the class by
its module path."""

import base64
import signal
from typing import Any

import litserve as ls
import torch
from fastapi import Request

from lcv_vision.deploy.package import DeployedModel, PackageInfo, load_package

__all__ = ["ClassifierAPI"]


class ClassifierAPI(ls.LitAPI):
    """Requests arrive as ``{"pixels": base64 of uint8 (3, H, W)}``, made by ``ImageIntake``."""

    def __init__(self, package: str, info: PackageInfo, top_k: int, **batching: Any) -> None:
        super().__init__(api_path="/predict", **batching)
        self.package = package
        self.shape = (3, *info.input_size)
        self.top_k_count = top_k
        self.model: DeployedModel | None = None

    def setup(self, device: str) -> None:
        # Ctrl-C reaches the whole process group: the server process stops this worker itself (SIGTERM, then
        # SIGKILL), so the worker ignores SIGINT rather than print a KeyboardInterrupt trace from its queue wait.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.model = load_package(self.package)

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
