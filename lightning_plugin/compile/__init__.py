"""``torch.compile`` for a LightningModule: the compiler, the compile-or-eager decision, the stats, the caches,
and the mixin the strategies share.

May import ``lightning_plugin.kernel_choice``, ``cpu`` and the top-level modules, never ``strategies``.
"""
