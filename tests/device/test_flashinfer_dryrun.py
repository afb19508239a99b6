"""The FlashInfer backend driven through flashinfer's real Python layer, on CPU.

Only the compiled kernels are replaced: a stand-in for the prefill/tensor-core
module records what plan() hands the C++ planner and, for paged_run, computes
attention from exactly the buffers the kernel would receive (tests/paged_reference).
This checks our calls against flashinfer 0.7.2's real signatures and semantics:
the wrappers accept our buffers, the decode plan is made once with split-KV off in
CUDA-graph mode, and every later run reads the DecodeState buffers advance_step
rewrites, so lengths can grow after the plan. Skipped where flashinfer does not
import (it is not a dependency); the GPU tests run the real kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

flashinfer = pytest.importorskip("flashinfer")

from graphdecode.attention import PrefillMetadata, TorchAttentionBackend  # noqa: E402
from graphdecode.attention.flashinfer_backend import FlashInferBackend  # noqa: E402
from graphdecode.attention.kv_cache import allocate_kv_caches  # noqa: E402
from graphdecode.device.decode_state import DecodeState  # noqa: E402
from graphdecode.device.graph_runtime import NoHostCopies  # noqa: E402
from graphdecode.device.graphs import WindowGraphs  # noqa: E402
from graphdecode.device.window_writes import WindowWrites  # noqa: E402
from tests.paged_reference import csr_attention  # noqa: E402

CAUSAL = flashinfer.utils.MaskMode.CAUSAL.value
H, H_KV, D, P, NUM_PAGES = 4, 2, 16, 4, 64


class FakeKernels:
    """Stands in for the compiled module get_batch_prefill_module returns."""

    def __init__(self):
        self.plans: list[tuple] = []
        self.runs: list[dict] = []

    def plan(self, *args):
        self.plans.append(args)
        return [len(self.plans)]  # plan_info

    def paged_run(self, *args):
        (_, _, plan_info, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, out, _, mask_mode,
         _, window_left, enable_pdl, *rest) = args
        sm_scale = rest[7]
        self.runs.append(dict(plan_info=plan_info, kv_indptr=kv_indptr, kv_indices=kv_indices,
                              last_page_len=last_page_len, mask_mode=mask_mode, window_left=window_left,
                              enable_pdl=enable_pdl))
        ref = csr_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len,
                            causal=mask_mode == CAUSAL, scale=sm_scale)
        out.copy_(ref.to(out.dtype))


class _Event:
    synchronized = 0

    def record(self, stream=None):
        pass

    def synchronize(self):
        _Event.synchronized += 1


@pytest.fixture
def kernels(monkeypatch):
    fake = FakeKernels()
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):  # no pinned allocator without CUDA
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    for module in (flashinfer.decode, flashinfer.prefill):
        monkeypatch.setattr(module, "get_batch_prefill_module", lambda *a, **k: fake)
    return fake


def _caches(seed=0):
    caches = allocate_kv_caches(1, NUM_PAGES, P, H_KV, D, torch.bfloat16, "cpu")
    caches[0].normal_(generator=torch.Generator().manual_seed(seed))
    return caches


def _state(bucket_rows, max_pages=6):
    state = DecodeState(8, max_pages, 2, 4, 2, "cpu")
    g = torch.Generator().manual_seed(1)
    pages = torch.randperm(NUM_PAGES - 1, generator=g)[: 8 * max_pages].add(1).int().view(8, max_pages)
    state.block_table.copy_(pages)
    for row, length in bucket_rows.items():
        state.seq_lens[row] = length
        state.positions[row] = length - 1
        state.max_len[row] = max_pages * P
        state.done[row] = False
    return state


def test_decode_is_planned_once_and_reads_the_buffers_advance_step_rewrites(kernels):
    fi_caches, ref_caches = _caches(), _caches()
    backend = FlashInferBackend(fi_caches, H, H_KV, D, device="cpu")
    reference = TorchAttentionBackend(ref_caches, H, H_KV, D)
    bucket = 4
    state = _state({0: 1, 1: 4, 2: 9})  # row 3 is padding (done)
    meta = state.decode_metadata(bucket, state.max_pages)
    backend.plan_decode(bucket, meta)
    backend.plan_decode(bucket, meta)  # idempotent: never planned again
    assert len(kernels.plans) == 1
    args = kernels.plans[0]
    assert args[3].tolist() == list(range(bucket + 1))  # qo_indptr: one query per row
    assert args[4].tolist() == [0, 6, 12, 18, 24]  # the worst case: every row max_pages pages
    assert args[5].tolist() == [24] * bucket  # ... all full
    assert args[6] == bucket and args[7] == bucket  # total rows, batch size
    assert (args[8], args[9], args[10]) == (H, H_KV, P)
    assert args[11] is True  # CUDA-graph plan
    assert args[14] is False  # decode: not causal
    assert args[16] == -1 and args[17] is True  # no fixed split, split-KV disabled
    assert args[19] == 0  # uniform_q_len: FlashInfer's one-token decode convention

    state.advance(bucket, state.input_ids[:bucket], P, advance=False)
    for step in range(12):  # every live row crosses at least two page boundaries
        meta = state.decode_metadata(bucket, state.max_pages)
        q = torch.randn(bucket, H, D).bfloat16()
        k = torch.randn(bucket, H_KV, D).bfloat16()
        v = torch.randn(bucket, H_KV, D).bfloat16()
        got = backend.decode(0, q, k, v, meta)  # the custom op -> wrapper.run -> "kernel"
        want = reference.decode(0, q, k, v, meta)
        run = kernels.runs[-1]
        assert run["kv_indptr"].data_ptr() == state.kv_indptr.data_ptr()  # the fixed buffers are the state's
        assert run["kv_indices"].data_ptr() == state.kv_indices.data_ptr()
        assert run["last_page_len"].data_ptr() == state.kv_last_page_len.data_ptr()
        assert run["mask_mode"] != CAUSAL and run["window_left"] == -1 and run["enable_pdl"] is False
        live = ~state.done[:bucket]
        torch.testing.assert_close(got[live].float(), want[live].float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(fi_caches[0][1:], ref_caches[0][1:])  # K/V written by slot (page 0: scratch)
        state.advance(bucket, torch.full((bucket,), step, dtype=torch.int64), P, advance=True)
    assert state.seq_lens[:3].tolist() == [13, 16, 21]
    assert len(kernels.plans) == 1  # lengths grew, the plan did not change


def test_prefill_plans_each_batch_and_alternates_wrappers(kernels):
    fi_caches, ref_caches = _caches(2), _caches(2)
    backend = FlashInferBackend(fi_caches, H, H_KV, D, device="cpu")
    reference = TorchAttentionBackend(ref_caches, H, H_KV, D)
    query_lens = [5, 1, 9]
    table = torch.tensor([[3, 9, 0], [4, 0, 0], [11, 2, 7]], dtype=torch.int32)
    slots = torch.cat([
        table[g, torch.arange(n) // P].long() * P + torch.arange(n) % P for g, n in enumerate(query_lens)
    ])
    meta = PrefillMetadata(
        cu_query_lens=torch.tensor([0, 5, 6, 15], dtype=torch.int32), seq_lens=torch.tensor(query_lens),
        block_table=table, slot_mapping=slots, query_lens_host=query_lens, seq_lens_host=query_lens,
        block_table_host=table,
    )
    used = []
    for batch in range(3):
        backend.plan_prefill(meta)
        used.append(backend._prefill_wrapper)
        args = kernels.plans[-1]
        assert args[3].tolist() == [0, 5, 6, 15] and args[4].tolist() == [0, 2, 3, 6]
        assert args[5].tolist() == query_lens  # host lengths, from our pinned seq_lens
        assert args[11] is False and args[14] is True  # eager plan, causal
        assert args[16] == -1 and args[17] is True  # batch-invariant (the default): split-KV off
        q = torch.randn(15, H, D).bfloat16()
        k, v = torch.randn(15, H_KV, D).bfloat16(), torch.randn(15, H_KV, D).bfloat16()
        got = backend.prefill(0, q, k, v, meta)
        want = reference.prefill(0, q, k, v, meta)
        assert kernels.runs[-1]["mask_mode"] == CAUSAL
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(fi_caches[0], ref_caches[0])
    assert used[0] is not used[1] and used[0] is used[2]
    assert _Event.synchronized >= 1  # reusing a wrapper waits for its previous upload
    # a partial prefix hit: the third sequence's first 2 slots are copied from page 3 (which
    # this very forward writes) after the write and before attending, as the torch reference does
    meta.copy_src, meta.copy_dst = torch.tensor([12, 13]), torch.tensor([44, 45])
    backend.plan_prefill(meta)
    q = torch.randn(15, H, D).bfloat16()
    k, v = torch.randn(15, H_KV, D).bfloat16(), torch.randn(15, H_KV, D).bfloat16()
    got, want = backend.prefill(0, q, k, v, meta), reference.prefill(0, q, k, v, meta)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(fi_caches[0], ref_caches[0]) and torch.equal(fi_caches[0][11, :, :2], fi_caches[0][3, :, :2])
    variant = FlashInferBackend(_caches(2), H, H_KV, D, device="cpu", batch_invariant=False)
    variant.plan_prefill(meta)
    assert kernels.plans[-1][17] is False  # --allow-batch-variance: FlashInfer may split a long prefill's KV


def test_window_graphs_plan_every_bucket_up_front(kernels):
    state = _state({0: 3})
    backend = FlashInferBackend(_caches(), H, H_KV, D, device="cpu")
    graphs = WindowGraphs(None, None, backend, state, buckets=(1, 2, 4, 8), num_decode_steps=4,
                          page_size=P, use_graphs=False, writes=WindowWrites())
    assert len(kernels.plans) == 4
    for bucket in graphs.buckets:
        wrapper = backend._decode_wrappers[bucket]
        assert wrapper._fixed_batch_size == bucket
        assert wrapper._paged_kv_indptr_buf.data_ptr() == state.kv_indptr.data_ptr()
        assert wrapper._paged_kv_indptr_buf.numel() == bucket + 1
        assert wrapper._paged_kv_indices_buf.numel() == bucket * state.max_pages
        assert wrapper._paged_kv_last_page_len_buf.numel() == bucket
    assert np.array_equal(kernels.plans[-1][4].numpy(), np.arange(9) * state.max_pages)


def test_verify_is_planned_once_causal_and_matches_the_torch_verify(kernels):
    """Speculative decoding's verify: Q queries per row through BatchPrefill in CUDA-graph mode,
    planned once; the KV CSR prepare_verify writes each round gives the torch verify's output."""
    from graphdecode.device.speculative import verify_metadata

    fi_caches, ref_caches = _caches(3), _caches(3)
    backend = FlashInferBackend(fi_caches, H, H_KV, D, device="cpu")
    reference = TorchAttentionBackend(ref_caches, H, H_KV, D)
    bucket, queries = 4, 3
    state = _state({0: 2, 1: 5, 2: 13})  # row 3 is padding (done)
    backend.plan_verify(bucket, queries, state.max_rows, state.verify_pages)
    backend.plan_verify(bucket, queries, state.max_rows, state.verify_pages)  # idempotent
    assert len(kernels.plans) == 1
    args = kernels.plans[0]
    assert args[3].tolist() == [0, 3, 6, 9, 12]  # qo_indptr: Q queries per row
    assert args[11] is True and args[14] is True  # CUDA-graph plan, causal
    assert args[17] is True  # split-KV disabled
    for round_ in range(4):  # lengths grow past the plan's page boundaries
        live = ~state.done[:bucket]
        meta = verify_metadata(state, bucket, queries, P, state.max_pages, live)
        with NoHostCopies():  # it runs inside the captured window: no copy from the host
            backend.prepare_verify(bucket, meta, state, P)
        q = torch.randn(bucket * queries, H, D).bfloat16()
        k = torch.randn(bucket * queries, H_KV, D).bfloat16()
        v = torch.randn(bucket * queries, H_KV, D).bfloat16()
        got = backend.verify(0, q, k, v, meta).view(bucket, queries, H, D)
        want = reference.verify(0, q, k, v, meta).view(bucket, queries, H, D)
        run = kernels.runs[-1]
        assert run["mask_mode"] == CAUSAL
        assert run["kv_indptr"].data_ptr() == backend._verify_buffers["kv_indptr"].data_ptr()
        torch.testing.assert_close(got[live].float(), want[live].float(), rtol=2e-2, atol=2e-2)
        assert torch.isfinite(got.float()).all()  # inert rows see Q scratch tokens, never none
        assert torch.equal(fi_caches[0][1:], ref_caches[0][1:])
        state.positions[:3] += 2  # as if each live row accepted one draft
        state.seq_lens[:3] += 2
    assert len(kernels.plans) == 1


