"""What a one-layer draft head is to the loader and the runner, whichever head it is (models/eagle3.py's EAGLE-3
head, models/mtp.py's MTP layer): its one decoder layer's attention spec, its own rope table (made once the
weights are in, in their dtype and on their device), and no tensors a window writes besides its K/V."""

from __future__ import annotations

import torch
from torch import nn

from ..attention.spec import AttentionSpec
from .rope import RotaryEmbedding


class OneLayerHead(nn.Module):
    """A head with `config`, `layers` (one decoder layer, its attention `self_attn`) and `norm`."""

    rotary: RotaryEmbedding | None = None
    streams_weights = True  # run between the target's layers, which evict its weights (cpu_linear.py: panels)
    cpu_decode = None  # a cpu_decode.CpuDecodeLayers where its layer's steps run in one C++ call (the loader's)
    one_call_reads_concat = False  # its layer's q/k/v read [normed embedding | normed hidden] (an EAGLE-3 head's)

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        return [self.layers[0].self_attn.attention_spec]

    def rotary_tables(self) -> list[RotaryEmbedding]:
        return [self.rotary]

    def window_tensors(self) -> dict[str, torch.Tensor | None]:
        """The one call's argument words (cache pointers and its input's, rewritten by each call)."""
        return {"cpu_decode.words": self.cpu_decode.words} if self.cpu_decode is not None else {}

    def post_load(self, max_positions: int) -> None:
        weight = self.norm.weight
        self.rotary = RotaryEmbedding(self.config.rope, self.config.rope_head_dim, max_positions, weight.dtype,
                                      weight.device)
