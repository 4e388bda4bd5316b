"""Moved to :mod:`lightning_plugin.strategies.ddp` (this path warns: ``lightning_plugin._moved``)."""

from lightning_plugin._moved import forward_to

__getattr__ = forward_to(__name__)
