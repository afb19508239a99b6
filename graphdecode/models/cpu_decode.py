"""A decode step's decoder layers in one C++ call on the CPU (csrc/cpu_layers.cpp), for the rows the panels take.

At batch 1 a decode step of SmolLM2 reads its weights in about 20 ms; the eager forward around those reads
(per layer: two norms, four projections, rotary, the K/V write, attention, SwiGLU, the residual adds, each a
Python call) adds several ms. `CpuDecodeLayers` hands every layer to one call of the kernel library, which
calls the same kernels the eager forward calls, in the same order, on the same arguments: the same bits,
except SwiGLU's exp (the library's polynomial where torch uses Sleef's; both about 1 ulp).

It applies to plain Llama-style layers (the RMSNorm and full rotary the CPU kernels take, fused qkv with or
without a bias, no o_proj bias, SwiGLU, no MoE, no qk-norm, no sandwich norms, one rank), with every
projection a `PanelWeight` (fp32 or bf16 of a model that streams its weights) or a quantized linear on its CPU
panels (quant/linear.py, int8 / int4 / FP8, in the input's order), for decode steps (one query per
row) and speculative verify forwards, of at most PANEL_ROWS query rows (bf16: 8, MIN_ROWS; any number on a
batch-invariant engine, whose panels take every row count), outside compiled
graphs, with the CPU attention kernel. A verify of Q queries per sequence runs as Q decode rows over the
sequence's block table, each with its own position, slot and KV length (position + 1): each layer writes every
row's K/V before any row attends, so query i sees the K/V of the queries before it, as the causal verify does,
and each position runs the layer kernels plain decoding runs (SmolLM2's logprobs agree with plain decoding's to
about 1e-5: the LM head takes another kernel above two rows). Only live rows go into the call: a bucket's
padding and rows done in the window hold the scratch slot, and come out as zeros.
An EAGLE-3 head's one layer runs through the same call (`build_head`): its qkv projection reads the
[normed embedding | normed hidden state] rows the head makes (`run`'s `pre`, the IN words), the hidden state
is the residual. Everything else runs the eager forward. `DecoderForCausalLM.forward_aux` (forward() runs it)
asks `applies` each step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.kv_cache import FP8
from ..kernels.cpu import DTYPE_CODES, FP8_CODE
from .cpu_linear import PANEL_ROWS, PanelWeight
from .layers import GatedActivation, RMSNorm
from .quant.linear import QuantizedWeight

# The driver runs the panels up to max(PanelWeight.rows, MIN_ROWS) rows. bf16: oneDNN's bf16 GEMM beats the
# panels from 8 rows in the layer-by-layer forward, but by less than the one call saves there (SmolLM2 bf16, two
# threads, one call with panels against the eager forward with oneDNN: 1.18x at batch 8, 0.89x at batch 16).
MIN_ROWS = {torch.bfloat16: 8}
WORDS = 15  # csrc/cpu_layers.cpp's Word entries per layer
SAVE = 10  # ... the one naming where a layer's input is copied (0: nowhere)
SAVE_LD = 14  # ... and its rows' stride in elements (0: hidden)
KV_DTYPE = 11  # ... its cache's dtype code
IN, IN_WIDTH = 12, 13  # ... and where its qkv projection reads its rows instead of the normed input (0: there)
REALS = 5  # and its Real entries: scale, soft-cap, and an FP8 cache's K / V multipliers and output factor
# csrc/cpu_layers.cpp's Quant entries per projection: kind (-1: float panels), scales, offsets, group, then its LoRA
# panels A and B (0: none) and their columns
QUANT_WORDS = 7
LORA_WORDS = slice(4, 7)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _runs_here(weight) -> bool:
    """A projection the driver runs: float panels, or quantized panels in the input's order."""
    if isinstance(weight, QuantizedWeight):
        return weight.kernel == "panels" and weight.perm is None
    return isinstance(weight, PanelWeight)


def _quant_words(weight) -> list[int]:
    if not isinstance(weight, QuantizedWeight):
        return [-1, 0, 0, 0, 0, 0, 0]
    offsets = weight.panel_offsets.data_ptr() if weight.panel_offsets is not None else 0
    return [weight.kernels.QUANT_KINDS[weight.kind], weight.panel_scales.data_ptr(), offsets, weight.group, 0, 0, 0]


