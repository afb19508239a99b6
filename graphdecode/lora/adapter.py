"""A PEFT LoRA adapter's files, checked against the model before any weight is read, then read.

PEFT (`peft.LoraModel.save_pretrained`, what vLLM and SGLang load) writes `adapter_config.json` (peft_type
"LORA", r, lora_alpha, use_rslora, target_modules, rank_pattern / alpha_pattern, ...) and
`adapter_model.safetensors` (or the older `adapter_model.bin`) with, per adapted projection,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight` [r, in] and `....lora_B.weight` [out, r].

A projection's update is `B A x * scaling`, scaling = lora_alpha / r (use_rslora: lora_alpha / sqrt(r)), with
rank_pattern / alpha_pattern overriding r and alpha per module as PEFT matches them. `check_adapter` reads the
config and the tensors' headers only: every tensor must be an attention or MLP projection this engine adapts
(q/k/v/o, gate/up/down, or a fused qkv_proj / gate_up_proj as Phi-3 stores them) of a layer the model has, of the
model's shapes, at a rank of at most max_lora_rank; what PEFT can save but this engine does not run (DoRA, bias
training, modules_to_save, LoRA on the embedding or the LM head) is refused by name. `read_adapter` then reads
the weights, B already times its scaling.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from ..models.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint projection's update lands: the fused module, its column group (q, k, v: 0, 1, 2),
    and the output rows it writes."""

    module: str  # qkv_proj, o_proj, gate_up_proj or down_proj
    group: int
    row_offset: int
    rows: int
    in_features: int


# groups of each adapted module: one set of LoRA columns per shard it fuses
GROUPS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_PARENTS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


def targets(cfg: ModelConfig) -> dict[tuple[str, str], Target]:
    """(parent, checkpoint projection name) -> Target, from the model's sizes."""
    hidden, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {
        ("self_attn", "q_proj"): Target("qkv_proj", 0, 0, q, hidden),
        ("self_attn", "k_proj"): Target("qkv_proj", 1, q, kv, hidden),
        ("self_attn", "v_proj"): Target("qkv_proj", 2, q + kv, kv, hidden),
        ("self_attn", "qkv_proj"): Target("qkv_proj", 0, 0, q + 2 * kv, hidden),
        ("self_attn", "o_proj"): Target("o_proj", 0, 0, hidden, q),
        ("mlp", "gate_proj"): Target("gate_up_proj", 0, 0, inter, hidden),
        ("mlp", "up_proj"): Target("gate_up_proj", 1, inter, inter, hidden),
        ("mlp", "gate_up_proj"): Target("gate_up_proj", 0, 0, 2 * inter, hidden),
        ("mlp", "down_proj"): Target("down_proj", 0, 0, hidden, inter),
    }


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adapted (fused) module's (in_features, out_features), from the model's sizes."""
    known = targets(cfg)
    return {module: (known[(parent, module)].in_features, known[(parent, module)].rows)
            for module, parent in _PARENTS.items()}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter checked against the model: its weight file and, per tensor pair, where it lands."""

    weight_file: str
    # (layer, Target, A's key, B's key, scaling)
    pairs: tuple[tuple[int, Target, str, str, float], ...]


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module's name's end."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from a safetensors header (no data read) or, for a .bin, the loaded state dict."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return {k: tuple(v.shape) for k, v in _load_bin(path).items()}


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle torch refuses to read safely, or not a state dict at all
        raise ValueError(f"lora_path: {path} cannot be read as a state dict ({type(e).__name__}: {e})") from None


