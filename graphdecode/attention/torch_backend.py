"""Torch attention over the paged cache: what CPU runs use, and the oracle FlashInfer is tested against.

Prefill on a CPU with the kernels is csrc/cpu_prefill.cpp (`CpuKernels.prefill_attention`):
every sequence of the batch in one call, fresh or after cached tokens, its keys read from
the pages in place (this chunk's K/V are written first), windows and sinks included; a
soft-capped layer runs the paged kernel below. Elsewhere (no compiler, a head size that is
not a multiple of 16, a compiled graph, CUDA) it is `scaled_dot_product_attention`'s flash
kernels, not a materialised score matrix: a fresh sequence attends its own chunk's K/V
causally (no gather); a chunk after cached or earlier tokens gathers those once and, on
CPU, runs two flash calls, the earlier keys unmasked and the chunk's own square causally,
merged by their log-sum-exps (so no mask is built either); sinks scale the merged output
by sigmoid(lse - sink). Sliding windows build a mask in query blocks of `MASK_BLOCK`
rows, which bounds its memory; soft-capped layers run the reference since SDPA has no
soft-cap.

Decode and verify on CPU read the pages in place with the CPU kernel
(kernels/cpu.py, csrc/cpu_attention.cpp): no per-step copy of the KV. Under
torch.compile they go through the opaque `graphdecode::cpu_paged_*` ops (attention/
cpu_ops.py), which write the step's K/V and attend, so the cache never enters the graph.

The reference (CUDA, or a CPU without a C++ compiler) gathers pages:

* padded: every row gathers the W pages its block-table view holds and masks past its
  length (the only form inside CUDA graphs: static shapes); a sliding-window layer gathers
  only the ceil((window + Q - 1) / P) + 1 pages its window can reach, from the row's first
  page in the window on (a static count, so graphs keep one shape);
* ragged (`DecodeMetadata.ragged`, chosen by the runner for eager CPU windows without the
  kernel whose rows' lengths differ a lot): the pages FlashInfer's CSR metadata lists are
  gathered once, and a softmax per row runs over its own tokens only.

Every path takes the layer's AttentionSpec (sliding window, soft-cap, scale, sinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.cpu import cpu_kernels_for
from . import cpu_ops  # noqa: F401 - registers the graphdecode::cpu_paged_* ops compiled windows call
from .backend import AttentionBackend
from .handles import register_backend
from .kv_cache import FP8, copy_slots, from_fp8, write_kv
from .metadata import DecodeMetadata, PrefillMetadata, VerifyMetadata
from .spec import AttentionSpec

MASK_BLOCK = 1024  # query rows per masked SDPA call: a mask holds at most MASK_BLOCK x keys entries
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """q [1, H, L, D], k/v [1, H_kv, S, D] (strided views are fine) -> (out [1, H, L, D], lse [1, H, L])."""
    return _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _merge(parts):
    """Outputs of attention over disjoint key sets, with their log-sum-exps, as one attention."""
    if len(parts) == 1:
        return parts[0]
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    return out.to(o1.dtype), lse


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv_caches, num_heads, num_kv_heads, head_dim, specs: list[AttentionSpec] | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(kv_caches, num_heads, num_kv_heads, head_dim, specs, dtype)
        kernels = cpu_kernels_for(kv_caches[0].device)
        usable = (kernels is not None and self.dtype in kernels.supported_dtypes and self.kv_dtype in (self.dtype, FP8)
                  and head_dim <= kernels.MAX_HEAD_DIM)  # wider heads: torch's ops
        self.kernels = kernels if usable else None
        self.handle = register_backend(self)  # for the compiled ops

    @property
    def reads_pages_in_place(self) -> bool:
        """Decode reads each row's pages where they lie (no gathered width to choose)."""
        return self.kernels is not None

    # ---------------------------------------------------------------- prefill
    def prefill(self, layer, q, k, v, meta: PrefillMetadata) -> torch.Tensor:
        kv = self.kv_caches[layer]
        self._write(layer, k, v, meta.slot_mapping)
        if meta.copy_src is not None:
            copy_slots(kv, meta.copy_src, meta.copy_dst)
        spec = self.specs[layer]
        if self._prefill_kernel(spec):
            return self.kernels.prefill_attention(
                q, kv, meta.block_table, *meta.host_lens(), scale=spec.scale_for(self.head_dim),
                window_left=spec.window_left, sinks=None if spec.sinks is None else spec.sinks.float().contiguous(),
                k_scale=spec.k_scale, v_scale=spec.v_scale)
        out = torch.empty_like(q)
        lens = list(zip(meta.query_lens_host, meta.seq_lens_host))
        start, g = 0, 0
        while g < len(lens):
            q_len, kv_len = lens[g]
            run = self._fresh_run(spec, lens, g, meta.copy_src is None and q.device.type == "cpu")
            if run > 1:  # fresh sequences of one length: one batched flash call
                end = start + run * q_len
                shape = (run, q_len, self.num_heads, self.head_dim)
                kv_shape = (run, q_len, self.num_kv_heads, self.head_dim)
                qh, kh, vh = (t[start:end].view(s).transpose(1, 2) for t, s in ((q, shape), (k, kv_shape),
                                                                                 (v, kv_shape)))
                o, lse = _flash_with_lse(qh, kh, vh, spec.scale_for(self.head_dim), causal=True)
                out[start:end].view(shape).copy_(self._with_sinks(spec, o, lse).transpose(1, 2))
                start, g = end, g + run
                continue
            end = start + q_len
            if spec.soft_cap is not None and self.kernels is not None:  # SDPA has no soft-cap
                self._prefill_in_kernel(out[start:end], q[start:end], kv, meta.block_table[g : g + 1], spec, kv_len)
            elif kv_len == q_len and meta.copy_src is None:  # a fresh sequence: its keys are this chunk's own
                out[start:end] = self._attend_chunk(spec, q[start:end], k[start:end], v[start:end], 0)
            else:
                keys, values = self._gather(kv, meta.block_table[g], kv_len, spec, q.dtype)
                out[start:end] = self._attend_chunk(spec, q[start:end], keys, values, kv_len - q_len)
            start, g = end, g + 1
        return out

    def _prefill_kernel(self, spec: AttentionSpec) -> bool:
        """Whether the CPU prefill kernel attends this layer (csrc/cpu_prefill.cpp: every variant but
        soft-cap, head sizes in multiples of 16; not inside a compiled graph)."""
        return (self.kernels is not None and spec.soft_cap is None and self.kernels.prefill_supports(self.head_dim)
                and not torch.compiler.is_compiling())

    @staticmethod
    def _fresh_run(spec: AttentionSpec, lens, g: int, allowed: bool) -> int:
        """How many sequences from g on are fresh (no cached keys) with g's length: they batch into
        one causal flash call (CPU, no window or soft-cap, no partial-hit copies in the batch)."""
        if not allowed or _FLASH_CPU is None or spec.sliding_window is not None or spec.soft_cap is not None:
            return 1
        q_len = lens[g][0]
        run = 0
        while g + run < len(lens) and lens[g + run] == (q_len, q_len):
            run += 1
        return run

    @staticmethod
    def _with_sinks(spec: AttentionSpec, out, lse):
        """Attention whose softmax also had each head's sink logit: out * sigmoid(lse - sink)."""
        if spec.sinks is None:
            return out
        return out * torch.sigmoid(lse - spec.sinks.to(lse.device)[None, :, None])[..., None].to(out.dtype)

    def _gather(self, kv, pages_row, kv_len: int, spec: AttentionSpec, dtype: torch.dtype):
        page_size = kv.shape[2]
        pages = pages_row[: -(-kv_len // page_size)].long()
        keys = kv[pages, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len]
        values = kv[pages, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len]
        return from_fp8(keys, spec.k_scale, dtype), from_fp8(values, spec.v_scale, dtype)

    def _write(self, layer: int, k, v, slot_mapping) -> None:
        """This step's K/V into layer's cache: by the CPU kernel, or by torch ops inside a compiled graph and
        without the kernel (an FP8 cache divided by the layer's scales either way)."""
        spec = self.specs[layer]
        if self.kernels is not None and not torch.compiler.is_compiling():
            self.kernels.write_kv(self.kv_caches[layer], k, v, slot_mapping, spec.k_scale, spec.v_scale)
        else:
            write_kv(self.kv_caches[layer], k, v, slot_mapping, spec.k_scale, spec.v_scale)

    def _attend_chunk(self, spec: AttentionSpec, q, keys, values, offset: int) -> torch.Tensor:
        """q [L, H, D] at positions offset..offset+L-1 over keys/values [offset + L, H_kv, D] -> [L, H, D]."""
        if spec.soft_cap is not None or (spec.sinks is not None and (_FLASH_CPU is None or not q.device.type == "cpu")):
            return self._reference_chunk(spec, q, keys, values, offset)
        scale = spec.scale_for(self.head_dim)
        qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, keys, values))  # [1, heads, len, D] views
        length = q.shape[0]
        if q.device.type == "cpu" and _FLASH_CPU is not None:
            if spec.sliding_window is None:  # no mask: the chunk's causal square, then the keys before it
                parts = [_flash_with_lse(qh, kh[:, :, offset:], vh[:, :, offset:], scale, causal=True)]
                if offset > 0:
                    parts.append(_flash_with_lse(qh, kh[:, :, :offset], vh[:, :, :offset], scale, causal=False))
                out, lse = _merge(parts)
            else:
                blocks = [self._window_block(spec, qh, kh, vh, offset, i, min(length, i + MASK_BLOCK), scale)
                          for i in range(0, length, MASK_BLOCK)]
                out, lse = torch.cat([b[0] for b in blocks], dim=2), torch.cat([b[1] for b in blocks], dim=2)
            return self._with_sinks(spec, out, lse)[0].transpose(0, 1)
        out = torch.empty_like(qh)
        for i in range(0, length, MASK_BLOCK):  # elsewhere: one masked SDPA per block of queries
            i1 = min(length, i + MASK_BLOCK)
            lo, visible = self._block_mask(spec, offset, i, i1, q.device)
            out[:, :, i:i1] = F.scaled_dot_product_attention(qh[:, :, i:i1], kh[:, :, lo : offset + i1],
                                                             vh[:, :, lo : offset + i1], attn_mask=visible,
                                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    @staticmethod
    def _block_mask(spec: AttentionSpec, offset: int, i0: int, i1: int, device):
        """Queries i0..i1-1 (positions offset + i) over keys lo..offset+i1-1: (lo, visible [rows, keys])."""
        lo = 0 if spec.sliding_window is None else max(0, offset + i0 - spec.window_left)
        q_pos = torch.arange(offset + i0, offset + i1, device=device)[:, None]
        k_pos = torch.arange(lo, offset + i1, device=device)[None, :]
        visible = k_pos <= q_pos
        if spec.sliding_window is not None:
            visible &= k_pos >= q_pos - spec.window_left
        return lo, visible

    def _window_block(self, spec, qh, kh, vh, offset, i0, i1, scale):
        lo, visible = self._block_mask(spec, offset, i0, i1, qh.device)
        mask = torch.zeros(visible.shape, dtype=qh.dtype).masked_fill_(~visible, float("-inf"))
        return _flash_with_lse(qh[:, :, i0:i1], kh[:, :, lo : offset + i1], vh[:, :, lo : offset + i1], scale,
                               causal=False, mask=mask)

    def _reference_chunk(self, spec, q, keys, values, offset: int) -> torch.Tensor:
        """The materialised reference (soft-cap, or sinks without the CPU flash kernel), in query blocks."""
        out = torch.empty_like(q)
        for i in range(0, q.shape[0], MASK_BLOCK):
            i1 = min(q.shape[0], i + MASK_BLOCK)
            lo, visible = self._block_mask(spec, offset, i, i1, q.device)
            out[i:i1] = self._attend(q[None, i:i1], keys[None, lo : offset + i1], values[None, lo : offset + i1],
                                     ~visible[None], spec)[0]
        return out

    # ------------------------------------------------------------ the reference
    def _attend(self, q, keys, values, hidden, spec: AttentionSpec | None = None):
        """q [B, Q, H, D], keys/values [B, L, H_kv, D], hidden [B, Q, L] (True = masked) -> [B, Q, H, D]."""
        spec = spec or AttentionSpec()
        batch, queries = q.shape[:2]
        groups = self.num_heads // self.num_kv_heads
        qg = q.reshape(batch, queries, self.num_kv_heads, groups, self.head_dim).float()
        scores = torch.einsum("bqhgd,blhd->bhgql", qg, keys.float()) * spec.scale_for(self.head_dim)
        if spec.soft_cap is not None:
            scores = spec.soft_cap * torch.tanh(scores / spec.soft_cap)
        scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
        if spec.sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # one more logit per head that attends nothing
            sink = spec.sinks.float().view(1, self.num_kv_heads, groups, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("bhgql,blhd->bqhgd", probs, values.float())
        return out.reshape(q.shape).to(q.dtype)

    def _window_hidden(self, spec: AttentionSpec, hidden, key_positions, query_positions):
        """Also hide the keys a sliding window leaves out (query_positions broadcast as [B, Q, 1])."""
        if spec.sliding_window is None:
            return hidden
        return hidden | (key_positions < query_positions - spec.window_left)

    def _prefill_in_kernel(self, out, q, kv, block_table, spec: AttentionSpec, kv_len: int) -> None:
        """A chunk's queries (positions kv_len - len .. kv_len - 1) through the paged kernel's multi-query form.
        A one-token chunk (the rest of a prompt after a prefix-cache hit or a chunk boundary) goes twice, as
        two queries: the kernel's one-query form is decode's (another order of sums), and a prompt's tokens
        must come out the same however it was prefilled."""
        q_len = q.shape[0]
        positions = torch.arange(kv_len - q_len, kv_len, device=q.device)[None]
        if q_len == 1:
            twice = torch.empty((1, 2, *q.shape[1:]), dtype=q.dtype, device=q.device)
            self._kernel(twice, q.expand(2, *q.shape[1:])[None], kv, block_table, spec,
                         positions=positions.expand(1, 2).contiguous())
            out.copy_(twice[0, :1])
            return
        self._kernel(out[None], q[None], kv, block_table, spec, positions=positions)

    # ------------------------------------------------------------ decode, verify
    def _kernel(self, out, q, kv, block_table, spec: AttentionSpec, positions=None, seq_lens=None):
        self.kernels.paged_attention(
            out, q.contiguous(), kv, block_table, positions=positions, seq_lens=seq_lens,
            scale=spec.scale_for(self.head_dim), window_left=spec.window_left, soft_cap=spec.soft_cap or 0.0,
            sinks=None if spec.sinks is None else spec.sinks.float().contiguous(), k_scale=spec.k_scale,
            v_scale=spec.v_scale,
        )

    def run_paged_decode(self, layer, q, k, v, slot_mapping, seq_lens, block_table) -> torch.Tensor:
        """The CPU kernel's decode step: write this step's K/V, attend each row's pages in place."""
        kv = self.kv_caches[layer]
        self._write(layer, k, v, slot_mapping)
        out = torch.empty_like(q)
        self._kernel(out[:, None], q[:, None], kv, block_table, self.specs[layer], seq_lens=seq_lens)
        return out

    def run_paged_verify(self, layer, q, k, v, slot_mapping, query_positions, block_table) -> torch.Tensor:
        """A verify's Q queries per row as Q decode rows over the row's pages, each attending up to its own
        position (the K/V of all Q written first): the decode form's sums, so accepted tokens are the bits plain
        decoding gives (batch invariance; the Llama decode driver, models/cpu_decode.py, does the same)."""
        kv = self.kv_caches[layer]
        self._write(layer, k, v, slot_mapping)
        rows, queries = query_positions.shape
        out = torch.empty_like(q)
        seq_lens = (query_positions.reshape(-1) + 1).to(torch.int32)
        self._kernel(out[:, None], q[:, None], kv, block_table.repeat_interleave(queries, dim=0), self.specs[layer],
                     seq_lens=seq_lens)
        return out

    def write(self, layer, k, v, slot_mapping) -> None:
        """Write K/V [T, H_kv, D] at slots [T] without attending (an EAGLE-3 head following a plain step)."""
        self._write(layer, k, v, slot_mapping)

    def decode(self, layer, q, k, v, meta: DecodeMetadata) -> torch.Tensor:
        if self.kernels is not None:
            args = (q, k, v, meta.slot_mapping, meta.seq_lens, meta.block_table)
            if torch.compiler.is_compiling():
                return torch.ops.graphdecode.cpu_paged_decode(*args, self.handle, layer)
            return self.run_paged_decode(layer, *args)
        kv = self.kv_caches[layer]
        spec = self.specs[layer]
        write_kv(kv, k, v, meta.slot_mapping, spec.k_scale, spec.v_scale)
        if meta.ragged:
            return self._decode_ragged(kv, q, meta, spec)
        last = meta.seq_lens.long() - 1  # [B]: the query's position
        keys, values, positions = self._gather_rows(kv, meta.block_table, spec, last, 1, q.dtype)  # [B, N*P, ...]
        hidden = positions[:, None, :] > last[:, None, None]  # [B, 1, N*P]
        hidden = self._window_hidden(spec, hidden, positions[:, None, :], last[:, None, None])
        return self._attend(q[:, None], keys, values, hidden, spec)[:, 0]

    def verify(self, layer, q, k, v, meta: VerifyMetadata) -> torch.Tensor:
        """Q queries per row over the W pages of its block-table view, masked causally by position."""
        if self.kernels is not None:
            args = (q, k, v, meta.slot_mapping, meta.query_positions, meta.block_table)
            if torch.compiler.is_compiling():
                return torch.ops.graphdecode.cpu_paged_verify(*args, self.handle, layer)
            return self.run_paged_verify(layer, *args)
        kv = self.kv_caches[layer]
        spec = self.specs[layer]
        write_kv(kv, k, v, meta.slot_mapping, spec.k_scale, spec.v_scale)
        rows, queries = meta.query_positions.shape
        keys, values, positions = self._gather_rows(kv, meta.block_table, spec, meta.query_positions[:, 0], queries,
                                                    q.dtype)
        query_positions = meta.query_positions[:, :, None]
        hidden = positions[:, None, :] > query_positions  # [B, Q, N*P]
        hidden = self._window_hidden(spec, hidden, positions[:, None, :], query_positions)
        out = self._attend(q.view(rows, queries, self.num_heads, self.head_dim), keys, values, hidden, spec)
        return out.reshape(rows * queries, self.num_heads, self.head_dim)

    def _gather_rows(self, kv, block_table, spec: AttentionSpec, first_query, queries: int, dtype: torch.dtype):
        """The padded reference's keys/values per row and their positions: all W block-table columns,
        or, for a sliding window narrower than that, only the N columns the window of Q queries from
        `first_query` [B] can reach (a static N, so graphs keep one shape; columns past W are clamped
        and their positions, past every query, masked) -> keys/values [B, N*P, H_kv, D], positions [B, N*P]."""
        rows, width = block_table.shape
        page_size = kv.shape[2]
        columns = torch.arange(width, device=block_table.device)[None, :].expand(rows, -1)
        if spec.sliding_window is not None:
            span = spec.sliding_window + queries - 1  # positions from the first query's window to the last query
            count = -(-span // page_size) + 1
            if count < width:
                start = torch.div((first_query - spec.window_left).clamp(min=0), page_size, rounding_mode="floor")
                columns = start[:, None] + torch.arange(count, device=block_table.device)[None, :]
        pages = block_table.gather(1, columns.clamp(max=width - 1)).long()  # [B, N]
        keys = from_fp8(kv[:, 0][pages].reshape(rows, -1, self.num_kv_heads, self.head_dim), spec.k_scale, dtype)
        values = from_fp8(kv[:, 1][pages].reshape(rows, -1, self.num_kv_heads, self.head_dim), spec.v_scale, dtype)
        offsets = torch.arange(page_size, device=block_table.device)
        positions = (columns[:, :, None] * page_size + offsets).reshape(rows, -1)
        return keys, values, positions

    def _decode_ragged(self, kv, q, meta: DecodeMetadata, spec: AttentionSpec) -> torch.Tensor:
        """q [B, H, D] over each row's own pages (CSR), one segment softmax per row."""
        rows, page_size = q.shape[0], kv.shape[2]
        pages_per_row = (meta.kv_indptr[1:] - meta.kv_indptr[:-1]).long()  # [B]
        pages = meta.kv_indices[: int(meta.kv_indptr[rows])].long()  # [N_pages]
        keys = from_fp8(kv[pages, 0].reshape(-1, self.num_kv_heads, self.head_dim), spec.k_scale, q.dtype)
        values = from_fp8(kv[pages, 1].reshape(-1, self.num_kv_heads, self.head_dim), spec.v_scale, q.dtype)
        row_of_page = torch.repeat_interleave(torch.arange(rows), pages_per_row)  # [N_pages]
        last_page = torch.zeros_like(row_of_page, dtype=torch.bool)
        last_page[meta.kv_indptr[1:].long() - 1] = True
        valid = torch.where(last_page, meta.kv_last_page_len.long()[row_of_page], page_size)  # tokens per page
        row = row_of_page.repeat_interleave(page_size)  # [N_tokens]
        in_page = torch.arange(page_size).repeat(len(pages))
        keep = in_page < valid.repeat_interleave(page_size)
        if spec.sliding_window is not None:  # the token's position in its row vs the row's query
            first_page = meta.kv_indptr[:-1].long()[row_of_page]
            position = ((torch.arange(len(pages)) - first_page) * page_size).repeat_interleave(page_size) + in_page
            keep &= position >= (meta.seq_lens.long() - 1)[row] - spec.window_left
        row, keys, values = row[keep], keys[keep].float(), values[keep].float()
        groups = self.num_heads // self.num_kv_heads
        qg = q.reshape(rows, self.num_kv_heads, groups, self.head_dim).float()
        scores = torch.einsum("thgd,thd->thg", qg[row], keys) * spec.scale_for(self.head_dim)  # [N, H_kv, G]
        if spec.soft_cap is not None:
            scores = spec.soft_cap * torch.tanh(scores / spec.soft_cap)
        sinks = None if spec.sinks is None else spec.sinks.float().view(1, self.num_kv_heads, groups)
        peak = scores.new_full((rows, self.num_kv_heads, groups), float("-inf")) if sinks is None else \
            sinks.expand(rows, -1, -1).clone()
        peak = peak.scatter_reduce(0, row[:, None, None].expand_as(scores), scores, "amax")
        weights = torch.exp(scores - peak[row])
        total = weights.new_zeros(rows, self.num_kv_heads, groups).index_add(0, row, weights)
        if sinks is not None:
            total = total + torch.exp(sinks - peak)
        out = weights.new_zeros(rows, self.num_kv_heads, groups, self.head_dim)
        out = out.index_add(0, row, weights[..., None] * values[:, :, None, :])
        return (out / total[..., None]).reshape(q.shape).to(q.dtype)
