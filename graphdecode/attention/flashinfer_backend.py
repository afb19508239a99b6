"""FlashInfer paged attention (CUDA), behind the AttentionBackend interface.

flashinfer is imported lazily (only when this backend is built), so the package
imports and runs on machines without it.

Decode: one BatchDecodeWithPagedKVCacheWrapper per bucket B, built with
use_cuda_graph=True and use_tensor_cores=True, whose fixed buffers are views of the
DecodeState's kv_indptr[:B + 1], kv_indices[:B * max_pages] and
kv_last_page_len[:B]. It is planned once (`plan_decode`, called by WindowGraphs
before anything runs a bucket) with disable_split_kv=True and pinned host metadata
for the worst case (see flashinfer_plan.py for why that plan stays valid while the
lengths grow); it is never planned again. advance_step rewrites the device
metadata every step and the kernel reads it at run time.

Prefill: BatchPrefillWithPagedKVCacheWrapper(backend="fa2"), causal, planned per
prefill batch from the host copies in PrefillMetadata. Two wrappers alternate:
plan() fills a pinned buffer and enqueues its upload on the stream, so a wrapper is
only planned again after the event recorded behind its previous upload (in the
engine's steady state that event completed long ago).

Workspaces: FlashInfer's float workspace holds split-KV partial results. Decode
never splits, so its plans allocate nothing there; prefill may, and runs between
windows on the same stream. One float workspace is therefore shared by every
wrapper. The int workspace holds a plan's schedule (and its pinned mirror); each
wrapper allocates its own, so a bucket's captured graph always reads its own plan.

K/V are written into the cache by slot (kv_cache.write_kv) inside the attention
ops (flashinfer_ops.py), before attending. KV layout NHD: [pages, 2, P, H_kv, D].

Verify (speculative decoding: Q = d + 1 queries per row, causal): one
BatchPrefillWithPagedKVCacheWrapper per bucket in CUDA-graph mode, planned once with
split-KV off over fixed buffers (qo_indptr = 0, Q, 2Q, ...; the KV CSR in buffers of
its own, which `prepare_verify` rewrites inside the window each round: the same
argument as decode's, FlashInfer's causal prefill aligning each row's queries to the
end of its KV). Inert rows attend Q tokens of the scratch page (never fewer than Q: a
query with no key to see is what makes NaNs).
"""

from __future__ import annotations

import importlib

import numpy as np
import torch

from . import flashinfer_ops  # noqa: F401 - registers the graphdecode::flashinfer_* ops this backend calls
from .backend import AttentionBackend
from .flashinfer_plan import decode_plan_csr, prefill_csr
from .flashinfer_probe import SUPPORTED_DTYPES
from .handles import register_backend
from .kv_cache import copy_slots, write_kv
from .metadata import DecodeMetadata, PrefillMetadata, VerifyMetadata

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


