"""Callbacks for compiled training: monitoring, NaN/Inf guarding, fault-tolerant checkpoints, compiling."""

from lightning_plugin.callbacks.compile import TorchCompile
from lightning_plugin.callbacks.fault_tolerance import FaultTolerantCheckpoint
from lightning_plugin.callbacks.monitor import TrainingMonitor
from lightning_plugin.callbacks.nan_guard import NonFiniteLossError, NonFiniteLossGuard

__all__ = [
    "FaultTolerantCheckpoint",
    "NonFiniteLossError",
    "NonFiniteLossGuard",
    "TorchCompile",
    "TrainingMonitor",
]
