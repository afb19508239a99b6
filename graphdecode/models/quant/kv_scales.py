"""Per-layer FP8 KV-cache scales for a checkpoint, calibrated on sample text, written as real files.

The engine runs `kv_cache_dtype="fp8"` with each attention layer's `self_attn.k_scale` / `v_scale` from the
checkpoint (compressed-tensors' `kv_cache_scheme`, as llm-compressor writes it; vLLM reads the same), else 1.0.
This writes them: the float model prefills the calibration prompts, each layer's largest |K| and |V| in its
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


def calibrate_kv_scales(src: str, prompts: list[list[int]], page_size: int = 16) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per decoder layer: the largest |K| / |V| that a float32 prefill of each prompt writes
    into the cache, / 448 (the model run directly through the torch attention backend, one prompt at a time)."""
    from ...attention import ForwardContext, PrefillMetadata, TorchAttentionBackend
    from ...attention.kv_cache import allocate_kv_caches
    from ..loader import load_model
    from ..model_config import load_model_config

    cfg = load_model_config(src)
    longest = max(len(p) for p in prompts)
    model = load_model(src, cfg, torch.float32, torch.device("cpu"), longest)
    pages = -(-longest // page_size)
    peaks = torch.zeros(cfg.num_layers, 2)
    with torch.inference_mode():
        for prompt in prompts:
            caches = allocate_kv_caches(cfg.num_layers, pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                                        torch.float32, "cpu")
            backend = TorchAttentionBackend(caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                            specs=getattr(model, "attention_specs", None))
            n = len(prompt)
            table = torch.arange(1, pages + 1, dtype=torch.int32)[None]  # page 0: the scratch page
            meta = PrefillMetadata(cu_query_lens=torch.tensor([0, n], dtype=torch.int32),
                                   seq_lens=torch.tensor([n], dtype=torch.int32), block_table=table,
                                   slot_mapping=torch.arange(page_size, page_size + n), query_lens_host=[n],
                                   seq_lens_host=[n], block_table_host=table)
            model(torch.tensor(prompt), torch.arange(n), ForwardContext(backend, prefill=meta))
            for layer, cache in enumerate(caches):
                peaks[layer] = torch.maximum(peaks[layer], cache[1:].abs().amax(dim=(0, 2, 3, 4)))
    return [(max(float(k), 1e-6) / FP8_MAX, max(float(v), 1e-6) / FP8_MAX) for k, v in peaks]


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
