"""Quiet one misleading log line of ``torch.utils.cpp_extension`` (a CPU build needs no CUDA).

A CUDA build of torch on a machine without a GPU logs "No CUDA runtime is found" when a C++ extension is first
built, and Inductor's C++ wrapper builds through the same module: it concerns CUDA extensions, which no CPU
build here uses. Lives in the lowest layer because both the strategy's CPU compile and the data package's
C++ colour jitter build C++ code, and the data package must not import Lightning to get it.
"""

from __future__ import annotations

import logging

__all__ = ["quiet_cpp_extension_notice"]


class _NoCUDARuntimeNotice(logging.Filter):
    """Drops the "No CUDA runtime is found" notice; every other message of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def quiet_cpp_extension_notice() -> None:
    """Install the filter on ``torch.utils.cpp_extension``'s logger, once (calling it again adds nothing)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _NoCUDARuntimeNotice) for f in logger.filters):
        logger.addFilter(_NoCUDARuntimeNotice())
