"""Shared test set-up: the Triton interpreter without a GPU, full-precision fp32 on one, seeds."""

from __future__ import annotations

import os

# Two threads in a serial run; one per pytest-xdist worker (`make test` runs two), so two workers do not
# oversubscribe a 2-core machine (OpenMP threads spin-wait at barriers).
os.environ.setdefault("OMP_NUM_THREADS", "1" if "PYTEST_XDIST_WORKER" in os.environ else "2")

import logging

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter (numpy). The kernels choose their launch configs
# when they are defined, so this must happen before anything imports them. On a GPU they run compiled, as
# users run them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # fp32 results are compared with float64 at fp32 tolerances: TF32 products (10-bit mantissas) would not
    # meet them, in PyTorch's reference convolutions or in our kernels (which follow the same flag). Tests of
    # TF32 turn it back on themselves.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

import lightning_plugin  # noqa: F401  (registers the strategies)

# pytest-xdist's loadgroup scheduler waits forever after a worker dies; this one ends the run (its docstring).
pytest_plugins = ("worker_crashes",)

# torch's structured trace log is DEBUG-level; letting pytest capture it slows every compile.
logging.getLogger("torch.__trace").propagate = False

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine"
)


@pytest.fixture(autouse=True)
def _seed_and_reset_dynamo():
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _deterministic_algorithms_restored(request):
    """torch's deterministic mode is process-wide and changes what Inductor generates (torch's max-pool
    backward decomposition steps aside in it); a Trainer(deterministic=...) or a library that turns it on
    must not leak into the next test of the worker. A test that leaves it changed is named in a warning."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield
    after = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if after != before:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        request.node.warn(
            pytest.PytestWarning(f"left torch.use_deterministic_algorithms at {after}; restored")
        )


@pytest.fixture(autouse=True)
def _private_decision_cache(tmp_path_factory, monkeypatch):
    """Each test gets an empty kernel/compile decision cache: a decision one test measured (under whatever
    load) must not make another test train eagerly, nor may tests read or write the user's ``~/.cache``."""
    monkeypatch.setenv("LCV_KERNEL_CACHE_DIR", str(tmp_path_factory.mktemp("lcv_decisions")))


#: What a run writes into its working folder by default; a test that leaves one in the repository has
#: forgotten ``default_root_dir`` (a user's clone must not collect our tests' artefacts).
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUN_ARTEFACTS = ("torch_compile_cache.bin", "checkpoints", "lightning_logs", "runs")


@pytest.fixture(autouse=True)
def _nothing_written_into_the_repository():
    before = {name for name in _RUN_ARTEFACTS if os.path.exists(os.path.join(_REPOSITORY, name))}
    yield
    after = {name for name in _RUN_ARTEFACTS if os.path.exists(os.path.join(_REPOSITORY, name))}
    assert not after - before, f"the test wrote {sorted(after - before)} into the repository root"


SHARED_CIFAR_ZIP = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "cifar10-jpeg.zip")


@pytest.fixture
def cifar_zip() -> str:
    path = os.path.abspath(SHARED_CIFAR_ZIP)
    if not os.path.exists(path):
        pytest.skip(f"shared CIFAR-10 JPEG zip not found at {path}")
    return path


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory) -> str:
    """A small ImageFolder tree of real photos in every format (see ``tests/photo_folder.py``); read-only:
    tests that add bad files work on a copy (``photo_copy``)."""
    from photo_folder import write_photo_folder

    return str(write_photo_folder(tmp_path_factory.mktemp("photos")))


@pytest.fixture
def photo_copy(photo_folder, tmp_path):
    """A fresh copy of ``photo_folder`` (a ``Path``) that a test may add bad files to."""
    import shutil
    from pathlib import Path

    return Path(shutil.copytree(photo_folder, tmp_path / "photos"))


@pytest.fixture
def unoptimised_cpp_builds(monkeypatch):
    """Inductor's C++ builds at ``-O0 -g`` (``TORCHINDUCTOR_DEBUG_COMPILE=1``, read at each build): the same
    generated code with its layout assertions, the same operations in the same order (Inductor's flags keep
    ``-ffp-contract=off``), only not optimised by g++, which was most of such a test's CPU time (the small
    ResNet-50's forward graph: 23 s at ``-O3``, 9 s at ``-O0 -g``). For tests whose subject is Inductor's
    code, not g++'s, nor the built code's speed."""
    monkeypatch.setenv("TORCHINDUCTOR_DEBUG_COMPILE", "1")
