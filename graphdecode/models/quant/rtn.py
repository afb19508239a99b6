"""Round-to-nearest quantization of a float checkpoint into each format the engine loads (config.py), as real files.

Every decoder-layer linear is rounded to the nearest representable value with min-max scales (each group's range
shrunk by the clip that rounds it best), so any small model can be run and measured in every format here
(`profiling/quantize_rtn.py` writes one, `profiling/bench_quant.py` measures perplexity and speed). No GPTQ
Hessian; with `calibration`, AWQ's activation-aware scales (awq.py) are searched and folded into the float weights
first, for the integer formats. The embedding, norms and LM head stay float (unless `quantize_head`).

* `compressed-tensors` pack-quantized / int-quantized / float-quantized: written by the compressed-tensors library
  itself (its compressors quantize with our scales and pack; its QuantizationConfig writes config.json's section);
* `fp8-block`: FP8 E4M3 with `weight_scale_inv` per 128x128 block, quant_method fp8 (transformers' FineGrainedFP8);
* `gptq` (v1 packing: zero points minus one; `act_order` writes a g_idx permutation, columns grouped by
  decreasing norm) and `awq` (GEMM packing, AWQ's column order), with the library's int32 packing.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from ...attention.kv_cache import FP8_MAX
from ..loader import checkpoint_files
from .rounding import int_rounding

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "fp8-block", "gptq", "awq")
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_checkpoint(src: str, dst: str, fmt: str, bits: int = 4, group: int | None = 128,
                        symmetric: bool = True, act_order: bool = False, scale_dtype: torch.dtype | None = None,
                        quantize_head: bool = False, device: str = "cpu",
                        calibration: list[list[int]] | None = None) -> str:
    """Write `src` (a float HuggingFace directory) to `dst` in `fmt`; returns dst. group None: one scale per row.
    quantize_head (compressed-tensors formats): the LM head too, int8 (FP8 for float-quantized) with one scale per
    row, as its own config group; a tied head is written as an untied lm_head (the embedding stays float).
    device: where the rounding runs (a GPU for billion-parameter checkpoints).
    calibration: token-id sequences (profiling/quantize_rtn.py's calibration_tokens samples some): the decoder
    linears are first scaled by AWQ's activation-aware search on them (awq.py; int formats of llama-family
    models), the scales folded into the float ops before them, then rounded as without; None: plain
    round-to-nearest."""
    if fmt not in FORMATS:
        raise ValueError(f"format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if quantize_head and fmt not in ("pack-quantized", "int-quantized", "float-quantized"):
        raise ValueError("quantize_head: only the compressed-tensors formats are written with a quantized head")
    if calibration is not None and fmt in ("float-quantized", "fp8-block"):
        raise ValueError(f"calibration: AWQ scaling is searched for the integer formats, not {fmt}")
    if calibration is not None and act_order:
        raise ValueError("calibration: AWQ scaling is searched for the natural column order, not with act_order")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if calibration is not None:
        from .awq import check_model_type

        check_model_type(config)
    os.makedirs(dst, exist_ok=True)
    state = {}
    for path in checkpoint_files(src):
        state.update(load_file(path))
    model_dtype = next(v.dtype for k, v in state.items() if k.endswith("norm.weight"))
    scale_dtype = scale_dtype or (torch.float16 if fmt in ("gptq", "awq") else model_dtype)
    inputs: dict[str, torch.Tensor] = {}  # calibrated: each linear's input moments (its clip search)
    if calibration is not None:
        from .awq import awq_calibrate, fold_scales

        found = awq_calibrate(src, calibration, fmt, bits, group, symmetric, scale_dtype, device=device)
        state, inputs = fold_scales(state, found.scales, config), found.inputs
    out = {}
    norms: dict[str, torch.Tensor] = {}  # act_order: one input order per input (q/k/v share it, gate/up too)
    for key, w in state.items():
        if _LINEAR.match(key):
            norms[_input_of(key)] = norms.get(_input_of(key), 0) + w.float().pow(2).sum(0)
    for key, w in state.items():
        if not _LINEAR.match(key):
            out[key] = w
            continue
        module = key[: -len(".weight")]
        order = torch.argsort(norms[_input_of(key)], descending=True, stable=True) if act_order else None
        tensors = _quantize(w.to(device), fmt, bits, group, symmetric, order, scale_dtype, inputs.get(module))
        out.update({f"{module}.{suffix}": t.contiguous().cpu() for suffix, t in tensors.items()})
    if quantize_head:
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        out.pop("lm_head.weight", None)
        tensors = _quantize(head.to(device), fmt, 8, None, True, None, scale_dtype)
        out.update({f"lm_head.{suffix}": t.contiguous().cpu() for suffix, t in tensors.items()})
        config["tie_word_embeddings"] = False
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = _config(fmt, bits, group, symmetric, act_order, quantize_head)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(src):
        if name != "config.json" and not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            source = os.path.join(src, name)
            if os.path.isfile(source):
                shutil.copy(source, os.path.join(dst, name))
    return dst


def _input_of(key: str) -> str:
    """Linears reading the same input share one name: their activation order is one."""
    return re.sub(r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gate_up.", key))


def _scheme(fmt: str, bits: int, group: int | None, symmetric: bool, targets: list[str] | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    targets = targets or ["Linear"]
    if fmt == "float-quantized":
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        return QuantizationScheme(targets=targets, weights=weights, input_activations=acts)
    strategy = "group" if group else "channel"
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    return QuantizationScheme(targets=targets, weights=weights)


def _config(fmt: str, bits: int, group: int | None, symmetric: bool, act_order: bool, quantize_head: bool) -> dict:
    if fmt in ("pack-quantized", "int-quantized", "float-quantized"):
        from compressed_tensors.quantization import QuantizationConfig

        groups = {"group_0": _scheme(fmt, bits, group, symmetric)}
        if quantize_head:  # a name target: it takes precedence over the "Linear" class target
            groups["head"] = _scheme(fmt, 8, None, True, targets=["lm_head"])
        config = QuantizationConfig(config_groups=groups, format=fmt, ignore=[] if quantize_head else ["lm_head"],
                                    quantization_status="compressed")
        return json.loads(json.dumps(config.model_dump(), default=str))
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "desc_act": act_order,
                "sym": symmetric, "checkpoint_format": "gptq"}
    return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}


def _quantize(w: torch.Tensor, fmt: str, bits: int, group: int | None, symmetric: bool, order: torch.Tensor | None,
              scale_dtype: torch.dtype, inputs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    w = w.float()
    if fmt == "float-quantized":
        from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

        scale = (w.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
        scheme = _scheme(fmt, bits, group, symmetric)
        return dict(FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme))
    if fmt == "fp8-block":
        rows, cols = -(-n // 128), -(-k // 128)
        padded = torch.zeros(rows * 128, cols * 128, device=w.device)
        padded[:n, :k] = w
        blocks = padded.view(rows, 128, cols, 128)
        scale = (blocks.abs().amax((1, 3)) / FP8_MAX).clamp(min=1e-12)
        values = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * 128, cols * 128)[:n, :k]
        return {"weight": values.to(torch.float8_e4m3fn), "weight_scale_inv": scale}
    if group and k % group:
        raise ValueError(f"group: {group} does not divide the {k} input columns; choose a group size that does")
    if order is not None and fmt != "gptq":
        raise ValueError("act_order: only the gptq format is written with an activation order (desc_act)")
    perm = order  # columns of larger norm first, as GPTQ's desc_act orders by the Hessian's diagonal
    if perm is not None:
        w = w[:, perm]
    scale, zero, values = int_rounding(w, fmt, bits, group, symmetric, scale_dtype, inputs)
    if fmt in ("pack-quantized", "int-quantized"):
        from compressed_tensors.compressors.base import BaseCompressor

        tensors = {"weight": w, "weight_scale": scale.to(scale_dtype)}
        if not symmetric:
            tensors["weight_zero_point"] = zero
        compressor = BaseCompressor.load_from_registry(fmt)
        return dict(compressor.compress(tensors, _scheme(fmt, bits, group, symmetric)))
    g = group or k
    zero_stored = zero if symmetric is False else torch.zeros_like(zero)
    if fmt == "gptq":
        if perm is not None:
            inverse = torch.argsort(perm)
            values = values[:, inverse]
            g_idx = (torch.arange(k, device=w.device) // g)[inverse.to(w.device)]
        else:
            g_idx = torch.arange(k, device=w.device) // g
        return {"qweight": pack_to_int32(values.t().contiguous(), bits, packed_dim=0),
                "qzeros": pack_to_int32((zero_stored - 1).t().contiguous(), bits),  # v1: stored minus one
                "scales": scale.t().to(scale_dtype), "g_idx": g_idx.to(torch.int32)}
    order = torch.arange(n, device=w.device).view(-1, 8)[:, _AWQ_ORDER].reshape(-1)
    return {"qweight": pack_to_int32(values.t()[:, order].contiguous(), bits),
            "qzeros": pack_to_int32(zero_stored.t()[:, order].contiguous(), bits),
            "scales": scale.t().to(scale_dtype)}
