"""Pack a zip of files (the CIFAR-10 JPEG zip) small enough to travel to a lent GPU machine, and unpack it
there.

The device tool carries at most 64 MiB with the working tree. The CIFAR-10 JPEG zip is 59.3 MiB: 6.6 MiB of
per-member zip headers (60,000 small files) and 52.7 MiB of JPEG files, most of whose bytes are the same
quantization and Huffman tables repeated in every file. ``pack`` stores the members back to back, with
their offsets and names, in one zlib-compressed ``.npz``: 17.7 MiB, which leaves room for the wheels of the
packages the GPU image lacks. ``unpack`` writes the same members, byte for byte, into a stored zip again,
so every script reads the zip it always reads.

    python benchmarks/device_data.py pack ../shared/data/cifar10-jpeg.zip .device_data/cifar10-jpeg.npz
    python benchmarks/device_data.py unpack .device_data/cifar10-jpeg.npz /tmp/cifar10-jpeg.zip
"""

from __future__ import annotations

import argparse
import os
import zipfile

import numpy as np


def pack(zip_path: str, npz_path: str) -> int:
    """Write every file member of ``zip_path`` into ``npz_path``; return the number of members."""
    with zipfile.ZipFile(zip_path) as zf:
        names = [info.filename for info in zf.infolist() if not info.is_dir()]
        blobs = [zf.read(name) for name in names]
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(b) for b in blobs])
    os.makedirs(os.path.dirname(os.path.abspath(npz_path)), exist_ok=True)
    with open(npz_path, "wb") as f:  # a file object: numpy would otherwise append ".npz" to the name
        np.savez_compressed(  # the tables repeated in every JPEG compress away
            f,
            data=np.frombuffer(b"".join(blobs), dtype=np.uint8),
            offsets=offsets,
            names=np.frombuffer("\n".join(names).encode(), dtype=np.uint8),
        )
    return len(names)


def unpack(npz_path: str, zip_path: str) -> int:
    """Write the members stored by :func:`pack` into a stored (uncompressed) zip; return their number."""
    with np.load(npz_path) as packed:
        data, offsets = packed["data"], packed["offsets"]
        names = packed["names"].tobytes().decode().split("\n")
    if len(names) + 1 != len(offsets):
        raise ValueError(f"{npz_path}: {len(names)} names but {len(offsets) - 1} members; not made by pack()")
    os.makedirs(os.path.dirname(os.path.abspath(zip_path)), exist_ok=True)
    with zipfile.ZipFile(zip_path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, start, end in zip(names, offsets[:-1], offsets[1:]):
            zf.writestr(name, data[start:end].tobytes())
    return len(names)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="zip -> npz")
    p.add_argument("zip")
    p.add_argument("npz")
    u = sub.add_parser("unpack", help="npz -> stored zip")
    u.add_argument("npz")
    u.add_argument("zip")
    args = parser.parse_args()
    if args.command == "pack":
        n = pack(args.zip, args.npz)
        print(f"packed {n} members into {args.npz} ({os.path.getsize(args.npz) / 2**20:.1f} MiB)")
    else:
        n = unpack(args.npz, args.zip)
        print(f"unpacked {n} members into {args.zip} ({os.path.getsize(args.zip) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
