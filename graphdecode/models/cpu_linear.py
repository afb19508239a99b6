"""The CPU's linears: prepacked oneDNN weights, and float32 panels for few rows.

A CPU decode step is mostly matmuls of a few rows by each weight; which kernel is fastest
depends on the rows and the dtype (profiling/bench_cpu.py's linear probe; BENCHMARKS.md 12):

* float32 (with the CPU kernels): every projection keeps its `[out, in]` parameter, stored
  column-major in place (W^T in memory: aten runs x @ W^T as a plain NN GEMM), and one more copy
  of W in column panels (`PanelWeight`, csrc/cpu_linear.cpp). Up to PANEL_ROWS rows the panel
  kernel runs: each panel of 64 output columns is one sequential stream, its sums stay in
  registers, 1.1-2x aten's and oneDNN's GEMMs at 4-32 rows of SmolLM2's shapes with every
  layer's weights streaming from memory, about even at 1-2 rows (BENCHMARKS.md). More rows (a batch
  of 64 and up, prefill) run aten's NN GEMM on the column-major parameter, 1.0-1.4x oneDNN's
  packed one from 48 rows to 2,048. With more than one torch thread all rows take aten's threaded
  GEMM (the panel kernel runs on one).
* bfloat16: oneDNN's blocked layout, made once at load (`torch.ops.mkldnn._reorder_linear_weight`)
  and used by `_linear_pointwise` (`PackedWeight`): 1.3-2.3x aten's bf16 linear up to 64 rows
  (AMX / avx512_bf16); the dense weight is released.
* float32 without the CPU kernels (no compiler, GRAPHDECODE_CPU_KERNELS=0): `PackedWeight`, with
  the dense weight kept for 1-2 rows (aten's GEMV is faster there); weights under FP32_PACK_MIN
  elements only column-major, where the packed call's fixed cost (~15 us) outweighs its gain.
* The LM head (`packed_head`) is a `PackedWeight` in both dtypes (at 4-64 rows oneDNN's packed
  head beats both dense layouts); a tied head packs the embedding, which stays row-major for its
  lookups.

`prepack_cpu_linears(model)` (the loader calls it for CPU models) gives each fused qkv /
gate_up, o / down projection its weight object and the LM head its `PackedWeight`; their
forwards call it. Under torch.compile the call goes through the opaque
`graphdecode::packed_linear` op (inductor can take neither an oneDNN tensor nor a ctypes call
into its graph), named by an integer handle, so the compiled window fuses everything around
the matmuls.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

DENSE_ROWS = 2  # fp32 PackedWeight: up to this many rows, aten's dense GEMV is faster than the packed GEMM
FP32_PACK_MIN = 1 << 19  # fp32 weights with fewer elements stay dense only (without the CPU kernels)
PANEL = 64  # output columns per panel (csrc/cpu_linear.cpp)
PANEL_ROWS = 48  # fp32: up to this many rows the panel kernel, more aten's NN GEMM (decode buckets <= 32 / >= 64)
_PACKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> CpuWeight
_HANDLES = itertools.count(1)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class CpuWeight:
    """A linear's weight in a CPU layout: y = x W^T (+ b) through `run`, named by a handle for the opaque op
    a compiled forward calls instead (inductor can take neither an oneDNN tensor nor a ctypes call)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.graphdecode.packed_linear(x, bias, self.handle, self.out_features)
        return self.run(x, bias)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def extra_bytes(self) -> int:
        """Bytes beyond the model's parameters (an fp32 dense copy is the parameter itself)."""
        raise NotImplementedError


class PackedWeight(CpuWeight):
    """W in oneDNN's layout; fp32 also keeps W dense for 1-2 rows."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        super().__init__(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.dense = weight if weight.dtype == torch.float32 else None

    @property
    def extra_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dense is not None and x.shape[0] <= DENSE_ROWS:
            return F.linear(x, self.dense, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class PanelWeight(CpuWeight):
    """float32: W in column panels [ceil(N / 64), K, 64] for up to PANEL_ROWS rows (the CPU kernel), the
    column-major parameter through aten's NN GEMM for more."""

    def __init__(self, weight: torch.Tensor, kernels):
        weight = weight.detach()
        super().__init__(weight)
        self.dense = weight
        panels = -(-self.out_features // PANEL)
        padded = weight.new_zeros((panels * PANEL, self.in_features))
        padded[: self.out_features] = weight
        self.panels = padded.view(panels, PANEL, self.in_features).transpose(1, 2).contiguous()
        self.kernels = kernels

    @property
    def extra_bytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() <= PANEL_ROWS * self.in_features:
            return self.kernels.panel_linear(x, self.panels, self.out_features, bias)
        return F.linear(x, self.dense, bias)


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
    """Give every linear (FusedLinear, RowParallelLinear) its CPU weight and the LM head a PackedWeight.

    fp32 projections: column-major in place plus a PanelWeight (with the CPU kernels). bf16: packed, the
    dense weight released. The LM head packs the embedding when they are tied; the embedding stays."""
    from ..kernels.cpu import cpu_kernels
    from .layers import FusedLinear
    from .parallel import RowParallelLinear

    kernels = cpu_kernels()

    def worth_packing(weight: torch.Tensor) -> bool:  # fp32: a weight that streams from memory, not cache
        return weight.dtype != torch.float32 or weight.numel() >= FP32_PACK_MIN

    for module in model.modules():
        if isinstance(module, (FusedLinear, RowParallelLinear)):
            if module.weight.dtype == torch.float32 and kernels is not None and worth_packing(module.weight):
                column_major_(module.weight)
                module.packed = PanelWeight(module.weight, kernels)
            elif worth_packing(module.weight):
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
    """Bytes the packed and panelled weights hold beyond the model's parameters (fp32's dense copies are them)."""
    weights = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    weights += [model.packed_head] if getattr(model, "packed_head", None) is not None else []
    return sum(w.extra_bytes for w in weights)
