"""Vision models, recipes, LightningModules, data sets and the GPU augmentation loader."""

# Set before the check below imports lightning_plugin, which reads it: this ``vision`` is ours.
__distribution__ = "lightning-compiled-vision"

from lightning_plugin.package_identity import require_own_package  # noqa: E402

require_own_package("kernels")
