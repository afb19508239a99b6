"""FlashInfer decode and prefill against the torch reference attention (bf16 tolerances).

Decode: one wrapper per bucket planned once (worst case, split-KV off), then run
while advance_step grows every row across page boundaries, eagerly and replayed
from a captured CUDA graph; padded and done rows attend the scratch page. Prefill:
a ragged causal batch over shuffled pages. The kit ships bf16 kernels for head_dim
64 and 128 only, so those are the shapes tested.
"""

from __future__ import annotations

import pytest
import torch

from graphdecode.attention import PrefillMetadata, TorchAttentionBackend
from graphdecode.attention.kv_cache import allocate_kv_caches
from graphdecode.device.decode_state import DecodeState
from tests.helpers import assert_padded_ctas_masked, require_flashinfer

pytestmark = pytest.mark.gpu

SHAPES = [(8, 2, 64), (4, 4, 128), (32, 8, 64)]  # (heads, kv heads, head_dim); the last is Llama-3.2-1B's
TOL = dict(rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module", autouse=True)
def cuda_kernel():
    from graphdecode.device.advance_step import use_cuda_kernel

    use_cuda_kernel()


def make_caches(num_pages, page_size, num_kv_heads, head_dim, seed):
    caches = allocate_kv_caches(1, num_pages, page_size, num_kv_heads, head_dim, torch.bfloat16, "cuda")
    caches[0].normal_(generator=torch.Generator("cuda").manual_seed(seed))
    return caches, [caches[0].clone()]


def make_state(rows, lengths, done_rows, max_pages, page_size, num_pages, seed):
    """DecodeState: rows 0..len(lengths)-1 hold sequences on distinct shuffled pages (those in
    done_rows finished but still sit in the batch); the rest are padding."""
    state = DecodeState(rows, max_pages, 2, 4, 2, "cuda")
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages - 1, generator=g)[: rows * max_pages].add(1).int().view(rows, max_pages)
    state.block_table.copy_(pages)
    for row, length in enumerate(lengths):
        state.seq_lens[row] = length
        state.positions[row] = length - 1
        state.done[row] = row in done_rows
    return state


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize(
    "bucket, lengths, done_rows",
    [(1, [1], ()), (8, [1, 15, 16, 17, 200, 31], (3,)), (64, [3, 600] * 20, (5, 6))],
)
def test_decode_planned_once_follows_growing_lengths(num_heads, num_kv_heads, head_dim, bucket, lengths, done_rows):
    require_flashinfer(head_dim, torch.bfloat16)
    from graphdecode.attention.flashinfer_backend import FlashInferBackend

    page_size, max_pages = 16, 48  # up to 768 tokens per row
    num_pages = bucket * max_pages + 1
    fi_caches, ref_caches = make_caches(num_pages, page_size, num_kv_heads, head_dim, seed=bucket)
    fi = FlashInferBackend(fi_caches, num_heads, num_kv_heads, head_dim, device="cuda")
    ref = TorchAttentionBackend(ref_caches, num_heads, num_kv_heads, head_dim)
    state = make_state(bucket, lengths, done_rows, max_pages, page_size, num_pages, seed=bucket)
    fi.plan_decode(bucket, state.decode_metadata(bucket, max_pages))
    assert_padded_ctas_masked(fi._decode_wrappers[bucket], bucket)
    state.advance(bucket, state.input_ids[:bucket], page_size, advance=False)
    g = torch.Generator("cuda").manual_seed(0)

    def qkv():
        shape = lambda h: (bucket, h, head_dim)  # noqa: E731
        return (torch.randn(shape(num_heads), generator=g, device="cuda").bfloat16(),
                torch.randn(shape(num_kv_heads), generator=g, device="cuda").bfloat16(),
                torch.randn(shape(num_kv_heads), generator=g, device="cuda").bfloat16())

    def check(got, q, k, v):
        want = ref.decode(0, q, k, v, state.decode_metadata(bucket, max_pages))
        live = ~state.done[:bucket]
        torch.testing.assert_close(got[live].float(), want[live].float(), **TOL)
        assert torch.isfinite(got).all()  # inert rows read the scratch page: finite garbage
        assert torch.equal(fi_caches[0][1:], ref_caches[0][1:])  # same K/V at the same slots

    def advance():
        state.advance(bucket, torch.arange(bucket, device="cuda"), page_size, advance=True)

    for _ in range(18):  # eager: every live row crosses a page boundary
        q, k, v = qkv()
        check(fi.decode(0, q, k, v, state.decode_metadata(bucket, max_pages)), q, k, v)
        advance()

    q_in, k_in, v_in = qkv()  # static inputs of the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi.decode(0, q_in, k_in, v_in, state.decode_metadata(bucket, max_pages))
    for _ in range(18):  # replays read the metadata advance_step keeps rewriting
        q, k, v = qkv()
        q_in.copy_(q)
        k_in.copy_(k)
        v_in.copy_(v)
        graph.replay()
        check(out, q, k, v)
        advance()
    grown = state.seq_lens[: len(lengths)].tolist()
    assert grown == [n if row in done_rows else n + 36 for row, n in enumerate(lengths)]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
