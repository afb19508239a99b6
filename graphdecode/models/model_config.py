"""What the engine needs to know about a HuggingFace checkpoint, read from config.json.

transformers 4.x and 5.x write the same facts under different keys: 5.x writes
`rope_parameters` and `dtype`, 4.x wrote `rope_theta`/`rope_scaling` and
`torch_dtype`. Both are accepted here, so the rest of the engine sees one shape.

Every value is checked here, before any weight is read: a missing, non-numeric or
inconsistent field (heads that do not divide, a zero size, ...) and a file that is
not JSON are ValueErrors naming the file's path and the field.

The families differ here by a few facts, which the model files turn into modules:
q/k RMSNorm (Qwen3, Gemma 3), per-layer sliding windows (`layer_types`: Mistral and
Phi-3 window every layer, Qwen2/3 the layers from `max_window_layers` on when
`use_sliding_window`, Gemma 3 five of every six), partial rotary and `longrope`
(Phi-3), a second rope for the local layers, GeGLU, a query scale and soft-caps (Gemma 3).

`num_layers` counts the attention layers that hold a KV cache, which is what the
runner allocates; it is `num_hidden_layers` except for a longrope model whose context
reaches past `original_max_position_embeddings`, which keeps a second stream of K/V
for the long factors (models/phi3.py says why).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

import torch

from .moe import MoEConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "mixtral", "qwen3_moe", "gpt_oss")
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0  # the rotated fraction of each head (Phi-3: the first dims)
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original length
    long_factor: tuple[float, ...] = ()  # ... and beyond it
    attention_factor: float = 1.0  # cos and sin are scaled by it (longrope, yarn)
    beta_fast: float = 32.0  # yarn: the correction range's bounds, in rotations
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the correction range outwards to whole dims

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's dims rotate (transformers: int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama with attention_bias)
    o_proj_bias: bool  # o_proj carries a bias (Llama with attention_bias only)
    dtype: torch.dtype  # the checkpoint's own dtype
    eos_token_ids: tuple[int, ...] = field(default=())
    sliding_window: int | None = None  # the window of the sliding layers (None: no layer has one)
    num_hidden_layers: int = 0  # decoder layers (0: num_layers); num_layers counts KV-cache layers
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per decoder layer (empty: all FULL)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rotary (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation
    local_rope: RopeConfig | None = None  # the sliding layers' own rope (Gemma 3); None: `rope`
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    attn_soft_cap: float | None = None  # attention scores soft-capped (Gemma 2/3 attn_logit_softcapping)
    final_soft_cap: float | None = None  # logits soft-capped (final_logit_softcapping)
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (Mixtral, Qwen3-MoE, gpt-oss)
    attn_sinks: bool = False  # a learned sink logit per head in every softmax (gpt-oss `self_attn.sinks`)
    norm_weight_fp32: bool = False  # RMSNorm multiplies by its weight before the cast back (gpt-oss)
    quantization: str | None = None  # the checkpoint's expert weights: None or "mxfp4" (dequantised at load)

    @property
    def decoder_layers(self) -> int:
        return self.num_hidden_layers or self.num_layers

    @property
    def long_rope_streams(self) -> bool:
        """A longrope model that can see positions past original_max_position_embeddings (two K/V streams)."""
        return (self.rope.rope_type == "longrope"
                and self.max_position_embeddings > self.rope.original_max_position_embeddings)

    def layer_window(self, layer: int) -> int | None:
        """Decoder layer `layer`'s sliding window (None: full attention)."""
        if self.sliding_window is None or not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


_REQUIRED = object()


def read_json_object(path: str) -> dict:
    """A JSON file that must hold an object; every failure is a ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); is the file truncated?"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not valid JSON (the file is not UTF-8 text)") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(raw).__name__}")
    return raw


def _int(where: str, raw: dict, key: str, default=_REQUIRED, minimum: int = 1) -> int:
    """raw[key] as an int >= minimum (an integral float such as 64.0 is accepted); null means absent."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{where}: {key} is missing")
        return default
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _float(where: str, raw: dict, key: str, default: float, positive: bool = True) -> float:
    """raw[key] as a finite float, > 0 (positive) or >= 0; null means absent."""
    value = raw.get(key)
    if value is None:
        return float(default)
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be a finite number {bound}, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{where}: {key} must be a finite number {bound}, got {value!r}")
    return float(value)


