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
prefill batch from the host copies in PrefillMetadata; batch-invariant (the default,
EngineConfig.batch_invariant) with split-KV off, so a query's keys are never split
by what else the batch holds (docs/batch_invariance.md says what is left). Two wrappers alternate:
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
An FP8 cache (kv_cache_dtype="fp8") is planned as `kv_data_type=float8_e4m3fn`
against the model's q dtype, and each layer's run passes its `k_scale` / `v_scale`
(FlashInfer multiplies sm_scale by the one and the output by the other); its
module is a variant like those below.

Attention variants (AttentionSpec): a sliding window, a logits soft-cap and a query
scale are plan() arguments of FlashInfer's wrappers (`window_left`, `logits_soft_cap`,
`sm_scale`), fixed per plan; so layers are grouped by variant and every wrapper above
exists once per variant the model has (Gemma 3: its local and its global layers; most
models: one). A window or soft-cap needs its own compiled module (flashinfer_probe.py);
where that module cannot be had (the GPU kit prebuilds only the plain one), those layers
run the torch reference attention over the same cache, with one log line naming them,
while the other layers keep FlashInfer. Sinks (gpt-oss) are no plan argument of the fa2
kernels: a sink layer's run also returns the softmax's log-sum-exp (FlashInfer's base-2
convention, log2 of the sum of exp(scores)), and the output is scaled by
sigmoid(ln Z - sink) = Z / (Z + exp(sink)), exactly what adding exp(sink) to the
denominator does (the torch backend's `_with_sinks` does the same with its natural-log LSE).

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
import logging
import math

import numpy as np
import torch

from . import flashinfer_ops, flashinfer_probe  # noqa: F401 - flashinfer_ops registers the ops this backend calls
from .backend import AttentionBackend
from .flashinfer_plan import decode_plan_csr, prefill_csr
from .flashinfer_probe import SUPPORTED_DTYPES
from .handles import register_backend
from .kv_cache import FP8, copy_slots, write_kv
from .metadata import DecodeMetadata, PrefillMetadata, VerifyMetadata
from .spec import AttentionSpec
from .torch_backend import TorchAttentionBackend

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
LN2 = math.log(2.0)  # FlashInfer's LSE is log2 of the softmax's sum; sinks need its natural log
logger = logging.getLogger("graphdecode")


def plan_variant(spec: AttentionSpec) -> tuple[int, float, float | None]:
    """What a spec changes in a FlashInfer plan: (window_left, logits_soft_cap, sm_scale or None)."""
    return spec.window_left, float(spec.soft_cap or 0.0), spec.scale


def _pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, kv_caches, num_heads, num_kv_heads, head_dim, device, workspace_bytes=WORKSPACE_BYTES,
                 specs=None, dtype=None, batch_invariant: bool = True):
        super().__init__(kv_caches, num_heads, num_kv_heads, head_dim, specs, dtype)
        self.batch_invariant = batch_invariant  # prefill plans without split-KV
        # per layer: its sink logits [H] float32 on the device, or None (applied through the run's LSE)
        self.sinks = [None if spec.sinks is None else spec.sinks.float().to(device) for spec in self.specs]
        self.flashinfer = importlib.import_module("flashinfer")
        self.device = torch.device(device)  # CUDA (EngineConfig checks); tests dry-run it on CPU
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"attention_backend 'flashinfer' needs bfloat16 or float16, got {self.dtype}")
        self.page_size = kv_caches[0].shape[2]
        self.variants: list[tuple[int, float, float | None]] = []  # the plans' (window_left, soft_cap, scale)
        self.layer_variant: list[int | None] = []  # per layer: its variant, None where the reference runs it
        missing: dict[str, list[int]] = {}
        for layer, spec in enumerate(self.specs):
            why = flashinfer_probe.variant_unavailable_reason(
                head_dim, self.dtype, spec.sliding_window is not None, spec.soft_cap is not None, self.kv_dtype)
            if why is not None:
                missing.setdefault(why, []).append(layer)
                self.layer_variant.append(None)
                continue
            if plan_variant(spec) not in self.variants:
                self.variants.append(plan_variant(spec))
            self.layer_variant.append(self.variants.index(plan_variant(spec)))
        self.reference = None  # the torch attention of the layers FlashInfer has no kernel for
        if missing:
            self.reference = TorchAttentionBackend(kv_caches, num_heads, num_kv_heads, head_dim, specs=self.specs,
                                                   dtype=self.dtype)
            layers = sorted(i for group in missing.values() for i in group)
            logger.warning("graphdecode: FlashInfer has no kernel here for the sliding-window / soft-capped / FP8-KV "
                           "attention of layers %s (%s); the torch reference attention runs them", _short(layers),
                           "; ".join(missing))
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)  # [bytes], shared
        self._prefill_wrappers = [[self._new_prefill_wrapper() for _ in range(2)] for _ in self.variants]
        self._prefill_uploads: list[torch.cuda.Event | None] = [None, None]
        self._prefill_next = 0
        self._prefill_planned: list = []  # per variant: the wrapper planned for the current prefill batch
        self._prefill_wrapper = None  # the first variant's (what a one-variant model runs)
        self._prefill_copies = None  # (src slots, dst slots) of the current prefill batch
        self._decode_wrappers: dict[int, object] = {}  # bucket -> the first variant's planned wrapper
        self._decode_by_variant: dict[tuple[int, int], object] = {}  # (bucket, variant) -> planned wrapper
        self._decode_plans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # host plan inputs, kept alive
        self._verify_wrappers: dict[int, object] = {}  # bucket -> the first variant's planned verify wrapper
        self._verify_by_variant: dict[tuple[int, int], object] = {}
        self._verify_buffers: dict[str, torch.Tensor] = {}  # fixed CSR buffers, sized at the first plan
        self._verify_plans: dict[int, tuple] = {}
        self.handle = register_backend(self)

    def _variant_args(self, variant: int) -> dict:
        window_left, soft_cap, scale = self.variants[variant]
        return dict(window_left=window_left, logits_soft_cap=soft_cap or None, sm_scale=scale)

    # ------------------------------------------------------------------ plans
    def _new_prefill_wrapper(self):
        return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")

    def plan_prefill(self, meta: PrefillMetadata) -> None:
        csr = prefill_csr(meta.query_lens_host, meta.seq_lens_host, meta.block_table_host.numpy(), self.page_size)
        self._prefill_copies = None if meta.copy_src is None else (meta.copy_src, meta.copy_dst)
        if not self.variants:
            return  # every layer runs the reference
        index = self._prefill_next
        self._prefill_next ^= 1
        upload = self._prefill_uploads[index]
        if upload is not None:
            upload.synchronize()  # these wrappers' previous uploads have left their pinned buffers
        inputs = [_pinned(a) for a in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len)]
        seq_lens = _pinned(csr.seq_lens)  # host lengths: plan() reads them without a device copy
        self._prefill_planned = []
        for variant, pair in enumerate(self._prefill_wrappers):
            wrapper = pair[index]
            wrapper.plan(
                *inputs,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.page_size,
                causal=True,
                q_data_type=self.dtype,
                kv_data_type=self.kv_dtype,
                non_blocking=True,
                seq_lens=seq_lens,
                disable_split_kv=self.batch_invariant,
                **self._variant_args(variant),
            )
            self._prefill_planned.append(wrapper)
        self._prefill_wrapper = self._prefill_planned[0]
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._prefill_uploads[index] = event

    def plan_decode(self, bucket: int, meta: DecodeMetadata) -> None:
        """Build and plan the bucket's wrappers (one per variant) once; later calls for the bucket do nothing."""
        if bucket in self._decode_plans or not self.variants:
            return
        max_pages = meta.block_table.shape[1]
        plan = decode_plan_csr(bucket, max_pages, self.page_size)
        indptr, last_page_len = _pinned(plan.kv_indptr), _pinned(plan.kv_last_page_len)
        for variant in range(len(self.variants)):
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
            # plan() copies its inputs into the fixed buffers. Those hold derived metadata that the window's
            # first advance_step rewrites before any attention reads it, so the worst case landing there is
            # harmless (every variant's plan copies the same). Device zeros for the indices keep that copy
            # asynchronous.
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
                kv_data_type=self.kv_dtype,
                non_blocking=True,
                disable_split_kv=True,
                **self._variant_args(variant),
            )
            self._decode_by_variant[bucket, variant] = wrapper
        self._decode_wrappers[bucket] = self._decode_by_variant[bucket, 0]
        self._decode_plans[bucket] = (indptr, last_page_len)

    def plan_verify(self, bucket: int, queries: int, max_rows: int, max_pages: int) -> None:
        """Build and plan the bucket's verify wrappers (one per variant) once (Q queries per row, causal,
        no split-KV); max_pages: the most pages a row's verify KV spans (DecodeState.verify_pages)."""
        if bucket in self._verify_plans:
            return
        if not self._verify_buffers:
            self._verify_buffers = {
                "qo_indptr": torch.arange(max_rows + 1, dtype=torch.int32, device=self.device) * queries,
                "kv_indptr": torch.zeros(max_rows + 1, dtype=torch.int32, device=self.device),
                "kv_indices": torch.zeros(max_rows * max_pages, dtype=torch.int32, device=self.device),
                "kv_last_page_len": torch.ones(max_rows, dtype=torch.int32, device=self.device),
            }
        buffers = self._verify_buffers
        plan = decode_plan_csr(bucket, max_pages, self.page_size)  # the worst case the buffers admit
        qo_indptr = _pinned((np.arange(bucket + 1, dtype=np.int64) * queries).astype(np.int32))
        indptr, last_page_len = _pinned(plan.kv_indptr), _pinned(plan.kv_last_page_len)
        for variant in range(len(self.variants)):
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
            indices = torch.zeros(plan.num_indices, dtype=torch.int32, device=self.device)
            wrapper.plan(
                qo_indptr, indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
                self.page_size, causal=True, q_data_type=self.dtype, kv_data_type=self.kv_dtype, non_blocking=True,
                disable_split_kv=True, **self._variant_args(variant),
            )
            self._verify_by_variant[bucket, variant] = wrapper
        self._verify_wrappers[bucket] = self._verify_by_variant[bucket, 0]
        self._verify_plans[bucket] = (qo_indptr, indptr, last_page_len)

    def prepare_verify(self, bucket: int, meta: VerifyMetadata, state, page_size: int) -> None:
        """Each row's KV CSR up to its last query, into the fixed buffers (device ops, capturable).
        A row's KV length is p + Q (FlashInfer aligns its Q queries to the end of its KV); pages
        past the row's context (at or past its max_len: only queries whose samples are never kept
        see them) are the scratch page, so no row reads a page it does not own."""
        if not self.variants:
            return  # only the reference runs, which reads the block table
        buffers, queries = self._verify_buffers, meta.query_positions.shape[1]
        max_pages, width = state.max_pages, state.verify_pages
        live = meta.live
        kv_len = meta.kv_lens.to(torch.int64)  # [B]
        pages = torch.where(live, torch.div(kv_len + page_size - 1, page_size, rounding_mode="floor"), 1)
        owned = torch.div(meta.context_lens.to(torch.int64) + page_size - 1, page_size, rounding_mode="floor")
        ends = torch.cumsum(pages, dim=0).to(torch.int32)
        indptr = buffers["kv_indptr"][: bucket + 1]
        indptr[:1].zero_()  # a device op: `indptr[0] = 0` copies from the host, which capture refuses
        indptr[1:].copy_(ends)
        flat = torch.arange(bucket * width, device=ends.device, dtype=torch.int32)
        row = torch.searchsorted(ends, flat, right=True)
        in_range = row < bucket
        row = row.clamp(max=bucket - 1)
        col = (flat - indptr[row]).to(torch.int64)  # >= 0 where in range
        page_at = state.block_table[:bucket][row, col.clamp(0, max_pages - 1)]
        own = in_range & live[row] & (col < owned[row])
        buffers["kv_indices"][: bucket * width].copy_(torch.where(own, page_at, 0))
        buffers["kv_last_page_len"][:bucket].copy_(torch.where(live, kv_len - (pages - 1) * page_size, queries))
        meta.kv_indptr = indptr
        meta.kv_indices = buffers["kv_indices"][: bucket * width]
        meta.kv_last_page_len = buffers["kv_last_page_len"][:bucket]

    # ------------------------------------------------------- forward (traced)
    def prefill(self, layer, q, k, v, meta: PrefillMetadata) -> torch.Tensor:
        if self.layer_variant[layer] is None:
            return self.reference.prefill(layer, q, k, v, meta)
        return torch.ops.graphdecode.flashinfer_prefill(q, k, v, meta.slot_mapping, self.handle, layer)

    def decode(self, layer, q, k, v, meta: DecodeMetadata) -> torch.Tensor:
        if self.layer_variant[layer] is None:
            return self.reference.decode(layer, q, k, v, meta)
        return torch.ops.graphdecode.flashinfer_decode(q, k, v, meta.slot_mapping, self.handle, layer)

    def verify(self, layer, q, k, v, meta: VerifyMetadata) -> torch.Tensor:
        if self.layer_variant[layer] is None:
            return self.reference.verify(layer, q, k, v, meta)
        return torch.ops.graphdecode.flashinfer_verify(q, k, v, meta.slot_mapping, self.handle, layer,
                                                      meta.query_positions.shape[0])

    # --------------------------------------------------- op bodies (opaque)
    def run_prefill(self, layer, q, k, v, slot_mapping) -> torch.Tensor:
        kv = self.kv_caches[layer]  # [pages, 2, P, H_kv, D]
        self._write(layer, kv, k, v, slot_mapping)
        if self._prefill_wrapper is None:
            raise RuntimeError("FlashInferBackend: prefill before plan_prefill")
        if self._prefill_copies is not None:  # partial prefix hits, after this forward's writes
            copy_slots(kv, *self._prefill_copies)
        return self._run(self._prefill_planned[self.layer_variant[layer]], layer, q, kv)

    def run_decode(self, layer, q, k, v, slot_mapping) -> torch.Tensor:
        kv = self.kv_caches[layer]
        self._write(layer, kv, k, v, slot_mapping)
        wrapper = self._decode_by_variant.get((q.shape[0], self.layer_variant[layer]))
        if wrapper is None:
            raise RuntimeError(f"FlashInferBackend: bucket {q.shape[0]} was never planned (plan_decode)")
        return self._run(wrapper, layer, q, kv)

    def run_verify(self, layer, q, k, v, slot_mapping, bucket: int) -> torch.Tensor:
        kv = self.kv_caches[layer]
        self._write(layer, kv, k, v, slot_mapping)
        wrapper = self._verify_by_variant.get((bucket, self.layer_variant[layer]))
        if wrapper is None:
            raise RuntimeError(f"FlashInferBackend: bucket {bucket} has no verify plan (plan_verify)")
        return self._run(wrapper, layer, q, kv)

    def _write(self, layer: int, kv, k, v, slot_mapping) -> None:
        spec = self.specs[layer]
        write_kv(kv, k, v, slot_mapping, spec.k_scale, spec.v_scale)

    def _run(self, wrapper, layer: int, q, kv) -> torch.Tensor:
        sinks = self.sinks[layer]
        scales = {}
        if self.kv_dtype == FP8:  # FlashInfer folds k_scale into the scores' scale, v_scale into the output
            scales = dict(k_scale=self.specs[layer].k_scale, v_scale=self.specs[layer].v_scale)
        if sinks is None:
            return wrapper.run(q.contiguous(), kv, enable_pdl=False, **scales)
        out, lse = wrapper.run(q.contiguous(), kv, enable_pdl=False, return_lse=True, **scales)  # lse [T, H], base 2
        return out * torch.sigmoid(lse.float() * LN2 - sinks)[..., None].to(out.dtype)


def _short(layers: list[int]) -> str:
    return str(layers) if len(layers) <= 8 else f"{layers[:8]}... ({len(layers)} layers)"
