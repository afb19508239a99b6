"""Host-side metadata for FlashInfer's plan(): plain numpy, no GPU, no flashinfer import.

plan() reads its CSR inputs on the host; giving it device tensors makes it copy them
back, which synchronises the host with the stream. These builders produce the host
arrays; the backend pins them before handing them over.

Prefill: an exact CSR of the batch (pages of each sequence, in block-table order).

Decode: one plan per bucket, made once at capture and never again, while the device
metadata it describes keeps changing (advance_step rewrites it every step). With
`disable_split_kv=True`, FlashInfer 0.7.2's planner (PrefillSplitQOKVIndptr in
include/flashinfer/attention/scheduler.cuh, used by the tensor-core decode path)
gives every request exactly one KV chunk whatever its length; the kernel then reads
each row's length from kv_indptr / kv_last_page_len on the device at run time, and
the launch grid depends only on the batch size, the query length (1) and the head
geometry. The host lengths therefore only have to be valid. We still pass the worst
case the buffers admit (every row max_pages full pages), so the plan describes the
longest sequence the graph can ever see.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefillCSR:
    qo_indptr: np.ndarray  # [G + 1] int32: query-token offsets
    kv_indptr: np.ndarray  # [G + 1] int32: page offsets into kv_indices
    kv_indices: np.ndarray  # [sum(pages)] int32: each sequence's pages, in order
    kv_last_page_len: np.ndarray  # [G] int32, in 1..page_size
    seq_lens: np.ndarray  # [G] int32: KV length of each sequence after the prefill


@dataclass(frozen=True)
class DecodePlanCSR:
    kv_indptr: np.ndarray  # [B + 1] int32: row b owns pages [b * max_pages, (b + 1) * max_pages)
    kv_last_page_len: np.ndarray  # [B] int32: every last page full
    num_indices: int  # B * max_pages: the fixed kv_indices buffer, filled completely


def pages_for(num_tokens: np.ndarray, page_size: int) -> np.ndarray:
    return (num_tokens + page_size - 1) // page_size


def prefill_csr(query_lens, seq_lens, block_table: np.ndarray, page_size: int) -> PrefillCSR:
    """query_lens, seq_lens: [G] ints; block_table: [G, W] int (a row's pages, left-aligned)."""
    q = np.asarray(query_lens, dtype=np.int64)
    kv = np.asarray(seq_lens, dtype=np.int64)
    table = np.asarray(block_table)
    if q.ndim != 1 or q.shape != kv.shape or table.ndim != 2 or table.shape[0] != q.shape[0]:
        raise ValueError("prefill_csr: query_lens, seq_lens and block_table rows must agree")
    if q.size == 0 or (q < 1).any() or (kv < q).any():
        raise ValueError("prefill_csr: every sequence needs 1 <= query_len <= seq_len")
    pages = pages_for(kv, page_size)
    if (pages > table.shape[1]).any():
        raise ValueError("prefill_csr: a sequence needs more pages than its block-table row holds")
    qo_indptr = np.zeros(q.size + 1, dtype=np.int32)
    np.cumsum(q, out=qo_indptr[1:])
    kv_indptr = np.zeros(q.size + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    columns = np.arange(table.shape[1])[None, :] < pages[:, None]  # [G, W]
    return PrefillCSR(
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=table[columns].astype(np.int32),  # row-major: sequence by sequence, in page order
        kv_last_page_len=(kv - (pages - 1) * page_size).astype(np.int32),
        seq_lens=kv.astype(np.int32),
    )


def decode_plan_csr(bucket: int, max_pages: int, page_size: int) -> DecodePlanCSR:
    """The worst case a bucket's fixed buffers admit: every row max_pages full pages."""
    if bucket < 1 or max_pages < 1 or page_size < 1:
        raise ValueError("decode_plan_csr: bucket, max_pages and page_size must be positive")
    return DecodePlanCSR(
        kv_indptr=(np.arange(bucket + 1, dtype=np.int64) * max_pages).astype(np.int32),
        kv_last_page_len=np.full(bucket, page_size, dtype=np.int32),
        num_indices=bucket * max_pages,
    )
