"""Vision models: a registry (``create_model``) over our architectures, torchvision and timm."""

from lcv_vision.models import airbench, resnet, vit  # noqa: F401  (register the entrypoints)
from lcv_vision.models._registry import create_model, is_model, list_models, register_model
from lcv_vision.models.airbench import AirbenchNet, whitening_weights
from lcv_vision.models.resnet import BasicBlock, Bottleneck, ResNet
from lcv_vision.models.vit import VisionTransformer

__all__ = [
    "AirbenchNet",
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "VisionTransformer",
    "create_model",
    "is_model",
    "list_models",
    "register_model",
    "whitening_weights",
]
