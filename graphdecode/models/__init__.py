"""The models as plain nn.Modules with HuggingFace parameter names over one shared decoder, one
file per family holding its module and how its config.json reads (a Family), the shared config
parsing (model_config.py), the list of families (registry.py) and checkpoint loading (loader.py)."""

from .loader import load_model
from .model_config import ModelConfig, load_model_config
from .registry import model_class

__all__ = ["ModelConfig", "load_model", "load_model_config", "model_class"]
