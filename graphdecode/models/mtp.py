"""A target's own multi-token-prediction layer as a draft head (`speculative_config={"method": "mtp"}`): the
`mtp.*` tensors Qwen3.5 (dense and MoE, text-only and multimodal checkpoints) and Qwen3-Next ship beside their
decoder, read from the target's own directory.

The layer, as those checkpoints and vLLM / SGLang define it (the target's embedding and LM head are shared):

* `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`: the target's kind of RMSNorm on the embedding of the
  token at i + 1 and on the target's final hidden state at i (after its final norm);
* `mtp.fc` [hidden, 2 x hidden]: the two, concatenated, fused into one hidden state;
* `mtp.layers.0.*`: one of the target's full-attention decoder layers (gated attention, q/k norms, partial
  rotary; a dense MLP or the MoE of the target's layers, as the checkpoint holds it);
* `mtp.norm`: its output, which the target's LM head reads to predict the token at i + 2, and which stands in
  for the target's hidden state at i + 1 when it drafts further.

DeepSeek-V3's layout (GLM-4.5 / 4.6 / 4.7, `num_nextn_predict_layers`), `NextNHead`: the same computation, its
tensors under `model.layers.{num_hidden_layers}.` beside the target's: `enorm` and `hnorm` (the embedding's and
the hidden state's plain RMSNorms), `eh_proj` [hidden, 2 x hidden] over the two concatenated, the layer's own
decoder-layer tensors (attention and the MoE, the target's kinds), and `shared_head.norm` on its output. The
layer's `embed_tokens` and `shared_head.head` are the paper's shared embedding and output head: the target's are
used, those copies are not read. The output after shared_head.norm both predicts (through the LM head) and
stands in for the hidden state when drafting further, as SGLang chains it (vLLM chains the output before the
norm); the embedding is not masked at position 0 (vLLM zeroes it there).

So it reads what an EAGLE-3 head reads at each position (a hidden state at i, the token at i + 1) and drafts
through the same window code (device/draft_head.py); its K/V lives in its own one-layer cache over the rows'
pages. Replicated on every tensor-parallel rank, as an EAGLE-3 head is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open
from torch import nn

from ..attention.spec import AttentionSpec
from .decoder import DecoderLayer
from .layers import RMSNorm
from .loader import checkpoint_files, load_model, plan_checkpoint
from .model_config import FULL, ModelConfig
from .moe import default_implementation
from .one_layer_head import OneLayerHead
from .parallel import RowParallelLinear, TPGroup
from .rope import RotaryEmbedding

FIELD = "speculative_config"
PREFIX = "mtp."
_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class MTPConfig:
    model: ModelConfig  # the head's: the target's, as one full-attention layer
    path: str  # the checkpoint holding the mtp.* tensors (the target's own directory)
    target_class: type  # the target's model class: its layer class, norms and checkpoint layout
    first_layer: int = 0  # DeepSeek-V3's layout: the layer index its tensors are stored under (num_hidden_layers)


def read_mtp_config(path: str, target: ModelConfig, target_class: type) -> MTPConfig:
    """The MTP layer's tensors in the target's checkpoint, checked against its config before any weight is
    read; a ValueError naming speculative_config otherwise."""
    where = f"{FIELD}: method 'mtp'"
    nextn = target.model_type in NEXTN_MODEL_TYPES
    if not nextn and (target.linear is None or getattr(target_class, "layer_class", None) is None or
                      target.model_type not in MTP_MODEL_TYPES):
        raise ValueError(f"{where} reads the target's own multi-token-prediction layers, which graphdecode runs for "
                         f"{', '.join(MTP_MODEL_TYPES + NEXTN_MODEL_TYPES)}; model_type {target.model_type!r} has "
                         f"none it reads (use 'eagle3', 'draft_model' or 'ngram')")
    if nextn and not target.nextn_layers:
        raise ValueError(f"{where}: the target's config.json has num_nextn_predict_layers 0: no MTP layer to read")
    try:
        files = checkpoint_files(path)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    first = target.decoder_layers  # nextn: the MTP layers' index after the decoder's
    pattern = re.compile(r"^model\.layers\.(\d+)\.") if nextn else _LAYER
    layers, experts = set(), False
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                match = pattern.match(key)
                if match and (not nextn or int(match.group(1)) >= first):
                    layers.add(int(match.group(1)) - (first if nextn else 0))
                    experts |= ".mlp.experts." in key or key.endswith(".mlp.experts.gate_up_proj")
    stored = f"model.layers.{first}.*" if nextn else "mtp.layers.*"
    if not layers:
        raise ValueError(f"{where}: the checkpoint in {path!r} has no {stored} tensors (its multi-token-"
                         f"prediction layers; some exports drop them)")
    if layers != {0}:
        names = [first + i for i in sorted(layers)] if nextn else sorted(layers)
        raise ValueError(f"{where}: the checkpoint holds {len(layers)} MTP layers ({names}); graphdecode runs "
                         f"exactly one ({stored.rstrip('*')}, as Qwen3.5, Qwen3-Next and GLM-4.5 ship)")
    if experts and target.moe is None:
        raise ValueError(f"{where}: {stored.rstrip('*')} holds experts but the target's config.json has none")
    moe = replace(target.moe, sparse_layers=()) if experts else None
    cfg = replace(target, num_layers=1, num_hidden_layers=1, layer_types=(FULL,), linear=None, moe=moe,
                  tie_word_embeddings=False)  # the target's LM head, not one of its own
    mtp = MTPConfig(model=cfg, path=path, target_class=target_class, first_layer=first if nextn else 0)
    try:
        with torch.device("meta"):
            plan_checkpoint(path, mtp_head_class(mtp)(mtp))  # every MTP header: names, shapes, dtypes
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return mtp


MTP_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")  # mtp.*
NEXTN_MODEL_TYPES = ("glm4_moe", "deepseek_v3")  # DeepSeek-V3's layout: model.layers.{num_hidden_layers}.*


class MTPHead(OneLayerHead):
    """The MTP layer with the checkpoint's names below `mtp.` (mtp_head_class gives the loader the target's
    layout: fused projections, experts)."""

    checkpoint_renames = {PREFIX: ""}
    checkpoint_skipped = ("model.", "lm_head.")  # the target's own tensors (multimodal: model.language_model.)

    def __init__(self, mtp: MTPConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        cfg = mtp.model
        cls = mtp.target_class
        self.config = cfg
        self.tp = tp
        offset = cls.norm_offset
        self.fc = RowParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, False, tp)
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        spec = AttentionSpec(soft_cap=cfg.attn_soft_cap, scale=cfg.attn_scale)
        self.layers = nn.ModuleList([cls.layer_class(cfg, 0, tp, spec, offset)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.lm_head = None  # the target's (target_logits)
        self.rotary: RotaryEmbedding | None = None
        self.packed_head = None  # the loader's slot for a quantized LM head (the target's is shared)
        self.target_logits = None  # the target's compute_logits (its LM head), set by load_mtp_head

    def post_load(self, max_positions: int) -> None:
        super().post_load(max_positions)
        if hasattr(self.layers[0].self_attn, "post_load"):  # MLA's W_UK and W_UV (DeepSeek-V3)
            self.layers[0].self_attn.post_load()
        mlp = self.layers[0].mlp
        if hasattr(mlp, "experts"):
            weight = self.norm.weight
            mlp.experts.implementation = default_implementation(weight.device, weight.dtype)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the head reads them (its final ones, as they are)."""
        return hidden

    def _fused(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """embeds [T, H] (the tokens at i + 1), hidden [T, H] (the target's final hidden states at i, or the
        head's own output before it), positions [T] (i) -> the head's output [T, H] (after mtp.norm)."""
        return self.norm(self.layers[0](positions, self._fused(embeds, hidden), self.rotary, ctx))

    def write_kv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, backend,
                 slots: torch.Tensor) -> None:
        """Only the K/V forward() would write at `positions` (no attention, no MLP)."""
        layer = self.layers[0]
        _, k, v, _ = layer.self_attn.project(positions, layer.input_layernorm(self._fused(embeds, hidden)),
                                             self.rotary)
        backend.write(0, k, v, slots)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R, vocab] float32, through the target's LM head."""
        return self.target_logits(out)

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R] int64: the greedy draft."""
        return self.logits(out).argmax(dim=-1)


class NextNHead(MTPHead):
    """The MTP layer in DeepSeek-V3's layout (GLM-4.5): enorm, hnorm, eh_proj, a decoder layer of the target's
    and shared_head.norm, named in the checkpoint under model.layers.{num_hidden_layers}. (mtp_head_class)."""

    def __init__(self, mtp: MTPConfig, tp: TPGroup = TPGroup()):
        OneLayerHead.__init__(self)
        cfg = mtp.model
        cls = mtp.target_class
        self.config = cfg
        self.tp = tp
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = RowParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, False, tp)
        spec = AttentionSpec(soft_cap=cfg.attn_soft_cap, scale=cfg.attn_scale)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, tp, spec=spec, norm_offset=cls.norm_offset,
                                                  sandwich_norms=cls.sandwich_norms)])
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        self.rotary = None
        self.packed_head = None
        self.target_logits = None

    @property
    def norm(self) -> RMSNorm:
        return self.shared_head.norm

    def _fused(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


def mtp_head_class(mtp: MTPConfig) -> type:
    """The MTP head with the target's checkpoint layout (fused projections, the experts' format; where its tensors
    are: mtp.*, or DeepSeek-V3's model.layers.{num_hidden_layers}.*)."""
    target_class = mtp.target_class
    layout = {
        "packed_modules": target_class.packed_modules,
        "fused_checkpoint": getattr(target_class, "fused_checkpoint", {}),
        "expert_format": target_class.expert_format,
    }
    if mtp.model.model_type not in NEXTN_MODEL_TYPES:
        return type(f"MTPHead[{target_class.__name__}]", (MTPHead,), layout)
    at = f"model.layers.{mtp.first_layer}."
    renames = {at + part: part for part in ("enorm.", "hnorm.", "eh_proj.", "shared_head.")}
    renames.update({**target_class.checkpoint_renames, at: "layers.0."})
    return type(f"NextNHead[{target_class.__name__}]", (NextNHead,), {
        **layout,
        "checkpoint_renames": renames,
        "checkpoint_only": at,  # the target's own tensors, and any other MTP layer's, are not the head's
        "checkpoint_skipped": (at + "embed_tokens.", at + "shared_head.head."),  # the target's are shared
    })


def load_mtp_head(mtp: MTPConfig, target, dtype: torch.dtype, device: torch.device, max_positions: int,
                  huge_pages: bool = False) -> MTPHead:
    """The MTP layer's weights (the loader's checks), sharing the target's LM head; huge_pages: as load_model's."""
    cls = mtp_head_class(mtp)
    head = load_model(mtp.path, mtp.model, dtype, device, max_positions, build=lambda cfg, tp: cls(mtp, tp),
                      huge_pages=huge_pages)
    head.target_logits = target.compute_logits
    return head
