"""How the MoE families' checkpoints store expert weights, and how the loader fills `Experts` from them.

`Experts` (moe.py) holds `gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up
rows), `down_proj` [E, H, I] and, for gpt-oss, `gate_up_proj_bias` [E, 2I] and
`down_proj_bias` [E, H]; with tensor parallelism a rank holds its rows of gate and up and
its columns of down (I / ranks of each expert). The layouts read into them:

* "per_expert" (Mixtral, Qwen3-MoE, as the Hub and transformers' save_pretrained write
  them): `experts.N.<gate>.weight` [I, H], `experts.N.<up>.weight` [I, H],
  `experts.N.<down>.weight` [H, I]; the names per family (`ExpertFormat.names`: Mixtral's
  w1 / w3 / w2, Qwen3-MoE's gate_proj / up_proj / down_proj).
* "stacked" (transformers 5's in-memory layout for the same families, if a checkpoint holds
  it): `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (Nemotron 3's ungated experts:
  `experts.up_proj` [E, I, H]; per expert, `N.up_proj` and `N.down_proj` only).
* "gpt_oss": `experts.gate_up_proj` [E, H, 2I] with gate and up interleaved along the last
  dim (gate at even columns), `gate_up_proj_bias` [E, 2I] interleaved alike,
  `experts.down_proj` [E, I, H], `down_proj_bias` [E, H]; or, quantised (config.json's
  quantization_config mxfp4), `gate_up_proj_blocks` / `_scales` and `down_proj_blocks` /
  `_scales` as [E, out, in] MXFP4 (mxfp4.py), kept in 4 bits (moe.Experts.hold_mxfp4; this rank's rows, gate
  then up), or dequantised to the compute dtype here where a rank's slice is no whole number of 32-blocks.

The loader (loader.py) asks `slot()` about each checkpoint tensor under an `Experts`
module: what it fills (a `Slot`: the parameter and the part of it, the shape and dtypes to
expect), then `load()` copies it in; `missing()` names what a parameter still lacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from . import mxfp4
from .moe import Experts

FLOAT = ("F32", "F16", "BF16", "F64")
_PER_EXPERT = re.compile(r"^(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class ExpertFormat:
    """A family's expert tensors: per-expert names (checkpoint name -> gate / up / down) or gpt-oss's."""

    names: dict[str, str] = field(default_factory=dict)
    gpt_oss: bool = False


@dataclass(frozen=True)
class Slot:
    param: str  # the Experts parameter it fills
    part: str  # which part of it: "gate.3", "up.3", "down.3" (one expert's), "all", or MXFP4 "blocks" / "scales"
    shape: tuple[int, ...]  # the checkpoint tensor's shape
    layout: str  # per_expert, stacked, gpt_oss, mxfp4 (blocks: reads its scales too), scales (read with them)
    dtypes: tuple[str, ...] = FLOAT
    expert: int = -1
    shard: str = ""  # gate, up or down (per_expert)


def slot(module: Experts, suffix: str, fmt: ExpertFormat) -> Slot | None:
    """The slot of the tensor named `<module>.<suffix>`, or None if it has no place."""
    cfg = module.cfg
    e, i, h = cfg.num_experts, cfg.intermediate_size, module.down_proj.shape[1]
    if fmt.gpt_oss:
        shapes = {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h),
                  "gate_up_proj_bias": (e, 2 * i), "down_proj_bias": (e, h)}
        if suffix in shapes:
            return Slot(suffix, "all", shapes[suffix], "gpt_oss")
        quantized = {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}  # [E, out, in]
        for param, (experts, out, inp) in quantized.items():
            if suffix == f"{param}_blocks":
                return Slot(param, "blocks", (experts, out, inp // 32, 16), "mxfp4", ("U8",))
            if suffix == f"{param}_scales":
                return Slot(param, "scales", (experts, out, inp // 32), "scales", ("U8",))
        return None
    if suffix == ("gate_up_proj" if cfg.gated else "up_proj"):  # relu2's experts: up rows only
        return Slot("gate_up_proj", "all", (e, (2 if cfg.gated else 1) * i, h), "stacked")
    if suffix == "down_proj":
        return Slot(suffix, "all", (e, h, i), "stacked")
    match = _PER_EXPERT.match(suffix)
    if match is None or match[2] not in fmt.names or int(match[1]) >= e:
        return None
    expert, shard = int(match[1]), fmt.names[match[2]]
    if shard == "gate" and not cfg.gated:
        return None
    param = "down_proj" if shard == "down" else "gate_up_proj"
    return Slot(param, f"{shard}.{expert}", (h, i) if shard == "down" else (i, h), "per_expert",
                expert=expert, shard=shard)


def missing(module: Experts, found: set[tuple[str, str]], fmt: ExpertFormat) -> str | None:
    """The checkpoint name (relative to the module) of a tensor an Experts parameter still needs."""
    for param, _ in module.named_parameters(recurse=False):
        parts = {part for name, part in found if name == param}
        if "all" in parts or {"blocks", "scales"} <= parts:
            continue
        if fmt.gpt_oss:
            if "blocks" in parts or "scales" in parts:
                return f"{param}_scales" if "blocks" in parts else f"{param}_blocks"
            return param
        shards = ("down",) if param == "down_proj" else ("gate", "up") if module.cfg.gated else ("up",)
        names = {shard: name for name, shard in fmt.names.items()}
        for expert in range(module.cfg.num_experts):
            for shard in shards:
                if f"{shard}.{expert}" not in parts:
                    return f"{expert}.{names[shard]}.weight"
    return None


def load(module: Experts, s: Slot, tensor: torch.Tensor, read) -> None:
    """Copy a checkpoint tensor into this rank's part of the parameter; `read(suffix)` gives a sibling
    tensor (an MXFP4 blocks tensor's scales)."""
    if s.layout == "scales":
        return  # read with its blocks
    param = getattr(module, s.param).data
    rows = module.rows  # this rank's rows of gate and of up (columns of down)
    lo, hi, full = rows.start, rows.stop, module.cfg.intermediate_size
    local = hi - lo
    if s.layout == "per_expert":
        if s.shard == "down":
            param[s.expert].copy_(tensor[:, lo:hi])
        else:
            offset = local if s.shard == "up" and module.cfg.gated else 0
            param[s.expert, offset:offset + local].copy_(tensor[lo:hi])
        return
    if s.layout == "stacked":
        if s.param == "down_proj":
            param.copy_(tensor[:, :, lo:hi])
        elif not module.cfg.gated:
            param.copy_(tensor[:, lo:hi])
        else:
            param.copy_(torch.cat([tensor[:, lo:hi], tensor[:, full + lo:full + hi]], dim=1))
        return
    if s.layout == "mxfp4" and module.mxfp4:  # kept in 4 bits: this rank's rows, gate rows then up rows
        scales = read(f"{s.param}_scales")
        name = s.param.removesuffix("_proj")
        blocks_param, scales_param = getattr(module, f"{name}_blocks"), getattr(module, f"{name}_scales")
        if s.param == "gate_up_proj":  # [E, 2I, H / 32, ...], gate and up rows interleaved
            blocks_param.copy_(torch.cat([tensor[:, 0::2][:, lo:hi], tensor[:, 1::2][:, lo:hi]], dim=1))
            scales_param.copy_(torch.cat([scales[:, 0::2][:, lo:hi], scales[:, 1::2][:, lo:hi]], dim=1))
        else:  # down [E, H, I / 32, ...]: this rank's input blocks
            b0, b1 = lo // mxfp4.BLOCK, hi // mxfp4.BLOCK
            blocks_param.copy_(tensor[:, :, b0:b1])
            scales_param.copy_(scales[:, :, b0:b1])
        return
    if s.layout == "mxfp4":  # [E, out, in] -> the unquantized gpt-oss layout [E, in, out]
        scales = read(f"{s.param}_scales")
        tensor = mxfp4.dequantize(tensor, scales, torch.float32).transpose(1, 2)
    if s.param == "gate_up_proj":  # [E, H, 2I] interleaved -> [E, 2I_local, H], gate rows then up rows
        t = tensor.transpose(1, 2)
        param.copy_(torch.cat([t[:, 0::2][:, lo:hi], t[:, 1::2][:, lo:hi]], dim=1))
    elif s.param == "gate_up_proj_bias":
        param.copy_(torch.cat([tensor[:, 0::2][:, lo:hi], tensor[:, 1::2][:, lo:hi]], dim=1))
    elif s.param == "down_proj":  # [E, I, H] -> [E, H, I_local]
        param.copy_(tensor.transpose(1, 2)[:, :, lo:hi])
    else:  # down_proj_bias [E, H]: whole on every rank (rank 0 adds it)
        param.copy_(tensor)
