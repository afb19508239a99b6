"""Qwen3-Next (`qwen3_next`: Qwen3NextForCausalLM, e.g. Qwen3-Next-80B-A3B): Qwen3.5's hybrid of Gated DeltaNet
and gated attention layers (qwen3_5.py) with mixtures of experts.

What differs from Qwen3.5:

* the linear layers' input projections are stored grouped by key head (`in_proj_qkvz`: per key head its q, k
  and its value heads' v and z; `in_proj_ba`: per key head its value heads' b and a), reordered at load into
  the split layout the layer runs (gated_deltanet.grouped_order);
* the MLPs: routed experts beside a gated shared expert (moe.SharedExpert) in the layers that are sparse
  (not in `mlp_only_layers`, (index + 1) a multiple of `decoder_sparse_step`), a dense SwiGLU MLP of
  intermediate_size elsewhere; the top-k weights renormalised with `norm_topk_prob` (default true);
* the rope is plain (no multimodal sections), over partial_rotary_factor (0.25) of head_dim.
"""

from __future__ import annotations

from .config_fields import read_bool, read_int
from .moe import MoEConfig
from .qwen3_5 import Qwen3_5Family, Qwen3_5MoeForCausalLM, shared_expert_moe


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    pass


class Qwen3NextFamily(Qwen3_5Family):
    model_type = "qwen3_next"
    model_class = Qwen3NextForCausalLM
    layout = "grouped"

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig | None:
        step = read_int(where, raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense
        ):
            raise ValueError(f"{where}: mlp_only_layers must list layer indices below {num_layers}, got {dense!r}")
        experts = read_int(where, raw, "num_experts", 512, minimum=0)
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        if not any(sparse):
            return None
        return shared_expert_moe(where, raw, sparse, renormalize=read_bool(where, raw, "norm_topk_prob", True))
