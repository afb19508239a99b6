"""The CPU's linears: column panels at every row count (batch-invariant), or panels for few rows and
prepacked oneDNN weights for more.

Batch-invariant (EngineConfig.batch_invariant, the default, with the CPU kernels): every projection and
the LM head a `PanelWeight(invariant=True)`, the panel kernel at every row count: each output one sum in
a fixed order, so a row's bits do not depend on the other rows (docs/batch_invariance.md); bf16 on a CPU
with avx512_bf16 in pair panels (vdpbf16ps; with AMX, tdpbf16ps, the pairs padded to 16). No oneDNN copy is
kept. The rest of this docstring is the variant dispatch (`batch_invariant=False`), for speed at many rows.

A CPU decode step is mostly matmuls of a few rows by each weight; which kernel is fastest
depends on the rows and the dtype (profiling/bench_cpu.py's linear probe; BENCHMARKS.md 12d, 18):

* float32 or bfloat16, in a model whose projections stream from memory (STREAM_BYTES and up,
  with the CPU kernels): each projection's weight in column panels (`PanelWeight`,
  csrc/cpu_linear.cpp) and in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
  run by `_linear_pointwise`); the dense parameter is released. Up to PANEL_ROWS rows the panel
  kernel runs: the panels are one sequential stream whose sums stay in registers. fp32: 1.2-2.2x
  oneDNN's and aten's GEMMs at one row with two threads, even with oneDNN at 8-16; more rows
  (decode batches of 32 and up, prefill) run oneDNN's GEMM, at this CPU's FMA peak from 64 rows
  (1.2-1.7x aten's). bf16 panels are widened to float32 as the kernel reads them (half the bytes
  of fp32's) and take up to 4 rows: 1.3-1.5x oneDNN's bf16 GEMM at 1-4 rows, which from 8 rows
  computes faster with avx512_bf16 / AMX.
* float32 in a model that fits in cache (a 256-wide model's): the `[out, in]` parameter stored
  column-major in place (W^T in memory: aten runs x @ W^T as a plain NN GEMM) and nothing else;
  there aten's GEMM beats the panels (0.5-0.9x) and a packed or ctypes call's fixed cost counts.
* bfloat16 in a model that fits in cache, or without the kernels: oneDNN's blocked layout
  (`PackedWeight`), 1.3-2.3x aten's bf16 linear up to 64 rows (AMX / avx512_bf16); the dense
  weight is released.
* float32 without the CPU kernels (no compiler, GRAPHDECODE_CPU_KERNELS=0): `PackedWeight`.
* The LM head (`packed_head`) of a model that streams its weights is a `PanelWeight` whose panels take
  up to HEAD_PANEL_ROWS rows (SmolLM2's [49152, 576] head, two threads: 1.34x oneDNN's packed head at one
  row in fp32, 1.44x in bf16; from 4 rows oneDNN's is as fast or faster). A tied head's embedding lookups
  then read their rows from those panels (`PanelWeight.weight_rows`) and the row-major embedding is released, so
  the vocabulary is held twice (panels, packed), as before. Otherwise the head is a `PackedWeight` (a tied
  one packs the embedding, which stays row-major for its lookups).

`prepack_cpu_linears(model)` (the loader calls it for CPU models) gives each fused qkv /
gate_up, o / down projection its weight object and the LM head its `PanelWeight` or `PackedWeight`; their
forwards call it. Under torch.compile the call goes through the opaque
`graphdecode::packed_linear` op (inductor can take neither an oneDNN tensor nor a ctypes call
into its graph), named by an integer handle, so the compiled window fuses everything around
the matmuls.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch
from torch import nn

STREAM_BYTES = 64 << 20  # projections + head of a model this large stream from memory: panels and packed
PANEL = 64  # output columns per panel (csrc/cpu_linear.cpp)
PANEL_ROWS = {torch.float32: 16, torch.bfloat16: 4}  # up to this many rows the panels, more oneDNN's GEMM
HEAD_PANEL_ROWS = 2  # the LM head's panels: up to this many rows (decode at batch 1-2)
_PACKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> CpuWeight
_HANDLES = itertools.count(1)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN's blocked layout exists for this dtype on this CPU: bf16's needs avx512bw/vl/dq or avx_ne_convert
    (an AVX2-only CPU, e.g. AMD's Zen 2 / 3, has neither: the reorder raises)."""
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
    """W in oneDNN's blocked layout, for every row count."""

    def __init__(self, weight: torch.Tensor, pack: bool = True):
        super().__init__(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if pack else None

    @property
    def extra_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() if self.packed is not None else 0

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class PanelWeight(PackedWeight):
    """float32 or bf16: W in column panels [ceil(N / 64), K, 64] (bf16 with avx512_bf16: pairs, [ceil(N / 64),
    ceil(K / 2) (AMX: padded to 16), 64, 2]) for up to PANEL_ROWS rows (the CPU kernel), and in oneDNN's layout
    for more. Batch-invariant (`invariant`), or where oneDNN cannot lay out the dtype on this CPU: the panels for
    every row count, and no oneDNN copy."""

    def __init__(self, weight: torch.Tensor, kernels, rows: int | None = None, invariant: bool = False):
        # no oneDNN copy where oneDNN has no such dtype here (bf16 on an AVX2-only CPU): the panels at every row
        pack = not invariant and onednn_packs(weight.dtype)
        super().__init__(weight, pack=pack)
        weight = weight.detach()
        panels = -(-self.out_features // PANEL)
        # bf16 with avx512_bf16: [P, ceil(K / 2) padded to the kernel's multiple, 64, 2] (vdpbf16ps or AMX)
        self.pairs = weight.dtype == torch.bfloat16 and kernels.bf16_pairs
        k = 2 * kernels.pair_rows_for(self.in_features) if self.pairs else self.in_features
        padded = weight.new_zeros((panels * PANEL, k))
        padded[: self.out_features, : self.in_features] = weight
        if self.pairs:
            self.panels = padded.view(panels, PANEL, k // 2, 2).transpose(1, 2).contiguous()
        else:
            self.panels = padded.view(panels, PANEL, k).transpose(1, 2).contiguous()
        self.kernels = kernels
        self.rows = math.inf if not pack else PANEL_ROWS[weight.dtype] if rows is None else rows

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """W[index] ([..., K], a copy) read from the panels: an embedding lookup in a tied head's weight."""
        rows = panel_rows(self.panels, index.reshape(-1), self.in_features)
        return rows.view(*index.shape, self.in_features)

    def write_rows(self, start: int, rows: torch.Tensor) -> None:
        """W[start : start + n] = rows ([n, K]), into the panels in place (their pointers stay: the decode layers'
        tables and compiled windows keep reading them); a new weight's rows (models/weight_update.py). The
        oneDNN copy, if any, is behind them until `repack`."""
        rows = rows.to(device=self.panels.device, dtype=self.panels.dtype)
        n, k = rows.shape
        if k != self.in_features or not 0 <= start <= start + n <= self.out_features:
            raise ValueError(f"weights: rows [{start}, {start + n}) x {k} do not fit a [{self.out_features}, "
                             f"{self.in_features}] weight")
        if self.pairs:  # [P, K2, 64, 2]: K zero-padded to the pairs' rows, each pair of columns side by side
            rows = torch.nn.functional.pad(rows, (0, 2 * self.panels.shape[1] - k))
        width = rows.shape[1]

        def laid_out(block: torch.Tensor) -> torch.Tensor:  # [panels, 64, K] -> the panels' layout
            if self.pairs:
                return block.view(block.shape[0], PANEL, width // 2, 2).transpose(1, 2)
            return block.transpose(1, 2)

        r, end = start, start + n
        while r < end:
            panel, column = divmod(r, PANEL)
            whole = (end - r) // PANEL if column == 0 else 0
            if whole:  # whole panels in one copy
                block = rows[r - start: r - start + whole * PANEL].view(whole, PANEL, width)
                self.panels[panel: panel + whole] = laid_out(block)
                r += whole * PANEL
                continue
            take = min(PANEL - column, end - r)  # part of one panel (the first or the last)
            block = rows[r - start: r - start + take].view(1, take, width)
            if self.pairs:
                self.panels[panel: panel + 1, :, column: column + take] = block.view(
                    1, take, width // 2, 2).transpose(1, 2)
            else:
                self.panels[panel: panel + 1, :, column: column + take] = block.transpose(1, 2)
            r += take

    def repack(self) -> None:
        """oneDNN's blocked copy made again from the panels (after write_rows)."""
        if self.packed is not None:
            dense = self.weight_rows(torch.arange(self.out_features, device=self.panels.device))
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense)

    @property
    def extra_bytes(self) -> int:
        return super().extra_bytes + self.panels.numel() * self.panels.element_size()

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() <= self.rows * self.in_features:  # always, batch-invariant (rows: inf)
            return self.kernels.panel_linear(x, self.panels, self.out_features, bias)
        return super().run(x, bias)

    def run_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T: in the panels' one pass (the bits of the two ops), or, past the panels' rows, the two."""
        if x.numel() <= self.rows * self.in_features:
            return self.kernels.panel_linear_add(x, self.panels, self.out_features, residual)
        return residual + self.run(x)

    @property
    def gated_one_pass(self) -> bool:
        """Whether run_swiglu serves this [gate | up] projection: panels for every row count, gate and up each a
        whole number of panels."""
        return self.rows == math.inf and self.out_features % (2 * PANEL) == 0

    def run_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] projection of x (gated_one_pass): in one pass, without writing the
        projection (the bits of run, then the SwiGLU pass, at less time at every row count: BENCHMARKS.md 18i)."""
        return self.kernels.panel_linear_swiglu(x, self.panels, self.out_features // 2)


@torch.library.custom_op("graphdecode::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, bias: torch.Tensor | None, handle: int, out_features: int) -> torch.Tensor:
    weight = _PACKED.get(handle)
    if weight is None:
        raise RuntimeError(f"graphdecode: no live packed weight with handle {handle}")
    return weight.run(x, bias)


@packed_linear.register_fake
def _(x, bias, handle, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("graphdecode::panel_rows", mutates_args=())
def panel_rows(panels: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` [n] of a weight in column panels -> [n, k] (CpuKernels.panel_rows; an op compiled windows trace
    through)."""
    from ..kernels.cpu import cpu_kernels

    return cpu_kernels().panel_rows(panels, ids, k)


@panel_rows.register_fake
def _(panels, ids, k):
    return panels.new_empty((ids.shape[0], k))


def prepack_cpu_linears(model: nn.Module, batch_invariant: bool = True) -> None:
    """Give every linear (FusedLinear, RowParallelLinear) its CPU weight, and the LM head its own.

    Batch-invariant (EngineConfig.batch_invariant, with the CPU kernels): every projection and the head a
    PanelWeight for every row count, whose sums run in a fixed order: a row's outputs are the same bits
    whatever the other rows (aten's and oneDNN's GEMMs pick their blocking from the row count: fp32 rows
    change from 8 rows on, bf16 ones at one row against two). Otherwise, projections of a model that streams
    them from memory: a PanelWeight (with the CPU kernels) or a PackedWeight, the dense parameter released; of
    a model that fits in cache: fp32 column-major in place, bf16 a PackedWeight. The LM head likewise (its
    panels for HEAD_PANEL_ROWS rows). A tied head in panels serves its embedding's lookups (the dense
    embedding is released), else the embedding stays for its lookups."""
    from ..kernels.cpu import cpu_kernels
    from .layers import FusedLinear
    from .parallel import RowParallelLinear

    kernels = cpu_kernels()
    linears = [m for m in model.modules() if isinstance(m, (FusedLinear, RowParallelLinear))]
    tied = model.config.tie_word_embeddings
    head = model.model.embed_tokens if tied else model.lm_head  # None: the head reads another model's (MTP)
    # a module run beside a larger model (an EAGLE-3 head) finds its weights evicted by that model's: it streams
    streams = getattr(model, "streams_weights", False) or sum(
        w.numel() * w.element_size() for w in [m.weight for m in linears] + ([head.weight] if head else [])
    ) >= STREAM_BYTES

    def release(module: nn.Module) -> None:
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)

    def cpu_weight(weight: torch.Tensor, rows: int | None = None) -> CpuWeight | None:
        """The linear's CPU weight (`rows`: its panels' row limit on a variant engine), or None where the fp32
        parameter stays, column-major."""
        panels = kernels is not None and weight.dtype in kernels.supported_dtypes
        packs = onednn_packs(weight.dtype)
        if batch_invariant and panels:
            return PanelWeight(weight, kernels, invariant=True)
        if weight.dtype == torch.float32 and not streams:
            return None
        if panels and (streams or not packs):  # (where oneDNN has no bf16, a PanelWeight's panels take every row)
            return PanelWeight(weight, kernels, rows)
        return PackedWeight(weight) if packs else None  # bf16 with neither: aten's dense linear

    for module in linears:
        if module.packed is not None:  # a quantized weight (quant/linear.py), run as it is
            continue
        module.packed = cpu_weight(module.weight)
        if module.packed is None:
            column_major_(module.weight)
        else:
            release(module)
    if head is None or model.packed_head is not None:  # none of its own, or a quantized one
        return
    model.packed_head = cpu_weight(head.weight, HEAD_PANEL_ROWS)
    if model.packed_head is None:
        if not tied:
            column_major_(head.weight)
        return
    panels = isinstance(model.packed_head, PanelWeight)
    if panels and tied:  # the embedding's lookups read the head's panels
        model.model.embed_tokens.rows_from = model.packed_head
    if panels or not tied:  # else a tied head is the embedding, whose rows the lookup reads
        release(head)


def column_major_(weight: torch.Tensor) -> None:
    """Store an [out, in] weight as W^T in memory (same shape and values): F.linear runs NN."""
    weight.data = weight.data.t().contiguous().t()


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed and panelled weights hold beyond the model's parameters."""
    weights = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    weights += [model.packed_head] if getattr(model, "packed_head", None) is not None else []
    return sum(w.extra_bytes for w in weights)
