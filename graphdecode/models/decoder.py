"""The decoder every family is built from: attention, gated MLP, norms, the causal LM around them.

A family is a small file (llama.py, qwen2.py, qwen3.py, phi3.py, gemma3.py, mixtral.py,
qwen3_moe.py, gpt_oss.py) that picks variants of these parts and declares how its
config.json reads (a Family, models/model_config.py); nothing here branches on model_type.
The variants:

* attention (`Attention`): q/k RMSNorm over head_dim before rotary (`qk_norm`), the
  layer's sliding window, soft-cap and query scale (an `AttentionSpec` the backends
  take, listed per layer by `attention_specs`), the rope it rotates with (partial
  rotary lives in the RotaryEmbedding: Phi-3 rotates only the first dims);
* MLP (`GatedMLP`): the activation of the gated pair, SwiGLU or GeGLU; or a mixture of
  experts (`SparseMoE`, moe.py: Mixtral, Qwen3-MoE, gpt-oss) in the layers
  `ModelConfig.moe` marks sparse;
* attention sinks (gpt-oss: a learned logit per head, `self_attn.sinks`, carried to the
  backend in the layer's AttentionSpec) and RMSNorm's weight applied in float32
  (`norm_weight_fp32`);
* norms: `norm_offset` (Gemma's (1 + weight) RMSNorm) and `sandwich_norms` (Gemma's
  norm after attention and around the MLP, besides the input norm);
* embeddings scaled by sqrt(hidden_size) (`embed_scale`), logits soft-capped
  (ModelConfig.final_soft_cap).

Parameter names follow HuggingFace (`model.layers.N.self_attn...`), except that
q/k/v live in one fused `qkv_proj` and gate/up in one `gate_up_proj`; the loader
fills them from the unfused checkpoint tensors (`packed_modules`), or, for a
checkpoint that stores them fused already (Phi-3), from row blocks of its own fused
tensors (`fused_checkpoint`).

forward() takes flattened tokens `[T]` and a ForwardContext that owns the paged
KV cache and the attention metadata, so the same module serves ragged prefill,
batched decode and speculative verify.

Pipeline parallelism (models/pipeline.py): a stage builds only its layers (the others are MissingLayers) and
the LM head only on the last stage; forward receives the previous stage's hidden states and sends its own on,
and compute_logits gives every rank the last stage's logits.

Tensor parallelism (models/parallel.py): with a TPGroup of N ranks each rank holds
its query heads, its KV heads (replicated when there are fewer than N), its share of
the MLP's intermediate size and a block of the vocabulary; o_proj and down_proj
all-reduce, the embedding all-reduces, the logits are all-gathered. q/k norms act
per head, so each rank applies the whole (replicated) weight to its own heads.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..attention.spec import AttentionSpec
from . import mxfp4
from .layers import FusedLinear, GatedActivation, RMSNorm
from .mla import MLAttention
from .model_config import SLIDING, ModelConfig
from .moe import SparseMoE, default_implementation
from .parallel import (
    ParallelLMHead,
    RowParallelLinear,
    ShardSpec,
    TPGroup,
    VocabParallelEmbedding,
    kv_heads_spec,
    local_kv_heads,
)
from .parallel import split as split_rows
from .pipeline import MissingLayer
from .rope import RotaryEmbedding


class Attention(nn.Module):
    """Self-attention over the paged cache. Variants are parameters: qk_norm (RMSNorm over head_dim
    on q and k before rotary; norm_offset: Gemma's), and the AttentionSpec the backend runs the
    layer with (sliding window, soft-cap, query scale)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, *, qk_norm: bool = False,
                 norm_offset: bool = False, spec: AttentionSpec | None = None, output_gate: bool = False,
                 rope: bool = True):
        super().__init__()
        self.rope = rope  # False: no position encoding at all (Nemotron-H's attention layers)
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads // tp.size  # this rank's
        self.num_kv_heads = local_kv_heads(cfg.num_kv_heads, tp)
        self.head_dim = cfg.head_dim
        self.spec = spec or AttentionSpec()
        self.k_scale = self.v_scale = 1.0  # an FP8 KV cache's scales (the checkpoint's k_scale / v_scale)
        # output_gate (Qwen3.5, Qwen3-Next): q_proj's rows hold each head's query and then its gate, and the
        # attention output is multiplied by sigmoid(gate) before o_proj
        self.output_gate = output_gate
        widen = 2 if output_gate else 1
        q_spec = split_rows(cfg.num_heads * cfg.head_dim * widen, tp)
        kv_spec = kv_heads_spec(cfg.num_kv_heads, cfg.head_dim, tp)
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": q_spec, "k": kv_spec, "v": kv_spec}, cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp)
        q_size, kv_size = self.num_heads * cfg.head_dim * widen, self.num_kv_heads * cfg.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, norm_offset)
        if cfg.attn_sinks:  # gpt-oss: one learned logit per query head in the softmax's denominator
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
            self.tp_specs = {"sinks": ShardSpec(0, tp.rank * self.num_heads, (tp.rank + 1) * self.num_heads,
                                                cfg.num_heads)}

    @property
    def attention_spec(self) -> AttentionSpec:
        """The spec the backend runs this layer with (the loaded sink logits and KV scales included)."""
        sinks = self.sinks.detach().float() if hasattr(self, "sinks") else None
        return replace(self.spec, sinks=sinks, k_scale=self.k_scale, v_scale=self.v_scale)

    def project(self, positions, hidden, rotary: RotaryEmbedding):
        """(q [T, H, D], k and v [T, KV, D], the output gate [T, H, D] or None): normed and rotated."""
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = rotary(positions, q, k)
        return q, k, v, gate

    def forward(self, positions, hidden, rotary: RotaryEmbedding, ctx, kv_layer: int | None = None) -> torch.Tensor:
        """kv_layer: the KV-cache layer to attend with (default: this layer's own)."""
        tokens = hidden.shape[0]
        q, k, v, gate = self.project(positions, hidden, rotary)
        out = ctx.attend(self.layer_idx if kv_layer is None else kv_layer, q, k, v)  # [T, H, D]
        if gate is not None:
            return self.o_proj((out * torch.sigmoid(gate)).reshape(tokens, -1))
        return self.o_proj(out.reshape(tokens, -1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused; act: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, act: str = "silu"):
        super().__init__()
        rows = split_rows(cfg.intermediate_size, tp)
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": rows, "up": rows}, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)
        self.act = GatedActivation(act)

    one_pass = None  # a cpu_linear.PanelWeight whose run_swiglu is gate_up and SwiGLU at once (CPU), set at load

    def use_cpu_kernels(self, kernels) -> None:
        """SwiGLU over gate_up's panels: one pass of the CPU kernel (csrc/cpu_linear.cpp) with the same bits."""
        packed = self.gate_up_proj.packed
        if (kernels is not None and self.act.act == "silu" and self.gate_up_proj.bias is None
                and getattr(packed, "gated_one_pass", False)):
            self.one_pass = packed

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: added to the output (residual + MLP(x)), in down_proj's pass where the CPU panels run it."""
        if self.one_pass is not None and not torch.compiler.is_compiling():
            return self.down_proj(self.one_pass.run_swiglu(x), residual)
        return self.down_proj(self.act(self.gate_up_proj(x)), residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, *, spec: AttentionSpec,
                 norm_offset: bool = False, sandwich_norms: bool = False):
        super().__init__()
        if cfg.mla is not None:  # DeepSeek-V3's latent attention (mla.py)
            self.self_attn = MLAttention(cfg, layer_idx, tp, spec=spec)
        else:
            self.self_attn = Attention(cfg, layer_idx, tp, qk_norm=cfg.qk_norm, norm_offset=norm_offset, spec=spec)
        self.sparse = cfg.moe is not None and cfg.moe.is_sparse(layer_idx)
        self.mlp = SparseMoE(cfg.moe, cfg.hidden_size, tp) if self.sparse else GatedMLP(cfg, tp, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset, cfg.norm_weight_fp32)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset, cfg.norm_weight_fp32)
        self.sandwich_norms = sandwich_norms
        if sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)

    def forward(self, positions, hidden, rotary, ctx, kv_layer: int | None = None):
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, ctx, kv_layer)
        if self.sandwich_norms:  # Gemma: each block's output normed too
            hidden = hidden + self.post_attention_layernorm(attn)
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, attn)  # Llama: pre-norms only
        if self.sparse:  # an MoE counts the live tokens it routes
            return hidden + self.mlp(normed, ctx.live_tokens())
        return self.mlp(normed, residual=hidden)  # hidden + MLP(normed)


