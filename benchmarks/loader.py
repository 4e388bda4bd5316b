"""Loader throughput, images/s: our batched pipeline vs albumentations per sample in a DataLoader.

Same ops on both sides (ours is built from the very same ``A.Compose`` by ``from_albumentations``):
  cifar:    reflect-pad 4 + random crop 32 + horizontal flip + normalize, from uint8 in memory.
  imagenet: JPEG decode + random resized crop 224 + flip + colour jitter (0.4, 0.4, 0.4, 0.1) + normalize.
Both sides get 2 CPU cores: albumentations as 2 DataLoader worker processes, ours as 2 torch threads (the
pipeline runs chunks of the batch on 2 single-threaded workers; JPEGs are decoded by 2 loader threads).
The JPEGs are real CIFAR-10 images (32x32) from the shared zip; ``--jpeg-size S`` re-encodes them upscaled
to S x S (quality 90) so that decoding costs what it does on ImageNet-sized files.

The two sides alternate (albumentations pass, our pass, ...) so that load from other processes hits both
alike; each figure is the median of ``--repeats`` timed passes after a warm-up pass, and the ratio is the
median of the per-repeat ratios.  GPU rows (ours on CUDA, torchvision v2 per sample, kornia when installed)
run only when CUDA is available; otherwise "not measured on GPU".

    python benchmarks/loader.py --cifar-images 8192 --jpeg-images 256 --repeats 5 --jpeg-size 0 256 --cpu-time
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import ResultStream, out_of_time, print_table, write_results  # noqa: E402

ZIP = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "cifar10-jpeg.zip"))
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def load_jpegs(n: int, size: int) -> list[bytes]:
    """``n`` real CIFAR-10 JPEGs (re-encoded at ``size`` x ``size`` when ``size`` > 0); synthetic if no zip."""
    from PIL import Image

    if os.path.exists(ZIP):
        with zipfile.ZipFile(ZIP) as zf:
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
        Image.open(io.BytesIO(b)).convert("RGB").resize((size, size), Image.BICUBIC).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def decode_all(blobs: list[bytes]) -> np.ndarray:
    import cv2

    return np.stack([cv2.cvtColor(cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
                     for b in blobs])


def alternate(sides: dict[str, Callable[[], int]], repeats: int) -> dict[str, list[float]]:
    """img/s of each side, ``repeats`` times, the sides interleaved; one untimed warm-up pass each."""
    for run in sides.values():
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
            img = cv2.cvtColor(cv2.imdecode(np.frombuffer(img, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        return self.transform(image=img)["image"], 0


def albumentations_side(items, transform, from_jpeg: bool, batch_size: int) -> Callable[[], int]:
    dl = torch.utils.data.DataLoader(_AlbDataset(items, transform, from_jpeg), batch_size=batch_size,
                                     num_workers=2, persistent_workers=True, shuffle=True)
    return lambda: count(dl)


def alb_cifar():
    import albumentations as A
    import cv2
    from albumentations.pytorch import ToTensorV2

    return A.Compose([A.Pad(4, border_mode=cv2.BORDER_REFLECT_101), A.RandomCrop(32, 32), A.HorizontalFlip(),
                      A.Normalize(MEAN, STD), ToTensorV2()])


def alb_imagenet():
    import albumentations as A
    from albumentations.pytorch import ToTensorV2

    return A.Compose([A.RandomResizedCrop((224, 224)), A.HorizontalFlip(), A.ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0),
                      A.Normalize(), ToTensorV2()])


def albumentations_missing() -> str | None:
    """Why the albumentations side cannot run here (the GPU machine may lack it), or None."""
    try:
        import albumentations  # noqa: F401
        import cv2  # noqa: F401
    except ImportError as err:
        return f"albumentations not installed ({err}); not measured"
    return None


# ------------------------------------------------------------------------------------------- ours
def ours_cifar():
    """Our batched equivalent of ``alb_cifar()``, built without albumentations (tests check they agree)."""
    from vision.data import HorizontalFlip, Normalize, Pipeline, RandomCrop

    return Pipeline([RandomCrop(32, 4, "reflect"), HorizontalFlip(), Normalize(MEAN, STD)])


def ours_imagenet():
    """Our batched equivalent of ``alb_imagenet()``, built without albumentations."""
    from vision.data import ColorJitter, HorizontalFlip, Normalize, Pipeline, RandomResizedCrop

    return Pipeline([RandomResizedCrop(224), HorizontalFlip(), ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0), Normalize()])


def ours_side(images: torch.Tensor, pipeline, batch_size: int, device: str = "cpu") -> Callable[[], int]:
    from vision.data import DeviceLoader

    loader = DeviceLoader(images, torch.zeros(len(images), dtype=torch.long), batch_size, pipeline, device=device)

    def run() -> int:
        n = count(loader)
        if device != "cpu":
            torch.cuda.synchronize()
        return n

    return run


def ours_jpeg_side(blobs: list[bytes], pipeline, batch_size: int) -> Callable[[], int]:
    """The real loader path for files: EncodedImages decoded per batch by 2 threads, one batch ahead."""
    from vision.data import DeviceLoader, EncodedImages

    class InMemory(EncodedImages):  # the bytes are in memory on both sides
        def read(self, i: int) -> bytes:
            return blobs[i]

    enc = InMemory([f"img{i}.jpg" for i in range(len(blobs))], torch.zeros(len(blobs), dtype=torch.long), ["x"])
    loader = DeviceLoader(enc, enc.targets, batch_size, pipeline, decode_threads=2)
    return lambda: count(loader)


def cpu_time_rows(args) -> list[dict]:
    """Single-thread CPU time per image of the augmentation alone (no loader, no decode), both sides.

    Thread CPU time is what the work costs, so it barely moves when other processes share the cores
    (wall-clock throughput does); the wall-clock rows above include loading, decoding and parallelism.
    """
    import albumentations  # noqa: F401
    import cv2

    from vision.data import from_albumentations

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    rows = []
    cifar = torch.from_numpy(decode_all(load_jpegs(512, 0))).permute(0, 3, 1, 2).contiguous()
    small = torch.from_numpy(decode_all(load_jpegs(64, 0))).permute(0, 3, 1, 2).contiguous()
    for name, compose, images in (("cifar pad-crop+flip+normalize", alb_cifar(), cifar),
                                  ("RRC224+flip+jitter+normalize", alb_imagenet(), small)):
        pipe = from_albumentations(compose)
        hwc = [im.permute(1, 2, 0).numpy().copy() for im in images]
        ours, alb = [], []
        for r in range(args.repeats + 1):
            t = time.thread_time()
            pipe(images, generator=torch.Generator().manual_seed(r))
            ours.append(time.thread_time() - t)
            t = time.thread_time()
            for im in hwc:
                compose(image=im)
            alb.append(time.thread_time() - t)
        o, a = (statistics.median(v[1:]) / len(images) * 1e3 for v in (ours, alb))
        rows.append({"pipeline": name, "ours_ms_per_img": round(o, 4), "albumentations_ms_per_img": round(a, 4),
                     "ratio": round(a / o, 2)})
    torch.set_num_threads(threads)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cifar-images", type=int, default=8192)
    ap.add_argument("--jpeg-images", type=int, default=256)
    ap.add_argument("--jpeg-size", type=int, nargs="+", default=[0],
                    help="re-encode the JPEGs at S x S (0: the native 32 x 32 CIFAR files); several allowed")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--jpeg-batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-cifar", action="store_true")
    ap.add_argument("--case-seconds", type=float, default=20.0,
                    help="do not start a pipeline with less than this left before the deadline")
    ap.add_argument("--cpu-time", action="store_true",
                    help="also report single-thread CPU time per image of the augmentation alone")
    args = ap.parse_args()
    torch.set_num_threads(2)

    src = "real CIFAR-10 JPEGs" if os.path.exists(ZIP) else "synthetic JPEGs (shared zip not found)"
    print(f"data: {src}; torch {torch.__version__}; CPU threads {torch.get_num_threads()}; "
          f"median of {args.repeats} alternating passes after a warm-up")
    stream = ResultStream("loader")
    no_alb = albumentations_missing()
    if no_alb:
        stream.skip("albumentations side", no_alb)

    def record(name: str, rates: dict[str, list[float]]) -> None:
        ours = rates["ours"]
        row = {"pipeline": name, "device": "cpu", "ours_img_s": round(statistics.median(ours))}
        if "albumentations" in rates:
            alb = rates["albumentations"]
            ratios = [o / a for o, a in zip(ours, alb)]
            row.update({"albumentations_img_s": round(statistics.median(alb)),
                        "ratio": round(statistics.median(ratios), 2),
                        "ratio_range": f"{min(ratios):.2f}-{max(ratios):.2f}"})
        stream.add(row)

    if not args.skip_cifar and out_of_time(args.case_seconds):
        stream.skip("cifar pad-crop+flip+normalize", "deadline reached")
    elif not args.skip_cifar:
        hwc = decode_all(load_jpegs(args.cifar_images, 0))
        images = torch.from_numpy(hwc).permute(0, 3, 1, 2).contiguous()
        sides = {"ours": ours_side(images, ours_cifar(), args.batch_size)}
        if not no_alb:
            sides["albumentations"] = albumentations_side(list(hwc), alb_cifar(), False, args.batch_size)
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
        record(name, alternate(sides, args.repeats))
    rows = stream.rows
    print_table(rows, ["pipeline", "device", "ours_img_s", "albumentations_img_s", "ratio", "ratio_range"])
    payload = {"args": vars(args), "data": src, "rows": rows}
    if args.cpu_time and not no_alb:
        cpu_rows = cpu_time_rows(args)
        print("single-thread CPU time per image, augmentation only (ratio = albumentations / ours):")
        print_table(cpu_rows, ["pipeline", "ours_ms_per_img", "albumentations_ms_per_img", "ratio"])
        payload["cpu_time_rows"] = cpu_rows

    if not torch.cuda.is_available():
        print("GPU: not measured on GPU (no CUDA device on this machine)")
        print(f"wrote {write_results('loader-cpu', payload)}")
        return
    gpu_rows = gpu_measurements(args, stream)
    print_table(gpu_rows, ["pipeline", "side", "img_s"])
    payload["gpu_rows"] = gpu_rows
    print(f"wrote {write_results('loader-gpu', payload)}")


def gpu_measurements(args, stream: ResultStream) -> list[dict]:
    """Ours on CUDA (data resident), torchvision v2 per sample, kornia batched (if installed)."""
    import torchvision.transforms.v2 as T

    rows = stream.rows
    start = len(rows)
    hwc = decode_all(load_jpegs(args.cifar_images, 0))
    images = torch.from_numpy(hwc).permute(0, 3, 1, 2).contiguous()
    rate = alternate({"ours": ours_side(images, ours_cifar(), args.batch_size, device="cuda")}, args.repeats)
    stream.add({"pipeline": "cifar", "side": "ours cuda (resident)", "img_s": round(statistics.median(rate["ours"]))})
    big = torch.nn.functional.interpolate(images[: args.jpeg_images * 4].float(), size=256).round().byte()
    rate = alternate({"ours": ours_side(big, ours_imagenet(), 256, device="cuda")}, args.repeats)
    stream.add({"pipeline": "imagenet-style from uint8 256x256", "side": "ours cuda (resident)",
                "img_s": round(statistics.median(rate["ours"]))})
    tv = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ColorJitter(0.4, 0.4, 0.4, 0.1),
                    T.ToDtype(torch.float32, scale=True), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    dev_imgs = big.cuda()

    def tv_run() -> int:
        for i in range(len(dev_imgs)):
            tv(dev_imgs[i])
        torch.cuda.synchronize()
        return len(dev_imgs)

    rate = alternate({"tv": tv_run}, args.repeats)
    stream.add({"pipeline": "imagenet-style from uint8 256x256", "side": "torchvision v2 per sample",
                "img_s": round(statistics.median(rate["tv"]))})
    try:
        import kornia.augmentation as K
    except ImportError:
        stream.skip("kornia batched", "kornia not installed; not measured")
        return rows[start:]
    aug = torch.nn.Sequential(K.RandomResizedCrop((224, 224)), K.RandomHorizontalFlip(),
                              K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0))

    def k_run() -> int:
        for s in range(0, len(dev_imgs), 256):
            aug(dev_imgs[s: s + 256].float() / 255)
        torch.cuda.synchronize()
        return len(dev_imgs)

    rate = alternate({"kornia": k_run}, args.repeats)
    stream.add({"pipeline": "imagenet-style from uint8 256x256", "side": "kornia batched",
                "img_s": round(statistics.median(rate["kornia"]))})
    return rows[start:]


if __name__ == "__main__":
    main()
