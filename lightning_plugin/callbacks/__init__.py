"""Callbacks for compiled training: monitoring, NaN/Inf guarding, fault-tolerant checkpoints, compiling.

``TrainingMonitor`` is the five monitoring callbacks together (``StepMonitor``, ``ScalarLayout``,
``CompileReport``, ``ImageGrid``, ``HParamsRecord``); each can also be used alone."""

from lightning_plugin.callbacks.compile import TorchCompile
from lightning_plugin.callbacks.compile_report import CompileReport
from lightning_plugin.callbacks.fault_tolerance import FaultTolerantCheckpoint
from lightning_plugin.callbacks.hparams import HParamsRecord
from lightning_plugin.callbacks.image_grid import ImageGrid, NormalizedBatches
from lightning_plugin.callbacks.monitor import TrainingMonitor
from lightning_plugin.callbacks.nan_guard import NonFiniteLossError, NonFiniteLossGuard
from lightning_plugin.callbacks.scalar_layout import ScalarLayout
from lightning_plugin.callbacks.step_monitor import StepMonitor

__all__ = [
    "CompileReport",
    "FaultTolerantCheckpoint",
    "HParamsRecord",
    "ImageGrid",
    "NonFiniteLossError",
    "NonFiniteLossGuard",
    "NormalizedBatches",
    "ScalarLayout",
    "StepMonitor",
    "TorchCompile",
    "TrainingMonitor",
]
