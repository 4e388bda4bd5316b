"""Run airbench's own ``train94`` on the CIFAR-10 JPEGs: the yardstick for ``cifar10_accuracy.py``.

Our ``cifar10-airbench`` recipe re-implements airbench94 on Lightning, our loader and our modules. When it
misses an accuracy target, the question is whether the recipe or the data is to blame. This script answers
it by training the published code (PyPI package ``airbench``, unmodified) on the same JPEG files, decoded
here with Pillow rather than our decoder. airbench is written for one CUDA GPU in fp16; on a machine
without one, this script redirects its ``.cuda()``/``.half()`` calls to the CPU in fp32 and times it with
``time.perf_counter`` (the maths is unchanged; fp32 is at least as accurate as fp16).

    pip install --no-deps airbench==0.1.8
    OMP_NUM_THREADS=1 python benchmarks/airbench_reference.py --threads 1

Writes ``benchmarks/results/airbench_reference-<cpu|gpu>[-<tag>].json`` with the test accuracy (with and
without airbench's TTA), the per-epoch log, the wall time and the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from benchmarks._common import SHARED_ZIP, ResultStream, machine_info, write_results  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zip", default=SHARED_ZIP, help="CIFAR-10 JPEG zip (ImageFolder layout)")
    p.add_argument("--epochs", type=float, default=None, help="default: airbench94's 9.9")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache", default=None, help="folder for the decoded train.pt/test.pt (default: a temp dir)"
    )
    p.add_argument("--tag", default="", help="suffix of the result file name")
    return p.parse_args(argv)


def write_airbench_tensors(zip_path: str, folder: str) -> list[str]:
    """Decode the zip with Pillow into airbench's ``{train,test}.pt`` (uint8 NHWC, labels, class names)."""
    with zipfile.ZipFile(zip_path) as zf:
        names = sorted(n for n in zf.namelist() if n.lower().endswith(".jpg"))
        classes = sorted({n.split("/")[1] for n in names})
        for split in ("train", "test"):
            members = [n for n in names if n.startswith(split + "/")]
            if not members:
                raise SystemExit(f"airbench_reference: {zip_path} has no {split}/<class>/*.jpg members")
            if split == "train":  # CIFAR-10's own files mix the classes; airbench whitens on the first 5,000
                members = [members[i] for i in np.random.default_rng(0).permutation(len(members))]
            images = np.stack(
                [np.asarray(Image.open(io.BytesIO(zf.read(n))).convert("RGB")) for n in members]
            )
            labels = [classes.index(n.split("/")[1]) for n in members]
            torch.save(
                {"images": torch.from_numpy(images), "labels": torch.tensor(labels), "classes": classes},
                os.path.join(folder, f"{split}.pt"),
            )
    return classes


class _WallClockEvent:
    """Stands in for ``torch.cuda.Event(enable_timing=True)`` on a CPU."""

    def __init__(self, **_: object) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _WallClockEvent) -> float:
        return 1e3 * (end.t - self.t)


@contextlib.contextmanager
def airbench_on_cpu() -> Iterator[None]:
    """Redirect airbench's CUDA/fp16 calls to the CPU in fp32 for the duration of the block."""
    import airbench.utils as ab_utils

    saved = (
        torch.cuda.Event,
        torch.cuda.synchronize,
        torch.nn.Module.cuda,
        torch.nn.Module.half,
        torch.Tensor.half,
        ab_utils.CifarLoader.__init__.__defaults__,
    )
    defaults = list(saved[-1])
    defaults[-1] = "cpu"  # CifarLoader(..., gpu=0) -> torch.load(map_location="cpu")
    torch.cuda.Event = _WallClockEvent
    torch.cuda.synchronize = lambda *a, **k: None
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.nn.Module.half = lambda self: self.float()
    torch.Tensor.half = lambda self, *a, **k: self.float()
    ab_utils.CifarLoader.__init__.__defaults__ = tuple(defaults)
    try:
        yield
    finally:
        (
            torch.cuda.Event,
            torch.cuda.synchronize,
            torch.nn.Module.cuda,
            torch.nn.Module.half,
            torch.Tensor.half,
            ab_utils.CifarLoader.__init__.__defaults__,
        ) = saved


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.exists(args.zip):
        raise SystemExit(
            f"airbench_reference: {args.zip} not found; pass --zip PATH to the CIFAR-10 JPEG zip"
        )
    if args.epochs is not None and not args.epochs > 0:
        raise SystemExit(f"airbench_reference: --epochs must be > 0, got {args.epochs}")
    try:
        import airbench
        from airbench.lib_airbench94 import hyp
    except ImportError as exc:
        raise SystemExit(
            "airbench_reference: needs the airbench package: pip install --no-deps airbench==0.1.8"
        ) from exc

    gpu = torch.cuda.is_available()
    epochs = args.epochs or hyp["opt"]["train_epochs"]
    torch.manual_seed(args.seed)
    workdir = args.cache or tempfile.mkdtemp(prefix="airbench-jpeg-")
    data_dir = os.path.join(workdir, "cifar10")  # train94 opens its test set at the relative path 'cifar10'
    os.makedirs(data_dir, exist_ok=True)
    started = time.perf_counter()
    if not os.path.exists(os.path.join(data_dir, "test.pt")):
        write_airbench_tensors(args.zip, data_dir)
    decoded = time.perf_counter()

    log = io.StringIO()
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.ExitStack() as stack:
            if not gpu:
                stack.enter_context(airbench_on_cpu())  # also makes the loaders' default device the CPU
            loader = airbench.CifarLoader(
                "cifar10", train=True, batch_size=hyp["opt"]["batch_size"], aug=hyp["aug"], altflip=True
            )
            test_loader = airbench.CifarLoader("cifar10", train=False, batch_size=2000)

            class Tee(io.TextIOBase):
                def write(self, s: str) -> int:
                    log.write(s)
                    return sys.__stdout__.write(s)

            with contextlib.redirect_stdout(Tee()):
                model = airbench.train94(loader, epochs=epochs)
            trained = time.perf_counter()
            accuracy = {
                f"tta{level}": airbench.evaluate(model, test_loader, tta_level=level) for level in (0, 2)
            }
    finally:
        os.chdir(cwd)

    result = {
        "what": "airbench 0.1.8 train94, unmodified, on the CIFAR-10 JPEG zip decoded with Pillow",
        "precision": "fp16 (airbench's own)" if gpu else "fp32 (airbench's .half() redirected on the CPU)",
        "epochs": epochs,
        "seed": args.seed,
        "test_accuracy": accuracy["tta2"],
        "test_accuracy_by_tta_level": accuracy,
        "decode_s": decoded - started,
        "train_and_eval_s": trained - decoded,
        "airbench_log": log.getvalue(),
        **machine_info(),
    }
    name = f"airbench_reference-{'gpu' if gpu else 'cpu'}{'-' + args.tag if args.tag else ''}"
    write_results(name, result)
    ResultStream("airbench_reference").add(
        {
            key: result[key]
            for key in (
                "epochs",
                "test_accuracy",
                "test_accuracy_by_tta_level",
                "decode_s",
                "train_and_eval_s",
            )
        }
    )
    print(
        f"airbench train94 on the JPEG set: {100 * accuracy['tta2']:.2f}% (TTA 2), "
        f"{100 * accuracy['tta0']:.2f}% (no TTA), {result['train_and_eval_s']:.0f} s"
    )
    return result


if __name__ == "__main__":
    main()
