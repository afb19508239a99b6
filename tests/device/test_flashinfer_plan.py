"""Host-side pieces of the FlashInfer path, on CPU: the CSR metadata handed to plan(),
the meaning of the CSR advance_step writes, the backend-handle registry, and the
attention custom ops under torch.compile (opaque, fullgraph, hidden KV writes)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from graphdecode.attention import DecodeMetadata, ForwardContext, TorchAttentionBackend, handles
from graphdecode.attention.flashinfer_plan import decode_plan_csr, prefill_csr
from graphdecode.attention.kv_cache import allocate_kv_caches
from graphdecode.device.advance_step import advance_step_reference
from tests.paged_reference import csr_attention

# ---------------------------------------------------------------- prefill CSR


def test_prefill_csr_layout():
    table = np.array([[7, 3, 0, 0], [5, 0, 0, 0], [9, 8, 2, 4]], dtype=np.int32)
    csr = prefill_csr([16, 1, 40], [16, 1, 49], table, page_size=16)
    assert csr.qo_indptr.tolist() == [0, 16, 17, 57]
    assert csr.kv_indptr.tolist() == [0, 1, 2, 6]
    assert csr.kv_indices.tolist() == [7, 5, 9, 8, 2, 4]
    assert csr.kv_last_page_len.tolist() == [16, 1, 1]
    assert csr.seq_lens.tolist() == [16, 1, 49]
    for array in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, csr.seq_lens):
        assert array.dtype == np.int32


@pytest.mark.parametrize(
    "query_lens, seq_lens, width",
    [([0], [3], 1), ([4], [3], 1), ([], [], 1), ([17], [17], 1), ([1, 2], [1], 1)],
)
def test_prefill_csr_rejects_inconsistent_batches(query_lens, seq_lens, width):
    table = np.zeros((len(query_lens), width), dtype=np.int32)
    with pytest.raises(ValueError):
        prefill_csr(query_lens, seq_lens, table, page_size=16)


def test_decode_plan_is_the_worst_case_the_buffers_admit():
    plan = decode_plan_csr(bucket=3, max_pages=5, page_size=16)
    assert plan.kv_indptr.tolist() == [0, 5, 10, 15]
    assert plan.kv_last_page_len.tolist() == [16, 16, 16]
    assert plan.num_indices == 15  # exactly the fixed kv_indices buffer of the bucket
    lengths = (np.diff(plan.kv_indptr) - 1) * 16 + plan.kv_last_page_len  # FlashInfer's get_seq_lens
    assert lengths.tolist() == [80, 80, 80]  # max_pages full pages: the longest row the graph can see
    with pytest.raises(ValueError):
        decode_plan_csr(bucket=0, max_pages=5, page_size=16)


# ------------------------------------------- the CSR that advance_step writes


def _decode_state(seq_lens, done, max_pages, page_size, num_pages, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = len(seq_lens)
    pages = torch.randperm(num_pages - 1, generator=g)[: rows * max_pages].add(1).int().view(rows, max_pages)
    return dict(
        block_table=pages,  # [B, max_pages] distinct pages, none the scratch page
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        positions=torch.tensor(seq_lens, dtype=torch.int64) - 1,
        done=torch.tensor(done),
        input_ids=torch.zeros(rows, dtype=torch.int64),
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        kv_indptr=torch.zeros(rows + 1, dtype=torch.int32),
        kv_indices=torch.full((rows * max_pages,), -7, dtype=torch.int32),
        kv_last_page_len=torch.zeros(rows, dtype=torch.int32),
    )


def _advance(s, page_size, advance, sampled=None):
    sampled = s["input_ids"] if sampled is None else sampled
    advance_step_reference(
        sampled, s["done"], s["block_table"], s["input_ids"], s["positions"], s["seq_lens"], s["slot_mapping"],
        s["kv_indptr"], s["kv_indices"], s["kv_last_page_len"], page_size, advance,
    )


def test_advance_step_csr_matches_prefill_csr_for_live_rows():
    page_size, max_pages = 16, 5
    seq_lens = [1, 15, 16, 17, 33, 80, 2]
    done = [False, False, True, False, False, False, False]
    s = _decode_state(seq_lens, done, max_pages, page_size, num_pages=64)
    _advance(s, page_size, advance=False)
    live = [i for i, d in enumerate(done) if not d]
    expected = prefill_csr(
        [seq_lens[i] for i in live], [seq_lens[i] for i in live], s["block_table"][live].numpy(), page_size
    )
    indptr = s["kv_indptr"].numpy()
    got_pages = [s["kv_indices"][indptr[i] : indptr[i + 1]].tolist() for i in live]
    want_pages = [expected.kv_indices[expected.kv_indptr[j] : expected.kv_indptr[j + 1]].tolist()
                  for j in range(len(live))]
    assert got_pages == want_pages
    assert s["kv_last_page_len"][live].tolist() == expected.kv_last_page_len.tolist()
    # the done row attends one token of the scratch page
    assert s["kv_indices"][indptr[2] : indptr[3]].tolist() == [0] and s["kv_last_page_len"][2] == 1
    assert s["kv_indices"][indptr[-1] :].eq(-7).all()  # entries past kv_indptr[B] are untouched


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (4, 4, 8), (8, 1, 16)])
def test_csr_attention_over_advance_step_metadata_equals_the_torch_backend(num_heads, num_kv_heads, head_dim):
    """What FlashInfer would compute from the CSR equals the torch reference, step after step."""
    page_size, max_pages, num_pages = 4, 6, 64
    seq_lens = [1, 3, 4, 5, 12, 7]
    done = [False, False, False, False, False, True]
    s = _decode_state(seq_lens, done, max_pages, page_size, num_pages, seed=1)
    torch.manual_seed(0)
    kv = allocate_kv_caches(1, num_pages, page_size, num_kv_heads, head_dim, torch.float32, "cpu")[0]
    kv.normal_()
    backend = TorchAttentionBackend([kv], num_heads, num_kv_heads, head_dim)
    rows = len(seq_lens)
    _advance(s, page_size, advance=False)
    for step in range(9):  # crosses page boundaries for every live row
        meta = DecodeMetadata(
            seq_lens=s["seq_lens"], block_table=s["block_table"], slot_mapping=s["slot_mapping"],
            kv_indptr=s["kv_indptr"], kv_indices=s["kv_indices"], kv_last_page_len=s["kv_last_page_len"],
        )
        q = torch.randn(rows, num_heads, head_dim)
        k = torch.randn(rows, num_kv_heads, head_dim)
        v = torch.randn(rows, num_kv_heads, head_dim)
        want = backend.decode(0, q, k, v, meta)  # writes k/v by slot, then attends
        got = csr_attention(
            q, kv[:, 0], kv[:, 1], torch.arange(rows + 1), s["kv_indptr"], s["kv_indices"],
            s["kv_last_page_len"], causal=False, scale=head_dim**-0.5,
        )
        live = ~s["done"]
        torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)
        _advance(s, page_size, advance=True, sampled=torch.full((rows,), step, dtype=torch.int64))


def test_csr_attention_causal_prefill_equals_the_torch_backend():
    page_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 8
    torch.manual_seed(3)
    kv = allocate_kv_caches(1, 32, page_size, num_kv_heads, head_dim, torch.float32, "cpu")[0]
    backend = TorchAttentionBackend([kv], num_heads, num_kv_heads, head_dim)
    query_lens = [5, 1, 8]
    table = torch.tensor([[3, 9, 0], [4, 0, 0], [11, 2, 7]], dtype=torch.int32)
    slots = torch.cat([
        table[g, torch.arange(n) // page_size].long() * page_size + torch.arange(n) % page_size
        for g, n in enumerate(query_lens)
    ])
    total = sum(query_lens)
    q, k, v = torch.randn(total, num_heads, head_dim), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    from graphdecode.attention import PrefillMetadata

    meta = PrefillMetadata(
        cu_query_lens=torch.tensor([0, 5, 6, 14], dtype=torch.int32), seq_lens=torch.tensor(query_lens),
        block_table=table, slot_mapping=slots, query_lens_host=query_lens, seq_lens_host=query_lens,
        block_table_host=table,
    )
    want = backend.prefill(0, q, k, v, meta)
    csr = prefill_csr(query_lens, query_lens, table.numpy(), page_size)
    got = csr_attention(
        q, kv[:, 0], kv[:, 1], *(torch.from_numpy(a) for a in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices,
                                                                csr.kv_last_page_len)),
        causal=True, scale=head_dim**-0.5,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------- handles and the ops


class _Named:
    pass


def test_backend_handles_are_distinct_and_weak():
    a, b = _Named(), _Named()
    ha, hb = handles.register_backend(a), handles.register_backend(b)
    assert ha != hb and handles.backend_for(ha) is a
    del a
    gc.collect()
    with pytest.raises(RuntimeError):
        handles.backend_for(ha)  # a dead engine leaves nothing behind
    assert handles.backend_for(hb) is b


def test_ops_have_shape_only_fake_implementations():
    q = torch.empty(3, 4, 16, device="meta", dtype=torch.bfloat16)
    k = torch.empty(3, 2, 16, device="meta", dtype=torch.bfloat16)
    slots = torch.empty(3, device="meta", dtype=torch.int64)
    for op in (torch.ops.graphdecode.flashinfer_decode, torch.ops.graphdecode.flashinfer_prefill):
        out = op(q, k, k, slots, 123456, 0)  # no backend 123456: the fake never looks one up
        assert out.shape == q.shape and out.dtype == q.dtype


class OpRoutedReference(TorchAttentionBackend):
    """The torch reference behind the same custom op and handle the FlashInfer backend uses."""

    def __init__(self, *args):
        super().__init__(*args)
        self.handle = handles.register_backend(self)
        self.meta = None  # the DecodeMetadata of the call in flight (test-only plumbing)

    def decode(self, layer, q, k, v, meta):
        return torch.ops.graphdecode.flashinfer_decode(q, k, v, meta.slot_mapping, self.handle, layer)

    def run_decode(self, layer, q, k, v, slot_mapping):
        return TorchAttentionBackend.decode(self, layer, q, k, v, self.meta)


def test_decode_forward_through_the_op_compiles_fullgraph(tiny_models):
    """dynamo traces ForwardContext -> backend.decode -> op without a graph break; the op's
    hidden KV write still happens; compiled logits equal eager logits."""
    from graphdecode.models.loader import load_model
    from graphdecode.models.model_config import load_model_config

    path = tiny_models["llama_gqa_llama3"]
    cfg = load_model_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 256)
    page_size, max_pages, rows = 16, 4, 3

    def fresh():
        caches = allocate_kv_caches(cfg.num_layers, 32, page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                                    "cpu")
        for c in caches:
            c.normal_(generator=torch.Generator().manual_seed(5))
        backend = OpRoutedReference(caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        s = _decode_state([5, 17, 30], [False, False, False], max_pages, page_size, num_pages=32, seed=2)
        _advance(s, page_size, advance=False)
        backend.meta = DecodeMetadata(
            seq_lens=s["seq_lens"], block_table=s["block_table"], slot_mapping=s["slot_mapping"],
            kv_indptr=s["kv_indptr"], kv_indices=s["kv_indices"], kv_last_page_len=s["kv_last_page_len"],
        )
        return caches, backend, s

    ids = torch.tensor([5, 9, 100])
    compiled_fn = torch.compile(model.decode_logits, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():  # as the engine runs it
        caches_e, backend_e, s_e = fresh()
        eager = model.decode_logits(ids, s_e["positions"], ForwardContext(backend_e, decode=backend_e.meta))
        caches_c, backend_c, s_c = fresh()
        compiled = compiled_fn(ids, s_c["positions"], ForwardContext(backend_c, decode=backend_c.meta))
        untouched = fresh()[0]
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for ce, cc in zip(caches_e, caches_c):  # the op wrote K/V at the same slots under compile (eager's fused
        torch.testing.assert_close(ce, cc, rtol=1e-5, atol=1e-5)  # CPU RMSNorm sums in another order)
    slots = s_c["slot_mapping"]
    written = caches_c[0][:, 0].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[slots]
    assert not torch.equal(written, untouched[0][:, 0].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[slots])
    assert rows == ids.numel()


def test_the_gpu_tests_padded_cta_check_reads_plan_info_as_flashinfer_writes_it():
    """helpers.assert_padded_ctas_masked (run on every decode and verify graph plan on the GPU)
    checked here on plan infos laid out as flashinfer 0.7.2.post1's PrefillPlanInfo::ToVector."""
    from types import SimpleNamespace

    from tests.helpers import assert_padded_ctas_masked

    def wrapper(padded, offset, scheduled, cuda_graph=1, split_kv=0, hole=None):
        buf = torch.zeros(4096, dtype=torch.uint8)
        buf[offset:offset + scheduled] = 1
        if hole is not None:
            buf[offset + hole] = 0
        info = [padded, 8, 0, 16, 64, 128, 192, 0, 0, 256, 0, 0, offset, cuda_graph, split_kv]
        return SimpleNamespace(_plan_info=info, _pin_memory_int_workspace_buffer=buf)

    assert_padded_ctas_masked(wrapper(padded=33, offset=1024, scheduled=1), rows=1)  # B=1, 8 KV heads
    assert_padded_ctas_masked(wrapper(padded=159, offset=2048, scheduled=128), rows=128)
    bad = [(wrapper(33, 0, 1), 1),  # no block_valid_mask (the #4002 bug)
           (wrapper(33, 1024, 1, cuda_graph=0), 1), (wrapper(33, 1024, 1, split_kv=1), 1),
           (wrapper(33, 1024, 4, hole=1), 4),  # the valid blocks are not a prefix
           (wrapper(33, 1024, 1), 2)]  # fewer scheduled blocks than rows
    for plan, rows in bad:
        with pytest.raises(AssertionError):
            assert_padded_ctas_masked(plan, rows=rows)