def test_prefill_matches_the_torch_reference(num_heads, num_kv_heads, head_dim):
    require_flashinfer(head_dim, torch.bfloat16)
    from graphdecode.attention.flashinfer_backend import FlashInferBackend

    page_size, num_pages = 16, 128
    query_lens = [1, 15, 16, 17, 100, 250, 3]
    width = max(-(-n // page_size) for n in query_lens)
    fi_caches, ref_caches = make_caches(num_pages, page_size, num_kv_heads, head_dim, seed=1)
    fi = FlashInferBackend(fi_caches, num_heads, num_kv_heads, head_dim, device="cuda")
    ref = TorchAttentionBackend(ref_caches, num_heads, num_kv_heads, head_dim)
    pages = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(2)).add(1).int()
    table = torch.zeros(len(query_lens), width, dtype=torch.int32)
    used = 0
    for g, n in enumerate(query_lens):
        count = -(-n // page_size)
        table[g, :count] = pages[used : used + count]
        used += count
    slots = torch.cat([table[g, torch.arange(n) // page_size].long() * page_size + torch.arange(n) % page_size
                       for g, n in enumerate(query_lens)])
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens).cumsum(0)
    meta = PrefillMetadata(
        cu_query_lens=cu.cuda(), seq_lens=torch.tensor(query_lens, dtype=torch.int32).cuda(),
        block_table=table.cuda(), slot_mapping=slots.cuda(), query_lens_host=query_lens,
        seq_lens_host=query_lens, block_table_host=table.pin_memory(),
    )
    total = sum(query_lens)
    for _ in range(3):  # alternating prefill wrappers, replanned per batch
        q = torch.randn(total, num_heads, head_dim, device="cuda").bfloat16()
        k = torch.randn(total, num_kv_heads, head_dim, device="cuda").bfloat16()
        v = torch.randn(total, num_kv_heads, head_dim, device="cuda").bfloat16()
        fi.plan_prefill(meta)
        got = fi.prefill(0, q, k, v, meta)
        want = ref.prefill(0, q, k, v, meta)
        torch.testing.assert_close(got.float(), want.float(), **TOL)
        assert torch.equal(fi_caches[0], ref_caches[0])
    # a partial prefix hit: slots copied (after the write, before attending) from a page this
    # very forward writes, as the torch reference does
    src_page, dst_page = int(table[4, 0]), int(table[5, 0])
    meta.copy_src = (src_page * page_size + torch.arange(5)).cuda()
    meta.copy_dst = (dst_page * page_size + torch.arange(5)).cuda()
    fi.plan_prefill(meta)
    got, want = fi.prefill(0, q, k, v, meta), ref.prefill(0, q, k, v, meta)
    torch.testing.assert_close(got.float(), want.float(), **TOL)
    assert torch.equal(fi_caches[0], ref_caches[0])
    assert torch.equal(fi_caches[0][dst_page, :, :5], fi_caches[0][src_page, :, :5])