class CpuDecodeLayers:
    def __init__(self, layers, rotary, cfg, kernels, in_width: int = 0):
        """`layers` (plain Llama layers, every projection on panels), their rotary table and config; `in_width`: the
        width of the rows the first layer's qkv projection reads in place of its normed input (`run`'s `pre`; an
        EAGLE-3 head: 2 x hidden), or 0."""
        first = layers[0].self_attn
        self.kernels = kernels
        panel_rows = getattr(first.qkv_proj.packed, "rows", PANEL_ROWS[torch.float32])  # quantized: float32's
        self.rows = max(panel_rows, MIN_ROWS.get(rotary.cos.dtype, 0))
        self.rotary = rotary
        self.dims = (cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim, cfg.intermediate_size)
        self.eps = cfg.rms_norm_eps
        self.dtype = rotary.cos.dtype
        self.num_layers = len(layers)
        self.in_width = in_width
        self.words = torch.zeros(len(layers), WORDS, dtype=torch.int64)
        self.words[0, IN_WIDTH] = in_width
        self.quant = torch.tensor([[_quant_words(p.packed) for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
                                   for layer in layers], dtype=torch.int64)
        # the Real table for a cache in the model's dtype, and for an FP8 one (its K scale folded into the query's)
        self.reals = torch.zeros(len(layers), REALS, dtype=torch.float32)
        self.fp8_reals = torch.zeros(len(layers), REALS, dtype=torch.float32)
        self._keep = []  # tensors whose pointers the table holds
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            spec = attn.attention_spec
            sinks = None if spec.sinks is None else spec.sinks.float().contiguous()
            self._keep.append(sinks)
            self.words[i, :9] = torch.tensor([
                layer.input_layernorm.weight.data_ptr(), attn.qkv_proj.packed.panels.data_ptr(),
                attn.qkv_proj.bias.data_ptr() if attn.qkv_proj.bias is not None else 0,
                attn.o_proj.packed.panels.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                layer.mlp.gate_up_proj.packed.panels.data_ptr(), layer.mlp.down_proj.packed.panels.data_ptr(),
                0, sinks.data_ptr() if sinks is not None else 0])
            self.words[i, 9] = spec.window_left
            self.words[i, KV_DTYPE] = DTYPE_CODES[self.dtype]  # run() sets the cache's
            scale = spec.scale_for(attn.head_dim)
            self.reals[i] = torch.tensor([scale, spec.soft_cap or 0.0, 1.0, 1.0, 1.0])
            self.fp8_reals[i] = torch.tensor([scale * spec.k_scale, spec.soft_cap or 0.0, 1.0 / spec.k_scale,
                                                1.0 / spec.v_scale, spec.v_scale])
        self._scratch = torch.empty(0, dtype=self.dtype)
        self.max_loras = 0  # a LoRA engine's adapter slots (use_lora), 0: none
        self._lora_cols = 0
        self._lora_scratch = torch.empty(0, dtype=self.dtype)

    def use_lora(self, linears: dict, max_loras: int) -> None:
        """Each projection's LoRA panels (lora/model.py's LoRALinear by (layer, name), their A and B on panels),
        added in the same call: the bits of the eager LoRA forward."""
        widest = 0
        for i in range(self.num_layers):
            for p, name in enumerate(PROJECTIONS):
                linear = linears[(i, name)]
                a, b = linear.a.panels, linear.b.panels
                self.quant[i, p, LORA_WORDS] = torch.tensor([a.panels.data_ptr(), b.panels.data_ptr(), a.out_features])
                widest = max(widest, a.out_features)
        hidden, heads, kv_heads, head_dim, inter = self.dims
        self._lora_cols = widest + max((heads + 2 * kv_heads) * head_dim, 2 * inter, hidden)
        self.max_loras = max_loras

    @classmethod
    def build(cls, model: nn.Module, kernels) -> CpuDecodeLayers | None:
        """The driver for `model`, or None where a layer is not the plain Llama layer it runs."""
        from .decoder import DecoderForCausalLM

        if getattr(model, "one_call_reads_concat", False):
            return cls.build_head(model, kernels)
        own_loop = getattr(type(model), "forward_aux", None) is not DecoderForCausalLM.forward_aux
        hybrid = model.config.linear is not None  # recurrent layers beside attention: not the plain layer
        if (kernels is None or own_loop or hybrid or model.tp.size != 1
                or model.norm_offset or model.sandwich_norms or model.embed_scale or not model.rotaries
                or len({id(r) for r in model.rotaries}) != 1):
            return None
        if not cls._runs(model.model.layers, model.rotaries[0]):
            return None
        return cls(model.model.layers, model.rotaries[0], model.config, kernels)

    @classmethod
    def build_head(cls, head: nn.Module, kernels) -> CpuDecodeLayers | None:
        """The driver for an EAGLE-3 head's layer (models/eagle3.py: q/k/v over 2 x hidden), or None."""
        if kernels is None or head.tp.size != 1 or head.rotary is None or not cls._runs(head.layers, head.rotary):
            return None
        return cls(head.layers, head.rotary, head.config, kernels, in_width=2 * head.config.hidden_size)

    @staticmethod
    def _runs(layers, rotary) -> bool:
        """Whether every layer is the plain Llama layer the driver runs, its projections on panels."""
        from .decoder import Attention, GatedMLP

        if rotary.kernels is None or rotary.rotary_dim != rotary.head_dim or rotary.cos.dtype not in DTYPE_CODES:
            return False
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (not isinstance(attn, Attention) or attn.qk_norm or not isinstance(mlp, GatedMLP)
                    or not isinstance(mlp.act, GatedActivation) or mlp.act.act != "silu" or attn.o_proj.bias is not None
                    or any(not isinstance(n, RMSNorm) or n.kernels is None for n in norms)
                    or any(not _runs_here(p.packed) for p in
                           (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))):
                return False
        return True

    def applies(self, ctx, tokens: int) -> bool:
        """Whether this forward is a decode step (or a speculative verify) the driver takes."""
        if torch.compiler.is_compiling() or (ctx.decode is None and ctx.verify is None) or tokens > self.rows:
            return False
        backend = ctx.backend
        return getattr(backend, "kernels", None) is not None and backend.kv_caches[0].dtype in (self.dtype, FP8)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """hidden [M, hidden] embeddings -> the last layer's output (before the final norm), new tensor."""
        return self.run(hidden, positions, ctx)[0]

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, ctx, stops: tuple[int, ...] = (),
            pre: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the last layer's output, the hidden states entering each layer in `stops` (ascending), concatenated
        [M, len(stops) x hidden], or None without stops): one call, which copies each stop layer's input. `pre`
        [M, in_width]: the rows the first layer's qkv projection reads (a driver built with `in_width`), `hidden`
        then its residual."""
        if (pre is None) != (self.in_width == 0) or (pre is not None and pre.shape != (hidden.shape[0], self.in_width)):
            raise ValueError(f"pre {None if pre is None else tuple(pre.shape)}: this driver's first layer reads "
                             f"{f'[{hidden.shape[0]}, {self.in_width}]' if self.in_width else 'its normed input'}")
        caches = ctx.backend.kv_caches  # read each step: a pool rebuilt in place moves them
        self.words.numpy()[:, 7] = [c.data_ptr() for c in caches[: self.num_layers]]  # host words, no tensor op
        meta = ctx.decode
        if meta is not None:
            seq_lens, slots, table = meta.seq_lens, meta.slot_mapping, meta.block_table
        else:  # Q queries per sequence as Q rows over its block table
            verify = ctx.verify
            queries = verify.query_positions.shape[1]
            seq_lens = (verify.query_positions.reshape(-1) + 1).to(torch.int32)
            slots, table = verify.slot_mapping, verify.block_table.repeat_interleave(queries, dim=0)
        # Inert rows (done in the window, or a bucket's padding) write and read only the scratch slot: the call
        # runs the live rows alone (each row's bits do not depend on the others), and the inert ones come out as
        # zeros. A batch drained down to its one last row at row 3 is a 4-row bucket, a third dearer a step here.
        bucket = hidden.shape[0]
        live = ctx.live_tokens().nonzero().squeeze(1)  # a host read: this driver runs on the CPU only
        if live.numel() == bucket:
            live = None
        else:
            hidden, positions, seq_lens, slots, table = (t[live] for t in (hidden, positions, seq_lens, slots, table))
            pre = pre[live] if pre is not None else None
        x = hidden.contiguous().clone()
        if pre is not None:
            pre = pre.to(self.dtype).contiguous()
        rows = x.shape[0]
        need = self.kernels.layers_scratch(rows, *self.dims)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=self.dtype)
        kv = caches[0]
        width = x.shape[1]
        aux = x.new_empty((rows, len(stops) * width)) if stops else None  # each stop layer's input: its columns
        words = self.words.numpy()
        fp8 = kv.dtype == FP8
        words[:, KV_DTYPE] = FP8_CODE if fp8 else DTYPE_CODES[self.dtype]
        words[:, SAVE] = 0
        words[:, SAVE_LD] = aux.shape[1] if stops else 0
        for j, layer in enumerate(stops):
            words[layer, SAVE] = aux[:, j * width :].data_ptr()
        words[0, IN] = pre.data_ptr() if pre is not None else 0
        lora = None
        if self.max_loras:  # each live row's adapter slot, and room for the updates
            adapters = ctx.lora_slots() if live is None else ctx.lora_slots()[live]
            if self._lora_scratch.numel() < rows * self._lora_cols:
                self._lora_scratch = torch.empty(rows * self._lora_cols, dtype=self.dtype)
            lora = (adapters, self.max_loras, self._lora_scratch[: rows * self._lora_cols].view(rows, self._lora_cols))
        if rows:
            self.kernels.decoder_layers(
                self.words, self.quant, self.fp8_reals if fp8 else self.reals, self.num_layers, x, positions,
                seq_lens, slots, table, self.rotary.cos, self.rotary.sin, self._scratch, self.dims,
                kv.shape[2], kv.shape[0], self.eps, lora=lora)
        if live is None:
            return x, aux
        out = x.new_zeros((bucket, x.shape[1]))
        out[live] = x
        if aux is not None:
            full = aux.new_zeros((bucket, aux.shape[1]))
            full[live] = aux
            aux = full
        return out, aux
