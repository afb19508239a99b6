"""Prepacked oneDNN weights for the CPU's linears (what inductor's `freezing` does, in eager too).

A CPU decode step is mostly matmuls of a few rows by each weight. aten's `linear`
re-reads the row-major weight every call; oneDNN's blocked layout, made once at load
(`torch.ops.mkldnn._reorder_linear_weight`) and used by `_linear_pointwise`, runs the
same product faster: per SmolLM2 shape (profiling/bench_cpu.py's linear probe,
2026-12-01), fp32 1.1-1.9x at 4-16 rows and 1.0-1.2x at 64, bf16 1.3-2.3x up to 64 rows
(AMX / avx512_bf16); at 512 rows (prefill) they are about even. For one or two rows (fp32
GEMV) aten's dense kernel is faster (0.65-0.93x packed), so fp32
keeps the dense weight beside the packed one (one more copy of the linear weights: the
price of batch 1 staying at its best); bf16 keeps only the packed one. A small fp32 weight
(under FP32_PACK_MIN elements, e.g. a 256-wide model's) is not packed: there the packed
call's fixed cost (~15 us) outweighs what it saves. It is laid out column-major instead
(the same [out, in] parameter, stored as W^T): aten's `linear` then runs x @ W^T as a
plain NN GEMM, 1.1-2x faster than the NT one for 1-64 rows of such weights and even at
256 (2026-12-01, 256-512 wide weights). For SmolLM2's larger projections the column-major
layout also beats the packed one alone (profiling/bench_cpu.py's linear probe: qkv 455 vs
547 us at 64 rows), but not inside a decode step, where every layer's weights stream from
memory: an in-process A/B of the two (2026-12-01) read 1.04-1.06x at batch 64 and 0.91-0.92x
at batch 8, so the projections stay packed.

`prepack_cpu_linears(model)` (the loader calls it for CPU models) gives each fused qkv /
gate_up, o / down projection and the LM head a `PackedWeight`; their forwards call it.
Under torch.compile the call goes through the opaque `graphdecode::packed_linear` op
(inductor cannot take an oneDNN tensor as a graph constant), named by an integer handle,
so the compiled window fuses everything around the matmuls and keeps the packed ones.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

DENSE_ROWS = 2  # fp32: up to this many rows, aten's dense GEMV is faster than the packed GEMM
FP32_PACK_MIN = 1 << 19  # fp32 weights with fewer elements stay dense only
_PACKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> PackedWeight
_HANDLES = itertools.count(1)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedWeight:
    """y = x W^T (+ b) with W in oneDNN's layout; fp32 also keeps W dense for 1-2 rows."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.dense = weight if weight.dtype == torch.float32 else None
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self

    @property
    def nbytes(self) -> int:
        dense = self.dense.numel() * self.dense.element_size() if self.dense is not None else 0
        return self.packed.numel() * self.packed.element_size() + dense

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.graphdecode.packed_linear(x, bias, self.handle, self.out_features)
        return self.run(x, bias)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dense is not None and x.shape[0] <= DENSE_ROWS:
            return F.linear(x, self.dense, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


@torch.library.custom_op("graphdecode::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, bias: torch.Tensor | None, handle: int, out_features: int) -> torch.Tensor:
    weight = _PACKED.get(handle)
    if weight is None:
        raise RuntimeError(f"graphdecode: no live packed weight with handle {handle}")
    return weight.run(x, bias)


@packed_linear.register_fake
def _(x, bias, handle, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def prepack_cpu_linears(model: nn.Module) -> None:
    """Give every linear (FusedLinear, RowParallelLinear) and the LM head a PackedWeight.

    A bf16 linear's dense weight is released (the packed one is all it runs); fp32 keeps it
    (for 1-2 rows). The LM head packs the embedding when they are tied; the embedding stays."""
    from .layers import FusedLinear
    from .parallel import RowParallelLinear

    def worth_packing(weight: torch.Tensor) -> bool:
        return weight.dtype != torch.float32 or weight.numel() >= FP32_PACK_MIN

    for module in model.modules():
        if isinstance(module, (FusedLinear, RowParallelLinear)):
            if worth_packing(module.weight):
                module.packed = PackedWeight(module.weight)
                if module.packed.dense is None:
                    module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
            else:
                column_major_(module.weight)
    tied = model.config.tie_word_embeddings
    head = model.model.embed_tokens if tied else model.lm_head
    if worth_packing(head.weight):
        model.packed_head = PackedWeight(head.weight)
        if not tied and model.packed_head.dense is None:
            head.weight = nn.Parameter(head.weight.new_empty(0), requires_grad=False)
    elif not tied:  # a tied head is the embedding, whose rows the lookup reads
        column_major_(head.weight)


def column_major_(weight: torch.Tensor) -> None:
    """Store an [out, in] weight as W^T in memory (same shape and values): F.linear runs NN."""
    weight.data = weight.data.t().contiguous().t()


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed weights hold beyond the model's parameters (fp32: their dense twins are parameters)."""
    weights = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    weights += [model.packed_head] if getattr(model, "packed_head", None) is not None else []
    return sum(w.packed.numel() * w.packed.element_size() for w in weights)
