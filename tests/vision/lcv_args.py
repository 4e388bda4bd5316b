"""Command-line arguments the in-process ``lcv`` tests share: a tiny airbench and a quiet Trainer."""

TINY_QUIET = [
    "--model.model_kwargs",
    '{"widths": [8, 8, 8]}',
    "--model.whitening_images",
    "64",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
]
