"""Vision models, recipes, LightningModules, data sets and the GPU augmentation loader."""
