"""Phi-3 / Phi-3.5-mini / Phi-4-mini: Llama's decoder with fused checkpoint tensors, partial rotary
and longrope.

* The checkpoint stores `self_attn.qkv_proj` ([q | k | v] rows) and `mlp.gate_up_proj`
  ([gate | up] rows) fused; the loader reads each shard's block of rows straight into our
  own fused linears (`fused_checkpoint`), so with tensor parallelism a rank reads its
  query heads, its KV heads and its halves of gate and up, as it does from unfused
  checkpoints.
* `partial_rotary_factor` (Phi-4-mini: 0.75): only the first dims of each head rotate.
* No biases; the sliding window, when config.json has one, is every layer's.
* config.json (Phi3Family below): rope default or longrope (Phi3Config reads the old
  names "su" and "yarn" as longrope); its own `original_max_position_embeddings` (4,096)
  and `partial_rotary_factor` win over rope_parameters' copies.

longrope, as transformers' generate runs it
-------------------------------------------
transformers picks the short or the long frequencies per forward by the sequence's
length: long when `max(position) + 1 > original_max_position_embeddings`, for every
position of that forward, with cos and sin scaled by the attention factor
(sqrt(1 + ln(factor) / ln(original)) unless config.json gives one) in both cases. A
prompt longer than the original length is therefore prefilled with the long factors
throughout; a shorter one with the short factors. And when generation crosses the
original length, Phi3ForCausalLM.prepare_inputs_for_generation drops the KV cache and
recomputes the whole sequence with the long factors.

That recomputation is a causal forward over the same tokens, so its K/V at position p
is exactly what a forward that had used the long factors from the start computes at p.
This model therefore runs two streams through the same weights, stacked along the
token dimension (one matmul per linear: a decode step still reads every weight once):
the short stream attends KV-cache layers 0..L-1, the long stream layers L..2L-1, and the
hidden state at position p is the long stream's when p >= original_max_position_embeddings
(the forward that predicts token p + 1 has seen p + 1 > original tokens), else the short
stream's. Both streams' K/V are functions of the token prefix only, so prefix caching,
chunked prefill, preemption and speculative verify keep the exact tokens. The cost is
twice the KV cache and twice the activations' FLOPs; it is paid only when the context can
cross the original length: config.json's max_position_embeddings decides the cache
layers (ModelConfig.num_layers = 2L), and with max_model_len <= original length the
long stream never runs (its cache layers stay unused).

Prompt logprobs follow the same rule per position (each is what generate computes for
the token after it), so a prompt longer than the original length has short-factor
logprobs before that length, where one transformers forward over the whole prompt
would use the long factors.
"""

from __future__ import annotations

import torch

from .decoder import DecoderForCausalLM
from .model_config import Family, ModelConfig
from .parallel import TPGroup
from .rope import RotaryEmbedding
from .rope_config import RopeRules


class _TwoStreams:
    """A ForwardContext for stacked [short; long] rows: each half attends its own KV-cache layers."""

    def __init__(self, ctx, layers: int):
        self.ctx = ctx
        self.layers = layers

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        half = q.shape[0] // 2
        short = self.ctx.attend(layer, q[:half], k[:half], v[:half])
        long = self.ctx.attend(layer + self.layers, q[half:], k[half:], v[half:])
        return torch.cat([short, long])


class Phi3ForCausalLM(DecoderForCausalLM):
    packed_modules = {}  # nothing to fuse on the way in: the checkpoint's tensors are fused already
    fused_checkpoint = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__(cfg, tp)
        self.two_streams = False  # set by init_rotary: whether the long stream runs
        self._streams_rotary = None
        self._long_offset = 0

    @property
    def attention_specs(self):
        specs = super().attention_specs
        return specs * 2 if self.config.long_rope_streams else specs  # the long stream's cache layers

    def init_rotary(self, max_positions: int) -> None:
        super().init_rotary(max_positions)
        cfg = self.config
        self.two_streams = cfg.long_rope_streams and max_positions > cfg.rope.original_max_position_embeddings
        if self.two_streams:
            weight = self.model.embed_tokens.weight
            long = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, weight.dtype, weight.device, long=True)
            self._streams_rotary = RotaryEmbedding.stacked(self.rotary, long)
            self._long_offset = max_positions

    def rotary_tables(self):
        tables = super().rotary_tables()
        return tables + [self._streams_rotary] if self._streams_rotary is not None else tables

    @classmethod
    def plain_layer_loop(cls, cfg) -> bool:
        """One stream of K/V (no longrope past original_max_position_embeddings): the plain loop runs."""
        return cfg.num_layers == cfg.decoder_layers

    def forward_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
                    aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.two_streams:
            return super().forward_aux(input_ids, positions, ctx, aux_layers)
        tokens = input_ids.shape[0]
        hidden = self.embed(input_ids)
        hidden = torch.cat([hidden, hidden])  # [2T, hidden]: the short stream, then the long one
        rows = torch.cat([positions, positions + self._long_offset])  # rows of the stacked cos/sin table
        streams = _TwoStreams(ctx, self.config.decoder_layers)
        long = (positions >= self.config.rope.original_max_position_embeddings)[:, None]

        def each_token_own_stream(both):
            return torch.where(long, both[tokens:], both[:tokens])

        saved = []
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                saved.append(each_token_own_stream(hidden))
            hidden = layer(rows, hidden, self._streams_rotary, streams)
        return self.model.norm(each_token_own_stream(hidden)), torch.cat(saved, dim=-1) if saved else None


class Phi3Family(Family):
    model_type = "phi3"
    model_class = Phi3ForCausalLM
    rope = RopeRules(types=("default", "longrope"), aliases=(("su", "longrope"), ("yarn", "longrope")),
                     partial_rotary=True, original_max=4096)

    def biases(self, where: str, raw: dict) -> tuple[bool, bool]:
        super().biases(where, raw)  # attention_bias is still checked; Phi-3's projections have no bias
        return False, False
