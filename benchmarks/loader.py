"""Loader throughput, images/s: our batched pipeline vs albumentations per-sample in a DataLoader.

Same ops on both sides.  Pipelines:
  cifar:    reflect-pad 4 + random crop 32 + horizontal flip + normalize, from uint8 in memory.
  imagenet: (JPEG decode) + random resized crop 224 + flip + colour jitter + normalize.
Both sides use 2 CPU cores (albumentations: 2 DataLoader workers; ours: 2 intra-op threads).  Each
measurement: warm-up, then --repeats timed passes, median reported.  GPU rows (ours on CUDA, torchvision v2
per-sample, kornia when installed) run only when CUDA is available; otherwise "not measured on GPU".

    python benchmarks/loader.py --cifar-images 8192 --jpeg-images 256 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
import zipfile

import numpy as np
import torch

ZIP = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "cifar10-jpeg.zip")
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def load_jpegs(n: int) -> list[bytes]:
    path = os.path.abspath(ZIP)
    if os.path.exists(path):
        with zipfile.ZipFile(path) as zf:
            names = sorted(x for x in zf.namelist() if x.startswith("train/") and x.endswith(".jpg"))[:n]
            return [zf.read(x) for x in names]
    from PIL import Image  # fallback: synthetic JPEGs

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def decode_all(blobs: list[bytes]) -> np.ndarray:
    import cv2

    return np.stack([cv2.cvtColor(cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
                     for b in blobs])


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = fn()
        times.append(n / (time.perf_counter() - t))
    return statistics.median(times)


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


def albumentations_rate(items, transform, from_jpeg, batch_size, repeats) -> float:
    dl = torch.utils.data.DataLoader(_AlbDataset(items, transform, from_jpeg), batch_size=batch_size,
                                     num_workers=2, persistent_workers=True, shuffle=True)

    def run():
        n = 0
        for x, _ in dl:
            n += len(x)
        return n

    return timed(run, repeats)


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


# ------------------------------------------------------------------------------------------- ours
def ours_rate(images: torch.Tensor, compose, batch_size, repeats, device="cpu") -> float:
    from vision.data import DeviceLoader, from_albumentations

    loader = DeviceLoader(images, torch.zeros(len(images), dtype=torch.long), batch_size,
                          from_albumentations(compose), device=device)

    def run():
        n = 0
        for x, _ in loader:
            n += len(x)
        if device != "cpu":
            torch.cuda.synchronize()
        return n

    return timed(run, repeats)


def ours_jpeg_rate(blobs, compose, batch_size, repeats) -> float:
    """Decode (torchvision, 2 threads) + batched pipeline, per batch: the whole path from JPEG bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from vision.data import from_albumentations
    from vision.data.datasets import decode_image_bytes

    pipe = from_albumentations(compose)
    pool = ThreadPoolExecutor(2)
    g = torch.Generator().manual_seed(0)

    def run():
        n = 0
        for s in range(0, len(blobs), batch_size):
            imgs = list(pool.map(lambda b: decode_image_bytes(b, "jpeg"), blobs[s: s + batch_size]))
            x, _ = pipe(torch.stack(imgs), generator=g)
            n += len(x)
        return n

    return timed(run, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cifar-images", type=int, default=8192)
    ap.add_argument("--jpeg-images", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--jpeg-batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)

    blobs = load_jpegs(max(args.cifar_images, args.jpeg_images))
    src = "real CIFAR-10 JPEGs" if os.path.exists(os.path.abspath(ZIP)) else "synthetic JPEGs"
    hwc = decode_all(blobs[: args.cifar_images])
    images = torch.from_numpy(hwc).permute(0, 3, 1, 2).contiguous()
    print(f"data: {src}; torch {torch.__version__}; CPU threads {torch.get_num_threads()}; "
          f"median of {args.repeats} after warm-up")

    rows = []
    a = albumentations_rate(list(hwc), alb_cifar(), False, args.batch_size, args.repeats)
    o = ours_rate(images, alb_cifar(), args.batch_size, args.repeats)
    rows.append(("cifar pad-crop+flip+normalize (uint8 in memory)", "cpu", o, a))
    jb = blobs[: args.jpeg_images]
    a = albumentations_rate(jb, alb_imagenet(), True, args.jpeg_batch_size, args.repeats)
    o = ours_jpeg_rate(jb, alb_imagenet(), args.jpeg_batch_size, args.repeats)
    rows.append(("imagenet-style RRC224+flip+jitter+normalize (from JPEG)", "cpu", o, a))
    print(f"{'pipeline':58s} {'device':6s} {'ours img/s':>12s} {'albument. img/s':>16s} {'ratio':>7s}")
    for name, dev, o, a in rows:
        print(f"{name:58s} {dev:6s} {o:12.0f} {a:16.0f} {o / a:7.2f}x")

    if not torch.cuda.is_available():
        print("GPU: not measured on GPU (no CUDA device on this machine)")
        return
    gpu = ours_rate(images, alb_cifar(), args.batch_size, args.repeats, device="cuda")
    print(f"GPU ours cifar (data resident on device): {gpu:.0f} img/s")
    big = torch.nn.functional.interpolate(images[: args.jpeg_images * 4].float(), size=256).round().byte()
    gpu224 = ours_rate(big, alb_imagenet(), 256, args.repeats, device="cuda")
    print(f"GPU ours imagenet-style from uint8 256x256 (resident): {gpu224:.0f} img/s")
    import torchvision.transforms.v2 as T

    tv = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ColorJitter(0.4, 0.4, 0.4, 0.1),
                    T.ToDtype(torch.float32, scale=True), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    dev_imgs = big.cuda()

    def tv_run():
        for i in range(len(dev_imgs)):
            tv(dev_imgs[i])
        torch.cuda.synchronize()
        return len(dev_imgs)

    print(f"GPU torchvision v2 per-sample imagenet-style: {timed(tv_run, args.repeats):.0f} img/s")
    try:
        import kornia.augmentation as K
    except ImportError:
        print("GPU kornia: not installed, not measured")
    else:
        aug = torch.nn.Sequential(K.RandomResizedCrop((224, 224)), K.RandomHorizontalFlip(),
                                  K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0))

        def k_run():
            for s in range(0, len(dev_imgs), 256):
                aug(dev_imgs[s: s + 256].float() / 255)
            torch.cuda.synchronize()
            return len(dev_imgs)

        print(f"GPU kornia batched imagenet-style: {timed(k_run, args.repeats):.0f} img/s")


if __name__ == "__main__":
    main()