def check_adapter(path: str, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """The adapter at `path` checked against the model (headers only); ValueError naming the file and field."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a directory")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"lora_path: {path!r} holds no {CONFIG_FILE} (a PEFT adapter's directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path}: not a JSON file ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: not a JSON object")

    def field(name, default=None):
        return config.get(name, default)

    if field("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_path}: peft_type {field('peft_type')!r} is not a LoRA adapter")
    for name, ok in (("use_dora", lambda v: not v), ("bias", lambda v: v in (None, "none")),
                     ("lora_bias", lambda v: not v), ("modules_to_save", lambda v: not v),
                     ("fan_in_fan_out", lambda v: not v), ("layer_replication", lambda v: not v),
                     ("target_parameters", lambda v: not v)):
        if not ok(field(name)):
            raise ValueError(f"{config_path}: {name}={field(name)!r} is not supported (graphdecode runs plain LoRA "
                             f"on the attention and MLP projections)")
    r, alpha = field("r", 8), field("lora_alpha", 8)
    for name, value in (("r", r), ("lora_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{config_path}: {name} must be a positive number, got {value!r}")
    rank_pattern, alpha_pattern = field("rank_pattern") or {}, field("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise ValueError(f"{config_path}: rank_pattern and alpha_pattern must be objects")
    rslora = bool(field("use_rslora", False))

    weight_file = next((os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))), None)
    if weight_file is None:
        raise ValueError(f"lora_path: {path!r} holds neither {' nor '.join(WEIGHT_FILES)}")
    try:
        shapes = _shapes(weight_file)
    except ValueError:
        raise
    except Exception as e:  # a damaged safetensors header
        raise ValueError(f"{weight_file}: cannot be read ({type(e).__name__}: {e})") from None
    known = targets(cfg)
    layers = cfg.num_hidden_layers or cfg.num_layers
    found: dict[tuple[int, str, str], dict[str, str]] = {}
    for key in shapes:
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{weight_file}: tensor {key!r} is not a LoRA weight of an attention or MLP projection "
                             f"(graphdecode adapts q/k/v/o_proj and gate/up/down_proj only; not the embedding, the "
                             f"LM head or a norm)")
        layer, parent, name, which = int(match[1]), match[2], match[3], match[4]
        if (parent, name) not in known:
            raise ValueError(f"{weight_file}: tensor {key!r}: {parent}.{name} is not a projection graphdecode adapts")
        if layer >= layers:
            raise ValueError(f"{weight_file}: tensor {key!r}: layer {layer}, but the model has {layers} layers")
        found.setdefault((layer, parent, name), {})[which] = key
    if not found:
        raise ValueError(f"{weight_file}: no LoRA weights in it")
    pairs, used = [], set()
    for (layer, parent, name), keys in sorted(found.items()):
        if set(keys) != {"A", "B"}:
            missing = "lora_B" if "A" in keys else "lora_A"
            raise ValueError(f"{weight_file}: model.layers.{layer}.{parent}.{name} has no {missing}.weight")
        target = known[(parent, name)]
        a, b = shapes[keys["A"]], shapes[keys["B"]]
        rank = a[0] if len(a) == 2 else -1
        if len(a) != 2 or a[1] != target.in_features:
            raise ValueError(f"{weight_file}: tensor {keys['A']!r} has shape {list(a)}, expected [r, "
                             f"{target.in_features}] for this model")
        if b != (target.rows, rank):
            raise ValueError(f"{weight_file}: tensor {keys['B']!r} has shape {list(b)}, expected "
                             f"[{target.rows}, {rank}] for this model and r = {rank}")
        if not 1 <= rank <= max_lora_rank:
            raise ValueError(f"{weight_file}: {parent}.{name} of layer {layer} has rank {rank}, above max_lora_rank "
                             f"({max_lora_rank}); start the engine with a larger max_lora_rank")
        slot = (layer, target.module, target.group)
        if slot in used:
            raise ValueError(f"{weight_file}: layer {layer} adapts {target.module} both fused and by its parts")
        used.add(slot)
        module = f"model.layers.{layer}.{parent}.{name}"
        r_module = _pattern_value(rank_pattern, module, r)
        if r_module != rank:
            raise ValueError(f"{weight_file}: {module} has rank {rank}, but {CONFIG_FILE} gives it r = {r_module}")
        alpha_module = _pattern_value(alpha_pattern, module, alpha)
        scaling = alpha_module / (math.sqrt(rank) if rslora else rank)
        pairs.append((layer, target, keys["A"], keys["B"], float(scaling)))
    return AdapterSpec(weight_file=weight_file, pairs=tuple(pairs))


@dataclass(frozen=True, eq=False)
class LoadedAdapter:
    """An adapter checked and read: what a plan's LoRALoad carries to the runner."""

    spec: AdapterSpec
    weights: tuple[tuple[int, Target, torch.Tensor, torch.Tensor], ...]  # (layer, Target, A, B times scaling)


def read_adapter(spec: AdapterSpec) -> list[tuple[int, Target, torch.Tensor, torch.Tensor]]:
    """(layer, Target, A [r, in], B [rows, r] times its scaling) for every pair, float32 on the CPU."""
    if spec.weight_file.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(spec.weight_file, framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    else:
        tensors = _load_bin(spec.weight_file)
    out = []
    for layer, target, a_key, b_key, scaling in spec.pairs:
        a, b = tensors[a_key].float(), tensors[b_key].float() * scaling
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{spec.weight_file}: tensor {a_key!r} or {b_key!r} holds a NaN or an infinity")
        out.append((layer, target, a, b))
    return out