def _pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, kv_caches, num_heads, num_kv_heads, head_dim, device, workspace_bytes=WORKSPACE_BYTES,
                 specs=None):
        super().__init__(kv_caches, num_heads, num_kv_heads, head_dim, specs)
        variants = [i for i, spec in enumerate(self.specs) if not spec.is_default]
        if variants:  # window_left / logits_soft_cap / sinks: not wired to the plans yet
            raise ValueError(f"attention_backend 'flashinfer' does not run this model's attention variants "
                             f"(sliding window, soft-cap, sinks or scale at layers {variants[:8]}); use 'torch'")
        self.flashinfer = importlib.import_module("flashinfer")
        self.device = torch.device(device)  # CUDA (EngineConfig checks); tests dry-run it on CPU
        self.dtype = kv_caches[0].dtype
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"attention_backend 'flashinfer' needs bfloat16 or float16, got {self.dtype}")
        self.page_size = kv_caches[0].shape[2]
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)  # [bytes], shared
        self._prefill_wrappers = [self._new_prefill_wrapper() for _ in range(2)]
        self._prefill_uploads: list[torch.cuda.Event | None] = [None, None]
        self._prefill_next = 0
        self._prefill_wrapper = None  # the wrapper planned for the current prefill batch
        self._prefill_copies = None  # (src slots, dst slots) of the current prefill batch
        self._decode_wrappers: dict[int, object] = {}  # bucket -> planned wrapper
        self._decode_plans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # host plan inputs, kept alive
        self._verify_wrappers: dict[int, object] = {}  # bucket -> planned verify wrapper
        self._verify_buffers: dict[str, torch.Tensor] = {}  # fixed CSR buffers, sized at the first plan
        self._verify_plans: dict[int, tuple] = {}
        self.handle = register_backend(self)

    # ------------------------------------------------------------------ plans
    def _new_prefill_wrapper(self):
        return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")

    def plan_prefill(self, meta: PrefillMetadata) -> None:
        csr = prefill_csr(meta.query_lens_host, meta.seq_lens_host, meta.block_table_host.numpy(), self.page_size)
        index = self._prefill_next
        self._prefill_next ^= 1
        upload = self._prefill_uploads[index]
        if upload is not None:
            upload.synchronize()  # this wrapper's previous upload has left its pinned buffer
        wrapper = self._prefill_wrappers[index]
        wrapper.plan(
            _pinned(csr.qo_indptr),
            _pinned(csr.kv_indptr),
            _pinned(csr.kv_indices),
            _pinned(csr.kv_last_page_len),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            causal=True,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            non_blocking=True,
            seq_lens=_pinned(csr.seq_lens),  # host lengths: plan() reads them without a device copy
        )
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._prefill_uploads[index] = event
        self._prefill_wrapper = wrapper
        self._prefill_copies = None if meta.copy_src is None else (meta.copy_src, meta.copy_dst)

    def plan_decode(self, bucket: int, meta: DecodeMetadata) -> None:
        """Build and plan the bucket's wrapper once; later calls for the bucket do nothing."""
        if bucket in self._decode_wrappers:
            return
        max_pages = meta.block_table.shape[1]
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=meta.kv_indptr,  # [B + 1] view of DecodeState.kv_indptr
            paged_kv_indices_buffer=meta.kv_indices,  # [B * max_pages] view
            paged_kv_last_page_len_buffer=meta.kv_last_page_len,  # [B] view
            backend="fa2",
        )
        plan = decode_plan_csr(bucket, max_pages, self.page_size)
        indptr, last_page_len = _pinned(plan.kv_indptr), _pinned(plan.kv_last_page_len)
        # plan() copies its inputs into the fixed buffers. Those hold derived metadata that the
        # window's first advance_step rewrites before any attention reads it, so the worst case
        # landing there is harmless. Device zeros for the indices keep that copy asynchronous.
        indices = torch.zeros(plan.num_indices, dtype=torch.int32, device=self.device)
        wrapper.plan(
            indptr,
            indices,
            last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            non_blocking=True,
            disable_split_kv=True,
        )
        self._decode_wrappers[bucket] = wrapper
        self._decode_plans[bucket] = (indptr, last_page_len)

    def plan_verify(self, bucket: int, queries: int, max_rows: int, max_pages: int) -> None:
        """Build and plan the bucket's verify wrapper once (Q queries per row, causal, no split-KV)."""
        if bucket in self._verify_wrappers:
            return
        if not self._verify_buffers:
            self._verify_buffers = {
                "qo_indptr": torch.arange(max_rows + 1, dtype=torch.int32, device=self.device) * queries,
                "kv_indptr": torch.zeros(max_rows + 1, dtype=torch.int32, device=self.device),
                "kv_indices": torch.zeros(max_rows * max_pages, dtype=torch.int32, device=self.device),
                "kv_last_page_len": torch.ones(max_rows, dtype=torch.int32, device=self.device),
            }
        buffers = self._verify_buffers
        wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=buffers["qo_indptr"][: bucket + 1],
            paged_kv_indptr_buf=buffers["kv_indptr"][: bucket + 1],
            paged_kv_indices_buf=buffers["kv_indices"][: bucket * max_pages],
            paged_kv_last_page_len_buf=buffers["kv_last_page_len"][:bucket],
            backend="fa2",
        )
        plan = decode_plan_csr(bucket, max_pages, self.page_size)  # the worst case the buffers admit
        qo_indptr = _pinned((np.arange(bucket + 1, dtype=np.int64) * queries).astype(np.int32))
        indptr, last_page_len = _pinned(plan.kv_indptr), _pinned(plan.kv_last_page_len)
        indices = torch.zeros(plan.num_indices, dtype=torch.int32, device=self.device)
        wrapper.plan(
            qo_indptr, indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
            self.page_size, causal=True, q_data_type=self.dtype, kv_data_type=self.dtype, non_blocking=True,
            disable_split_kv=True,
        )
        self._verify_wrappers[bucket] = wrapper
        self._verify_plans[bucket] = (qo_indptr, indptr, last_page_len)

    def prepare_verify(self, bucket: int, meta: VerifyMetadata, state, page_size: int) -> None:
        """Each row's KV CSR up to its last query, into the fixed buffers (device ops, capturable)."""
        buffers, queries = self._verify_buffers, meta.query_positions.shape[1]
        max_pages = state.max_pages
        live = meta.live
        kv_len = torch.where(live, meta.query_positions[:, -1] + 1, queries)  # [B]
        pages = torch.where(live, torch.div(kv_len + page_size - 1, page_size, rounding_mode="floor"), 1)
        ends = torch.cumsum(pages, dim=0).to(torch.int32)
        indptr = buffers["kv_indptr"][: bucket + 1]
        indptr[0] = 0
        indptr[1:].copy_(ends)
        flat = torch.arange(bucket * max_pages, device=ends.device, dtype=torch.int32)
        row = torch.searchsorted(ends, flat, right=True)
        in_range = row < bucket
        row = row.clamp(max=bucket - 1)
        col = (flat - indptr[row]).clamp(0, max_pages - 1)
        page_at = state.block_table[:bucket][row, col]
        buffers["kv_indices"][: bucket * max_pages].copy_(torch.where(in_range & live[row], page_at, 0))
        buffers["kv_last_page_len"][:bucket].copy_(torch.where(live, kv_len - (pages - 1) * page_size, queries))
        meta.kv_indptr = indptr
        meta.kv_indices = buffers["kv_indices"][: bucket * max_pages]
        meta.kv_last_page_len = buffers["kv_last_page_len"][:bucket]

    # ------------------------------------------------------- forward (traced)
    def prefill(self, layer, q, k, v, meta: PrefillMetadata) -> torch.Tensor:
        return torch.ops.graphdecode.flashinfer_prefill(q, k, v, meta.slot_mapping, self.handle, layer)

    def decode(self, layer, q, k, v, meta: DecodeMetadata) -> torch.Tensor:
        return torch.ops.graphdecode.flashinfer_decode(q, k, v, meta.slot_mapping, self.handle, layer)

    def verify(self, layer, q, k, v, meta: VerifyMetadata) -> torch.Tensor:
        return torch.ops.graphdecode.flashinfer_verify(q, k, v, meta.slot_mapping, self.handle, layer,
                                                      meta.query_positions.shape[0])

    # --------------------------------------------------- op bodies (opaque)
    def run_prefill(self, layer, q, k, v, slot_mapping) -> torch.Tensor:
        kv = self.kv_caches[layer]  # [pages, 2, P, H_kv, D]
        write_kv(kv, k, v, slot_mapping)
        if self._prefill_wrapper is None:
            raise RuntimeError("FlashInferBackend: prefill before plan_prefill")
        if self._prefill_copies is not None:  # partial prefix hits, after this forward's writes
            copy_slots(kv, *self._prefill_copies)
        return self._prefill_wrapper.run(q.contiguous(), kv, enable_pdl=False)

    def run_decode(self, layer, q, k, v, slot_mapping) -> torch.Tensor:
        kv = self.kv_caches[layer]
        write_kv(kv, k, v, slot_mapping)
        wrapper = self._decode_wrappers.get(q.shape[0])
        if wrapper is None:
            raise RuntimeError(f"FlashInferBackend: bucket {q.shape[0]} was never planned (plan_decode)")
        return wrapper.run(q.contiguous(), kv, enable_pdl=False)

    def run_verify(self, layer, q, k, v, slot_mapping, bucket: int) -> torch.Tensor:
        kv = self.kv_caches[layer]
        write_kv(kv, k, v, slot_mapping)
        wrapper = self._verify_wrappers.get(bucket)
        if wrapper is None:
            raise RuntimeError(f"FlashInferBackend: bucket {bucket} has no verify plan (plan_verify)")
        return wrapper.run(q.contiguous(), kv, enable_pdl=False)
