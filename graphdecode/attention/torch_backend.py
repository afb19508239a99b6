"""Torch reference attention over the paged cache: runs on CPU and GPU.

It is the backend CPU runs use and the oracle the FlashInfer backend is tested
against. Decode gathers the W pages per row its block-table view holds (a static width, so it can be
captured in a CUDA graph) and masks past each row's length.
"""

from __future__ import annotations

import torch

from .backend import AttentionBackend
from .kv_cache import write_kv
from .metadata import DecodeMetadata, PrefillMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prefill(self, layer, q, k, v, meta: PrefillMetadata) -> torch.Tensor:
        kv = self.kv_caches[layer]
        write_kv(kv, k, v, meta.slot_mapping)
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
        rows = q.shape[0]
        pages = meta.block_table.long()  # [B, W]
        keys = kv[:, 0][pages].reshape(rows, -1, self.num_kv_heads, self.head_dim)  # [B, W*P, H_kv, D]
        values = kv[:, 1][pages].reshape(rows, -1, self.num_kv_heads, self.head_dim)
        positions = torch.arange(keys.shape[1], device=q.device)
        hidden = positions[None, None, :] >= meta.seq_lens[:, None, None]  # [B, 1, W*P]
        return self._attend(q[:, None], keys, values, hidden)[:, 0]
