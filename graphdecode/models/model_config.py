"""What the engine needs to know about a HuggingFace checkpoint, read from config.json.

`parse_model_config` reads the fields every family shares (sizes, heads, dtype, EOS ids,
soft-caps, ...) and asks the checkpoint's family (its `model_type`) for the rest: each
family file (llama.py, qwen2.py, ..., gpt_oss.py) declares a `Family` that says how its
config class maps config.json onto ModelConfig: its defaults as data (head_dim,
activation, rope rules, sliding window, biases, query scale) and, for what data cannot
say, a method (per-layer window pattern, a second rope, the experts). models/registry.py
lists the families and registers them here when graphdecode.models is imported, so this
module never imports a family and a new family is one file plus its line in the registry.

transformers 4.x and 5.x write the same facts under different keys: 5.x writes
`rope_parameters` and `dtype`, 4.x wrote `rope_theta`/`rope_scaling` and `torch_dtype`.
Both are accepted (rope_config.py reads the rope), so the rest of the engine sees one shape.

Every value is checked before any weight is read, here or in the family's methods (through
config_fields.py's readers): a missing, non-numeric or inconsistent field (heads that do not
divide, a zero size, ...), an unknown model_type and a file that is not JSON are ValueErrors
naming the file's path and the field.

`num_layers` counts the attention layers that hold a KV cache, which is what the
runner allocates; it is `num_hidden_layers` except for a longrope model whose context
reaches past `original_max_position_embeddings`, which keeps a second stream of K/V
for the long factors (models/phi3.py says why).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .config_fields import read_bool, read_float, read_int, read_json_object, read_optional_positive
from .gated_deltanet import LinearAttentionConfig
from .mamba2 import Mamba2Config
from .mla import MLAConfig
from .moe import MoEConfig
from .quant.config import METHODS as QUANT_METHODS
from .quant.config import QuantConfig, parse_quant_config
from .rope_config import RopeConfig, RopeRules, rope_from

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"  # transformers' layer_types
MLP_ONLY = "mlp"  # a layer that is only an MLP (Nemotron-H)
MOE_ONLY = "moe"  # a layer that is only a mixture of experts (Nemotron 3)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


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
    quantization: str | None = None  # the checkpoint's expert weights: None or "mxfp4" (kept in 4 bits)
    weight_quant: QuantConfig | None = None  # the linears' quantized weights (quant/config.py), or None
    # hybrids: the layers layer_types marks LINEAR are recurrent layers of these sizes (Gated DeltaNet: Qwen3.5,
    # Qwen3-Next; mamba2.Mamba2Config: Nemotron-H), holding a per-sequence state instead of K/V (num_layers counts
    # only the attention layers)
    linear: LinearAttentionConfig | Mamba2Config | None = None
    attn_output_gate: bool = False  # attention output times sigmoid of a gate from q_proj (Qwen3.5, Qwen3-Next)
    rope_enabled: bool = True  # False: attention without any position encoding (Nemotron-H; Granite's "nope")
    embedding_multiplier: float = 1.0  # embeddings times this (Granite)
    residual_multiplier: float = 1.0  # each block's output times this before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    # multi-token-prediction layers the checkpoint ships after the decoder's, as model.layers.{N}... (GLM-4.5's
    # num_nextn_predict_layers): the target's load skips them, speculative decoding's "mtp" reads them
    nextn_layers: int = 0
    # multi-head latent attention (DeepSeek-V3, models/mla.py): head_dim is then the cached latent's width and
    # num_kv_heads 1
    mla: MLAConfig | None = None

    @property
    def rope_head_dim(self) -> int:
        """The width the rotary tables rotate within (MLA: the queries' and keys' rope part)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def decoder_layers(self) -> int:
        return self.num_hidden_layers or self.num_layers

    @property
    def long_rope_streams(self) -> bool:
        """A longrope model that can see positions past original_max_position_embeddings (two K/V streams)."""
        return (self.rope.rope_type == "longrope"
                and self.max_position_embeddings > self.rope.original_max_position_embeddings)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The decoder layers that are linear attention (a hybrid's), ascending."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR) if self.linear is not None else ()

    def attends(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a KV cache (an attention layer, not a hybrid's recurrent or MLP-only
        one)."""
        return self.linear is None or self.layer_types[layer] in (FULL, SLIDING)

    def kv_layers_of(self, layers: range | None) -> set[int] | None:
        """The KV-cache layers of these decoder layers (a pipeline stage's); None: all."""
        return None if layers is None else {self.kv_layer(i) for i in layers if self.attends(i)}

    def kv_layer(self, layer: int) -> int:
        """Decoder layer `layer`'s KV-cache layer (a hybrid's attention layers are numbered among themselves)."""
        if self.linear is None:
            return layer
        return sum(1 for t in self.layer_types[:layer] if t in (FULL, SLIDING))

    def layer_window(self, layer: int) -> int | None:
        """Decoder layer `layer`'s sliding window (None: full attention)."""
        if self.sliding_window is None or not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


class Family:
    """How one family's config.json maps onto ModelConfig, as its transformers config class reads it.

    A family file subclasses this: the class attributes are the config class's defaults and
    the module's fixed facts, the methods what data cannot say. The defaults are Llama's
    (with Mistral's window: every layer's, when config.json has one)."""

    model_type: str = ""  # config.json's model_type
    model_class: type | None = None  # the nn.Module that runs it (models/registry.py's model_class)
    head_dim: int | None = None  # head_dim when absent (None: hidden_size / num_attention_heads)
    activation_key: str = "hidden_act"  # the field naming the gated MLP's activation ...
    activation: str = "silu"  # ... and its default
    rope: RopeRules = RopeRules()
    attention_bias: bool = False  # attention_bias's default
    tie_word_embeddings: bool = False  # tie_word_embeddings' default
    query_pre_attn_scalar: float | None = None  # queries scale by this field ** -0.5; its default (None: not read)
    qk_norm: bool = False  # the module has an RMSNorm over head_dim on q and k
    attn_sinks: bool = False  # ... a learned sink logit per head
    norm_weight_fp32: bool = False  # ... RMSNorm multiplying by its weight in float32
    window_switch: str | None = None  # a flag that must be true for sliding_window to apply (Qwen)
    window_default: int | None = None  # the window when config.json has no sliding_window key
    keep_layer_types: bool = False  # layer_types matter without a window (each layer's kind picks its rope)
    quantizations: tuple[str, ...] = ()  # quantization_config quant_methods it loads (its experts' MXFP4)
    attn_output_gate: bool = False  # the module gates attention's output (Qwen3.5, Qwen3-Next)
    text_config: bool = False  # config.json keeps the text model's fields under text_config (a multimodal model)
    intermediate_size: int | None = None  # intermediate_size when config.json has none (None: it is required)
    intermediate_key: str = "intermediate_size"  # the field sizing the (dense) MLPs
    activations: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")  # the MLP activations the module runs
    norm_eps_key: str = "rms_norm_eps"  # the field naming the RMSNorms' epsilon

    def uses_qk_norm(self, where: str, raw: dict) -> bool:
        """Whether the attention has q/k RMSNorms (the class's fixed fact, or a config field's)."""
        return self.qk_norm

    def latent_attention(self, where: str, raw: dict) -> MLAConfig | None:
        """Multi-head latent attention's sizes (None: the attention q/k/v projections make)."""
        return None

    def nextn_layers(self, where: str, raw: dict) -> int:
        """MTP layers stored after the decoder's (ModelConfig.nextn_layers)."""
        return 0

    def rope_enabled(self, where: str, raw: dict) -> bool:
        """Whether attention rotates q and k (False: no position encoding)."""
        return True

    def multipliers(self, where: str, raw: dict) -> tuple[float, float, float]:
        """(embedding_multiplier, residual_multiplier, logits_scaling): 1.0 but for Granite's."""
        return 1.0, 1.0, 1.0

    def attention_scale(self, where: str, raw: dict) -> float | None:
        """The queries' scale (None: head_dim ** -0.5)."""
        return _attn_scale(where, raw, self.query_pre_attn_scalar)

    def num_layers(self, where: str, raw: dict) -> int:
        """Decoder layers (config.json's num_hidden_layers)."""
        return read_int(where, raw, "num_hidden_layers")

    def sliding_window(self, where: str, raw: dict) -> int | None:
        """The sliding layers' window (None: no window)."""
        if self.window_switch is not None and not read_bool(where, raw, self.window_switch):
            return None  # transformers: sliding_window = sliding_window if use_sliding_window else None
        if raw.get("sliding_window") is None:
            return self.window_default if "sliding_window" not in raw else None
        return read_int(where, raw, "sliding_window")

    def layer_types(self, where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
        """Each decoder layer's kind (FULL or SLIDING); here the window, if any, is every layer's."""
        return (SLIDING,) * num_layers

    def biases(self, where: str, raw: dict) -> tuple[bool, bool]:
        """(q/k/v, o_proj) biases: both with attention_bias."""
        bias = read_bool(where, raw, "attention_bias", self.attention_bias)
        return bias, bias

    def ropes(self, where: str, raw: dict, head_dim: int) -> tuple[RopeConfig, RopeConfig | None]:
        """The rope, and the sliding layers' own one (None: the same)."""
        return rope_from(raw, where, self.model_type, self.rope, head_dim=head_dim), None

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig | None:
        """The experts and their routing (None: dense MLPs)."""
        return None

    def linear_attention(self, where: str, raw: dict) -> LinearAttentionConfig | None:
        """A hybrid's linear-attention layers (None: attention only); layer_types marks which are LINEAR."""
        return None


def given_layer_types(where: str, raw: dict, num_layers: int) -> tuple[str, ...] | None:
    """config.json's own layer_types, checked (None: absent), for the config classes that read it."""
    given = raw.get("layer_types")
    if given is None:
        return None
    if not isinstance(given, list) or len(given) != num_layers or any(t not in (FULL, SLIDING) for t in given):
        raise ValueError(f"{where}: layer_types must list {FULL!r} or {SLIDING!r} for each of the "
                         f"{num_layers} layers, got {given!r}")
    return tuple(given)


def read_experts(where: str, raw: dict, key: str, experts: int, top_k: int) -> tuple[int, int]:
    """(experts, experts per token) from `key` and num_experts_per_tok, with the family's defaults."""
    experts = read_int(where, raw, key, experts)
    top_k = read_int(where, raw, "num_experts_per_tok", top_k)
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok ({top_k}) must not exceed {key} ({experts})")
    return experts, top_k


def read_group_routed_moe(where: str, raw: dict, experts: int, top_k: int, size: int, groups: int = 1,
                          topk_groups: int = 1, scaling: float = 1.0, **fields) -> MoEConfig:
    """An MoE routed as DeepSeek-V3 routes (moe.py's "sigmoid_groups"), its routing fields read: `norm_topk_prob`,
    `n_group`, `topk_group`, `routed_scaling_factor` (defaults: the config class's); `fields`: the rest of the
    MoEConfig. Its errors name the file."""
    try:
        return MoEConfig(experts, top_k, size, routing="sigmoid_groups",
                         renormalize=read_bool(where, raw, "norm_topk_prob", True), weights_fp32=True,
                         num_groups=read_int(where, raw, "n_group", groups),
                         topk_groups=read_int(where, raw, "topk_group", topk_groups),
                         routed_scaling=read_float(where, raw, "routed_scaling_factor", scaling), **fields)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def read_grouped_moe(where: str, raw: dict, num_layers: int, defaults: dict) -> MoEConfig | None:
    """DeepSeek-V3's MoE fields (GLM-4.5 shares them): the first `first_k_dense_replace` layers dense, the
    others `n_routed_experts` experts of `moe_intermediate_size` beside `n_shared_experts` ungated shared ones,
    routed by sigmoid scores over `n_group` groups (read_group_routed_moe); `defaults`: the config class's
    (n_routed_experts, num_experts_per_tok, moe_intermediate_size, first_k_dense_replace, n_group, topk_group,
    routed_scaling_factor)."""
    experts, top_k = read_experts(where, raw, "n_routed_experts", defaults["n_routed_experts"],
                                  defaults["num_experts_per_tok"])
    dense = read_int(where, raw, "first_k_dense_replace", defaults["first_k_dense_replace"], minimum=0)
    sparse = tuple(i >= dense for i in range(num_layers))
    if not any(sparse):
        return None
    size = read_int(where, raw, "moe_intermediate_size", defaults["moe_intermediate_size"])
    return read_group_routed_moe(where, raw, experts, top_k, size, defaults["n_group"], defaults["topk_group"],
                                 defaults["routed_scaling_factor"], sparse_layers=sparse, shared_gate=False,
                                 shared_intermediate_size=size * read_int(where, raw, "n_shared_experts", 1,
                                                                          minimum=0))


_FAMILIES: dict[str, Family] = {}  # filled by models/registry.py, in its order


def register_family(family: Family) -> None:
    """Make `family` read the configs whose model_type is family.model_type."""
    if family.model_type in _FAMILIES:
        raise ValueError(f"model_type {family.model_type!r} is registered twice")
    _FAMILIES[family.model_type] = family


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


def _quantization(where: str, raw: dict, family: Family) -> tuple[str | None, QuantConfig | None]:
    """(mxfp4 for a family that dequantises its experts, or None; the linears' QuantConfig, or None)."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None, None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method in family.quantizations:
        return method, None
    if method in QUANT_METHODS:
        if "num_local_experts" in raw or "num_experts" in raw:
            raise ValueError(f"{where}: quantization_config: quant_method {method!r} with a mixture of experts is "
                             f"not supported (quantized experts); dense models only")
        return None, parse_quant_config(where, quant)
    raise ValueError(f"{where}: quantization_config: quant_method {method!r} is not supported (supported: "
                     f"{', '.join(QUANT_METHODS + family.quantizations)})")


def _text_config(where: str, raw: dict) -> dict:
    """A multimodal config.json's text model: text_config's fields, with the top level's LM head tying and
    quantization (what the whole checkpoint's loader reads there)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: text_config must be an object with the text model's fields, got {text!r}")
    shared = {key: raw[key] for key in ("tie_word_embeddings", "quantization_config") if key in raw}
    return {**text, **shared, "model_type": raw["model_type"]}


def _attn_scale(where: str, raw: dict, default: float | None) -> float | None:
    """query_pre_attn_scalar ** -0.5 for a family that reads it (None: head_dim ** -0.5, as with a null one)."""
    scalar = None if default is None else raw.get("query_pre_attn_scalar", default)
    if scalar is None:
        return None
    return read_float(where, {"query_pre_attn_scalar": scalar}, "query_pre_attn_scalar", default) ** -0.5


def parse_model_config(raw: dict, model_dir: str = "") -> ModelConfig:
    """Check and translate config.json's fields; every ValueError names the file and the field."""
    where = os.path.join(model_dir, "config.json") if model_dir else "config.json"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"{where}: model_type: {model_type!r} is not supported (supported: {', '.join(_FAMILIES)})"
        )
    if family.text_config:
        raw = _text_config(where, raw)
    act = raw.get(family.activation_key, family.activation)
    if act not in family.activations:
        raise ValueError(f"{where}: {family.activation_key}: {act!r} is not supported "
                         f"(supported: {', '.join(family.activations)})")
    vocab_size = read_int(where, raw, "vocab_size")
    hidden = read_int(where, raw, "hidden_size")
    key = family.intermediate_key
    intermediate = (read_int(where, raw, key) if family.intermediate_size is None
                    else read_int(where, raw, key, family.intermediate_size))
    num_layers = family.num_layers(where, raw)
    num_heads = read_int(where, raw, "num_attention_heads")
    num_kv_heads = read_int(where, raw, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    if raw.get("head_dim") is None and family.head_dim is None and hidden % num_heads:
        raise ValueError(
            f"{where}: hidden_size ({hidden}) must be divisible by num_attention_heads ({num_heads}) "
            f"when head_dim is not given"
        )
    head_dim = read_int(where, raw, "head_dim", family.head_dim or hidden // num_heads)
    mla = family.latent_attention(where, raw)
    if mla is not None:  # the cache holds one latent head
        num_kv_heads, head_dim = 1, mla.cache_dim
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim ({head_dim}) must be even (rotary embeddings rotate pairs)")
    max_positions = read_int(where, raw, "max_position_embeddings", 2048)
    sliding = family.sliding_window(where, raw)
    keep = family.keep_layer_types
    layer_types = family.layer_types(where, raw, num_layers) if sliding is not None or keep else ()
    if SLIDING not in layer_types:
        sliding = None
        layer_types = layer_types if keep else ()
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise ValueError(f"{where}: dtype: checkpoint dtype {dtype_name!r} is not supported")
    if read_bool(where, raw, "mlp_bias"):
        raise ValueError(f"{where}: mlp_bias: MLP biases are not supported")
    qkv_bias, o_proj_bias = family.biases(where, raw)
    rope, local_rope = family.ropes(where, raw, mla.qk_rope_head_dim if mla is not None else head_dim)
    two_streams = rope.rope_type == "longrope" and max_positions > rope.original_max_position_embeddings
    moe = family.moe(where, raw, num_layers, intermediate)
    quantization, weight_quant = _quantization(where, raw, family)
    linear = family.linear_attention(where, raw)
    multipliers = family.multipliers(where, raw)
    kv_layers = sum(t in (FULL, SLIDING) for t in layer_types) if linear is not None else num_layers
    if linear is not None and not kv_layers:
        raise ValueError(f"{where}: layer_types: a hybrid needs at least one {FULL!r} layer")
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=kv_layers * (2 if two_streams else 1),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=read_float(where, raw, family.norm_eps_key, 1e-6, positive=False),
        max_position_embeddings=max_positions,
        rope=rope,
        tie_word_embeddings=read_bool(where, raw, "tie_word_embeddings", default=family.tie_word_embeddings),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        dtype=_DTYPES[dtype_name],
        eos_token_ids=_eos_ids(model_dir, raw, where) if model_dir else _as_id_tuple(raw.get("eos_token_id"), where),
        sliding_window=sliding,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        qk_norm=family.uses_qk_norm(where, raw),
        hidden_act=act,
        local_rope=local_rope,
        attn_scale=family.attention_scale(where, raw),
        attn_soft_cap=read_optional_positive(where, raw, "attn_logit_softcapping"),
        final_soft_cap=read_optional_positive(where, raw, "final_logit_softcapping"),
        moe=moe,
        attn_sinks=family.attn_sinks,
        norm_weight_fp32=family.norm_weight_fp32,
        quantization=quantization,
        weight_quant=weight_quant,
        linear=linear,
        attn_output_gate=family.attn_output_gate,
        rope_enabled=family.rope_enabled(where, raw),
        embedding_multiplier=multipliers[0],
        residual_multiplier=multipliers[1],
        logits_scaling=multipliers[2],
        nextn_layers=family.nextn_layers(where, raw),
        mla=mla,
    )


def load_model_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: no config.json in {model_dir!r}")
    return parse_model_config(read_json_object(path), model_dir)
