"""The CPU attention paths against a naive per-query oracle, with every attention variant.

* the CPU kernel (csrc/cpu_attention.cpp: decode Q = 1, verify Q = d + 1, a soft-capped
  prefill chunk), reading shuffled pages in place, fp32 and bf16, head_dim 32 / 64 / 128
  (the generic and the two unrolled paths), GQA groups 1 / 3 / 4;
* the gathering reference (padded and ragged decode, verify) the CUDA torch backend and
  a CPU without a compiler use;
* prefill through the CPU prefill kernel (csrc/cpu_prefill.cpp; its own tests:
  test_cpu_prefill.py) and, without it, SDPA's flash kernels: a fresh chunk, a chunk after
  cached tokens (two flash calls merged by log-sum-exp), sliding windows (masked query
  blocks), sinks (the merged log-sum-exp) and the masked-SDPA path other devices take;
* the variants: sliding window, soft-cap, sinks, scale, and all at once;
* a decode forward with the kernel compiles with fullgraph (the opaque op writes K/V).

The oracle loops over queries and heads in float64 over each row's keys by position.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from graphdecode.attention import DecodeMetadata, PrefillMetadata, TorchAttentionBackend, VerifyMetadata, torch_backend
from graphdecode.attention.spec import AttentionSpec
from graphdecode.kernels.cpu import cpu_kernels

PAGE = 8
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the CPU kernel cannot be built")


def oracle(q, keys, values, positions, spec: AttentionSpec, groups: int):
    """q [Q, H, D] at positions [Q] over one row's keys/values [S, H_kv, D] (position = index)."""
    q, keys, values = q.double(), keys.double(), values.double()
    out = torch.zeros_like(q)
    scale = spec.scale_for(q.shape[-1])
    for i, pos in enumerate(positions):
        lo = 0 if spec.sliding_window is None else max(0, pos - spec.sliding_window + 1)
        for h in range(q.shape[1]):
            scores = keys[lo : pos + 1, h // groups] @ q[i, h] * scale
            if spec.soft_cap is not None:
                scores = spec.soft_cap * torch.tanh(scores / spec.soft_cap)
            if spec.sinks is not None:
                scores = torch.cat([scores, spec.sinks[h : h + 1].double()])
            probs = torch.softmax(scores, dim=0)[: pos + 1 - lo]
            out[i, h] = probs @ values[lo : pos + 1, h // groups]
    return out


SPECS = {
    "default": lambda heads: AttentionSpec(),
    "window": lambda heads: AttentionSpec(sliding_window=5),
    "soft_cap": lambda heads: AttentionSpec(soft_cap=2.0),
    "sinks": lambda heads: AttentionSpec(sinks=torch.linspace(-1.0, 2.0, heads)),
    "scale": lambda heads: AttentionSpec(scale=0.3),
    "all": lambda heads: AttentionSpec(sliding_window=7, soft_cap=3.0, sinks=torch.linspace(0.5, 1.5, heads),
                                       scale=0.2),
}


class Rows:
    """B rows of keys/values by position, written into a paged cache on shuffled pages."""

    def __init__(self, lengths, heads, kv_heads, head_dim, dtype, seed=0, num_pages=None):
        g = torch.Generator().manual_seed(seed)
        self.lengths, self.heads, self.kv_heads, self.head_dim = lengths, heads, kv_heads, head_dim
        self.width = max(-(-n // PAGE) for n in lengths) + 1
        num_pages = num_pages or len(lengths) * self.width + 1
        self.kv = torch.randn(num_pages, 2, PAGE, kv_heads, head_dim, generator=g).to(dtype)  # garbage elsewhere
        pages = torch.randperm(num_pages - 1, generator=g)[: len(lengths) * self.width].add(1)
        self.block_table = pages.int().view(len(lengths), self.width)
        self.keys = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lengths]
        self.values = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lengths]
        for b, n in enumerate(lengths):  # every position but the last (the step's own K/V, written by attend)
            self.put(b, torch.arange(n - 1), self.keys[b][: n - 1], self.values[b][: n - 1])

    def put(self, b, positions, keys, values):
        pages, offsets = self.block_table[b, positions // PAGE].long(), positions % PAGE
        self.kv[pages, 0, offsets] = keys
        self.kv[pages, 1, offsets] = values

    def slots(self, b, positions):
        return self.block_table[b, positions // PAGE].long() * PAGE + positions % PAGE

    def backend(self, spec, kernels: bool):
        backend = TorchAttentionBackend([self.kv.clone()], self.heads, self.kv_heads, self.head_dim, specs=[spec])
        if not kernels:
            backend.kernels = None
        return backend

    def decode_meta(self, ragged=False):
        seq_lens = torch.tensor(self.lengths, dtype=torch.int32)
        pages = [-(-n // PAGE) for n in self.lengths]
        indptr = torch.tensor([0] + pages).cumsum(0).int()
        indices = torch.cat([self.block_table[b, :p] for b, p in enumerate(pages)]).int()
        last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(self.lengths, pages)], dtype=torch.int32)
        slots = torch.stack([self.slots(b, torch.tensor(n - 1)) for b, n in enumerate(self.lengths)])
        return DecodeMetadata(seq_lens=seq_lens, block_table=self.block_table, slot_mapping=slots, kv_indptr=indptr,
                              kv_indices=indices, kv_last_page_len=last, ragged=ragged)


def _tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)


def _decode_case(spec_name, dtype, heads, kv_heads, head_dim):
    rows = Rows([1, 7, 8, 9, 30, 17], heads, kv_heads, head_dim, dtype, seed=3)
    spec = SPECS[spec_name](heads)
    q = torch.randn(6, heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    k = torch.stack([keys[-1] for keys in rows.keys])
    v = torch.stack([values[-1] for values in rows.values])
    want = torch.stack([oracle(q[b : b + 1], rows.keys[b], rows.values[b], [n - 1], spec, heads // kv_heads)[0]
                        for b, n in enumerate(rows.lengths)])
    return rows, spec, q, k, v, want


@needs_kernels
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 32), (9, 3, 64), (8, 2, 128), (14, 2, 80), (6, 3, 40),
                                                     (4, 1, 576)])  # the last: an MLA latent (DeepSeek-V3's)
def test_kernel_decode_reads_pages_in_place(spec_name, dtype, heads, kv_heads, head_dim):
    rows, spec, q, k, v, want = _decode_case(spec_name, dtype, heads, kv_heads, head_dim)
    backend = rows.backend(spec, kernels=True)
    assert backend.reads_pages_in_place
    got = backend.decode(0, q, k, v, rows.decode_meta())
    torch.testing.assert_close(got.double(), want, **_tol(dtype))
    slots = rows.decode_meta().slot_mapping
    assert torch.equal(backend.kv_caches[0][slots // PAGE, 0, slots % PAGE], k)  # written first


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_on_several_threads_equal_one_thread_bit_for_bit(dtype):
    """The rows go over torch's threads, each with its own scratch: 1, 2 and 4 threads give the
    same output, and every row still matches the oracle (rows of unequal length: dynamic handout)."""
    rows, spec, q, k, v, want = _decode_case("all", dtype, 9, 3, 64)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            backend = rows.backend(spec, kernels=True)
            got.append(backend.decode(0, q, k, v, rows.decode_meta()))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got[0], g) for g in got[1:])
    torch.testing.assert_close(got[0].double(), want, **_tol(dtype))
    with pytest.raises(ValueError, match="rejected"):  # threads=0 is refused by the kernel, not rounded up
        out = torch.empty(6, 1, 9, 64, dtype=dtype)
        backend.kernels.paged_attention(out, q.view(6, 1, 9, 64), backend.kv_caches[0], rows.block_table,
                                        seq_lens=torch.tensor(rows.lengths, dtype=torch.int32), scale=0.125,
                                        threads=0)


@needs_kernels
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("spec_name", ["default", "all"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", [(16, 2, 64, torch.float32), (8, 1, 256, torch.float32),
                                                              (6, 3, 48, torch.float32), (16, 2, 64, torch.bfloat16)])
def test_kernel_decode_blocks_any_page_size_and_group(page, spec_name, heads, kv_heads, head_dim, dtype):
    """Decode goes over a row's keys in blocks of up to 16 that never cross a page, with an online
    softmax: pages of 1 key (a block per key), of 16 (one block each) and of 64 (four blocks a page);
    rows ending inside a block, on its edge and long enough for the maximum to rise block after block;
    8 query heads per KV head (two groups through P @ V); a head size that is no multiple of 16."""
    lengths = [1, 15, 16, 17, 100, 257]
    g = torch.Generator().manual_seed(11)
    width = -(-max(lengths) // page)
    num_pages = len(lengths) * width + 1
    kv = torch.randn(num_pages, 2, page, kv_heads, head_dim, generator=g).to(dtype)
    table = (torch.randperm(num_pages - 1, generator=g)[: len(lengths) * width] + 1).int().view(len(lengths), width)
    q = torch.randn(len(lengths), 1, heads, head_dim, generator=g).to(dtype)
    q[4] *= 8  # sharp scores: the maximum moves late in the row
    spec = SPECS[spec_name](heads)
    out = torch.empty_like(q)
    cpu_kernels().paged_attention(
        out, q, kv, table, seq_lens=torch.tensor(lengths, dtype=torch.int32), scale=spec.scale_for(head_dim),
        window_left=spec.window_left, soft_cap=spec.soft_cap or 0.0,
        sinks=None if spec.sinks is None else spec.sinks.float().contiguous())
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        pages = table[b, pos // page].long()
        keys, values = kv[pages, 0, pos % page], kv[pages, 1, pos % page]
        want = oracle(q[b], keys, values, [n - 1], spec, heads // kv_heads)
        torch.testing.assert_close(out[b].double(), want, **_tol(dtype))


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("ragged", [False, True])
def test_gathering_reference_decode_has_every_variant(spec_name, ragged):
    rows, spec, q, k, v, want = _decode_case(spec_name, torch.float32, 9, 3, 64)
    backend = rows.backend(spec, kernels=False)
    assert not backend.reads_pages_in_place
    got = backend.decode(0, q, k, v, rows.decode_meta(ragged=ragged))
    torch.testing.assert_close(got.double(), want, **_tol(torch.float32))


def verify_inputs(rows: Rows, queries: int):
    """Each row's last `queries` positions as one verify: (q, k, v, VerifyMetadata, positions [B, Q])."""
    count = len(rows.lengths)
    positions = torch.tensor([[n - queries + j for j in range(queries)] for n in rows.lengths])
    q = torch.randn(count * queries, rows.heads, rows.head_dim, generator=torch.Generator().manual_seed(6))
    k = torch.cat([keys[-queries:] for keys in rows.keys])
    v = torch.cat([values[-queries:] for values in rows.values])
    slots = torch.cat([rows.slots(b, positions[b]) for b in range(count)])
    meta = VerifyMetadata(block_table=rows.block_table, query_positions=positions, slot_mapping=slots,
                          live=torch.ones(count, dtype=torch.bool))
    return q, k, v, meta, positions


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False])
@pytest.mark.parametrize("spec_name", ["default", "window", "all"])
@pytest.mark.parametrize("queries", [2, 4])  # 6 queries per KV head: the decode-shaped loops; 12: the tiled ones
def test_verify_attends_queries_causally(kernels, spec_name, queries):
    """d + 1 queries per row at consecutive positions, their K/V written first."""
    heads, kv_heads, head_dim = 9, 3, 64
    rows = Rows([6, 20, 33], heads, kv_heads, head_dim, torch.float32, seed=5)
    spec = SPECS[spec_name](heads)
    q, k, v, meta, positions = verify_inputs(rows, queries)
    got = rows.backend(spec, kernels).verify(0, q, k, v, meta).view(3, queries, heads, head_dim)
    for b in range(3):
        want = oracle(q.view(3, queries, heads, head_dim)[b], rows.keys[b], rows.values[b], positions[b].tolist(),
                      spec, heads // kv_heads)
        torch.testing.assert_close(got[b].double(), want, **_tol(torch.float32))


def _prefill_case(spec_name, dtype, cached: list[int], new: list[int], heads=9, kv_heads=3, head_dim=64):
    """Sequences with `cached` tokens already in the pages and `new` tokens in this chunk."""
    totals = [c + n for c, n in zip(cached, new)]
    rows = Rows(totals, heads, kv_heads, head_dim, dtype, seed=7)
    spec = SPECS[spec_name](heads)
    for b, c in enumerate(cached):  # only the cached part is in the pages: the chunk writes the rest
        rest = torch.arange(c, totals[b])
        rows.put(b, rest, torch.zeros(len(rest), kv_heads, head_dim, dtype=dtype), 0 * rows.values[b][c:])
    g = torch.Generator().manual_seed(8)
    q = torch.randn(sum(new), heads, head_dim, generator=g).to(dtype)
    k = torch.cat([keys[c:] for keys, c in zip(rows.keys, cached)])
    v = torch.cat([values[c:] for values, c in zip(rows.values, cached)])
    cu = torch.tensor([0] + new).cumsum(0).int()
    slots = torch.cat([rows.slots(b, torch.arange(c, t)) for b, (c, t) in enumerate(zip(cached, totals))])
    meta = PrefillMetadata(cu_query_lens=cu, seq_lens=torch.tensor(totals, dtype=torch.int32),
                           block_table=rows.block_table, slot_mapping=slots, query_lens_host=new,
                           seq_lens_host=totals, block_table_host=rows.block_table)
    want = torch.cat([oracle(q[cu[b] : cu[b + 1]], rows.keys[b], rows.values[b], list(range(c, totals[b])), spec,
                             heads // kv_heads) for b, c in enumerate(cached)])
    return rows, spec, q, k, v, meta, want


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "sdpa"])
def test_prefill_fresh_and_after_cached_tokens(spec_name, dtype, kernels):
    """Three sequences in one batch: fresh (no gather), 13 cached + 10 new, 40 cached + 3 new; through the
    CPU prefill kernel (soft-cap: the paged kernel) and through SDPA's flash kernels (no compiler)."""
    if kernels and cpu_kernels() is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built")
    rows, spec, q, k, v, meta, want = _prefill_case(spec_name, dtype, cached=[0, 13, 40], new=[21, 10, 3])
    got = rows.backend(spec, kernels=kernels).prefill(0, q, k, v, meta)
    torch.testing.assert_close(got.double(), want, **_tol(dtype))


@pytest.mark.parametrize("spec_name", ["default", "window", "sinks", "soft_cap"])
def test_prefill_elsewhere_takes_masked_sdpa_or_the_reference(spec_name, monkeypatch):
    """Without the CPU flash kernel's log-sum-exp (CUDA): masked SDPA per query block, the
    materialised reference for sinks and soft-cap; query blocks smaller than a chunk."""
    monkeypatch.setattr(torch_backend, "_FLASH_CPU", None)
    monkeypatch.setattr(torch_backend, "MASK_BLOCK", 4)
    rows, spec, q, k, v, meta, want = _prefill_case(spec_name, torch.float32, cached=[0, 13], new=[11, 6])
    got = rows.backend(spec, kernels=False).prefill(0, q, k, v, meta)
    torch.testing.assert_close(got.double(), want, **_tol(torch.float32))


def test_window_masks_are_built_in_bounded_blocks(monkeypatch):
    monkeypatch.setattr(torch_backend, "MASK_BLOCK", 3)
    rows, spec, q, k, v, meta, want = _prefill_case("window", torch.float32, cached=[0, 9], new=[14, 8])
    got = rows.backend(spec, kernels=False).prefill(0, q, k, v, meta)
    torch.testing.assert_close(got.double(), want, **_tol(torch.float32))


def test_spec_validates_its_fields():
    for bad in (dict(sliding_window=0), dict(soft_cap=-1.0), dict(scale=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AttentionSpec(**bad)
    assert AttentionSpec(sliding_window=4).window_left == 3 and AttentionSpec().window_left == -1
    assert AttentionSpec().scale_for(64) == pytest.approx(1 / math.sqrt(64))


@needs_kernels
def test_kernel_rejects_what_it_cannot_take():
    kernels = cpu_kernels()
    q = torch.randn(2, 1, 4, 16)
    kv = torch.randn(5, 2, PAGE, 3, 16)  # 4 heads over 3 KV heads: not a whole group
    with pytest.raises(ValueError, match="rejected its arguments"):
        kernels.paged_attention(torch.empty_like(q), q, kv, torch.zeros(2, 2, dtype=torch.int32),
                                seq_lens=torch.ones(2, dtype=torch.int32), scale=0.25)


@needs_kernels
def test_decode_forward_with_the_kernel_compiles_fullgraph(tiny_models):
    """dynamo traces the model through the opaque cpu_paged_decode op (no graph break, no
    gather, the cache outside the graph); compiled logits equal eager ones, K/V written alike."""
    from graphdecode.attention import ForwardContext
    from graphdecode.attention.kv_cache import allocate_kv_caches
    from graphdecode.models.loader import load_model
    from graphdecode.models.model_config import load_model_config

    path = tiny_models["llama_gqa_llama3"]
    cfg = load_model_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 256)

    def fresh():
        caches = allocate_kv_caches(cfg.num_layers, 32, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        for c in caches:
            c.normal_(generator=torch.Generator().manual_seed(5))
        backend = TorchAttentionBackend(caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        seq_lens = torch.tensor([5, 17, 30], dtype=torch.int32)
        table = torch.arange(1, 13, dtype=torch.int32).view(3, 4)
        positions = (seq_lens - 1).long()
        slots = table[torch.arange(3), positions // PAGE].long() * PAGE + positions % PAGE
        meta = DecodeMetadata(seq_lens=seq_lens, block_table=table, slot_mapping=slots, kv_indptr=None,
                              kv_indices=None, kv_last_page_len=None)
        return caches, ForwardContext(backend, decode=meta), positions

    ids = torch.tensor([5, 9, 100])
    torch._dynamo.reset()  # the families share one decoder's code objects: earlier tests' compiles count
    compiled_fn = torch.compile(model.decode_logits, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():
        caches_e, ctx_e, positions = fresh()
        eager = model.decode_logits(ids, positions, ctx_e)
        caches_c, ctx_c, _ = fresh()
        compiled = compiled_fn(ids, positions, ctx_c)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for ce, cc in zip(caches_e, caches_c):  # the same slots written; eager's fused RMSNorm sums in another order
        torch.testing.assert_close(ce, cc, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec_name", ["default", "sinks", "window", "scale"])
def test_fresh_sequences_of_one_length_batch_into_one_flash_call(spec_name, monkeypatch):
    """Runs of fresh equal-length sequences (3 of 7 tokens, then 2 of 3 around a cached one)
    attend in one batched call each; the result is the per-sequence one."""
    calls = []
    real = torch_backend._flash_with_lse
    monkeypatch.setattr(torch_backend, "_flash_with_lse", lambda q, *a, **kw: calls.append(q.shape[0]) or
                        real(q, *a, **kw))
    rows, spec, q, k, v, meta, want = _prefill_case(spec_name, torch.float32, cached=[0, 0, 0, 5, 0, 0],
                                                    new=[7, 7, 7, 4, 3, 3])
    got = rows.backend(spec, kernels=False).prefill(0, q, k, v, meta)
    torch.testing.assert_close(got.double(), want, **_tol(torch.float32))
    if spec.sliding_window is None:
        assert calls[0] == 3 and 2 in calls  # the two runs, batched
    else:
        assert set(calls) == {1}  # windows take the masked per-sequence path


@needs_kernels
def test_the_kernel_loads_from_the_package_before_the_cache(tmp_path, monkeypatch):
    """pip install builds the kernels for the installing CPU into the package; first use takes
    that library, and builds into the cache only without one. GRAPHDECODE_CPU_KERNELS=0: none."""
    import shutil

    from graphdecode.kernels import build as kernel_build
    from graphdecode.kernels import cpu as module

    built = module.cpu_kernels().path
    src = kernel_build.source_dir(kernel_build.CPU_SOURCES)
    key = kernel_build.cpu_library_key(src)
    package = tmp_path / "package"  # an installed package: its sources beside it, its library inside
    shutil.copytree(src, tmp_path / "csrc")
    (package / "_kernels" / key).mkdir(parents=True)
    shutil.copy(built, package / "_kernels" / key / kernel_build.CPU_LIB_NAME)
    monkeypatch.setattr(kernel_build, "package_dir", lambda: str(package))
    module.cpu_kernels.cache_clear()
    try:
        assert module.cpu_kernels().path == str(package / "_kernels" / key / kernel_build.CPU_LIB_NAME)
        module.cpu_kernels.cache_clear()
        monkeypatch.setenv("GRAPHDECODE_CPU_KERNELS", "0")
        assert module.cpu_kernels() is None
    finally:
        module.cpu_kernels.cache_clear()


def test_the_kernels_load_wherever_a_compiler_is_found():
    """The kernel tests skip where no C++ compiler can build the library; where one is found, a library that
    fails to build or load (a compile error, an ABI version out of step with kernels/cpu.py) must fail here,
    not turn every kernel test into a skip."""
    from graphdecode.kernels import build as kernel_build

    if kernel_build.find_cxx() is None or os.environ.get("GRAPHDECODE_CPU_KERNELS", "1") == "0":
        pytest.skip("no C++ compiler (or GRAPHDECODE_CPU_KERNELS=0)")
    assert cpu_kernels() is not None


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_write_kv_equals_the_torch_write(dtype):
    """The step's K/V into the cache in one call (CpuKernels.write_kv) is kv_cache.write_kv's result exactly,
    from the fused qkv projection's strided views; a slot outside the cache is a ValueError and writes nothing."""
    from graphdecode.attention.kv_cache import write_kv

    g = torch.Generator().manual_seed(4)
    pages, page_size, kv_heads, head_dim, tokens = 6, 4, 3, 64, 7
    kv = torch.randn(pages, 2, page_size, kv_heads, head_dim, generator=g).to(dtype)
    qkv = torch.randn(tokens, 9 * 64 + 2 * kv_heads * head_dim, generator=g).to(dtype)
    _, k, v = qkv.split([576, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.tensor([0, 5, 23, 9, 10, 11, 16])  # first and last slot of the cache, a page's tail
    want = kv.clone()
    write_kv(want, k, v, slots)
    cpu_kernels().write_kv(kv, k, v, slots)
    assert torch.equal(kv, want)
    before = kv.clone()
    for bad in (torch.tensor([3, pages * page_size]), torch.tensor([-1, 2])):
        with pytest.raises(ValueError, match="write_kv"):
            cpu_kernels().write_kv(kv, k[:2], v[:2], bad)
        assert torch.equal(kv, before)
