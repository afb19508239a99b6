"""The families this engine runs: model_type -> its Family (how config.json reads) and model class.

FAMILIES is the one list; importing this module registers each family with model_config.py
(which never imports a family), in this order, which is the order errors list them in.
graphdecode.models imports it, so every family is registered before any config is parsed.
"""

from __future__ import annotations

from .deepseek_v3 import DeepseekV3Family
from .gemma3 import Gemma3Family
from .glm4_moe import Glm4MoeFamily
from .gpt_oss import GptOssFamily
from .granite_hybrid import GraniteHybridFamily
from .llama import LlamaFamily, MistralFamily
from .mixtral import MixtralFamily
from .model_config import Family, ModelConfig, register_family
from .nemotron_h import NemotronHFamily
from .phi3 import Phi3Family
from .qwen2 import Qwen2Family
from .qwen3 import Qwen3Family
from .qwen3_5 import Qwen3_5ConditionalFamily, Qwen3_5Family, Qwen3_5MoeConditionalFamily, Qwen3_5MoeFamily
from .qwen3_moe import Qwen3MoeFamily
from .qwen3_next import Qwen3NextFamily

FAMILIES: tuple[Family, ...] = (
    LlamaFamily(),
    MistralFamily(),
    Qwen2Family(),
    Qwen3Family(),
    Phi3Family(),
    Gemma3Family(),
    MixtralFamily(),
    Qwen3MoeFamily(),
    GptOssFamily(),
    Glm4MoeFamily(),
    DeepseekV3Family(),
    Qwen3_5Family(),
    Qwen3_5ConditionalFamily(),
    Qwen3_5MoeFamily(),
    Qwen3_5MoeConditionalFamily(),
    Qwen3NextFamily(),
    NemotronHFamily(),
    GraniteHybridFamily(),
)
for _family in FAMILIES:
    register_family(_family)
MODEL_CLASSES = {family.model_type: family.model_class for family in FAMILIES}


def model_class(cfg: ModelConfig):
    try:
        return MODEL_CLASSES[cfg.model_type]
    except KeyError:
        raise ValueError(f"model_type: {cfg.model_type!r} is not supported") from None
