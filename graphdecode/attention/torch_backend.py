"""Torch reference attention over the paged cache: runs on CPU and GPU.

It is the backend CPU runs use and the oracle the FlashInfer backend is tested
against. Decode has two forms of the same arithmetic:

* padded: every row gathers the W pages its block-table view holds and masks past its
  length (the only form inside torch.compile and CUDA graphs: static shapes);
* ragged (`DecodeMetadata.ragged`, chosen by the runner for eager CPU windows whose
  rows' lengths differ a lot): the pages FlashInfer's CSR metadata lists (`kv_indptr`,
  `kv_indices`, `kv_last_page_len`, kept by advance_step) are gathered once, and a
  softmax per row runs over its own tokens only, so such a window's cost follows the
  rows' real lengths: one 4,000-token row no longer makes 32 short rows gather 4,000
  keys each. For rows of similar length its index work costs more than the padding
  saves (micro, batch 64: 0.53 s against 0.31 s), hence the choice.
"""

from __future__ import annotations

import torch

from .backend import AttentionBackend
from .kv_cache import copy_slots, write_kv
from .metadata import DecodeMetadata, PrefillMetadata, VerifyMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prefill(self, layer, q, k, v, meta: PrefillMetadata) -> torch.Tensor:
        kv = self.kv_caches[layer]
        write_kv(kv, k, v, meta.slot_mapping)
        if meta.copy_src is not None:
            copy_slots(kv, meta.copy_src, meta.copy_dst)
        page_size = kv.shape[2]
        out = torch.empty_like(q)
        start = 0
        for g, (q_len, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            num_pages = -(-kv_len // page_size)
            pages = meta.block_table[g, :num_pages].long()
            keys = kv[pages, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len]
            values = kv[pages, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len]
            # query i sits at position kv_len - q_len + i and sees keys up to it
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            k_pos = torch.arange(kv_len, device=q.device)
            mask = k_pos[None, :] > q_pos[:, None]  # [q_len, kv_len]
            out[start : start + q_len] = self._attend(q[None, start : start + q_len], keys[None], values[None], mask[None])[0]
            start += q_len
        return out

    def _attend(self, q, keys, values, hidden):
        """q [B, Q, H, D], keys/values [B, L, H_kv, D], hidden [B, Q, L] (True = masked) -> [B, Q, H, D]."""
        batch, queries = q.shape[:2]
        groups = self.num_heads // self.num_kv_heads
        qg = q.reshape(batch, queries, self.num_kv_heads, groups, self.head_dim).float()
        scores = torch.einsum("bqhgd,blhd->bhgql", qg, keys.float()) * self.scale
        scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgql,blhd->bqhgd", probs, values.float())
        return out.reshape(q.shape).to(q.dtype)

    def decode(self, layer, q, k, v, meta: DecodeMetadata) -> torch.Tensor:
        kv = self.kv_caches[layer]
        write_kv(kv, k, v, meta.slot_mapping)
        if meta.ragged:
            return self._decode_ragged(kv, q, meta)
        rows = q.shape[0]
        pages = meta.block_table.long()  # [B, W]
        keys = kv[:, 0][pages].reshape(rows, -1, self.num_kv_heads, self.head_dim)  # [B, W*P, H_kv, D]
        values = kv[:, 1][pages].reshape(rows, -1, self.num_kv_heads, self.head_dim)
        positions = torch.arange(keys.shape[1], device=q.device)
        hidden = positions[None, None, :] >= meta.seq_lens[:, None, None]  # [B, 1, W*P]
        return self._attend(q[:, None], keys, values, hidden)[:, 0]

    def verify(self, layer, q, k, v, meta: VerifyMetadata) -> torch.Tensor:
        """Q queries per row over the W pages of its block-table view, masked causally by position."""
        kv = self.kv_caches[layer]
        write_kv(kv, k, v, meta.slot_mapping)
        rows, queries = meta.query_positions.shape
        pages = meta.block_table.long()  # [B, W]
        keys = kv[:, 0][pages].reshape(rows, -1, self.num_kv_heads, self.head_dim)  # [B, W*P, H_kv, D]
        values = kv[:, 1][pages].reshape(rows, -1, self.num_kv_heads, self.head_dim)
        positions = torch.arange(keys.shape[1], device=q.device)
        hidden = positions[None, None, :] > meta.query_positions[:, :, None]  # [B, Q, W*P]
        out = self._attend(q.view(rows, queries, self.num_heads, self.head_dim), keys, values, hidden)
        return out.reshape(rows * queries, self.num_heads, self.head_dim)

    def _decode_ragged(self, kv, q, meta: DecodeMetadata) -> torch.Tensor:
        """q [B, H, D] over each row's own pages (CSR), one segment softmax per row."""
        rows, page_size = q.shape[0], kv.shape[2]
        pages_per_row = (meta.kv_indptr[1:] - meta.kv_indptr[:-1]).long()  # [B]
        pages = meta.kv_indices[: int(meta.kv_indptr[rows])].long()  # [N_pages]
        keys = kv[pages, 0].reshape(-1, self.num_kv_heads, self.head_dim)  # [N_pages * P, H_kv, D]
        values = kv[pages, 1].reshape(-1, self.num_kv_heads, self.head_dim)
        row_of_page = torch.repeat_interleave(torch.arange(rows), pages_per_row)  # [N_pages]
        last_page = torch.zeros_like(row_of_page, dtype=torch.bool)
        last_page[meta.kv_indptr[1:].long() - 1] = True
        valid = torch.where(last_page, meta.kv_last_page_len.long()[row_of_page], page_size)  # tokens per page
        row = row_of_page.repeat_interleave(page_size)  # [N_tokens]
        keep = torch.arange(page_size).repeat(len(pages)) < valid.repeat_interleave(page_size)
        row, keys, values = row[keep], keys[keep].float(), values[keep].float()
        groups = self.num_heads // self.num_kv_heads
        qg = q.reshape(rows, self.num_kv_heads, groups, self.head_dim).float()
        scores = torch.einsum("thgd,thd->thg", qg[row], keys) * self.scale  # [N, H_kv, G]
        peak = scores.new_full((rows, self.num_kv_heads, groups), float("-inf"))
        peak = peak.scatter_reduce(0, row[:, None, None].expand_as(scores), scores, "amax")
        weights = torch.exp(scores - peak[row])
        total = weights.new_zeros(rows, self.num_kv_heads, groups).index_add(0, row, weights)
        out = weights.new_zeros(rows, self.num_kv_heads, groups, self.head_dim)
        out = out.index_add(0, row, weights[..., None] * values[:, :, None, :])
        return (out / total[..., None]).reshape(q.shape).to(q.dtype)