def test_verify_at_the_end_of_the_context_reads_only_owned_pages(kernels):
    """Rows whose Q queries reach past their max_len (the last one at max_pages * P): their KV CSR
    is p + Q long (FlashInfer aligns queries to the KV end) but lists only the row's own pages
    and, past its context, the scratch page; queries inside the context match the torch verify,
    and the past-the-end ones write only the scratch page."""
    from graphdecode.device.speculative import verify_metadata

    fi_caches, ref_caches = _caches(3), _caches(3)
    backend = FlashInferBackend(fi_caches, H, H_KV, D, device="cpu")
    reference = TorchAttentionBackend(ref_caches, H, H_KV, D)
    bucket, queries, max_pages = 4, P, 6  # d = P - 1, the most a page size allows
    limit = max_pages * P
    state = _state({0: limit - 1, 1: limit - 3, 2: 2 * P - 2}, max_pages=max_pages)
    state.spec_tokens = queries - 1  # a speculative state: the verify spans one page more
    state.max_len[2] = 2 * P  # row 2 ends inside its second page, far from the table's end
    backend.plan_verify(bucket, queries, state.max_rows, state.verify_pages)
    live = ~state.done[:bucket]
    meta = verify_metadata(state, bucket, queries, P, state.max_pages, live)
    with NoHostCopies():
        backend.prepare_verify(bucket, meta, state, P)
    assert meta.kv_lens[:3].tolist() == [limit - 2 + queries, limit - 4 + queries, 2 * P - 3 + queries]
    assert meta.kv_lens[0] > limit and meta.kv_lens[2] > state.max_len[2]  # two rows reach past their ends
    indptr, indices = meta.kv_indptr.tolist(), meta.kv_indices
    for row in range(3):
        listed = indices[indptr[row] : indptr[row + 1]].tolist()
        owned = -(-int(state.max_len[row]) // P)
        assert listed[:owned] == state.block_table[row, :owned].tolist()
        assert len(listed) == -(-int(meta.kv_lens[row]) // P)
        assert all(page == 0 for page in listed[owned:])  # past the context: the scratch page
    q = torch.randn(bucket * queries, H, D).bfloat16()
    k, v = torch.randn(bucket * queries, H_KV, D).bfloat16(), torch.randn(bucket * queries, H_KV, D).bfloat16()
    got = backend.verify(0, q, k, v, meta).view(bucket, queries, H, D)
    want = reference.verify(0, q, k, v, meta).view(bucket, queries, H, D)
    true_pos = state.positions[:bucket, None] + torch.arange(queries)
    inside = live[:, None] & (true_pos < state.max_len[:bucket, None])
    torch.testing.assert_close(got[inside].float(), want[inside].float(), rtol=2e-2, atol=2e-2)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(fi_caches[0][1:], ref_caches[0][1:])
    past = (~inside).reshape(-1)
    assert bool((meta.slot_mapping[past] < P).all())  # the scratch page's slots only


def test_sink_layers_are_built_with_their_logits_on_the_device(kernels):
    """Sinks are no plan argument: the backend keeps each sink layer's logits (float32, on its device) and
    applies them through the run's LSE (tests/host/test_model_families.py runs them against the torch backend)."""
    from graphdecode.attention.spec import AttentionSpec

    backend = FlashInferBackend(_caches(), H, H_KV, D, device="cpu", specs=[AttentionSpec(sinks=torch.ones(H).half())])
    assert backend.sinks[0].dtype == torch.float32 and backend.sinks[0].shape == (H,)
    assert FlashInferBackend(_caches(), H, H_KV, D, device="cpu", specs=[AttentionSpec()]).sinks == [None]


def test_importing_a_backend_registers_the_ops_it_calls():
    """Each backend module imports its ops module itself (no other import may be relied on)."""
    import subprocess
    import sys

    code = ("import torch, graphdecode.attention.flashinfer_backend, graphdecode.attention.torch_backend; "
            "ops = torch.ops.graphdecode; "
            "assert all(hasattr(ops, n) for n in ('flashinfer_decode', 'flashinfer_prefill', 'flashinfer_verify', "
            "'cpu_paged_decode', 'cpu_paged_verify'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
