"""The "No CUDA runtime is found" notice of ``torch.utils.cpp_extension`` is dropped, and nothing else is."""

from __future__ import annotations

import logging

from lcv_kernels.cpp_extension_notice import quiet_cpp_extension_notice


def test_only_the_cuda_runtime_notice_is_dropped_and_the_filter_is_installed_once(caplog):
    logger = logging.getLogger("torch.utils.cpp_extension")
    quiet_cpp_extension_notice()
    quiet_cpp_extension_notice()
    ours = [f for f in logger.filters if type(f).__module__ == "lcv_kernels.cpp_extension_notice"]
    assert len(ours) == 1
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'")
        logger.warning("Emitting ninja build file %s", "build.ninja")
    assert [r.getMessage() for r in caplog.records] == ["Emitting ninja build file build.ninja"]
