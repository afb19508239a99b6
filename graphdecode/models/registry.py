"""model_type -> model class."""

from __future__ import annotations

from .llama import LlamaForCausalLM
from .model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from .qwen2 import Qwen2ForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # same architecture; sliding window checked by the engine config
    "qwen2": Qwen2ForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)


def model_class(cfg: ModelConfig):
    try:
        return MODEL_CLASSES[cfg.model_type]
    except KeyError:
        raise ValueError(f"model_type: {cfg.model_type!r} is not supported") from None
