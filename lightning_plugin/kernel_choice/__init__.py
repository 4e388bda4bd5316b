"""``kernels="auto"``: which blocks run our fused kernels, chosen by measurement, cached, and substituted.

May import ``lcv_kernels``, ``lightning_plugin.blocks`` and the top-level modules, never ``strategies``.
"""
