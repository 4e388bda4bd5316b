"""Recycled CPU output buffers: a batch's output memory is reused once nobody holds the batch any more.

A fresh ``torch.empty`` of a batch of 224 px float images (38 MB for 64) comes from ``mmap``: the kernel then
faults in and zeroes every page on the first write, which costs about a third of what the augmentation itself
does on the CPU.  Reusing the memory of a batch the training step has let go of avoids that.  A buffer is
handed out again only when no tensor or view other than ours refers to its storage, so a batch the caller
still holds is never overwritten.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor


def _only_ours(buffer: Tensor) -> bool:
    # References to the storage: our tensor, the temporary storage object made here, and nothing else.
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2


class OutputBuffers:
    """A few output buffers of one shape and dtype, reused when the caller has dropped them."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._key: tuple | None = None
        self._buffers: list[Tensor] = []

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, memory_format: torch.memory_format) -> Tensor:
        key = (tuple(shape), dtype, memory_format, os.getpid())  # a forked worker starts with its own
        if key != self._key:
            self._key, self._buffers = key, []
        for buffer in self._buffers:
            if _only_ours(buffer):
                return buffer.detach()  # a tensor of its own on the storage: while it lives, it counts
        buffer = torch.empty(shape, dtype=dtype, memory_format=memory_format)
        if len(self._buffers) < self.keep:
            self._buffers.append(buffer)
            return buffer.detach()
        return buffer

    def __getstate__(self) -> dict:
        return {"keep": self.keep, "_key": None, "_buffers": []}  # buffers stay in this process
