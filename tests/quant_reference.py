"""Reference dequantizations of quantized checkpoints, after each format's published layout (compressed-tensors:
its own decompressors), independent of graphdecode/models/quant: what tests/host/test_quantized.py and the GPU
test compare the engine against."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values of 32-bit words, value j of a word at bits [j * bits, (j + 1) * bits), along `dim`."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    parts = [(w >> (bits * j)) & ((1 << bits) - 1) for j in range(per)]
    return torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)


def reference(module: dict[str, torch.Tensor], config: dict, name: str = "") -> torch.Tensor:
    """One linear's float weight [N, K] from its checkpoint tensors, after each format's published layout
    (compressed-tensors: its own decompressor)."""
    quant = config["quantization_config"]
    method = quant["quant_method"]
    if method == "compressed-tensors":
        from compressed_tensors.compressors.base import BaseCompressor
        from compressed_tensors.quantization import QuantizationScheme

        groups = quant["config_groups"].values()  # a group naming the module, else the "Linear" one
        group = next((g for g in groups if name in g["targets"]), next(g for g in groups if "Linear" in g["targets"]))
        scheme = QuantizationScheme.model_validate(group)
        return BaseCompressor.load_from_registry(quant["format"]).decompress(dict(module), scheme)["weight"]
    if method == "fp8":
        scale = module["weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
        n, k = module["weight"].shape
        return module["weight"].to(scale.dtype) * scale[:n, :k]
    bits, scales = quant["bits"], module["scales"]
    if method == "gptq":
        u = _unpack_words(module["qweight"], bits, 0)  # [K, N]
        z = _unpack_words(module["qzeros"], bits, 1) + (1 if quant["checkpoint_format"] == "gptq" else 0)
        g = module["g_idx"].long()
        w = (u.to(scales.dtype) - z[g].to(scales.dtype)) * scales[g]
        return w.t()
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # awq: nibble i of a word holds column order[i] of its 8
    words = module["qweight"]
    u = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    zeros = torch.empty(module["qzeros"].shape[0], u.shape[1], dtype=torch.int64)
    for i, col in enumerate(order):
        u[:, col::8] = (words.to(torch.int64) >> (4 * i)) & 0xF
        zeros[:, col::8] = (module["qzeros"].to(torch.int64) >> (4 * i)) & 0xF
    g = torch.arange(u.shape[0]) // quant["group_size"]
    return ((u.to(scales.dtype) - zeros[g].to(scales.dtype)) * scales[g]).t()


def checkpoint_modules(qdir: str) -> dict[str, dict[str, torch.Tensor]]:
    tensors = load_file(os.path.join(qdir, "model.safetensors"))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, _, suffix = key.rpartition(".")
        out.setdefault(module, {})[suffix] = t
    return out


def reference_checkpoint(src: str, qdir: str, dst: str) -> str:
    """A float copy of `src` whose linears hold the reference dequantization of `qdir`'s (a head that `qdir`
    quantized, untied, becomes a float lm_head)."""
    with open(os.path.join(qdir, "config.json")) as f:
        config = json.load(f)
    modules = checkpoint_modules(qdir)
    state = load_file(os.path.join(src, "model.safetensors"))
    quantized_parts = ("weight_scale", "scales", "weight_scale_inv")
    for module, tensors in modules.items():
        if any(part in tensors for part in quantized_parts):
            state[f"{module}.weight"] = reference(tensors, config, module).float().contiguous()
    os.makedirs(dst, exist_ok=True)
    save_file(state, os.path.join(dst, "model.safetensors"))
    raw = {k: v for k, v in config.items() if k != "quantization_config"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f)
    return dst
