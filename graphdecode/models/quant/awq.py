"""Activation-aware scaling (AWQ: Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", 2023, arXiv:2306.00978) for the round-to-nearest writer (rtn.py), as llm-compressor's AWQModifier
and AutoAWQ apply it: the output is a float state dict of the same model, whose linears then round better.

A linear's input channels with large activations carry most of its output, and rounding error in their weights
costs most. AWQ multiplies those weight columns by s > 1 before rounding (finer steps relative to them, coarser
for the rest) and divides the input by s, folded into the float op that produces it, so no scale is left at
run time and the checkpoint stays a standard one:

| linears (scale on their input columns) | s folded into (1 / s) |
|---|---|
| q_proj, k_proj, v_proj | input_layernorm's weight |
| o_proj | v_proj's output rows (with GQA, one scale per KV channel, repeated over the query heads of its group) |
| gate_proj, up_proj | post_attention_layernorm's weight |
| down_proj | up_proj's output rows |

Per group, s_x is the mean |x| of each input channel over the calibration tokens and the candidates are
s = s_x^alpha / sqrt(max * min) for alpha in ALPHAS (alpha 0: plain round-to-nearest, always a candidate); the
one kept has the least squared error between the linears' float outputs and their outputs with weights
round_trip(W * s) / s (the writer's own rounding, rounding.py: its scales, clip grid and integers) on the
calibration inputs, computed exactly through the inputs' second moments E[x x^T]. With the clip search (the
default), each candidate's groups also choose their clip by output error on those inputs (AWQ's clip search), and
the checkpoint is written with the same choice. Layers are calibrated in order, each on the outputs of the layers
before it as the quantized model computes them (scaled and rounded; within a layer, o_proj on the attention of the
rounded q/k/v, down_proj on the rounded gate/up), so errors do not compound unseen. Each calibration sequence's
first token (the attention sink, whose outlier activations would dominate the statistics) is left out of s_x and of
the error, but is attended to.

The layers run as transformers' LlamaForCausalLM (float32, SDPA attention): llama-family checkpoints only
(config.json's model_type "llama"); others are refused by that field. profiling/quantize_rtn.py's `calibration_tokens`
samples the model's own text as calibration data (nothing is downloaded; the evaluation text is not seen).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from .rounding import round_trip

ALPHAS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1
MODEL_TYPES = ("llama",)
log = logging.getLogger(__name__)


def check_model_type(config: dict) -> None:
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"model_type: {kind!r}: AWQ calibration runs llama-family checkpoints "
                         f"(model_type {', '.join(repr(t) for t in MODEL_TYPES)}) only")


@dataclass
class Calibration:
    """What awq_calibrate found: `scales` by name (fold_scales'), and `inputs` by linear (module name): the second
    moments of each group of its input columns in the scaled model, [K / g, g, g] (rounding.int_scales' `inputs`: the
    writer's clip search then measures output error; empty without clip search)."""

    scales: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def _second_moments(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """[K / g, g, g]: E[x_i x_j] within each group of g input columns, over x's tokens [T, K]."""
    t, k = x.shape
    g = group or k
    blocks = x.reshape(t, k // g, g).transpose(0, 1)
    return blocks.transpose(1, 2) @ blocks / t


@torch.no_grad()
def awq_calibrate(src: str, calibration: list[list[int]], fmt: str, bits: int, group: int | None, symmetric: bool,
                  scale_dtype: torch.dtype, alphas: tuple[float, ...] = ALPHAS, clip: bool = True,
                  device: str = "cpu") -> Calibration:
    """Search each layer's scales on `calibration` (token-id sequences) for rounding as rtn.py's `fmt`, `bits`,
    `group`, `symmetric` with scales stored in `scale_dtype`. Scales by name (`fold_scales`):
    "model.layers.N.self_attn.qkv" [hidden], "...self_attn.o_proj" [KV heads * head_dim],
    "model.layers.N.mlp.gate_up" [hidden], "...mlp.down_proj" [intermediate].

    clip: every candidate is rounded with each group's clip chosen by its output error on the calibration inputs
    (rounding.int_scales' `inputs`; AWQ's clip search, with the writer's clip grid), and the checkpoint is written so;
    False: by the weight's own error, as without calibration."""
    from transformers import LlamaForCausalLM

    with open(os.path.join(src, "config.json")) as f:
        check_model_type(json.load(f))
    seqs = [list(s) for s in calibration if len(s) >= 2]
    if not seqs:
        raise ValueError("calibration: needs token sequences of at least 2 tokens (the first is left out)")
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    found = Calibration({})

    def search(x: torch.Tensor, names: list[str], linears: list, kv: bool = False) -> torch.Tensor:
        """x [tokens, K]: the linears' inputs (first tokens left out). The error of a candidate is the squared
        error of the linears' outputs on x, through x's second moments. Leaves each linear holding
        round_trip(W * s) / s for the best s (what the written checkpoint computes); returns s."""
        s_x = x.abs().mean(0)
        if kv:  # one scale per KV channel: the query heads of a group read the same v_proj row
            s_x = s_x.view(kv_heads, heads // kv_heads, head_dim).mean(1).reshape(-1)
        s_x = s_x.clamp(min=1e-5)
        gram = x.T @ x / x.shape[0]
        moments = _second_moments(x, group) if clip else None
        originals = [lin.weight.data.clone() for lin in linears]
        best = None
        for alpha in alphas:
            s = s_x.pow(alpha).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            cols = _per_query_head(s, heads, kv_heads, head_dim) if kv else s
            scaled = None
            if moments is not None:  # the moments of x / s, the scaled weight's input
                inv = (1 / cols).view(-1, moments.shape[1])
                scaled = moments * inv[:, :, None] * inv[:, None, :]
            weights = [round_trip(w * cols, fmt, bits, group, symmetric, scale_dtype, scaled) / cols
                       for w in originals]
            err = sum(((w - o) @ gram * (w - o)).sum() for w, o in zip(weights, originals)).item()
            if best is None or err < best[0]:
                best = (err, s, weights, scaled)
        _, s, weights, scaled = best
        for name, lin, w in zip(names, linears, weights):
            lin.weight.data = w
            if scaled is not None:
                found.inputs[name] = scaled.cpu()
        return s.float().cpu()

    def tail(xs: list[torch.Tensor]) -> torch.Tensor:  # every sequence's tokens but its first, [tokens, C]
        return torch.cat([x[0, 1:] for x in xs])

    start = time.monotonic()
    hidden = [model.model.embed_tokens(torch.tensor([s], device=device)) for s in seqs]
    positions = [model.model.rotary_emb(h, torch.arange(h.shape[1], device=device)[None]) for h in hidden]
    for i, layer in enumerate(model.model.layers):
        attn, mlp, name = layer.self_attn, layer.mlp, f"model.layers.{i}"
        normed = [layer.input_layernorm(h) for h in hidden]
        found.scales[f"{name}.self_attn.qkv"] = search(
            tail(normed), [f"{name}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
            [attn.q_proj, attn.k_proj, attn.v_proj])
        captured: list[torch.Tensor] = []  # o_proj's inputs as the quantized model computes them (q/k/v rounded)
        hook = attn.o_proj.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        for x, p in zip(normed, positions):
            attn(hidden_states=x, position_embeddings=p, attention_mask=None)  # SDPA: causal
        hook.remove()
        found.scales[f"{name}.self_attn.o_proj"] = search(tail(captured), [f"{name}.self_attn.o_proj"],
                                                          [attn.o_proj], kv=True)
        hidden = [h + attn.o_proj(c) for h, c in zip(hidden, captured)]
        normed = [layer.post_attention_layernorm(h) for h in hidden]
        found.scales[f"{name}.mlp.gate_up"] = search(tail(normed), [f"{name}.mlp.gate_proj", f"{name}.mlp.up_proj"],
                                                     [mlp.gate_proj, mlp.up_proj])
        inner = [mlp.act_fn(mlp.gate_proj(n)) * mlp.up_proj(n) for n in normed]
        found.scales[f"{name}.mlp.down_proj"] = search(tail(inner), [f"{name}.mlp.down_proj"], [mlp.down_proj])
        hidden = [h + mlp.down_proj(n) for h, n in zip(hidden, inner)]
        log.info("awq: layer %d of %d calibrated (%.1f s)", i + 1, len(model.model.layers), time.monotonic() - start)
    return found


def _per_query_head(s: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """One scale per KV channel [kv_heads * head_dim] -> o_proj's input columns: each query head of a group reads
    its KV head's v_proj rows."""
    return s.view(kv_heads, 1, head_dim).expand(kv_heads, heads // kv_heads, head_dim).reshape(-1)


def fold_scales(state: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
                config: dict) -> dict[str, torch.Tensor]:
    """A copy of `state` (a llama checkpoint's tensors) with `scales` (awq_scales' names) folded in: each linear's
    input columns times s, the op before it (a norm's weight, v_proj's or up_proj's output rows and bias) divided
    by s. The float model computes the same function (up to rounding in the checkpoint's dtype)."""
    check_model_type(config)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    out = dict(state)

    def scale(key: str, s: torch.Tensor, dim: int, divide: bool) -> None:
        if key not in out:
            return
        t = out[key].float()
        s = s.to(t.device)
        shape = [1] * t.dim()
        shape[dim] = -1
        out[key] = (t / s.view(shape) if divide else t * s.view(shape)).to(state[key].dtype)

    for name, s in scales.items():
        layer, _, which = name.rpartition(".")
        if which == "qkv":
            prefix = layer.rpartition(".")[0]
            scale(f"{prefix}.input_layernorm.weight", s, 0, True)
            for p in ("q_proj", "k_proj", "v_proj"):
                scale(f"{layer}.{p}.weight", s, 1, False)
        elif which == "o_proj":
            scale(f"{layer}.v_proj.weight", s, 0, True)
            scale(f"{layer}.v_proj.bias", s, 0, True)
            scale(f"{layer}.o_proj.weight", _per_query_head(s, heads, kv_heads, head_dim), 1, False)
        elif which == "gate_up":
            prefix = layer.rpartition(".")[0]
            scale(f"{prefix}.post_attention_layernorm.weight", s, 0, True)
            for p in ("gate_proj", "up_proj"):
                scale(f"{layer}.{p}.weight", s, 1, False)
        elif which == "down_proj":
            scale(f"{layer}.up_proj.weight", s, 0, True)
            scale(f"{layer}.up_proj.bias", s, 0, True)
            scale(f"{layer}.down_proj.weight", s, 1, False)
        else:
            raise ValueError(f"scales: {name!r} is not a scale awq_scales writes")
    return out
