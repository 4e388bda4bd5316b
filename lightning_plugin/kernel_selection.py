"""Moved to :mod:`lightning_plugin.kernel_choice.selection` (this path warns: ``lightning_plugin._moved``)."""

from lightning_plugin._moved import forward_to

__getattr__ = forward_to(__name__)
