"""Tensor parallelism for the models: the group a rank belongs to, and Megatron-style layers.

* `FusedLinear` (layers.py) is column-parallel: each rank holds its rows of q/k/v or
  gate/up, read straight from the checkpoint's rows (`ShardSpec`).
* `RowParallelLinear` (o_proj, down_proj): each rank holds its input columns and
  multiplies its share; one all-reduce sums the partial products.
* `VocabParallelEmbedding` / `ParallelLMHead`: each rank holds a contiguous block of
  the vocabulary (padded to a multiple of the ranks); the embedding masks ids outside
  its block and all-reduces; the LM head's logits are all-gathered, so every rank
  holds the same full logits and samples the same tokens.

With one rank (`TPGroup()`), every layer is its plain single-device self: no
collective, no padding. Collectives are torch.distributed's functional ones when torch.compile
traces them (fullgraph), and c10d's in-place ones in eager forwards and graph captures (the
functional ones would import dynamo in every rank, ~2 s); gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .pipeline import PipelineStage


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group (the default: one rank, no group), and in the pipeline
    (`stage`, models/pipeline.py: the layers it holds; the default, every layer)."""

    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup for the model's collectives (this stage's ranks)
    stage: PipelineStage = PipelineStage()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if not torch.compiler.is_compiling():  # eager: c10d's own op (the functional one imports dynamo, ~2 s)
            out = x.clone()
            torch.distributed.all_reduce(out, group=self.group)
            return out
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if not torch.compiler.is_compiling():  # eager: c10d's own op, as all_reduce
            gathered = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # [size * rows, n]
            dist = torch.distributed
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
            gather(gathered, x, group=self.group)
        else:
            import torch.distributed._functional_collectives as funcol

            gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # renamed in torch 2.12
            gathered = gather(x, 0, self.group)
        rows = x.shape[0]
        return torch.cat([gathered[i * rows : (i + 1) * rows] for i in range(self.size)], dim=-1)


@dataclass(frozen=True)
class ShardSpec:
    """This rank's part of a checkpoint tensor: indices [start, stop) along `dim` of a
    dimension that holds `full` entries in the checkpoint (stop > full: zero padding)."""

    dim: int
    start: int
    stop: int
    full: int


def whole(total: int) -> ShardSpec:
    """A replicated linear's one shard: all `total` rows on every rank."""
    return ShardSpec(0, 0, total, total)


def split(total: int, tp: TPGroup) -> ShardSpec:
    """An even split of `total` (a multiple of the group size) along dim 0."""
    per = total // tp.size
    return ShardSpec(0, tp.rank * per, (tp.rank + 1) * per, total)


def kv_heads_spec(num_kv_heads: int, head_dim: int, tp: TPGroup) -> ShardSpec:
    """KV heads are split across ranks, or replicated when there are fewer heads than ranks
    (each rank then holds the one head its query heads attend to, as vLLM does)."""
    if num_kv_heads >= tp.size:
        per = num_kv_heads // tp.size
        return ShardSpec(0, tp.rank * per * head_dim, (tp.rank + 1) * per * head_dim, num_kv_heads * head_dim)
    head = tp.rank * num_kv_heads // tp.size
    return ShardSpec(0, head * head_dim, (head + 1) * head_dim, num_kv_heads * head_dim)


def local_kv_heads(num_kv_heads: int, tp: TPGroup) -> int:
    return max(1, num_kv_heads // tp.size)


def padded_vocab(vocab_size: int, tp: TPGroup) -> int:
    return -(-vocab_size // tp.size) * tp.size


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b): x holds this rank's input columns; the partial sums are all-reduced."""

    packed = None  # a cpu_linear.PackedWeight once prepack_cpu_linears ran (CPU)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.in_spec = split(in_features, tp)
        local = self.in_spec.stop - self.in_spec.start
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp_specs = {"weight": ShardSpec(1, self.in_spec.start, self.in_spec.stop, in_features)}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: added to the output (residual + y), by the CPU panels in the same pass where they run it."""
        if residual is not None:
            run_add = getattr(self.packed, "run_add", None)
            if (run_add is not None and self.tp.size == 1 and self.bias is None and residual.is_contiguous()
                    and not torch.compiler.is_compiling()):
                return run_add(x, residual)
            return residual + self.forward(x)
        y = self.tp.all_reduce(self.packed(x) if self.packed is not None else F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embeddings; this rank holds a block of the (padded) vocabulary."""

    rows_from = None  # a tied CPU head's cpu_linear.PanelWeight, whose panels the lookups read instead of weight

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        per = padded_vocab(vocab_size, tp) // tp.size
        self.start, self.stop = tp.rank * per, (tp.rank + 1) * per
        self.weight = nn.Parameter(torch.empty(per, hidden_size))
        self.tp_specs = {"weight": ShardSpec(0, self.start, self.stop, vocab_size)}

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.rows_from is None else self.rows_from.weight_rows(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        mine = (input_ids >= self.start) & (input_ids < self.stop)
        local = torch.where(mine, input_ids - self.start, 0)
        out = self.lookup(local) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over the vocabulary: this rank's block of rows, gathered into full logits."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        per = padded_vocab(vocab_size, tp) // tp.size
        self.weight = nn.Parameter(torch.empty(per, hidden_size))
        self.tp_specs = {"weight": ShardSpec(0, tp.rank * per, (tp.rank + 1) * per, vocab_size)}

    @staticmethod
    def logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TPGroup, vocab_size: int, packed=None) -> torch.Tensor:
        """[R, hidden] -> [R, vocab] float32, identical on every rank (packed: the weight prepacked, CPU)."""
        local = (packed(hidden) if packed is not None else F.linear(hidden, weight)).float()
        if tp.size == 1:
            return local
        return tp.all_gather_last(local)[:, :vocab_size]
