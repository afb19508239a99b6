"""model_type -> model class."""

from __future__ import annotations

from .gemma3 import Gemma3ForCausalLM
from .gpt_oss import GptOssForCausalLM
from .llama import LlamaForCausalLM
from .mixtral import MixtralForCausalLM
from .model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # same architecture; its sliding window is a per-layer AttentionSpec
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)


def model_class(cfg: ModelConfig):
    try:
        return MODEL_CLASSES[cfg.model_type]
    except KeyError:
        raise ValueError(f"model_type: {cfg.model_type!r} is not supported") from None
