"""Batch-invariant linears for GEMM libraries that pick their algorithm from the shape (cuBLAS on CUDA).

cuBLAS chooses tiles and split-K from M, N and K, so the same row of x can be summed in another order in a
batch of 16 than alone, and a decode window's padded bucket (1, 2, 4, ... rows) changes M by itself. Here
every GEMM a linear issues has one shape: x's rows in fixed blocks of BLOCK_ROWS (the last one zero-padded),
one call per block. With one shape there is one algorithm, and within it a row's sums do not depend on the
other rows of its block, so a row's outputs are the same bits at any batch size and in any bucket.

The cost: decode buckets below BLOCK_ROWS compute a full block, which at decode's row counts stays bound by
reading the weight (an H100's bf16 GEMM is memory-bound up to about 300 rows), and batches above it read the
weight once per block. BENCHMARKS.md ("Batch invariance") holds what it costs where a GPU measured it.

`block_linears(model)` (the loader calls it for batch-invariant models that `cpu_linear` does not take: CUDA)
gives each dense FusedLinear / RowParallelLinear and the LM head a `BlockedWeight` over its own parameter (no
copy); quantized and MoE expert weights keep their kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_linear import CpuWeight

BLOCK_ROWS = 128  # rows per GEMM call


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   rows: int = BLOCK_ROWS) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N], one GEMM of exactly `rows` rows per block of x's rows."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    blocks = max(1, -(-m // rows))
    padded = F.pad(flat, (0, 0, 0, blocks * rows - m))
    out = torch.cat([F.linear(padded[i * rows : (i + 1) * rows], weight, bias) for i in range(blocks)])
    return out[:m].reshape(*lead, weight.shape[0])


class BlockedWeight(CpuWeight):
    """A linear's dense weight (the module's parameter, not a copy) run by `blocked_linear`; compiled forwards
    reach it through the opaque op (one traced shape whatever the row count)."""

    def __init__(self, weight: torch.Tensor, rows: int = BLOCK_ROWS):
        super().__init__(weight)
        self.weight = weight
        self.rows = rows

    extra_bytes = 0

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return blocked_linear(x, self.weight, bias, self.rows)


def block_linears(model: nn.Module, rows: int = BLOCK_ROWS) -> None:
    """Give every dense linear and the LM head a BlockedWeight (see the module docstring)."""
    from .layers import FusedLinear
    from .parallel import RowParallelLinear

    for module in model.modules():
        if isinstance(module, (FusedLinear, RowParallelLinear)) and module.packed is None:
            module.packed = BlockedWeight(module.weight, rows)
    head = model.model.embed_tokens if model.config.tie_word_embeddings else model.lm_head
    if head is not None and model.packed_head is None:
        model.packed_head = BlockedWeight(head.weight, rows)
