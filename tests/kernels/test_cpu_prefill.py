"""The CPU prefill kernel (csrc/cpu_prefill.cpp) against a float64 oracle, and the invariances it promises.

* fp32 and bf16 caches, head sizes 64 / 128 / 48 (a last output chunk of 48) / 256, GQA groups 1 / 3 / 4,
  sliding windows and sinks; sequences longer than a key block and a query block (64), fresh and after
  cached keys, several in one call on shuffled pages;
* a row's output is bit for bit the same whatever the thread count, whatever else shares the call, and
  however the prompt was cut into chunks (later chunks read the earlier keys from the pages);
* bad arguments (a page outside the cache, rows past q's end, a head size it cannot take) are a ValueError;
* the backend takes it for prefill where the kernels exist (SDPA's flash kernel is not called).
"""

from __future__ import annotations

import pytest
import torch

from graphdecode.attention import PrefillMetadata, TorchAttentionBackend, torch_backend
from graphdecode.attention.spec import AttentionSpec
from graphdecode.kernels.cpu import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the CPU kernel cannot be built")
PAGE = 16


class Cache:
    """Sequences' keys/values by position, on shuffled pages of one paged cache (garbage elsewhere)."""

    def __init__(self, lengths, kv_heads, head_dim, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.width = max(-(-n // PAGE) for n in lengths) + 1
        num_pages = len(lengths) * self.width + 3
        self.kv = torch.randn(num_pages, 2, PAGE, kv_heads, head_dim, generator=g).to(dtype)
        self.block_table = torch.randperm(num_pages, generator=g)[: len(lengths) * self.width].int().view(
            len(lengths), self.width)

    def keys_values(self, b, n):
        pages = self.block_table[b].long()
        kv_heads, head_dim = self.kv.shape[3:]
        return (self.kv[pages, 0].reshape(-1, kv_heads, head_dim)[:n],
                self.kv[pages, 1].reshape(-1, kv_heads, head_dim)[:n])


def oracle(q, keys, values, first_pos, scale, window_left=-1, sinks=None):
    """q [L, H, D] at positions first_pos.. over keys/values [S, H_kv, D], float64, vectorised."""
    L, H, _ = q.shape
    groups = H // keys.shape[1]
    k = keys.double().repeat_interleave(groups, 1)
    v = values.double().repeat_interleave(groups, 1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    qp = torch.arange(first_pos, first_pos + L)[:, None]
    kp = torch.arange(keys.shape[0])[None]
    visible = kp <= qp
    if window_left >= 0:
        visible &= kp >= qp - window_left
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(H, L, 1)], -1)
    probs = scores.softmax(-1)[..., : keys.shape[0]]
    return torch.einsum("hls,shd->lhd", probs, v)


def run(cache, q, seqs, threads=None, table=None, **kw):
    """seqs: [(q_start, q_len, kv_len)], sequence b on the block table's row b -> the kernel's output."""
    starts, q_lens, kv_lens = (torch.tensor(c, dtype=torch.int64) for c in zip(*seqs))
    table = cache.block_table if table is None else table
    return cpu_kernels().prefill_attention(q, cache.kv, table, starts, q_lens, kv_lens,
                                           scale=q.shape[-1] ** -0.5, threads=threads, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 48), (6, 2, 96), (2, 1, 256)])
