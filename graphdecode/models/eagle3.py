"""An EAGLE-3 draft head (`speculative_config={"method": "eagle3", "model": DIR}`), in the checkpoint format
the EAGLE authors and SpecForge publish and vLLM / SGLang load.

config.json is a Llama config (`model_type` "llama", `architectures` ["LlamaForCausalLMEagle3"]) of one
decoder layer, plus `draft_vocab_size` (the head's reduced vocabulary), optionally `target_hidden_size`
and `eagle_config.eagle_aux_hidden_state_layer_ids` (the target layers whose input hidden states feed it;
default (2, L // 2, L - 3) for a target of L layers, vLLM's) and `norm_before_residual`. Its tensors:

* `fc.weight` [hidden, 3 x target_hidden]: the three target hidden states fused into one;
* `midlayer.*` (or `layers.0.*`): the decoder layer, whose q/k/v read the concatenation of the normed token
  embedding (`input_layernorm`) and the normed fused hidden state (`hidden_norm`), 2 x hidden wide;
* `norm.weight`, `lm_head.weight` [draft_vocab, hidden]; `d2t` [draft_vocab] int64 (draft id + d2t[id] is
  the target id; absent when the draft vocabulary is the target's); `t2d` (unused here);
* `embed_tokens.weight`, optional: without it the head embeds with the target's embedding.

At position i the head reads the target's hidden states at i and the token at i + 1 and predicts the token
at i + 2; its output before the final norm (`prenorm`) stands in for the target's hidden state at i + 1
when it drafts further (device/draft_head.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from .decoder import Attention, DecoderForCausalLM, GatedMLP
from .layers import FusedLinear, RMSNorm
from .loader import checkpoint_files, load_model, plan_checkpoint
from .model_config import ModelConfig, load_model_config
from .one_layer_head import OneLayerHead
from .parallel import ParallelLMHead, RowParallelLinear, TPGroup, VocabParallelEmbedding, split
from .rope import RotaryEmbedding

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FIELD = "speculative_config.model"


@dataclass(frozen=True)
class Eagle3Config:
    model: ModelConfig  # the head's own config.json (one decoder layer)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # the target layers whose input hidden states it reads, ascending
    own_embedding: bool  # the checkpoint holds embed_tokens.weight (else the target's embedding)
    has_d2t: bool
    norm_before_residual: bool


def read_eagle3_config(path: str, target: ModelConfig) -> Eagle3Config:
    """The head's config.json and tensor headers, checked against the target before any weight is read;
    a ValueError naming speculative_config.model and the field otherwise."""
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
        cfg = load_model_config(path)
        files = checkpoint_files(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{FIELD}: {e}") from None
    where = f"{FIELD} ({config_path})"
    architectures = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in architectures):
        raise ValueError(f"{where}: architectures must name an EAGLE-3 head ({' or '.join(ARCHITECTURES)}), "
                         f"got {architectures!r}")
    if cfg.decoder_layers != 1:
        raise ValueError(f"{where}: num_hidden_layers must be 1 (an EAGLE-3 head's one decoder layer), "
                         f"got {cfg.decoder_layers}")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: vocab_size ({cfg.vocab_size}) differs from the target's ({target.vocab_size}); "
                         f"the head must share the target's tokenizer")
    draft_vocab = raw.get("draft_vocab_size", cfg.vocab_size)
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 0 < draft_vocab <= cfg.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size must be an integer in 1..vocab_size ({cfg.vocab_size}), "
                         f"got {draft_vocab!r}")
    target_hidden = raw.get("target_hidden_size", cfg.hidden_size)
    if target_hidden != target.hidden_size:
        name = "target_hidden_size" if "target_hidden_size" in raw else "hidden_size"
        raise ValueError(f"{where}: {name} ({target_hidden}) differs from the target's hidden_size "
                         f"({target.hidden_size})")
    layers = target.decoder_layers
    eagle = raw.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    name = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if ids is None:
        ids, name = [2, layers // 2, layers - 3], f"the default aux layers (2, L // 2, L - 3) of a {layers}-layer target"
    if (not isinstance(ids, list) or len(ids) != 3 or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
            or len(set(ids)) != 3 or not all(0 <= i < layers for i in ids)):
        raise ValueError(f"{where}: {name} must be 3 distinct target layers in 0..{layers - 1}, got {ids!r}")
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state", True) is not True:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state must be true (an EAGLE-3 head)")
    keys = set()
    for file in files:
        with safe_open(file, "pt") as f:
            keys.update(f.keys())
            if "d2t" in f.keys():
                d2t = f.get_slice("d2t")
                if tuple(d2t.get_shape()) != (draft_vocab,) or d2t.get_dtype() not in ("I64", "I32"):
                    raise ValueError(f"{where}: tensor 'd2t' must be [draft_vocab_size] = [{draft_vocab}] int64, "
                                     f"got {tuple(d2t.get_shape())} {d2t.get_dtype()}")
    if draft_vocab < cfg.vocab_size and "d2t" not in keys:
        raise ValueError(f"{where}: tensor 'd2t' is missing (draft_vocab_size {draft_vocab} < vocab_size "
                         f"{cfg.vocab_size} needs the draft-to-target id map)")
    eagle = Eagle3Config(model=cfg, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
                         aux_layers=tuple(sorted(ids)), own_embedding="embed_tokens.weight" in keys,
                         has_d2t="d2t" in keys, norm_before_residual=bool(raw.get("norm_before_residual", False)))
    try:
        with torch.device("meta"):
            plan_checkpoint(path, Eagle3Head(eagle))  # every tensor's header: names, shapes, dtypes
        if eagle.has_d2t:
            draft_targets(path, eagle)
    except ValueError as e:
        raise ValueError(f"{FIELD}: {e}") from None
    return eagle


def draft_targets(path: str, eagle: Eagle3Config) -> torch.Tensor:
    """[draft_vocab] int64: each draft id's target id, from the checkpoint's d2t offsets, checked."""
    for file in checkpoint_files(path):
        with safe_open(file, "pt") as f:
            if "d2t" in f.keys():
                offsets = f.get_tensor("d2t").to(torch.int64)
    targets = torch.arange(eagle.draft_vocab_size, dtype=torch.int64) + offsets
    vocab = eagle.model.vocab_size
    if targets.min() < 0 or targets.max() >= vocab or targets.unique().numel() != targets.numel():
        raise ValueError(f"tensor 'd2t' maps draft ids outside 0..{vocab - 1} or two draft ids to one target id")
    return targets


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(cfg, 0, tp)
        attn = self.self_attn
        q_spec = split(cfg.num_heads * cfg.head_dim, tp)
        kv_spec = split(cfg.num_kv_heads * cfg.head_dim, tp)
        # q/k/v read [normed embedding | normed hidden state]
        attn.qkv_proj = FusedLinear(2 * cfg.hidden_size, {"q": q_spec, "k": kv_spec, "v": kv_spec}, cfg.qkv_bias)
        self.mlp = GatedMLP(cfg, tp, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle3Head(OneLayerHead):
    """The head as one small module with the checkpoint's names (the loader fuses q/k/v and gate/up)."""

    packed_modules = DecoderForCausalLM.packed_modules
    fused_checkpoint: dict[str, tuple[str, ...]] = {}
    checkpoint_renames = {"midlayer.": "layers.0."}
    checkpoint_extras = ("d2t", "t2d")  # integer maps, read by load_eagle3_head (t2d unused)
    expert_format = None
    one_call_reads_concat = True

    def __init__(self, eagle: Eagle3Config, tp: TPGroup = TPGroup()):
        super().__init__()
        cfg = eagle.model
        self.config = cfg
        self.eagle = eagle
        self.tp = tp
        self.fc = RowParallelLinear(3 * eagle.target_hidden_size, cfg.hidden_size, False, tp)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, tp)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(eagle.draft_vocab_size, cfg.hidden_size, tp)
        if eagle.own_embedding:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary: RotaryEmbedding | None = None
        self.packed_head = None  # the LM head's cpu_linear.PackedWeight (CPU)
        self.draft_to_target: torch.Tensor | None = None  # [draft_vocab] int64: each draft id's target id

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The three target hidden states [T, 3 x target_hidden] fused into one [T, hidden]."""
        return self.fc(aux)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """embeds [T, H] (the tokens at i + 1), hidden [T, H] (fc of the target's hidden states at i, or the
        head's own prenorm output before it), positions [T] (i) -> prenorm [T, H]."""
        layer = self.layers[0]
        if self.eagle.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), hidden], dim=-1)
        if self.cpu_decode is not None and self.cpu_decode.applies(ctx, x.shape[0]):  # the layer in one C++ call
            return self.cpu_decode.run(residual, positions, ctx, pre=x)[0]
        attn = layer.self_attn(positions, x, self.rotary, ctx)
        residual, normed = layer.post_attention_layernorm.add_and_norm(residual, attn)
        return residual + layer.mlp(normed)

    def write_kv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, backend,
                 slots: torch.Tensor) -> None:
        """Only the K/V forward() would write at `positions` (no attention, no MLP)."""
        layer = self.layers[0]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        _, k, v, _ = layer.self_attn.project(positions, x, self.rotary)
        backend.write(0, k, v, slots)

    def draft_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R, draft_vocab] float32: the logits over the head's own vocabulary."""
        return ParallelLMHead.logits(self.norm(prenorm), self.lm_head.weight, self.tp, self.eagle.draft_vocab_size,
                                     self.packed_head)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R, vocab] float32 over the target's vocabulary: -inf outside the draft vocabulary."""
        small = self.draft_logits(prenorm)
        if self.draft_to_target is None:
            return small
        full = small.new_full((small.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_to_target, small)

    def greedy(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R] int64: logits(prenorm).argmax(-1) without the vocabulary-wide logits (the draft ids
        ascend with the target's, so ties break alike)."""
        small = self.draft_logits(prenorm).argmax(dim=-1)
        return small if self.draft_to_target is None else self.draft_to_target[small]


def load_eagle3_head(path: str, eagle: Eagle3Config, dtype: torch.dtype, device: torch.device,
                     max_positions: int, huge_pages: bool = False) -> Eagle3Head:
    """The head's weights (the loader's checks: finite values; read_eagle3_config checked the rest), its d2t map;
    huge_pages: as load_model's."""
    head = load_model(path, eagle.model, dtype, device, max_positions, build=lambda cfg, tp: Eagle3Head(eagle, tp),
                      huge_pages=huge_pages)
    if eagle.has_d2t:
        head.draft_to_target = draft_targets(path, eagle).to(device)
    return head
