"""Pipeline parallelism for the models: which decoder layers a stage holds, and the hand-offs between stages.

With `pipeline_parallel_size` P, the decoder's layers are split into P contiguous stages (`partition_layers`:
even, the remainder to the stages before the last, as vLLM splits them; or an explicit `pp_layer_partition`).
Global rank r is stage r // T, tensor-parallel rank r % T of it (T = tensor_parallel_size): each stage is a
tensor-parallel group of its own, and stage s's tensor rank t hands its hidden states to stage s + 1's rank t.

Every rank runs the same plan (the driver broadcasts it to all), so each forward is the same on every stage:
the first stage embeds and runs its layers, each later stage receives the hidden states [T, hidden] (`recv`)
instead of embedding, runs its own layers and sends them on (`send`); the last stage applies the final norm and
the LM head, and its logits go to every rank (`share`, from the last stage's tensor rank 0), so that every rank
samples the same tokens with the same noise and advances the same decode state, as tensor-parallel ranks do from
their gathered logits (micro-batched windows share the last stage's sampled tokens instead: pipeline_window.py).
A stage holds only its layers' weights (others are `MissingLayer`s: no parameters, their checkpoint tensors
skipped) and only their KV cache; the embedding lives on the first stage (and on the last where a tied head reads
it), the LM head on the last.

A draft head (EAGLE-3, MTP: device/draft_head.py) runs replicated on every rank, as a draft model does: the hidden
states it reads are the inputs of layers on several stages (EAGLE-3) or the final ones (MTP), so each hand-off
carries, beside the hidden states, the head's layers' inputs seen so far ([T, hidden x (1 + carried)]), and the
last stage shares what the head reads with every rank; every stage then holds the embedding where the head embeds
its tokens with the target's (MTP, an EAGLE-3 head without an embedding of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..attention.spec import AttentionSpec


def partition_layers(num_layers: int, stages: int, partition: tuple[int, ...] | None = None) -> list[range]:
    """The layers of each stage. partition: layers per stage (summing to num_layers); None: an even split whose
    remainder goes one layer each to the stages just before the last (the last one also runs the LM head)."""
    if partition is None:
        counts = [num_layers // stages] * stages
        for i in range(num_layers % stages):
            counts[-2 - i if stages > 1 else 0] += 1
    else:
        counts = list(partition)
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage (the default: the only one, every layer). layers: the decoder layers it holds (None:
    all); ranks: the global ranks of the previous and next stages' same tensor rank, and of the rank whose logits
    every rank takes (the last stage's tensor rank 0). every_embedding: every stage holds the embedding (a draft
    head on every rank embeds its tokens with the target's)."""

    index: int = 0
    size: int = 1
    layers: range | None = None
    prev_rank: int = -1
    next_rank: int = -1
    logits_rank: int = -1
    every_embedding: bool = False

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def holds(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def recv(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's hidden states [rows, width]."""
        hidden = torch.empty(rows, width, dtype=dtype, device=device)
        dist.recv(hidden, self.prev_rank)
        return hidden

    def send(self, hidden: torch.Tensor, wait: bool = True):
        """The hidden states to the next stage; wait=False: at once, returning the send's handle (wait on it
        before the process exits)."""
        if wait:
            dist.send(hidden.contiguous(), self.next_rank)
            return None
        return dist.isend(hidden.contiguous(), self.next_rank)

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's tensor on every rank (in place: others pass an empty tensor of the shape): its logits,
        a micro-batch's sampled tokens (device/pipeline_window.py), or the hidden states a draft head reads."""
        dist.broadcast(tensor, self.logits_rank)
        return tensor


class MissingLayer(nn.Module):
    """A decoder layer another stage holds: no parameters, never run. It keeps the layer's index in
    `model.layers` (checkpoint names stay `model.layers.N.`) and, where it attends, its attention variant (one spec
    per KV layer); a hybrid's recurrent layer here has no state (this stage's StateCache holds its own layers')."""

    sparse = False
    state_mixer = None

    def __init__(self, spec: AttentionSpec, attends: bool = True):
        super().__init__()
        self.self_attn = _MissingAttention(spec) if attends else None

    @property
    def attention(self):
        return self.self_attn

    def forward(self, *args, **kwargs):
        raise RuntimeError("a decoder layer of another pipeline stage was run")


class _MissingAttention(nn.Module):
    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.attention_spec = spec
