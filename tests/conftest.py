"""Shared test set-up: CPU-only defaults, Triton interpreter, seeds."""

from __future__ import annotations

import os

# Kernels must see TRITON_INTERPRET before triton.jit decorates them, so set it before any import.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FOR_TESTS"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import logging

import pytest
import torch

import lightning_plugin  # noqa: F401  (registers the strategies)

# torch's structured trace log is DEBUG-level; letting pytest capture it slows every compile.
logging.getLogger("torch.__trace").propagate = False

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine")


@pytest.fixture(autouse=True)
def _seed_and_reset_dynamo():
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


SHARED_CIFAR_ZIP = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "cifar10-jpeg.zip")


@pytest.fixture
def cifar_zip() -> str:
    path = os.path.abspath(SHARED_CIFAR_ZIP)
    if not os.path.exists(path):
        pytest.skip(f"shared CIFAR-10 JPEG zip not found at {path}")
    return path
