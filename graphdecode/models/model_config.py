"""What the engine needs to know about a HuggingFace checkpoint, read from config.json.

transformers 4.x and 5.x write the same facts under different keys: 5.x writes
`rope_parameters` and `dtype`, 4.x wrote `rope_theta`/`rope_scaling` and
`torch_dtype`. Both are accepted here, so the rest of the engine sees one shape.

Every value is checked here, before any weight is read: a missing, non-numeric or
inconsistent field (heads that do not divide, a zero size, ...) and a file that is
not JSON are ValueErrors naming the file's path and the field.
"""

from __future__ import annotations

import json
import math
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


def _rope_from(raw: dict, where: str = "config.json") -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4.x layout
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ValueError(f"{where}: rope_scaling must be an object or null, got {scaling!r}")
        params = dict(scaling or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    elif not isinstance(params, dict):
        raise ValueError(f"{where}: rope_parameters must be an object, got {params!r}")
    if "layer_types" in params or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: rope_parameters: per-layer rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope_type: {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor: only 1.0 is supported")
    if params.get("rope_theta") is None:
        params = dict(params, rope_theta=raw.get("rope_theta", 10000.0))
    rope = RopeConfig(
        theta=_float(where, params, "rope_theta", 10000.0),
        rope_type=rope_type,
        factor=_float(where, params, "factor", 1.0),
        low_freq_factor=_float(where, params, "low_freq_factor", 1.0),
        high_freq_factor=_float(where, params, "high_freq_factor", 4.0),
        original_max_position_embeddings=_int(
            where, params, "original_max_position_embeddings", _int(where, raw, "max_position_embeddings", 8192)
        ),
    )
    if rope_type == "llama3" and not rope.high_freq_factor > rope.low_freq_factor:
        raise ValueError(
            f"{where}: rope high_freq_factor ({rope.high_freq_factor}) must exceed low_freq_factor "
            f"({rope.low_freq_factor}) for llama3 rope scaling"
        )
    return rope


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
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act: {act!r} is not supported (only 'silu')")
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
    if raw.get("head_dim") is None and hidden % num_heads:
        raise ValueError(
            f"{where}: hidden_size ({hidden}) must be divisible by num_attention_heads ({num_heads}) "
            f"when head_dim is not given"
        )
    head_dim = _int(where, raw, "head_dim", hidden // num_heads)
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim ({head_dim}) must be even (rotary embeddings rotate pairs)")
    max_positions = _int(where, raw, "max_position_embeddings", 2048)
    sliding = raw.get("sliding_window")
    if model_type == "qwen2" and not _bool(where, raw, "use_sliding_window"):
        sliding = None
    if sliding is not None:
        sliding = _int(where, raw, "sliding_window")
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise ValueError(f"{where}: dtype: checkpoint dtype {dtype_name!r} is not supported")
    if _bool(where, raw, "mlp_bias"):
        raise ValueError(f"{where}: mlp_bias: MLP biases are not supported")
    attention_bias = _bool(where, raw, "attention_bias")
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(where, raw, "rms_norm_eps", 1e-6, positive=False),
        max_position_embeddings=max_positions,
        rope=_rope_from(raw, where),
        tie_word_embeddings=_bool(where, raw, "tie_word_embeddings"),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_proj_bias=model_type != "qwen2" and attention_bias,
        dtype=_DTYPES[dtype_name],
        eos_token_ids=_eos_ids(model_dir, raw, where) if model_dir else _as_id_tuple(raw.get("eos_token_id"), where),
        sliding_window=sliding,
    )


def load_model_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: no config.json in {model_dir!r}")
    return parse_model_config(read_json_object(path), model_dir)