@pytest.mark.parametrize("variant", ["causal", "window", "sinks"])
def test_prefill_kernel_equals_the_oracle(dtype, heads, kv_heads, head_dim, variant):
    # (new tokens, keys in all): a fresh prompt over two query and key blocks, a chunk after 66 cached keys,
    # one query after 76, a short fresh one
    lens = [(150, 150), (64, 130), (1, 77), (5, 5)]
    cache = Cache([n for _, n in lens], kv_heads, head_dim, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    # q as the fused qkv projection gives it: a view with a token stride past its heads
    qkv = torch.randn(sum(n for n, _ in lens), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    window = 37 if variant == "window" else -1
    sinks = torch.linspace(-1.0, 2.0, heads) if variant == "sinks" else None
    seqs, start = [], 0
    for n, total in lens:
        seqs.append((start, n, total))
        start += n
    got = run(cache, q, seqs, window_left=window, sinks=sinks)
    for b, (s, n, total) in enumerate(seqs):
        keys, values = cache.keys_values(b, total)
        want = oracle(q[s : s + n], keys, values, total - n, head_dim**-0.5, window, sinks)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[s : s + n].double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_threads_neighbours_or_chunks(dtype):
    """One 300-token prompt: alone on 1 thread, on 2 and 3 threads, beside other sequences, and prefilled
    in chunks of 100 / 64 / 136 (each chunk after the keys of the ones before): the same bits."""
    heads, kv_heads, head_dim, total = 6, 2, 64, 300
    cache = Cache([total, 90, 40], kv_heads, head_dim, dtype, seed=3)
    q = torch.randn(total + 90 + 40, heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    alone = run(cache, q[:total], [(0, total, total)], threads=1)
    for threads in (2, 3):
        assert torch.equal(run(cache, q[:total], [(0, total, total)], threads=threads), alone)
    crowd = run(cache, q, [(total, 90, 90), (0, total, total), (total + 90, 40, 40)], threads=2,
                table=cache.block_table[[1, 0, 2]])  # the prompt second in the batch, its rows first in q
    assert torch.equal(crowd[:total], alone)
    chunks, start = [], 0
    for n in (100, 64, 136):
        chunks.append(run(cache, q[start : start + n], [(0, n, start + n)], threads=2))
        start += n
    assert torch.equal(torch.cat(chunks), alone)
    windowed = run(cache, q[:total], [(0, total, total)], window_left=50)
    tail = run(cache, q[200:total], [(0, 100, total)], window_left=50)
    assert torch.equal(tail, windowed[200:])


def test_prefill_kernel_refuses_what_it_cannot_take():
    kernels = cpu_kernels()
    cache = Cache([40], 2, 64, torch.float32)
    q = torch.randn(40, 4, 64)
    bad_table = cache.block_table.clone()
    bad_table[0, 1] = cache.kv.shape[0]  # a page past the cache's end
    one = torch.tensor([0]), torch.tensor([40]), torch.tensor([40])
    with pytest.raises(ValueError, match="page outside the cache"):
        kernels.prefill_attention(q, cache.kv, bad_table, *one, scale=0.125)
    with pytest.raises(ValueError, match="rejected"):  # rows 0..40 of a 30-token q
        kernels.prefill_attention(q[:30], cache.kv, cache.block_table, *one, scale=0.125)
    with pytest.raises(ValueError, match="rejected"):  # more keys than the block table's pages hold
        kernels.prefill_attention(q, cache.kv, cache.block_table, torch.tensor([0]), torch.tensor([40]),
                                  torch.tensor([PAGE * cache.width + 1]), scale=0.125)
    assert not kernels.prefill_supports(40) and kernels.prefill_supports(64)
    odd = torch.randn(5, 2, PAGE, 2, 40)
    with pytest.raises(ValueError, match="rejected"):
        kernels.prefill_attention(torch.randn(3, 4, 40), odd, cache.block_table, torch.tensor([0]),
                                  torch.tensor([3]), torch.tensor([3]), scale=0.125)


def test_the_backend_prefills_through_the_kernel(monkeypatch):
    """With the kernels, TorchAttentionBackend.prefill calls neither SDPA's flash kernel nor a gather."""
    monkeypatch.setattr(torch_backend, "_flash_with_lse", lambda *a, **kw: pytest.fail("SDPA flash called"))
    monkeypatch.setattr(TorchAttentionBackend, "_gather", lambda *a, **kw: pytest.fail("pages gathered"))
    heads, kv_heads, head_dim = 4, 2, 64
    new, cached = [70, 12], [0, 30]
    totals = [n + c for n, c in zip(new, cached)]
    cache = Cache(totals, kv_heads, head_dim, torch.float32, seed=5)
    q = torch.randn(sum(new), heads, head_dim)
    k = torch.randn(sum(new), kv_heads, head_dim)
    v = torch.randn(sum(new), kv_heads, head_dim)
    slots = torch.cat([cache.block_table[b, torch.arange(c, t) // PAGE].long() * PAGE + torch.arange(c, t) % PAGE
                       for b, (c, t) in enumerate(zip(cached, totals))])
    meta = PrefillMetadata(cu_query_lens=torch.tensor([0, 70, 82], dtype=torch.int32),
                           seq_lens=torch.tensor(totals, dtype=torch.int32), block_table=cache.block_table,
                           slot_mapping=slots, query_lens_host=new, seq_lens_host=totals,
                           block_table_host=cache.block_table)
    backend = TorchAttentionBackend([cache.kv], heads, kv_heads, head_dim, specs=[AttentionSpec()])
    got = backend.prefill(0, q, k, v, meta)
    start = 0
    for b, (n, total) in enumerate(zip(new, totals)):
        keys, values = cache.keys_values(b, total)  # the chunk's K/V written first
        torch.testing.assert_close(keys[total - n :], k[start : start + n])
        torch.testing.assert_close(got[start : start + n].double(),
                                   oracle(q[start : start + n], keys, values, total - n, head_dim**-0.5),
                                   rtol=1e-5, atol=1e-5)
        start += n
