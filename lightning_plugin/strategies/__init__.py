"""The Lightning strategies: one device (``compiled``), DDP (``compiled_ddp``), and their registered names.

May import ``lightning_plugin.compile``, ``kernel_choice``, ``cpu``, ``callbacks`` and the top-level modules.
"""