class DecoderModel(nn.Module):
    """The embedding (None on a pipeline stage that neither embeds nor reads it as its tied head), the decoder
    layers (the model class's `make_layer`) and the final norm."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, layers: list[nn.Module], norm_offset: bool,
                 embeds: bool = True):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if embeds else None
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset, cfg.norm_weight_fp32)


class DecoderForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused module name, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    # fused module name -> its shards in checkpoint row order, for checkpoints that store them fused
    fused_checkpoint: dict[str, tuple[str, ...]] = {}
    checkpoint_renames: dict[str, str] = {}  # checkpoint name fragment -> this engine's (Mixtral's block_sparse_moe)
    expert_format = None  # an expert_weights.ExpertFormat: how an MoE checkpoint stores its experts
    norm_offset = False  # (1 + weight) RMSNorms (Gemma)
    sandwich_norms = False  # norms after attention and around the MLP (Gemma)
    embed_scale = False  # embeddings times sqrt(hidden_size) (Gemma)
    skipped_parts: tuple[str, ...] = ()  # checkpoint name prefixes of parts the family never runs (a vision tower)

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.stage = stage = tp.stage
        if stage.size > 1 and type(self).forward_aux is not DecoderForCausalLM.forward_aux:
            raise ValueError(f"pipeline_parallel_size: {type(self).__name__} runs a layer loop of its own, which "
                             f"pipeline stages do not split yet; use tensor_parallel_size")
        layers = [self.make_layer(i, tp) if stage.holds(i) else MissingLayer(self.layer_spec(i), cfg.attends(i))
                  for i in range(cfg.decoder_layers)]
        # the embedding, the tied head's weight, or a draft head's embedding
        embeds = stage.first or (cfg.tie_word_embeddings and stage.last) or stage.every_embedding
        self.model = DecoderModel(cfg, tp, layers, self.norm_offset, embeds)
        if not cfg.tie_word_embeddings:  # the logits are the last stage's
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp) if stage.last else None
        self.rotaries: list[RotaryEmbedding] = []  # each decoder layer's (shared tables)
        self.packed_head = None  # the LM head's cpu_linear.PackedWeight (CPU)
        self._embed_scale = None
        self.expert_tokens: torch.Tensor | None = None  # [MoE layers, E] int64: live tokens routed per expert
        self.cpu_decode = None  # a cpu_decode.CpuDecodeLayers: plain layers' decode steps in one C++ call (CPU)
        self.lora = None  # a LoRA engine's lora.layers.LoRAState: each forward's tokens' adapter slots (lora/model.py)

    @property
    def checkpoint_skipped(self) -> tuple[str, ...]:
        """The family's skipped parts, and the MTP layers stored after the decoder's (DeepSeek-V3's layout,
        ModelConfig.nextn_layers): read by speculative decoding's "mtp" (models/mtp.py), not by the model."""
        first, nextn = self.config.decoder_layers, self.config.nextn_layers
        skipped = self.skipped_parts + tuple(f"model.layers.{i}." for i in range(first, first + nextn))
        if self.stage.size > 1:  # the other stages' layers, the LM head but on the last stage, the embedding where
            skipped += tuple(f"model.layers.{i}." for i in range(first) if not self.stage.holds(i))
            skipped += () if self.stage.last else ("lm_head.",)
            skipped += () if self.model.embed_tokens is not None else ("model.embed_tokens.",)  # none reads it
        return skipped

    @classmethod
    def plain_layer_loop(cls, cfg: ModelConfig) -> bool:
        """Whether the family's forward is DecoderForCausalLM's own loop over its decoder layers for this config
        (what pipeline stages split and LoRA runs with)."""
        return cls.forward_aux is DecoderForCausalLM.forward_aux

    def make_layer(self, layer: int, tp: TPGroup) -> nn.Module:
        """Decoder layer `layer` (a family with other layers, models/hybrid.py, builds its own)."""
        return DecoderLayer(self.config, layer, tp, spec=self.layer_spec(layer), norm_offset=self.norm_offset,
                            sandwich_norms=self.sandwich_norms)

    def layer_spec(self, layer: int) -> AttentionSpec:
        """Decoder layer `layer`'s attention variant, from the config."""
        cfg = self.config
        return AttentionSpec(sliding_window=cfg.layer_window(layer), soft_cap=cfg.attn_soft_cap, scale=cfg.attn_scale)

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        """One spec per KV-cache layer (what the attention backend is built with)."""
        return [layer.self_attn.attention_spec for layer in self.model.layers]

    def rotary_tables(self) -> list[RotaryEmbedding]:
        """Every rope table the forward reads (shared tables once)."""
        return list({id(r): r for r in self.rotaries}.values())

    @property
    def rotary(self) -> RotaryEmbedding | None:
        return self.rotaries[0] if self.rotaries else None

    @property
    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.model.layers if layer.sparse]

    def window_tensors(self) -> dict[str, torch.Tensor | None]:
        """What a decode window's forward writes besides the KV cache: the experts' counters, and the CPU's
        one-call layers' argument words (cache pointers and save slots, rewritten by each call)."""
        words = {"cpu_decode.words": self.cpu_decode.words} if self.cpu_decode is not None else {}
        return {"expert_tokens": self.expert_tokens, **words}

    def anchor(self) -> torch.Tensor:
        """A weight of the model's dtype on its device: the embedding's, or (a pipeline stage without one) its first
        attention layer's o_proj, or where it holds none (a hybrid's stage of recurrent layers) its first recurrent
        layer's out_proj."""
        if self.model.embed_tokens is not None:
            return self.model.embed_tokens.weight
        held = [layer for layer in self.model.layers if not isinstance(layer, MissingLayer)]
        for layer in held:
            attention = getattr(layer, "attention", None) or getattr(layer, "self_attn", None)
            if attention is not None:
                return attention.o_proj.weight
        return next(layer.state_mixer for layer in held if layer.state_mixer is not None).out_proj.weight

    def post_load(self, max_positions: int) -> None:
        """Device state made once the weights are in: rope tables, the experts' counters and kernels."""
        self.init_rotary(max_positions)
        for layer in self.model.layers:  # what an attention makes of its loaded weights (MLA's W_UK and W_UV)
            attention = getattr(layer, "self_attn", None)
            if hasattr(attention, "post_load"):
                attention.post_load()
        moe = self.moe_layers
        if moe:
            weight = self.anchor()
            self.expert_tokens = torch.zeros(len(moe), self.config.moe.num_experts, dtype=torch.int64,
                                             device=weight.device)
            implementation = default_implementation(weight.device, weight.dtype)
            for counter, layer in zip(self.expert_tokens, moe):
                layer.expert_tokens = counter
                layer.experts.implementation = implementation
                if layer.experts.mxfp4:  # the E2M1 values on the device, float32 (the weights dequantize exactly)
                    layer.experts.fp4_values = mxfp4.fp4_table(weight.device)

    def init_rotary(self, max_positions: int) -> None:
        weight = self.anchor()
        cfg = self.config
        tables, self.rotaries = {}, []
        for i in range(cfg.decoder_layers):
            local = cfg.local_rope is not None and cfg.layer_types and cfg.layer_types[i] == SLIDING
            rope = cfg.local_rope if local else cfg.rope
            if rope not in tables:
                tables[rope] = RotaryEmbedding(rope, cfg.rope_head_dim, max_positions, weight.dtype, weight.device)
            self.rotaries.append(tables[rope])
        if self.embed_scale:  # transformers: a float32 tensor of sqrt(hidden_size), cast to the weights' dtype
            self._embed_scale = torch.tensor(cfg.hidden_size**0.5).to(device=weight.device, dtype=weight.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite: times a Python float, as transformers does
            hidden = hidden * self.config.embedding_multiplier
        return hidden * self._embed_scale if self._embed_scale is not None else hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden]."""
        return self.forward_aux(input_ids, positions, ctx)[0]

    def forward_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx, aux_layers: tuple[int, ...] = (),
                    sends: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states [T, hidden], the hidden states entering each of `aux_layers` (ascending),
        concatenated [T, len(aux_layers) x hidden], what an EAGLE-3 head reads; None without aux_layers).
        A pipeline stage but the last sends its hidden states on (with the inputs of `aux_layers` seen so far
        beside them: models/pipeline.py) and returns them un-normed: at once, the send's handle appended to
        `sends`, where it is given; else waiting for the send.
        A family with its own layer loop overrides this, not forward()."""
        hidden, saved = self._stage_input(input_ids, aux_layers)
        if self.cpu_decode is not None and self.cpu_decode.applies(ctx, hidden.shape[0]):
            hidden, aux = self.cpu_decode.run(hidden, positions, ctx, aux_layers)
            return self.model.norm(hidden), aux
        if self.lora is not None:
            self.lora.begin(ctx.lora_slots())
        for i, (layer, rotary) in enumerate(zip(self.model.layers, self.rotaries)):
            if not self.stage.holds(i):
                continue
            if i in aux_layers:
                saved.append(hidden)  # each layer returns a new tensor: nothing writes it later
            hidden = layer(positions, hidden, rotary, ctx)
        if not self.stage.last:  # the next stage goes on; this one's rows only shape the logits it will receive
            handle = self.stage.send(torch.cat([hidden, *saved], dim=-1) if saved else hidden, wait=sends is None)
            if sends is not None:
                sends.append(handle)
            return hidden, None
        return self.model.norm(hidden), torch.cat(saved, dim=-1) if saved else None

    def _stage_input(self, input_ids: torch.Tensor, aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list]:
        """(The hidden states entering this stage's layers, the inputs of the `aux_layers` before them): the
        embedding (first stage), or the previous stage's hand-off."""
        if self.stage.first:
            return self.embed(input_ids), []
        weight, width = self.anchor(), self.config.hidden_size
        carried = sum(1 for i in aux_layers if i < self.stage.layers.start)
        received = self.stage.recv(input_ids.shape[0], width * (1 + carried), weight.dtype, weight.device)
        if not carried:
            return received, []
        return received[:, :width].contiguous(), list(received[:, width:].split(width, dim=-1))

    def stage_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx, sends: list) -> torch.Tensor | None:
        """A pipeline stage's part of one decode step of these rows (device/pipeline_window.py): the last stage's
        logits [R, vocab] float32, which only it samples; elsewhere None, the hidden states sent on without waiting
        (the send's handle appended to `sends`)."""
        hidden, _ = self.forward_aux(input_ids, positions, ctx, sends=sends)
        return self._logits(hidden).contiguous() if self.stage.last else None

    def shared_logits(self, logits: torch.Tensor | None, rows: int) -> torch.Tensor:
        """The last stage's logits on every rank (None elsewhere: received into [rows, V])."""
        if logits is None:
            logits = torch.empty(rows, self.config.vocab_size, dtype=torch.float32, device=self.anchor().device)
        return self.stage.share(logits)

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """One token per row: [B] -> logits [B, vocab] float32 (what a decode window compiles)."""
        return self.window_logits(self.forward(input_ids, positions, ctx), ctx)

    def window_logits(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        """A window forward's logits: on a CPU, the live rows' only (inert rows, done or padding, and a verify's
        queries past a row's drafts: what they sample is never read), the inert rows' zeros; elsewhere every
        row's (a graph's static shape; pipeline stages share whole logits)."""
        if hidden.device.type != "cpu" or self.stage.size > 1 or torch.compiler.is_compiling():
            return self.compute_logits(hidden)
        live = ctx.live_tokens()
        if bool(live.all()):
            return self.compute_logits(hidden)
        logits = hidden.new_zeros((hidden.shape[0], self.config.vocab_size), dtype=torch.float32)
        logits[live] = self.compute_logits(hidden[live])
        return logits

    def forward_for_head(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
                         aux_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states, the hidden states a draft head reads): the inputs of `aux_layers`
        [T, 3 x hidden] (an EAGLE-3 head), or with None the final hidden states [T, hidden] (an MTP layer)."""
        hidden, aux = self.forward_aux(input_ids, positions, ctx, aux_layers or ())
        read = hidden if aux_layers is None else aux
        if self.stage.size > 1:  # the last stage's, on every rank (each runs the head)
            width = self.config.hidden_size * (1 if aux_layers is None else len(aux_layers))
            read = self.stage.share(read if self.stage.last else hidden.new_empty(hidden.shape[0], width))
        return hidden, read

    def logits_and_aux(self, aux_layers: tuple[int, ...] | None):
        """A window's forward that also returns the hidden states a draft head reads (forward_for_head):
        (input_ids, positions, ctx) -> (logits [T, vocab] float32, those hidden states)."""
        def forward(input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
            hidden, aux = self.forward_for_head(input_ids, positions, ctx, aux_layers)
            return self.window_logits(hidden, ctx), aux
        return forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab] float32 (the same full logits on every rank)."""
        if self.stage.size > 1:  # the last stage's logits, sent to every rank
            return self.shared_logits(self._logits(hidden).contiguous() if self.stage.last else None, hidden.shape[0])
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = ParallelLMHead.logits(hidden, weight, self.tp, self.config.vocab_size, self.packed_head)
        if self.config.logits_scaling != 1.0:  # Granite's
            logits = logits / self.config.logits_scaling
        cap = self.config.final_soft_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap
