"""Per-layer FP8 KV-cache scales for a checkpoint, calibrated on sample text, written as real files.

The engine runs `kv_cache_dtype="fp8"` with each attention layer's `self_attn.k_scale` / `v_scale` from the
checkpoint (compressed-tensors' `kv_cache_scheme`, as llm-compressor writes it; vLLM reads the same), else 1.0.
This writes them: the float engine prefills the calibration prompts, each layer's largest |K| and |V| in its
cache (keys after rotary, what the cache holds) over E4M3's largest value, 448, is that layer's scale, so the
calibration's peak lands on 448 and nothing it saw saturates. The weights are copied unchanged; config.json's
`quantization_config` gains the `kv_cache_scheme` (a new compressed-tensors section without weight groups
when the checkpoint had none).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from ...attention.kv_cache import FP8_MAX
from ..loader import checkpoint_files

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def calibrate_kv_scales(src: str, prompts: list[list[int]]) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per decoder layer: the largest |K| / |V| the float engine caches for `prompts`, / 448."""
    from ...host.llm import LLM
    from ...sampling_params import SamplingParams

    longest = max(len(p) for p in prompts) + 1
    with LLM(src, dtype="float32", device="cpu", max_model_len=longest, max_batch_size=len(prompts),
             enable_prefix_caching=False, num_decode_steps=1) as llm:
        caches = llm.engine.runner.kv_caches
        for cache in caches:
            cache.zero_()  # only what the prompts write counts (padded rows write the scratch page: zero too)
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
        peaks = [(float(c[1:, 0].abs().amax()), float(c[1:, 1].abs().amax())) for c in caches]
    return [(max(k, 1e-6) / FP8_MAX, max(v, 1e-6) / FP8_MAX) for k, v in peaks]


def write_kv_scales(src: str, dst: str, scales: list[tuple[float, float]]) -> str:
    """A copy of checkpoint `src` at `dst` with `model.layers.{i}.self_attn.k_scale` / `v_scale` (float32 scalars)
    beside its weights and the kv_cache_scheme in config.json. Returns dst."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    files = checkpoint_files(src)
    extra = {}
    for layer, (k, v) in enumerate(scales):
        extra[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        extra[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    for i, path in enumerate(files):
        tensors = load_file(path)
        if i == len(files) - 1:
            tensors.update(extra)
        save_file(tensors, os.path.join(dst, os.path.basename(path)), metadata={"format": "pt"})
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            raw = json.load(f)
        last = os.path.basename(files[-1])
        raw["weight_map"].update({key: last for key in extra})
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump(raw, f, indent=2)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    quant = config.setdefault("quantization_config", {"quant_method": "compressed-tensors", "config_groups": {},
                                                      "quantization_status": "compressed"})
    if quant.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{src}: quantization_config.quant_method {quant.get('quant_method')!r}: KV-cache scales "
                         f"are written into compressed-tensors checkpoints (or float ones)")
    quant["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst
