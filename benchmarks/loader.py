"""Loader throughput, images/s: our compiled batched pipeline vs albumentations and torchvision v2 per sample
in a DataLoader, and kornia batched, on the same ops and the same images.

  cifar:    reflect-pad 4 + random crop 32 + horizontal flip + normalize, from uint8 in memory.
  imagenet: JPEG decode + random resized crop 224 + flip + colour jitter (0.4, 0.4, 0.4, 0.1) + normalize.

Every side gets 2 CPU cores: albumentations and torchvision v2 (uint8 tensors, ``antialias=False`` like
OpenCV and us) as 2 DataLoader worker processes; ours and kornia as 2 torch threads in this process (JPEGs
decoded by 2 threads one batch ahead; kornia, which needs float batches, gets ``uint8 / 255``).  Ours is built
natively (``ours_cifar``/``ours_imagenet``); a test checks it equals ``from_albumentations`` of the composes.
The JPEGs are real CIFAR-10 images (32x32) from the shared zip; ``--jpeg-size S`` re-encodes them upscaled
to S x S (quality 90) so that decoding costs what it does on ImageNet-sized files.

The sides alternate (one pass each, in turn, ``--repeats`` times) so that load from other processes hits all
alike; each figure is the median of the timed passes after a warm-up pass (which includes our compile), and
each ratio is the median of the per-repeat ratios.  ``--cpu-time`` adds the single-thread CPU time per image
of the augmentation alone (no loader, no decode): albumentations, ours eager and ours compiled (on the CPU
both run the colour jitter as its C++ kernel, ``vision/lcv_vision/data/functional/color_jitter_cpu.py``, when it
builds); thread CPU time barely moves when other processes share the cores.

GPU rows run when CUDA is available (otherwise "not measured on GPU"), every side on a uint8 store resident
there: ours compiled at several batch sizes and eager, torchvision v2 per sample, kornia batched; each rate
also as a fraction of the device-to-device copy bandwidth measured in the same run, and the CPU time per
batch of our parameters and tables.  ``--gpu-only`` skips the CPU sides; ``--profile`` prints the kernels and
CPU ops of a few of our batches; ``--device-rows-on cpu`` runs the same code on the CPU (tiny sizes).

Ours delivers channels_last float32 batches (the pipeline's default, what a convolutional model wants), the
per-sample sides contiguous NCHW (``default_collate``'s stack), kornia NCHW.  Tried on this CPU: NCHW output
made ours slower on the CIFAR pipeline (its gather is channels_last by nature) and changed the ImageNet-style
one within the noise, so the default stays.

    python benchmarks/loader.py --cifar-images 8192 --jpeg-images 256 --repeats 5 --jpeg-size 0 256 --cpu-time
    python benchmarks/loader.py --gpu-only --repeats 5 --profile     # on a GPU machine
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import zipfile
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))
from _common import SHARED_ZIP, ResultStream, out_of_time, print_table, time_ms, write_results  # noqa: E402

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def load_jpegs(n: int, size: int) -> list[bytes]:
    """``n`` real CIFAR-10 JPEGs (re-encoded at ``size`` x ``size`` when ``size`` > 0); synthetic if no
    zip."""
    from PIL import Image

    if os.path.exists(SHARED_ZIP):
        with zipfile.ZipFile(SHARED_ZIP) as zf:
            names = sorted(x for x in zf.namelist() if x.startswith("train/") and x.endswith(".jpg"))
            blobs = [zf.read(x) for x in names[:: max(1, len(names) // n)][:n]]
    else:
        rng = np.random.default_rng(0)
        blobs = []
        for _ in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
            blobs.append(buf.getvalue())
    if size <= 0:
        return blobs
    out = []
    for b in blobs:
        buf = io.BytesIO()
        Image.open(io.BytesIO(b)).convert("RGB").resize((size, size), Image.BICUBIC).save(
            buf, "JPEG", quality=90
        )
        out.append(buf.getvalue())
    return out


def decode_all(blobs: list[bytes]) -> np.ndarray:
    import cv2

    return np.stack(
        [
            cv2.cvtColor(cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
            for b in blobs
        ]
    )


def alternate(
    sides: dict[str, Callable[[], int]], repeats: int, warm_up: bool = True
) -> dict[str, list[float]]:
    """img/s of each side, ``repeats`` times, the sides interleaved; one untimed warm-up pass each.

    The warm-ups run last side first, so ours (the first side) warms up after the DataLoader sides have
    forked their worker processes: every page a process holds at a fork is shared copy-on-write, and its first
    write afterwards copies it. Warmed up before the forks, ours' first timed pass paid those copies for its
    buffers and ran at a third of its speed (418-459 img/s against ~1,500 for the ImageNet-style pipeline).
    """
    if warm_up:
        for run in reversed(list(sides.values())):
            run()
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            t = time.perf_counter()
            n = run()
            rates[name].append(n / (time.perf_counter() - t))
    return rates


def count(batches) -> int:
    n = 0
    for x, _ in batches:
        n += len(x)
    return n


# ------------------------------------------------------------------------------------------- albumentations
class _AlbDataset(torch.utils.data.Dataset):
    def __init__(self, items, transform, from_jpeg: bool):
        self.items, self.transform, self.from_jpeg = items, transform, from_jpeg

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        import cv2

        img = self.items[i]
        if self.from_jpeg:
            img = cv2.cvtColor(
                cv2.imdecode(np.frombuffer(img, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB
            )
        return self.transform(image=img)["image"], 0


def albumentations_side(items, transform, from_jpeg: bool, batch_size: int) -> Callable[[], int]:
    dl = torch.utils.data.DataLoader(
        _AlbDataset(items, transform, from_jpeg),
        batch_size=batch_size,
        num_workers=2,
        persistent_workers=True,
        shuffle=True,
    )
    return lambda: count(dl)


def alb_cifar():
    import albumentations as A
    import cv2
    from albumentations.pytorch import ToTensorV2

    return A.Compose(
        [
            A.Pad(4, border_mode=cv2.BORDER_REFLECT_101),
            A.RandomCrop(32, 32),
            A.HorizontalFlip(),
            A.Normalize(MEAN, STD),
            ToTensorV2(),
        ]
    )


def alb_imagenet():
    import albumentations as A
    from albumentations.pytorch import ToTensorV2

    return A.Compose(
        [
            A.RandomResizedCrop((224, 224)),
            A.HorizontalFlip(),
            A.ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0),
            A.Normalize(),
            ToTensorV2(),
        ]
    )


def albumentations_missing() -> str | None:
    """Why the albumentations side cannot run here (the GPU machine may lack it), or None."""
    try:
        import albumentations  # noqa: F401
        import cv2  # noqa: F401
    except ImportError as err:
        return f"albumentations not installed ({err}); not measured"
    return None


# ------------------------------------------------------------------------------------------- torchvision v2
class _TorchvisionDataset(torch.utils.data.Dataset):
    def __init__(self, items, transform, from_jpeg: bool):
        self.items, self.transform, self.from_jpeg = items, transform, from_jpeg

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        import torchvision.io as tio

        img = self.items[i]
        if self.from_jpeg:
            img = tio.decode_jpeg(
                torch.frombuffer(bytearray(img), dtype=torch.uint8), mode=tio.ImageReadMode.RGB
            )
        return self.transform(img), 0


def torchvision_side(items, transform, from_jpeg: bool, batch_size: int) -> Callable[[], int]:
    dl = torch.utils.data.DataLoader(
        _TorchvisionDataset(items, transform, from_jpeg),
        batch_size=batch_size,
        num_workers=2,
        persistent_workers=True,
        shuffle=True,
    )
    return lambda: count(dl)


def tv_cifar():
    import torchvision.transforms.v2 as T

    return T.Compose(
        [
            T.Pad(4, padding_mode="reflect"),
            T.RandomCrop(32),
            T.RandomHorizontalFlip(),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize(MEAN, STD),
        ]
    )


def tv_imagenet():
    import torchvision.transforms.v2 as T

    return T.Compose(
        [
            T.RandomResizedCrop(224, antialias=False),
            T.RandomHorizontalFlip(),
            T.ColorJitter(0.4, 0.4, 0.4, 0.1),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )


# ------------------------------------------------------------------------------------------- kornia
def kornia_missing() -> str | None:
    try:
        import kornia.augmentation  # noqa: F401
    except ImportError as err:
        return f"kornia not installed ({err}; pip install '.[bench]'); not measured"
    return None


def kornia_cifar(device: str = "cpu"):
    import kornia.augmentation as K

    return torch.nn.Sequential(
        K.RandomCrop((32, 32), padding=4, padding_mode="reflect"),
        K.RandomHorizontalFlip(),
        K.Normalize(torch.tensor(MEAN), torch.tensor(STD)),
    ).to(device)


def kornia_imagenet(device: str = "cpu"):
    import kornia.augmentation as K

    return torch.nn.Sequential(
        K.RandomResizedCrop((224, 224)),
        K.RandomHorizontalFlip(),
        K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0),
        K.Normalize(torch.tensor((0.485, 0.456, 0.406)), torch.tensor((0.229, 0.224, 0.225))),
    ).to(device)


def kornia_side(images: torch.Tensor, aug, batch_size: int) -> Callable[[], int]:
    """kornia on batches of the uint8 store (float 0..1, as it wants), shuffled like our loader."""

    def run() -> int:
        order = torch.randperm(len(images))
        with torch.no_grad():
            for s in range(0, len(images), batch_size):
                aug(images[order[s : s + batch_size]].float().div_(255))
        return len(images)

    return run


def kornia_jpeg_side(blobs: list[bytes], aug, batch_size: int) -> Callable[[], int]:
    """kornia on JPEG batches decoded by 2 threads one batch ahead (all the same size here, so they stack)."""
    from concurrent.futures import ThreadPoolExecutor

    import torchvision.io as tio

    pool = ThreadPoolExecutor(2)

    def decode(b: bytes) -> torch.Tensor:
        return tio.decode_jpeg(torch.frombuffer(bytearray(b), dtype=torch.uint8), mode=tio.ImageReadMode.RGB)

    def run() -> int:
        order = torch.randperm(len(blobs)).tolist()
        batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
        pending = [pool.submit(decode, blobs[i]) for i in batches[0]]
        with torch.no_grad():
            for b in range(len(batches)):
                images = torch.stack([f.result() for f in pending])
                if b + 1 < len(batches):
                    pending = [pool.submit(decode, blobs[i]) for i in batches[b + 1]]
                aug(images.float().div_(255))
        return len(blobs)

    return run


# ------------------------------------------------------------------------------------------- ours
def ours_cifar(compile: bool = True, channels_last: bool = True):
    """Our batched equivalent of ``alb_cifar()``, built without albumentations (tests check they agree)."""
    from lcv_vision.data import HorizontalFlip, Normalize, Pipeline, RandomCrop

    return Pipeline(
        [RandomCrop(32, 4, "reflect"), HorizontalFlip(), Normalize(MEAN, STD)],
        compile=compile,
        channels_last=channels_last,
    )


def ours_imagenet(compile: bool = True, channels_last: bool = True):
    """Our batched equivalent of ``alb_imagenet()``, built without albumentations."""
    from lcv_vision.data import ColorJitter, HorizontalFlip, Normalize, Pipeline, RandomResizedCrop

    return Pipeline(
        [RandomResizedCrop(224), HorizontalFlip(), ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0), Normalize()],
        compile=compile,
        channels_last=channels_last,
    )


def ours_side(images: torch.Tensor, pipeline, batch_size: int) -> Callable[[], int]:
    """Our loader over a uint8 store resident where it is (memory, or a GPU): an epoch of shuffled batches,
    synchronised at the end."""
    from lcv_vision.data import DeviceLoader

    device = str(images.device)
    loader = DeviceLoader(
        images, torch.zeros(len(images), dtype=torch.long), batch_size, pipeline, device=device, resident=True
    )

    def run() -> int:
        n = count(loader)
        synchronize(device)
        return n

    return run


def ours_jpeg_side(blobs: list[bytes], pipeline, batch_size: int) -> Callable[[], int]:
    """The real loader path for files: EncodedImages decoded per batch by 2 threads, one batch ahead."""
    from lcv_vision.data import DeviceLoader, EncodedImages

    class InMemory(EncodedImages):  # the bytes are in memory on both sides
        def read(self, i: int) -> bytes:
            return blobs[i]

    enc = InMemory(
        [f"img{i}.jpg" for i in range(len(blobs))], torch.zeros(len(blobs), dtype=torch.long), ["x"]
    )
    loader = DeviceLoader(enc, enc.targets, batch_size, pipeline, decode_threads=2)
    return lambda: count(loader)


def cpu_time_rows(args) -> list[dict]:
    """Single-thread CPU time per image of the augmentation alone (no loader, no decode): albumentations per
    image, ours eager and ours compiled (after a compiling warm-up call) on the same batch.

    Thread CPU time is what the work costs, so it barely moves when other processes share the cores
    (wall-clock throughput does); the wall-clock rows include loading, decoding and parallelism.
    """
    import albumentations  # noqa: F401
    import cv2

    from lcv_vision.data import Pipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    rows = []
    cifar = torch.from_numpy(decode_all(load_jpegs(512, 0))).permute(0, 3, 1, 2).contiguous()
    big = (
        torch.from_numpy(decode_all(load_jpegs(64, max(args.jpeg_size + [256]))))
        .permute(0, 3, 1, 2)
        .contiguous()
    )
    for name, compose, native, images in (
        ("cifar pad-crop+flip+normalize", alb_cifar(), ours_cifar(), cifar),
        ("RRC224+flip+jitter+normalize", alb_imagenet(), ours_imagenet(), big),
    ):
        eager, compiled = Pipeline(native.ops, compile=False), Pipeline(native.ops, compile=True)
        hwc = [im.permute(1, 2, 0).numpy().copy() for im in images]
        times: dict[str, list[float]] = {"eager": [], "compiled": [], "albumentations": []}
        for r in range(args.repeats + 1):  # the first pass (compile, caches) is not counted
            for side, pipe in (("eager", eager), ("compiled", compiled)):
                t = time.thread_time()
                pipe(images, generator=torch.Generator().manual_seed(r))
                times[side].append(time.thread_time() - t)
            t = time.thread_time()
            for im in hwc:
                compose(image=im)
            times["albumentations"].append(time.thread_time() - t)
        ms = {k: statistics.median(v[1:]) / len(images) * 1e3 for k, v in times.items()}
        rows.append(
            {
                "pipeline": name,
                "albumentations_ms_per_img": round(ms["albumentations"], 4),
                "ours_eager_ms_per_img": round(ms["eager"], 4),
                "ours_compiled_ms_per_img": round(ms["compiled"], 4),
                "compiled_vs_albumentations": round(ms["albumentations"] / ms["compiled"], 2),
                "compiled_vs_eager": round(ms["eager"] / ms["compiled"], 2),
            }
        )
    torch.set_num_threads(threads)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cifar-images", type=int, default=8192)
    ap.add_argument("--jpeg-images", type=int, default=256)
    ap.add_argument(
        "--jpeg-size",
        type=int,
        nargs="+",
        default=[0],
        help="re-encode the JPEGs at S x S (0: the native 32 x 32 CIFAR files); several allowed",
    )
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--jpeg-batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-cifar", action="store_true")
    ap.add_argument(
        "--case-seconds",
        type=float,
        default=20.0,
        help="do not start a pipeline with less than this left before the deadline",
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="also report single-thread CPU time per image of the augmentation alone",
    )
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU rows (the CPU sides are skipped)")
    ap.add_argument(
        "--gpu-cifar-images", type=int, default=50_000, help="GPU: images in the CIFAR-size store"
    )
    ap.add_argument("--gpu-rrc-images", type=int, default=4096, help="GPU: images in the 256 x 256 store")
    ap.add_argument(
        "--gpu-cifar-batches", type=int, nargs="+", default=[512, 8192, 25000], help="GPU: our batch sizes"
    )
    ap.add_argument(
        "--gpu-rrc-batches", type=int, nargs="+", default=[256, 1024, 4096], help="GPU: our batch sizes"
    )
    ap.add_argument(
        "--gpu-per-sample-images", type=int, default=1024, help="GPU: images per torchvision v2 pass"
    )
    ap.add_argument("--profile", action="store_true", help="GPU rows: also print a profile of our batches")
    ap.add_argument(
        "--device-rows-on",
        default=None,
        help="run the GPU rows on this device instead (e.g. 'cpu', to try the GPU code on tiny sizes)",
    )
    ap.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of our compiled pipelines instead of Inductor; 'aot_eager' in dry runs: the "
        "same traced graphs, no code generated and built",
    )
    args = ap.parse_args()
    if args.compile_backend:
        import lcv_vision.data.compiled

        # An unknown name fails here in one line, not at the first compiled batch: CompileConfig's rule, checked
        # without importing lightning_plugin (and with it Lightning) into this benchmark.
        known = set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"}
        if args.compile_backend not in known:
            ap.error(
                f"--compile-backend {args.compile_backend!r} is not a registered torch.compile backend; known: "
                f"{sorted(known)}"
            )

        lcv_vision.data.compiled.BACKEND = args.compile_backend
    torch.set_num_threads(2)
    if args.gpu_only:
        args.skip_cifar, args.jpeg_size, args.cpu_time = True, [], False

    src = "real CIFAR-10 JPEGs" if os.path.exists(SHARED_ZIP) else "synthetic JPEGs (shared zip not found)"
    print(
        f"data: {src}; torch {torch.__version__}; CPU threads {torch.get_num_threads()}; "
        f"median of {args.repeats} alternating passes after a warm-up"
    )
    stream = ResultStream("loader")
    no_alb = albumentations_missing()
    if no_alb:
        stream.skip("albumentations side", no_alb)

    def record(name: str, rates: dict[str, list[float]]) -> None:
        ours = rates["ours"]
        row = {"pipeline": name, "device": "cpu", "ours_img_s": round(statistics.median(ours))}
        for side, short in (("albumentations", "alb"), ("torchvision", "tv"), ("kornia", "kornia")):
            if side in rates:
                ratios = [o / a for o, a in zip(ours, rates[side])]
                row[f"{side}_img_s"] = round(statistics.median(rates[side]))
                row[f"vs_{short}"] = round(statistics.median(ratios), 2)
                row[f"vs_{short}_range"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
        stream.add(row)

    no_tv = None
    try:
        import torchvision.transforms.v2  # noqa: F401
    except ImportError as err:
        no_tv = f"torchvision not installed ({err}); not measured"
        stream.skip("torchvision v2 side", no_tv)
    no_kornia = kornia_missing()
    if no_kornia:
        stream.skip("kornia side", no_kornia)

    if not args.skip_cifar and out_of_time(args.case_seconds):
        stream.skip("cifar pad-crop+flip+normalize", "deadline reached")
    elif not args.skip_cifar:
        hwc = decode_all(load_jpegs(args.cifar_images, 0))
        images = torch.from_numpy(hwc).permute(0, 3, 1, 2).contiguous()
        sides = {"ours": ours_side(images, ours_cifar(), args.batch_size)}
        if not no_alb:
            sides["albumentations"] = albumentations_side(list(hwc), alb_cifar(), False, args.batch_size)
        if not no_tv:
            sides["torchvision"] = torchvision_side(list(images), tv_cifar(), False, args.batch_size)
        if not no_kornia:
            sides["kornia"] = kornia_side(images, kornia_cifar(), args.batch_size)
        record("cifar pad-crop+flip+normalize (uint8 in memory)", alternate(sides, args.repeats))
    for size in args.jpeg_size:
        label = f"{size}x{size}" if size else "32x32"
        name = f"imagenet-style RRC224+flip+jitter+normalize (from {label} JPEG)"
        if out_of_time(args.case_seconds):
            stream.skip(name, "deadline reached")
            continue
        blobs = load_jpegs(args.jpeg_images, size)
        sides = {"ours": ours_jpeg_side(blobs, ours_imagenet(), args.jpeg_batch_size)}
        if not no_alb:
            sides["albumentations"] = albumentations_side(blobs, alb_imagenet(), True, args.jpeg_batch_size)
        if not no_tv:
            sides["torchvision"] = torchvision_side(blobs, tv_imagenet(), True, args.jpeg_batch_size)
        if not no_kornia:
            sides["kornia"] = kornia_jpeg_side(blobs, kornia_imagenet(), args.jpeg_batch_size)
        record(name, alternate(sides, args.repeats))
    rows = stream.rows
    if rows:
        print_table(
            rows,
            [
                "pipeline",
                "ours_img_s",
                "albumentations_img_s",
                "vs_alb",
                "vs_alb_range",
                "torchvision_img_s",
                "vs_tv",
                "kornia_img_s",
                "vs_kornia",
            ],
        )
    payload = {"args": vars(args), "data": src, "rows": rows}
    if args.cpu_time and not no_alb:
        cpu_rows = cpu_time_rows(args)
        print(
            "single-thread CPU time per image, augmentation only (ratios: the other side's time / compiled):"
        )
        print_table(
            cpu_rows,
            [
                "pipeline",
                "albumentations_ms_per_img",
                "ours_eager_ms_per_img",
                "ours_compiled_ms_per_img",
                "compiled_vs_albumentations",
                "compiled_vs_eager",
            ],
        )
        payload["cpu_time_rows"] = cpu_rows

    device = args.device_rows_on or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print("GPU: not measured on GPU (no CUDA device on this machine)")
        if not args.gpu_only:
            print(f"wrote {write_results('loader-cpu', payload)}")
        return
    gpu_rows = gpu_measurements(args, stream, device)
    print_table(gpu_rows, ["pipeline", "side", "img_s", "epoch_50k_ms", "of_copy_bandwidth", "ms_per_batch"])
    payload["gpu_rows"] = gpu_rows
    name = "loader-gpu" if device.startswith("cuda") else f"loader-{device}-rows"
    print(f"wrote {write_results(name, payload)}")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes moved per second (read plus written) by a device-to-device copy: the ceiling of a pass."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_ms(lambda: dst.copy_(src), warmup=3, repeats=repeats) / 1e3)


def device_torchvision_side(store: torch.Tensor, transform, n: int) -> Callable[[], int]:
    """torchvision v2 per sample on device tensors (its way to use a GPU: it has no batched random ops)."""

    def run() -> int:
        order = torch.randperm(len(store))[:n].tolist()
        for i in order:
            transform(store[i])
        synchronize(str(store.device))
        return n

    return run


def device_kornia_side(store: torch.Tensor, aug, batch_size: int) -> Callable[[], int]:
    """kornia batched on the resident store (float 0..1, as it wants), shuffled batches."""

    def run() -> int:
        order = torch.randperm(len(store), device=store.device)
        with torch.no_grad():
            for s in range(0, len(store), batch_size):
                aug(store[order[s : s + batch_size]].float().div_(255))
        synchronize(str(store.device))
        return len(store)

    return run


def params_ms(pipeline, batch: int, store: torch.Tensor, repeats: int = 20) -> float:
    """Milliseconds per batch our loader spends drawing the parameters and making the tables (on the CPU,
    the tables of a resample on the device), the part of a batch that does not scale with the GPU."""
    g = torch.Generator().manual_seed(0)
    device = store.device
    shape = tuple(store.shape)
    times = []
    for _ in range(repeats + 3):
        index = torch.randperm(shape[0])[:batch]
        t = time.perf_counter()
        params = pipeline.sample(batch, shape[-2], shape[-1], g)
        pipeline._prepare(params, shape, batch, index, device)
        synchronize(str(device))
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1e3


def profile_batches(store: torch.Tensor, pipeline, batch: int, name: str, batches: int = 3) -> None:
    """Print where a few batches of our compiled loader spend their time: the device's kernels and the CPU's
    own time per op (the rates above say how fast; this says what to work on)."""
    from torch.profiler import ProfilerActivity, profile

    device = str(store.device)
    run = ours_side(store[: batch * batches], pipeline, batch)
    run()  # compiled and warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        run()
    events = prof.key_averages()
    print(f"\nprofile: {name}, {batches} batches of {batch} on {device}", flush=True)
    if device.startswith("cuda"):
        print(events.table(sort_by="self_device_time_total", row_limit=12), flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)


def gpu_measurements(args, stream: ResultStream, device: str = "cuda") -> list[dict]:
    """Every side on the GPU, on a uint8 store resident there (random pixels: the values do not change the
    work).  Ours compiled at several batch sizes (one pipeline: its graph has a dynamic batch size) and
    eager; torchvision v2 per sample; kornia batched (when installed).  Each rate also as the fraction of
    the copy bandwidth it reaches, counting each image's uint8 read once and its float32 output written
    once (the least any pipeline must move)."""
    rows = stream.rows
    start = len(rows)
    bandwidth = copy_bandwidth(device)
    print(f"GPU copy bandwidth (device to device, read + written): {bandwidth / 1e12:.2f} TB/s", flush=True)
    no_kornia = kornia_missing()
    if no_kornia:
        stream.skip("kornia side (GPU)", no_kornia)
    cases = [
        (
            "cifar pad-crop+flip+normalize",
            args.gpu_cifar_images,
            32,
            32,
            ours_cifar,
            tv_cifar,
            kornia_cifar,
            args.gpu_cifar_batches,
        ),
        (
            "imagenet-style RRC224+flip+jitter+normalize (uint8 256x256)",
            args.gpu_rrc_images,
            256,
            224,
            ours_imagenet,
            tv_imagenet,
            kornia_imagenet,
            args.gpu_rrc_batches,
        ),
    ]
    g = torch.Generator(device=device).manual_seed(0)
    for name, n, size, out_size, ours, tv, kornia, batches in cases:
        if out_of_time(args.case_seconds):
            stream.skip(f"{name} (GPU)", "deadline reached")
            continue
        store = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, device=device, generator=g)
        store = store.contiguous(memory_format=torch.channels_last)
        moved = 3 * size * size + 3 * out_size * out_size * 4
        compiled = ours()
        sides = {f"ours compiled, batch {b}": ours_side(store, compiled, b) for b in batches}
        sides[f"ours eager, batch {batches[0]}"] = ours_side(store, ours(compile=False), batches[0])
        sides["torchvision v2 per sample"] = device_torchvision_side(
            store, tv(), min(n, args.gpu_per_sample_images)
        )
        if not no_kornia:
            sides[f"kornia batched, batch {batches[0]}"] = device_kornia_side(
                store, kornia(device), batches[0]
            )
        for side, run in list(sides.items()):  # the warm-up pass; a side that fails is reported, not fatal
            try:
                run()
            except Exception as err:  # noqa: BLE001 - one side's failure must not lose the others' numbers
                stream.skip(f"{name}: {side} (GPU)", f"failed: {type(err).__name__}: {err}")
                del sides[side]
        rates = alternate(sides, args.repeats, warm_up=False)
        for side, rate in rates.items():
            img_s = statistics.median(rate)
            stream.add(
                {
                    "pipeline": name,
                    "device": device,
                    "side": side,
                    "img_s": round(img_s),
                    "epoch_50k_ms": round(50_000 / img_s * 1e3, 1),
                    "of_copy_bandwidth": round(img_s * moved / bandwidth, 4),
                }
            )
        if args.profile:
            profile_batches(store, compiled, batches[-1], name)
        for b in batches:
            stream.add(
                {
                    "pipeline": name,
                    "device": device,
                    "side": f"ours: parameters and tables, batch {b}",
                    "ms_per_batch": round(params_ms(ours(), b, store), 3),
                }
            )
        del store, sides, compiled
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows[start:]


if __name__ == "__main__":
    main()
