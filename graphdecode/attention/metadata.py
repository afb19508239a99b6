"""Attention metadata: what a backend reads to attend over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillMetadata:
    """A ragged batch of G sequences whose new tokens are concatenated into T tokens."""

    cu_query_lens: torch.Tensor  # [G + 1] int32, device: token offsets of each sequence
    seq_lens: torch.Tensor  # [G] int32, device: KV length after this prefill
    block_table: torch.Tensor  # [G, pages] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device: where each new token's K/V goes
    query_lens_host: list[int]  # [G] host copies for backends that plan on the host
    seq_lens_host: list[int]
    block_table_host: torch.Tensor  # [G, pages] int32, cpu (pinned on CUDA)
    # partial prefix-cache hits (runtime.plan.PrefixCopy): in every layer, once the batch's K/V
    # is written and before attending, slot copy_src[i] is copied to copy_dst[i] ([C] int64)
    copy_src: torch.Tensor | None = None
    copy_dst: torch.Tensor | None = None
    state_slots_host: list[int] | None = None  # [G]: each sequence's recurrent-state slot (a hybrid's)
    lora_slots: torch.Tensor | None = None  # [T] int64: each token's LoRA adapter slot (a LoRA engine's; 0: none)
    _host_lens: tuple | None = field(default=None, repr=False)

    def host_lens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query starts, query lengths, KV lengths) as [G] int64 CPU tensors, built once per batch."""
        if self._host_lens is None:
            q_lens = torch.tensor(self.query_lens_host, dtype=torch.int64)
            starts = torch.cumsum(q_lens, 0) - q_lens
            self._host_lens = (starts, q_lens, torch.tensor(self.seq_lens_host, dtype=torch.int64))
        return self._host_lens


@dataclass
class DecodeMetadata:
    """One token per row for a bucket of B rows; views into the engine's static buffers."""

    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, W] int32: the first W block-table columns (what the torch reference gathers)
    slot_mapping: torch.Tensor  # [B] int64
    kv_indptr: torch.Tensor  # [B + 1] int32 (FlashInfer CSR)
    kv_indices: torch.Tensor  # [B * max_pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    ragged: bool = False  # eager CPU only: the torch reference attends over the CSR pages, not a padded width
    state_slots: torch.Tensor | None = None  # [B] int64: each row's recurrent-state slot (a hybrid's; 0: scratch)
    lora_slots: torch.Tensor | None = None  # [B] int64: each row's LoRA adapter slot (a LoRA engine's; 0: none)


@dataclass
class VerifyMetadata:
    """Q queries per row (a row's next input and its d drafts, at consecutive positions),
    causal over the paged cache; their K/V is written first (speculative decoding)."""

    block_table: torch.Tensor  # [B, W] int32: the first W block-table columns
    query_positions: torch.Tensor  # [B, Q] int64
    slot_mapping: torch.Tensor  # [B * Q] int64: where each query token's K/V goes (0: scratch)
    live: torch.Tensor  # [B] bool: rows that are not done
    # query_positions are where each query runs (rope, causal limit): a live row's queries at or
    # past its max_len (their samples are never kept) run at max_len - 1 and write the scratch slot
    kv_lens: torch.Tensor | None = None  # [B] int32: the KV length the row's last query sees (p + Q; inert: Q)
    context_lens: torch.Tensor | None = None  # [B] int32: of it, positions held in the row's own pages (< max_len)
    # FlashInfer's CSR over each row's K/V up to its last query (set by backend.prepare_verify)
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    kv_last_page_len: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None  # [B] int64: each row's recurrent-state slot (a hybrid's)
