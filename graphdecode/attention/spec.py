"""AttentionSpec: one layer's attention variant, a parameter of every backend path.

The model families differ in their attention by a few parameters, not by code paths:
Gemma 3 mixes sliding-window and full layers, Gemma 2 soft-caps its logits, gpt-oss
adds a learned per-head "sink" logit to the softmax denominator. A model lists one
spec per layer (data, not branches in the hot loop); prefill, decode and verify take
them alike. The torch backend implements all of them on the CPU (its paged kernel and
the SDPA prefill) and in its reference; the FlashInfer backend maps window, soft-cap and
scale onto its plan arguments (`window_left`, `logits_soft_cap`, `sm_scale`), runs the
layers whose kernel module it cannot load with the torch reference, and applies sinks to
its output through the run's log-sum-exp (flashinfer_backend.py). An FP8 KV cache's per-layer
scales ride here too (kv_cache.py).

Sliding windows bound what a layer reads, not what the cache holds: a sequence keeps
all its pages, including those wholly outside every layer's window (the scheduler and
prefix cache treat a windowed model like any other), so memory is a full-attention
model's; only the attention work is bounded by the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    # a query sees itself and the sliding_window - 1 keys before it (transformers'
    # `sliding_window`); None: every earlier key
    sliding_window: int | None = None
    soft_cap: float | None = None  # scores = soft_cap * tanh(scores / soft_cap), after scaling
    scale: float | None = None  # None: head_dim ** -0.5
    sinks: torch.Tensor | None = field(default=None, repr=False)  # [H] float32: this layer's sink logits
    # an FP8 KV cache's scales (the checkpoint's `k_scale` / `v_scale`): it holds K / k_scale and V / v_scale;
    # a cache in the model's dtype ignores them
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self):
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"soft_cap must be > 0 or None, got {self.soft_cap!r}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be > 0 or None, got {self.scale!r}")
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (isinstance(value, float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite float > 0, got {value!r}")

    @property
    def window_left(self) -> int:
        """Keys before the query a window admits (FlashInfer's `window_left`); -1: all."""
        return -1 if self.sliding_window is None else self.sliding_window - 1

    @property
    def is_default(self) -> bool:
        return self.sliding_window is None and self.soft_cap is None and self.sinks is None and self.scale is None

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else head_dim**-0.5
