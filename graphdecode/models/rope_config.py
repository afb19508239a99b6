"""The rotary embedding's parameters, read from config.json in either transformers layout.

transformers 5.x writes `rope_parameters`; 4.x wrote `rope_theta` and `rope_scaling`. Both
are read into one RopeConfig, which rope.py turns into cos/sin tables. The scalings are
transformers' own: linear, llama3, YaRN (`_compute_yarn_parameters`) and longrope
(`_compute_longrope_parameters`). What differs by family (the rope types its config class
accepts, its rope_theta default, whether it rotates part of each head, where it keeps
original_max_position_embeddings) is a RopeRules the family file declares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .config_fields import read_bool, read_float, read_int

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


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
class RopeRules:
    """How one family's config class reads its rope; the defaults are LlamaConfig's."""

    types: tuple[str, ...] = ("default", "linear", "llama3", "yarn")  # the rope types it accepts
    aliases: tuple[tuple[str, str], ...] = ()  # (old name, rope type) it reads as another type
    theta: float = 10000.0  # rope_theta when config.json has none
    partial_rotary: bool = False  # config.json's partial_rotary_factor is read and may be below 1
    partial_default: float = 1.0  # partial_rotary_factor when config.json has none (Qwen3.5 / Qwen3-Next: 0.25)
    original_max: int | None = None  # the config class's own original_max_position_embeddings default:
    # its top-level field wins over rope_parameters' copy (None: rope_parameters', else max_position_embeddings)


def rope_params(raw: dict, where: str) -> dict:
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


def rope_from(raw: dict, where: str, model_type: str, rules: RopeRules = RopeRules(), params: dict | None = None,
              head_dim: int | None = None, theta: float | None = None) -> RopeConfig:
    """One rope from config.json (`params`: one set of rope parameters, else the file's only one), checked
    against the family's `rules`; `theta` overrides rules.theta as rope_theta's default."""
    theta_default = rules.theta if theta is None else theta
    if params is None:
        params = rope_params(raw, where)
        if "layer_types" in params or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"{where}: rope_parameters: per-layer rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    for old, new in rules.aliases:
        if rope_type == old:
            rope_type = new
            break
    if rope_type not in rules.types:
        raise ValueError(f"{where}: rope_type: {rope_type!r} is not supported for {model_type} "
                         f"(supported: {', '.join(rules.types)})")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", rules.partial_default)
                         if rules.partial_rotary else 1.0)
    partial = read_float(where, {"partial_rotary_factor": partial}, "partial_rotary_factor", 1.0)
    if partial != 1.0 and not rules.partial_rotary:
        raise ValueError(f"{where}: partial_rotary_factor: only 1.0 is supported for {model_type}")
    if partial > 1.0:
        raise ValueError(f"{where}: partial_rotary_factor must be in (0, 1], got {partial}")
    if params.get("rope_theta") is None:
        params = dict(params, rope_theta=raw.get("rope_theta", theta_default))
    max_positions = read_int(where, raw, "max_position_embeddings", 8192)
    if rules.original_max is not None:
        original = read_int(where, raw, "original_max_position_embeddings", rules.original_max)
    else:
        original = read_int(where, params, "original_max_position_embeddings", max_positions)
    rope = RopeConfig(
        theta=read_float(where, params, "rope_theta", theta_default),
        rope_type=rope_type,
        factor=read_float(where, params, "factor", 1.0),
        low_freq_factor=read_float(where, params, "low_freq_factor", 1.0),
        high_freq_factor=read_float(where, params, "high_freq_factor", 4.0),
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
            rope = _longrope(where, params, rope, max_positions, rotary)
    return rope


def _longrope(where: str, params: dict, rope: RopeConfig, max_positions: int, rotary: int) -> RopeConfig:
    """longrope's fields as transformers' _compute_longrope_parameters reads them: factor defaults to the
    context's growth, the attention factor to sqrt(1 + ln(factor) / ln(original))."""
    original = rope.original_max_position_embeddings
    if original < 2:  # its log divides the attention factor below
        raise ValueError(f"{where}: original_max_position_embeddings must be an integer >= 2 for longrope, got "
                         f"{original}")
    factor = params.get("factor")
    factor = max_positions / original if factor is None else read_float(where, params, "factor", 1.0)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    else:
        attention = read_float(where, params, "attention_factor", 1.0)
    return replace(rope, factor=factor, attention_factor=attention,
                   short_factor=_factors(where, params, "short_factor", rotary // 2),
                   long_factor=_factors(where, params, "long_factor", rotary // 2))


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's mscale (transformers' yarn_get_mscale): 0.1 m ln(scale) + 1, 1 where the scale does not stretch."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(where: str, params: dict, rope: RopeConfig, max_positions: int) -> RopeConfig:
    """YaRN's fields as transformers' _compute_yarn_parameters reads them (original_max_position_embeddings
    defaults to max_position_embeddings, as transformers' standardize_rope_params fills it)."""
    factor = params.get("factor")
    factor = max_positions / rope.original_max_position_embeddings if factor is None else rope.factor

    attention = params.get("attention_factor")
    if attention is not None:
        attention = read_float(where, params, "attention_factor", 1.0)
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention = yarn_mscale(factor, read_float(where, params, "mscale", 1.0)) / yarn_mscale(
            factor, read_float(where, params, "mscale_all_dim", 1.0))
    else:
        attention = yarn_mscale(factor)
    return replace(rope, factor=factor, attention_factor=float(attention),
                   beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                   truncate=read_bool(where, params, "truncate", True))
