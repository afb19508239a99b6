"""The models as plain nn.Modules with HuggingFace parameter names (one file per
architecture), their config (models/model_config.py) and checkpoint loading (loader.py)."""

from .loader import load_model
from .model_config import ModelConfig, load_model_config
from .registry import model_class

__all__ = ["ModelConfig", "load_model", "load_model_config", "model_class"]
