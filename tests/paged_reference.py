"""A loop-per-sequence reference for attention over FlashInfer's paged CSR layout.

It reads exactly what a FlashInfer kernel reads (qo_indptr, kv_indptr, kv_indices,
kv_last_page_len, an NHD paged cache) and nothing else, so tests can check that the
CSR metadata the engine produces means what the engine intends. Causal masks are
aligned bottom-right (the last query sees the whole KV), as FlashInfer aligns them.
"""

from __future__ import annotations

import torch


def csr_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [pages, P, H_kv, D]
    v_cache: torch.Tensor,  # [pages, P, H_kv, D]
    qo_indptr: torch.Tensor,  # [G + 1]
    kv_indptr: torch.Tensor,  # [G + 1]
    kv_indices: torch.Tensor,  # [>= kv_indptr[G]]
    kv_last_page_len: torch.Tensor,  # [G]
    causal: bool,
    scale: float,
) -> torch.Tensor:  # [T, H, D] float32
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    groups = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    qo, kv, idx, last = (t.cpu().long() for t in (qo_indptr, kv_indptr, kv_indices, kv_last_page_len))
    for g in range(qo.numel() - 1):
        q_rows = q[qo[g] : qo[g + 1]].float().cpu()  # [q_len, H, D]
        pages = idx[kv[g] : kv[g + 1]]
        kv_len = int((pages.numel() - 1) * page_size + last[g])
        keys = k_cache[pages].float().cpu().reshape(-1, num_kv_heads, head_dim)[:kv_len]
        values = v_cache[pages].float().cpu().reshape(-1, num_kv_heads, head_dim)[:kv_len]
        keys = keys.repeat_interleave(groups, dim=1)  # query head h reads KV head h // groups
        values = values.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_rows, keys) * scale
        if causal:
            q_len = q_rows.shape[0]
            q_pos = torch.arange(kv_len - q_len, kv_len)
            scores = scores.masked_fill(torch.arange(kv_len)[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[qo[g] : qo[g + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
    return out