def _bool(where: str, raw: dict, key: str, default: bool = False) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _rope_params(raw: dict, where: str) -> dict:
    """The rope parameters as one dict, from either layout (5.x rope_parameters, 4.x rope_theta/rope_scaling)."""
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4.x layout
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ValueError(f"{where}: rope_scaling must be an object or null, got {scaling!r}")
        params = dict(scaling or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    elif not isinstance(params, dict):
        raise ValueError(f"{where}: rope_parameters must be an object, got {params!r}")
    return dict(params)


def _factors(where: str, params: dict, key: str, count: int) -> tuple[float, ...]:
    value = params.get(key)
    if not isinstance(value, (list, tuple)) or len(value) != count or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value
    ):
        raise ValueError(f"{where}: rope {key} must be a list of {count} positive numbers (rotary dims / 2), "
                         f"got {value!r}")
    return tuple(float(v) for v in value)


def _rope_from(raw: dict, where: str = "config.json", model_type: str = "llama", params: dict | None = None,
               head_dim: int | None = None, theta_default: float = 10000.0) -> RopeConfig:
    if params is None:
        params = _rope_params(raw, where)
        if "layer_types" in params or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"{where}: rope_parameters: per-layer rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("su", "yarn") and model_type == "phi3":
        rope_type = "longrope"  # transformers' Phi3Config reads these old names as longrope
    allowed = ("default", "longrope") if model_type == "phi3" else tuple(t for t in SUPPORTED_ROPE_TYPES
                                                                         if t != "longrope")
    if model_type == "gemma3_text":
        allowed = tuple(t for t in allowed if t != "yarn")
    if rope_type not in allowed:
        raise ValueError(f"{where}: rope_type: {rope_type!r} is not supported for {model_type} "
                         f"(supported: {', '.join(allowed)})")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0) if model_type == "phi3"
                         else 1.0)
    partial = _float(where, {"partial_rotary_factor": partial}, "partial_rotary_factor", 1.0)
    if partial != 1.0 and model_type != "phi3":
        raise ValueError(f"{where}: partial_rotary_factor: only 1.0 is supported for {model_type}")
    if partial > 1.0:
        raise ValueError(f"{where}: partial_rotary_factor must be in (0, 1], got {partial}")
    if params.get("rope_theta") is None:
        params = dict(params, rope_theta=raw.get("rope_theta", theta_default))
    max_positions = _int(where, raw, "max_position_embeddings", 8192)
    if model_type == "phi3":  # transformers: Phi3Config's own field wins over rope_parameters' copy
        original = _int(where, raw, "original_max_position_embeddings", 4096)
    else:
        original = _int(where, params, "original_max_position_embeddings", max_positions)
    rope = RopeConfig(
        theta=_float(where, params, "rope_theta", theta_default),
        rope_type=rope_type,
        factor=_float(where, params, "factor", 1.0),
        low_freq_factor=_float(where, params, "low_freq_factor", 1.0),
        high_freq_factor=_float(where, params, "high_freq_factor", 4.0),
        original_max_position_embeddings=original,
        partial_rotary_factor=partial,
    )
    if rope_type == "yarn":
        rope = _yarn(where, params, rope, max_positions)
    if rope_type == "llama3" and not rope.high_freq_factor > rope.low_freq_factor:
        raise ValueError(
            f"{where}: rope high_freq_factor ({rope.high_freq_factor}) must exceed low_freq_factor "
            f"({rope.low_freq_factor}) for llama3 rope scaling"
        )
    if head_dim is not None:
        rotary = rope.rotary_dim(head_dim)
        if rotary < 2 or rotary % 2:
            raise ValueError(f"{where}: partial_rotary_factor ({partial}) leaves {rotary} rotary dims of head_dim "
                             f"{head_dim}; they must be a positive even number")
        if rope_type == "longrope":
            # transformers' _compute_longrope_parameters: factor defaults to the context's growth
            factor = params.get("factor")
            factor = max_positions / original if factor is None else _float(where, params, "factor", 1.0)
            attention = params.get("attention_factor")
            if attention is None:
                attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            else:
                attention = _float(where, params, "attention_factor", 1.0)
            rope = replace(rope, factor=factor, attention_factor=attention,
                           short_factor=_factors(where, params, "short_factor", rotary // 2),
                           long_factor=_factors(where, params, "long_factor", rotary // 2))
    return rope


def _yarn(where: str, params: dict, rope: RopeConfig, max_positions: int) -> RopeConfig:
    """YaRN's fields as transformers' _compute_yarn_parameters reads them (original_max_position_embeddings
    defaults to max_position_embeddings, as transformers' standardize_rope_params fills it)."""
    factor = params.get("factor")
    factor = max_positions / rope.original_max_position_embeddings if factor is None else rope.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is not None:
        attention = _float(where, params, "attention_factor", 1.0)
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention = mscale(factor, _float(where, params, "mscale", 1.0)) / mscale(
            factor, _float(where, params, "mscale_all_dim", 1.0))
    else:
        attention = mscale(factor)
    return replace(rope, factor=factor, attention_factor=float(attention),
                   beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                   truncate=_bool(where, params, "truncate", True))


def _as_id_tuple(value, where: str = "config.json") -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if not isinstance(value, (list, tuple)) else list(value)
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: eos_token_id must be a token id >= 0 or a list of them, got {value!r}")
    return tuple(ids)


def _eos_ids(model_dir: str, raw: dict, where: str = "config.json") -> tuple[int, ...]:
    """EOS ids as transformers `generate` uses them: generation_config.json first."""
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        gen = read_json_object(gen_path)
        if gen.get("eos_token_id") is not None:
            return _as_id_tuple(gen["eos_token_id"], gen_path)
    return _as_id_tuple(raw.get("eos_token_id"), where)


# the config classes' defaults when head_dim is absent
_HEAD_DIM_DEFAULTS = {"qwen3": 128, "gemma3_text": 256, "gpt_oss": 64}


def _layer_types(where: str, raw: dict, model_type: str, num_layers: int) -> tuple[str, ...]:
    """Each decoder layer's kind, as transformers' config classes derive it."""
    given = raw.get("layer_types")
    if given is not None and model_type in ("qwen2", "qwen3", "gemma3_text", "gpt_oss"):
        if not isinstance(given, list) or len(given) != num_layers or any(t not in (FULL, SLIDING) for t in given):
            raise ValueError(f"{where}: layer_types must list {FULL!r} or {SLIDING!r} for each of the "
                             f"{num_layers} layers, got {given!r}")
        return tuple(given)
    if model_type in ("qwen2", "qwen3"):
        first = _int(where, raw, "max_window_layers", 28, minimum=0)
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    if model_type == "gemma3_text":
        pattern = _int(where, raw, "sliding_window_pattern", 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if model_type == "gpt_oss":  # GptOssConfig: even layers local, odd layers global
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    return (SLIDING,) * num_layers  # mistral, mixtral, qwen3_moe, phi3: the window (if any) is every layer's


def _sliding_window(where: str, raw: dict, model_type: str) -> int | None:
    if model_type == "llama":
        return None  # LlamaConfig has no window
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not _bool(where, raw, "use_sliding_window"):
        return None  # transformers: sliding_window = sliding_window if use_sliding_window else None
    if raw.get("sliding_window") is None:
        if "sliding_window" not in raw and model_type in _WINDOW_DEFAULTS:
            return _WINDOW_DEFAULTS[model_type]
        return None
    window = _int(where, raw, "sliding_window")
    if model_type == "gemma3_text" and _bool(where, raw, "use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention: bidirectional Gemma 3 is not supported")
    return window


_THETA_DEFAULTS = {"mixtral": 1_000_000.0, "gpt_oss": 150_000.0}  # the config classes' rope_theta defaults
_WINDOW_DEFAULTS = {"gemma3_text": 4096, "gpt_oss": 128, "qwen3_moe": 4096}  # the config classes' defaults


def _optional_positive(where: str, raw: dict, key: str) -> float | None:
    return None if raw.get(key) is None else _float(where, raw, key, 1.0)


def parse_model_config(raw: dict, model_dir: str = "") -> ModelConfig:
    """Check and translate config.json's fields; every ValueError names the file and the field."""
    where = os.path.join(model_dir, "config.json") if model_dir else "config.json"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type: {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    gemma = model_type == "gemma3_text"
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = raw.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{where}: {act_key}: {act!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    vocab_size = _int(where, raw, "vocab_size")
    hidden = _int(where, raw, "hidden_size")
    intermediate = _int(where, raw, "intermediate_size")
    num_layers = _int(where, raw, "num_hidden_layers")
    num_heads = _int(where, raw, "num_attention_heads")
    num_kv_heads = _int(where, raw, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    default_head_dim = _HEAD_DIM_DEFAULTS.get(model_type)
    if raw.get("head_dim") is None and default_head_dim is None and hidden % num_heads:
        raise ValueError(
            f"{where}: hidden_size ({hidden}) must be divisible by num_attention_heads ({num_heads}) "
            f"when head_dim is not given"
        )
    head_dim = _int(where, raw, "head_dim", default_head_dim or hidden // num_heads)
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim ({head_dim}) must be even (rotary embeddings rotate pairs)")
    max_positions = _int(where, raw, "max_position_embeddings", 2048)
    sliding = _sliding_window(where, raw, model_type)
    layer_types = _layer_types(where, raw, model_type, num_layers) if sliding is not None or gemma else ()
    if SLIDING not in layer_types:
        sliding = None
        layer_types = layer_types if gemma else ()  # Gemma 3 picks each layer's rope by its type
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise ValueError(f"{where}: dtype: checkpoint dtype {dtype_name!r} is not supported")
    if _bool(where, raw, "mlp_bias"):
        raise ValueError(f"{where}: mlp_bias: MLP biases are not supported")
    attention_bias = _bool(where, raw, "attention_bias", model_type == "gpt_oss") and model_type != "phi3"
    if gemma:
        rope, local_rope = _gemma3_ropes(raw, where, head_dim)
    else:
        rope = _rope_from(raw, where, model_type, head_dim=head_dim,
                          theta_default=_THETA_DEFAULTS.get(model_type, 10000.0))
        local_rope = None
    two_streams = rope.rope_type == "longrope" and max_positions > rope.original_max_position_embeddings
    moe = _moe_config(where, raw, model_type, num_layers, intermediate) if model_type in MOE_MODEL_TYPES else None
    quantization = _quantization(where, raw, model_type)
    scalar = raw.get("query_pre_attn_scalar", 256) if gemma else None
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers * (2 if two_streams else 1),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(where, raw, "rms_norm_eps", 1e-6, positive=False),
        max_position_embeddings=max_positions,
        rope=rope,
        tie_word_embeddings=_bool(where, raw, "tie_word_embeddings", default=gemma),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_proj_bias=model_type != "qwen2" and attention_bias,
        dtype=_DTYPES[dtype_name],
        eos_token_ids=_eos_ids(model_dir, raw, where) if model_dir else _as_id_tuple(raw.get("eos_token_id"), where),
        sliding_window=sliding,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        hidden_act=act,
        local_rope=local_rope,
        attn_scale=None if scalar is None else _float(where, {"query_pre_attn_scalar": scalar},
                                                      "query_pre_attn_scalar", 256) ** -0.5,
        attn_soft_cap=_optional_positive(where, raw, "attn_logit_softcapping"),
        final_soft_cap=_optional_positive(where, raw, "final_logit_softcapping"),
        moe=moe,
        attn_sinks=model_type == "gpt_oss",
        norm_weight_fp32=model_type == "gpt_oss",
        quantization=quantization,
    )


def _moe_config(where: str, raw: dict, model_type: str, num_layers: int, intermediate: int) -> MoEConfig:
    """The experts and their routing, as each family's config class and modules read them."""
    key = "num_experts" if model_type == "qwen3_moe" and raw.get("num_experts") is not None else "num_local_experts"
    experts = _int(where, raw, key, 128 if model_type != "mixtral" else 8)
    top_k = _int(where, raw, "num_experts_per_tok", {"mixtral": 2, "qwen3_moe": 8, "gpt_oss": 4}[model_type])
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok ({top_k}) must not exceed {key} ({experts})")
    if model_type == "gpt_oss":
        return MoEConfig(experts, top_k, intermediate, routing="topk_softmax", router_bias=True, expert_bias=True,
                         activation="gpt_oss", swiglu_alpha=_float(where, raw, "swiglu_alpha", 1.702),
                         swiglu_limit=_float(where, raw, "swiglu_limit", 7.0))
    if model_type == "mixtral":
        return MoEConfig(experts, top_k, intermediate, renormalize=True, weights_fp32=True)
    step = _int(where, raw, "decoder_sparse_step", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
                                              for i in dense):
        raise ValueError(f"{where}: mlp_only_layers must list layer indices below {num_layers}, got {dense!r}")
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoEConfig(experts, top_k, _int(where, raw, "moe_intermediate_size", 768),
                     renormalize=_bool(where, raw, "norm_topk_prob"), sparse_layers=sparse)


def _quantization(where: str, raw: dict, model_type: str) -> str | None:
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if model_type == "gpt_oss" and method == "mxfp4":
        return "mxfp4"
    raise ValueError(f"{where}: quantization_config: quant_method {method!r} is not supported"
                     + (" (gpt_oss: mxfp4, dequantised at load)" if model_type == "gpt_oss" else
                        " (weights must be float32, float16 or bfloat16)"))


def _gemma3_ropes(raw: dict, where: str, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's two ropes: the global layers' (rope_theta, with rope_scaling) and the local layers'
    (rope_local_base_freq), from rope_parameters keyed by layer type or the 4.x fields."""
    params = raw.get("rope_parameters")
    if params is None:
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ValueError(f"{where}: rope_scaling must be an object or null, got {scaling!r}")
        full = dict(scaling or {}, rope_theta=raw.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    elif isinstance(params, dict) and set(params) <= {FULL, SLIDING}:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        raise ValueError(f"{where}: rope_parameters must map {FULL!r} and {SLIDING!r} to rope parameters, "
                         f"got {params!r}")
    return (_rope_from(raw, where, "gemma3_text", dict(full), head_dim, theta_default=1_000_000.0),
            _rope_from(raw, where, "gemma3_text", dict(local), head_dim, theta_default=10_000.0))


def load_model_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: no config.json in {model_dir!r}")
    return parse_model_config(read_json_object(path), model_dir)
