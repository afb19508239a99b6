"""What the engine needs to know about a HuggingFace checkpoint, read from config.json.

transformers 4.x and 5.x write the same facts under different keys: 5.x writes
`rope_parameters` and `dtype`, 4.x wrote `rope_theta`/`rope_scaling` and
`torch_dtype`. Both are accepted here, so the rest of the engine sees one shape.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

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
    sliding_window: int | None = None


def _rope_from(raw: dict) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4.x layout
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "layer_types" in params or any(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type: {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor: only 1.0 is supported")
    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _eos_ids(model_dir: str, raw: dict) -> tuple[int, ...]:
    """EOS ids as transformers `generate` uses them: generation_config.json first."""
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
        if gen.get("eos_token_id") is not None:
            return _as_id_tuple(gen["eos_token_id"])
    return _as_id_tuple(raw.get("eos_token_id"))


def parse_model_config(raw: dict, model_dir: str = "") -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type: {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported (only 'silu')")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    sliding = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if dtype_name not in _DTYPES:
        raise ValueError(f"dtype: checkpoint dtype {dtype_name!r} is not supported")
    if raw.get("mlp_bias", False):
        raise ValueError("mlp_bias: MLP biases are not supported")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=_rope_from(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        o_proj_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
        dtype=_DTYPES[dtype_name],
        eos_token_ids=_eos_ids(model_dir, raw) if model_dir else _as_id_tuple(raw.get("eos_token_id")),
        sliding_window=int(sliding) if sliding is not None else None,
    )


def load_model_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: no config.json in {model_dir!r}")
    with open(path) as f:
        raw = json.load(f)
    return parse_model_config(raw, model_dir)
