"""The AttentionBackend interface and the per-forward context the model calls.

A backend owns nothing but the algorithm; the KV caches and metadata are passed
in. The torch reference backend runs everywhere; the FlashInfer backend runs on
CUDA. Both write K/V by slot before attending.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .metadata import DecodeMetadata, PrefillMetadata, VerifyMetadata
from .spec import AttentionSpec


class AttentionBackend(ABC):
    name = "abstract"
    reads_pages_in_place = False  # True: decode reads each row's pages where they lie (no gathered width)

    @property
    def needs_csr(self) -> bool:
        """Whether decode reads advance_step's CSR metadata (kv_indptr/indices/last_page_len)."""
        return not self.reads_pages_in_place

    def __init__(self, kv_caches: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int,
                 specs: list[AttentionSpec] | None = None, dtype: torch.dtype | None = None):
        """dtype: the queries' (the model's); None: the caches' (an FP8 cache needs it named)."""
        self.kv_caches = kv_caches
        self.dtype = dtype or kv_caches[0].dtype
        self.kv_dtype = kv_caches[0].dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.specs = list(specs) if specs is not None else [AttentionSpec()] * len(kv_caches)  # one per layer
        if len(self.specs) != len(kv_caches):
            raise ValueError(f"specs: {len(self.specs)} attention specs for {len(kv_caches)} layers")

    def plan_prefill(self, meta: PrefillMetadata) -> None:
        """Host-side preparation before a prefill forward (no-op by default)."""

    def plan_decode(self, bucket: int, meta: DecodeMetadata) -> None:
        """Prepare decode for a bucket once (at graph capture); no-op by default."""

    def plan_verify(self, bucket: int, queries: int, max_rows: int, max_pages: int) -> None:
        """Prepare verify for a bucket once (speculative decoding); no-op by default."""

    def prepare_verify(self, bucket: int, meta: VerifyMetadata, state, page_size: int) -> None:
        """Before a verify forward (inside the window): any metadata the backend needs (no-op by default)."""

    def verify(self, layer: int, q, k, v, meta: VerifyMetadata) -> torch.Tensor:
        """q [B * Q, H, D], k/v [B * Q, H_kv, D] -> [B * Q, H, D], causal per row; writes k/v first."""
        raise NotImplementedError(f"{type(self).__name__} has no verify attention (speculative decoding)")

    @abstractmethod
    def prefill(self, layer: int, q, k, v, meta: PrefillMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] -> [T, H, D]; writes k/v into the cache."""

    @abstractmethod
    def decode(self, layer: int, q, k, v, meta: DecodeMetadata) -> torch.Tensor:
        """q [B, H, D], k/v [B, H_kv, D] -> [B, H, D]; writes k/v into the cache."""


@dataclass
class ForwardContext:
    """Handed to the model's forward: which backend, prefill or decode metadata."""

    backend: AttentionBackend
    prefill: PrefillMetadata | None = None
    decode: DecodeMetadata | None = None
    verify: VerifyMetadata | None = None

    def live_tokens(self) -> torch.Tensor:
        """[T] bool: the rows that are real tokens (padded and finished rows write the scratch slot)."""
        meta = self.decode if self.decode is not None else self.verify if self.verify is not None else self.prefill
        return meta.slot_mapping != 0  # advance_step.SCRATCH_SLOT

    def lora_slots(self) -> torch.Tensor:
        """[T] int64: each token's LoRA adapter slot (a LoRA engine's forwards: prefill and plain decode)."""
        meta = self.decode if self.decode is not None else self.prefill
        if meta is None or meta.lora_slots is None:
            raise RuntimeError("a LoRA model's forward needs its tokens' adapter slots (lora_slots) in its metadata")
        return meta.lora_slots

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        if self.decode is not None:
            return self.backend.decode(layer, q, k, v, self.decode)
        if self.verify is not None:
            return self.backend.verify(layer, q, k, v, self.verify)
        return self.backend.prefill(layer, q, k, v, self.prefill)
