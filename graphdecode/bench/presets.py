"""Benchmark model presets: random-weight HuggingFace directories made offline, on demand.

A preset is a HuggingFace `config.json` (in `preset_configs/`, beside this file) plus
random weights written straight to `model.safetensors`: the tensors are made with
`torch.empty(...).uniform_()` from a seeded generator, on the GPU when one is there,
so even the 1B preset takes seconds, not the minutes a transformers CPU init would.
The directory loads in transformers (`from_pretrained`) and in graphdecode alike.

Presets:
* `micro`: a tiny Llama (2 layers, hidden 128, head_dim 64, vocab 512) with the
  built-in byte-level BPE tokenizer; engine overhead dominates its run time.
* `llama-3.2-1b`: Llama-3.2-1B's exact shapes (16 layers, hidden 2048, GQA 32:8,
  head_dim 64, vocab 128256, llama3 rope, tied embeddings, bf16), no tokenizer.
* `tp-2048x8`: a Llama big enough for matmuls to dominate a CPU step (hidden 2048,
  8 layers, 16 heads / 8 KV heads, head_dim 128, intermediate 8192, vocab 32000, fp32,
  0.63B parameters): the tensor-parallel benchmark's model.
* `default`: the built-in default model (graphdecode.default_model).

Directories live in the cache root (`$GRAPHDECODE_CACHE`, else ~/.cache/graphdecode)
as `preset-<name>-v2`. Values are deterministic for a given generator device.
"""

from __future__ import annotations

import json
import math
import os

import torch

from ..cache import cache_root, cached_model_dir
from ..default_model import default_model_dir

PRESET_VERSION = "v2"  # v2: micro's tokenizer has the default model's chat template
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preset_configs")
PRESETS = ("micro", "llama-3.2-1b", "tp-2048x8", "default")
_WITH_TOKENIZER = {"micro"}
_SEED = 20261129
_MARKER = "graphdecode_preset.json"


def preset_config(name: str) -> dict:
    if name not in PRESETS or name == "default":
        raise ValueError(f"preset: {name!r} has no config (presets with configs: micro, llama-3.2-1b, tp-2048x8)")
    with open(os.path.join(CONFIG_DIR, f"{name}.json")) as f:
        return json.load(f)


def preset_dir(name: str) -> str:
    if name == "default":
        return default_model_dir()
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return os.path.join(cache_root(), f"preset-{name}-{PRESET_VERSION}")


def ensure_preset(name: str, device: str | None = None) -> str:
    """Return the preset's directory, building it first if it is missing."""
    if name == "default":
        return default_model_dir()
    return cached_model_dir(os.path.basename(preset_dir(name)), lambda path: build_preset(name, path, device))


def build_preset(name: str, path: str, device: str | None = None) -> None:
    """Write config.json, random model.safetensors (and the tokenizer for micro) into path."""
    raw = preset_config(name)
    gen_device = _generator_device(raw, device)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    write_random_weights(raw, os.path.join(path, "model.safetensors"), gen_device)
    tokenizer = None
    if name in _WITH_TOKENIZER:
        tokenizer = _save_tokenizer(path, raw["vocab_size"])
    with open(os.path.join(path, _MARKER), "w") as f:
        json.dump({"preset": name, "version": PRESET_VERSION, "seed": _SEED, "generator_device": gen_device,
                   "tokenizer": tokenizer}, f, indent=2)


def _generator_device(raw: dict, device: str | None) -> str:
    if device is not None:
        return torch.device(device).type
    big = raw["vocab_size"] * raw["hidden_size"] > 10_000_000
    return "cuda" if big and torch.cuda.is_available() else "cpu"


def llama_tensor_shapes(raw: dict) -> dict[str, tuple[int, ...]]:
    """HuggingFace tensor names and shapes of a Llama checkpoint with this config."""
    h, inter, vocab = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads", raw["num_attention_heads"])
    head_dim = raw.get("head_dim") or h // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (heads * head_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * head_dim)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not raw.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def write_random_weights(raw: dict, file: str, device: str = "cpu") -> None:
    """Uniform weights with the config's initializer_range as std; norms are ones."""
    from safetensors.torch import save_file

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(raw.get("torch_dtype"), torch.float32)
    bound = raw.get("initializer_range", 0.02) * math.sqrt(3.0)  # uniform(-a, a) has std a / sqrt(3)
    gen = torch.Generator(device=device).manual_seed(_SEED)
    tensors = {}
    for tensor_name, shape in llama_tensor_shapes(raw).items():
        if tensor_name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.empty(shape, dtype=dtype, device=device).uniform_(-bound, bound, generator=gen).cpu()
        tensors[tensor_name] = t
    save_file(tensors, file, metadata={"format": "pt"})


def _save_tokenizer(path: str, vocab_size: int) -> str | None:
    try:
        from ..default_model import build_tokenizer

        tokenizer = build_tokenizer(vocab_size)
    except ImportError as exc:  # transformers/tokenizers missing: token-id prompts still work
        print(f"[presets] no tokenizer written ({exc}); text prompts will not work with this preset")
        return None
    tokenizer.save_pretrained(path)
    return "byte-level BPE, built-in corpus"
