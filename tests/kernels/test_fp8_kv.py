"""The FP8 (E4M3) KV cache in the attention paths: K / k_scale and V / v_scale stored at one byte, read back.

* writes: the CPU kernel's bytes are torch's `.clamp(-448, 448).to(float8_e4m3fn)` bytes for every kind of
  value (ties between neighbours, subnormals, saturation, signed zero), from float32 and bf16, at any scale;
* reads: decode, verify and prefill over an FP8 cache, through the CPU kernels (csrc: the scales folded into
  the scores' scale and the output) and the gathering reference (the cache dequantized), equal the oracle on the
  dequantized keys and values to float32 rounding, with every attention variant and scales other than 1;
* accuracy: attention over the FP8 cache stays within a few percent of attention over the float cache;
* FlashInfer, driven through its real Python layer with a stand-in kernel: the plans name the FP8 cache, the
  runs pass the layer's scales, the result is the reference's; where the FP8 module is missing, the layers run
  the torch reference with one warning.
"""

from __future__ import annotations

import logging

import pytest
import torch

from graphdecode.attention import PrefillMetadata, TorchAttentionBackend
from graphdecode.attention.kv_cache import FP8, from_fp8, to_fp8, write_kv
from graphdecode.attention.spec import AttentionSpec
from graphdecode.kernels.cpu import cpu_kernels
from tests.kernels.test_cpu_attention import PAGE, SPECS, Rows, oracle, verify_inputs

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the CPU kernel cannot be built")
K_SCALE, V_SCALE = 0.37, 2.5  # scales other than 1, so that a dropped or inverted one shows


def _specs(name: str, heads: int) -> AttentionSpec:
    from dataclasses import replace

    return replace(SPECS[name](heads), k_scale=K_SCALE, v_scale=V_SCALE)


class Fp8Rows(Rows):
    """Rows whose cache is FP8: `keys` / `values` are what the cache holds, dequantized (the oracle's inputs)."""

    def __init__(self, lengths, heads, kv_heads, head_dim, seed=0):
        super().__init__(lengths, heads, kv_heads, head_dim, torch.float32, seed=seed)
        self.kv = torch.stack([to_fp8(self.kv[:, 0], K_SCALE), to_fp8(self.kv[:, 1], V_SCALE)], dim=1)
        self.keys = [from_fp8(to_fp8(k, K_SCALE), K_SCALE, torch.float32) for k in self.keys]
        self.values = [from_fp8(to_fp8(v, V_SCALE), V_SCALE, torch.float32) for v in self.values]

    def backend(self, spec, kernels: bool, dtype=torch.float32):
        backend = TorchAttentionBackend([self.kv.clone()], self.heads, self.kv_heads, self.head_dim, specs=[spec],
                                        dtype=dtype)
        assert (backend.kernels is not None) == (cpu_kernels() is not None)
        if not kernels:
            backend.kernels = None
        return backend


def _tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)


def _values() -> torch.Tensor:
    """Every kind of value an E4M3 write meets, [N, 1, 64]: spread magnitudes, each representable value, the
    midpoints between neighbours (ties to even), signed zero, the saturation edge and beyond."""
    g = torch.Generator().manual_seed(0)
    spread = torch.cat([torch.randn(4096, generator=g) * s for s in (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 300.0)])
    exact = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    exact = exact[exact.isfinite()].unique()
    mids = (exact[1:] + exact[:-1]) / 2
    edges = torch.tensor([0.0, -0.0, 448.0, 449.0, 463.9, 464.0, 470.0, 1e30, -1e30, float("inf"), float("-inf")])
    values = torch.cat([spread, exact, mids, -mids, edges])
    values = torch.cat([values, values.new_zeros(-values.numel() % 64)])
    return values.view(-1, 1, 64)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, K_SCALE, V_SCALE])
def test_kernel_fp8_writes_are_torchs_bytes(dtype, scale):
    values = _values().to(dtype)
    tokens = values.shape[0]
    got = torch.zeros(tokens + 1, 2, 1, 1, 64, dtype=FP8)
    want = got.clone()
    slots = torch.arange(1, tokens + 1)
    cpu_kernels().write_kv(got, values, -values, slots, scale, 2 * scale)
    write_kv(want, values, -values, slots, scale, 2 * scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    stored = from_fp8(got[1:, 0].reshape(-1), scale, torch.float32)
    finite = values.reshape(-1).float()
    assert stored.isfinite().all() and stored.abs().max() <= 448 * scale * (1 + 1e-6)  # saturated, not NaN or inf
    ordinary = finite.abs() < 400 * scale
    assert torch.equal(stored[finite == 0], finite[finite == 0])
    error = (stored - finite)[ordinary].abs() / finite[ordinary].abs().clamp(min=2**-6 * scale)
    assert error.max() <= 2**-4  # half a unit in the last of E4M3's 3 mantissa bits (subnormals: absolute)


def _decode_case(spec_name, heads, kv_heads, head_dim, dtype):
    rows = Fp8Rows([1, 7, 8, 9, 30, 17], heads, kv_heads, head_dim, seed=3)
    spec = _specs(spec_name, heads)
    q = torch.randn(6, heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    raw = Rows([1, 7, 8, 9, 30, 17], heads, kv_heads, head_dim, torch.float32, seed=3)  # the step's own K/V, raw
    k = torch.stack([keys[-1] for keys in raw.keys]).to(dtype)
    v = torch.stack([values[-1] for values in raw.values]).to(dtype)
    rows.keys = [torch.cat([a[:-1], from_fp8(to_fp8(k[b : b + 1], K_SCALE), K_SCALE, torch.float32)])
                 for b, a in enumerate(rows.keys)]  # what the step's write stores
    rows.values = [torch.cat([a[:-1], from_fp8(to_fp8(v[b : b + 1], V_SCALE), V_SCALE, torch.float32)])
                   for b, a in enumerate(rows.values)]
    want = torch.stack([oracle(q[b : b + 1], rows.keys[b], rows.values[b], [n - 1], spec, heads // kv_heads)[0]
                        for b, n in enumerate(rows.lengths)])
    return rows, spec, q, k, v, want


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "reference"])
@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", [(9, 3, 64, torch.float32), (8, 2, 128, torch.float32),
                                                              (6, 3, 40, torch.float32), (8, 2, 64, torch.bfloat16)])
def test_decode_over_an_fp8_cache_is_the_oracle_on_its_values(kernels, spec_name, heads, kv_heads, head_dim, dtype):
    rows, spec, q, k, v, want = _decode_case(spec_name, heads, kv_heads, head_dim, dtype)
    backend = rows.backend(spec, kernels, dtype)
    for ragged in ((False,) if kernels else (False, True)):
        got = backend.decode(0, q, k, v, rows.decode_meta(ragged=ragged))
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **_tol(dtype))
    slots = rows.decode_meta().slot_mapping
    stored = backend.kv_caches[0][slots // PAGE, :, slots % PAGE]
    assert torch.equal(stored[:, 0].view(torch.uint8), to_fp8(k, K_SCALE).view(torch.uint8))  # written first
    assert torch.equal(stored[:, 1].view(torch.uint8), to_fp8(v, V_SCALE).view(torch.uint8))


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "reference"])
@pytest.mark.parametrize("spec_name", ["default", "all"])
@pytest.mark.parametrize("queries", [2, 4])
def test_verify_over_an_fp8_cache(kernels, spec_name, queries):
    heads, kv_heads, head_dim = 9, 3, 64
    rows = Fp8Rows([6, 20, 33], heads, kv_heads, head_dim, seed=5)
    spec = _specs(spec_name, heads)
    q, k, v, meta, positions = verify_inputs(rows, queries)  # k, v: FP8 values already, written back unchanged
    got = rows.backend(spec, kernels).verify(0, q, k, v, meta).view(3, queries, heads, head_dim)
    for b in range(3):
        want = oracle(q.view(3, queries, heads, head_dim)[b], rows.keys[b], rows.values[b], positions[b].tolist(),
                      spec, heads // kv_heads)
        torch.testing.assert_close(got[b].double(), want, **_tol(torch.float32))


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("spec_name", ["default", "window", "sinks", "soft_cap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_after_cached_tokens_reads_the_fp8_cache(kernels, spec_name, dtype):
    """Chunks after cached tokens (a prefix hit, a later chunk) attend the FP8 cache, their own K/V written first;
    the CPU prefill kernel (soft-cap: the paged kernel) reads fresh chunks from the cache too."""
    heads, kv_heads, head_dim = 9, 3, 64
    cached, new = ([0, 13, 40] if kernels else [13, 40]), ([21, 10, 3] if kernels else [10, 3])
    totals = [c + n for c, n in zip(cached, new)]
    rows = Fp8Rows(totals, heads, kv_heads, head_dim, seed=7)
    spec = _specs(spec_name, heads)
    q = torch.randn(sum(new), heads, head_dim, generator=torch.Generator().manual_seed(8)).to(dtype)
    k = torch.cat([keys[c:] for keys, c in zip(rows.keys, cached)]).to(dtype)
    v = torch.cat([values[c:] for values, c in zip(rows.values, cached)]).to(dtype)
    cu = torch.tensor([0] + new).cumsum(0).int()
    slots = torch.cat([rows.slots(b, torch.arange(c, t)) for b, (c, t) in enumerate(zip(cached, totals))])
    meta = PrefillMetadata(cu_query_lens=cu, seq_lens=torch.tensor(totals, dtype=torch.int32),
                           block_table=rows.block_table, slot_mapping=slots, query_lens_host=new,
                           seq_lens_host=totals, block_table_host=rows.block_table)
    got = rows.backend(spec, kernels, dtype).prefill(0, q, k, v, meta)
    keys = [torch.cat([a[:c], from_fp8(to_fp8(k[cu[b] : cu[b + 1]], K_SCALE), K_SCALE, torch.float32)])
            for b, (a, c) in enumerate(zip(rows.keys, cached))]
    values = [torch.cat([a[:c], from_fp8(to_fp8(v[cu[b] : cu[b + 1]], V_SCALE), V_SCALE, torch.float32)])
              for b, (a, c) in enumerate(zip(rows.values, cached))]
    want = torch.cat([oracle(q[cu[b] : cu[b + 1]], keys[b], values[b], list(range(c, totals[b])), spec,
                             heads // kv_heads) for b, c in enumerate(cached)])
    torch.testing.assert_close(got.double(), want, **_tol(dtype))


@needs_kernels
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.02)], ids=["unscaled", "calibrated"])
def test_attention_over_fp8_stays_close_to_the_float_cache(scales):
    """The same keys and values in a float cache and in an FP8 one (unit scales, and scales that put the values'
    peak near E4M3's 448 as calibration does): decode outputs within a few percent (relative norm)."""
    from dataclasses import replace

    heads, kv_heads, head_dim = 8, 2, 64
    rows = Rows([5, 40, 130, 257], heads, kv_heads, head_dim, torch.float32, seed=9)
    spec = replace(AttentionSpec(), k_scale=scales[0], v_scale=scales[1])
    q = torch.randn(4, heads, head_dim, generator=torch.Generator().manual_seed(10))
    k = torch.stack([keys[-1] for keys in rows.keys])
    v = torch.stack([values[-1] for values in rows.values])
    exact = TorchAttentionBackend([rows.kv.clone()], heads, kv_heads, head_dim, specs=[spec])
    kv8 = torch.stack([to_fp8(rows.kv[:, 0], scales[0]), to_fp8(rows.kv[:, 1], scales[1])], dim=1)
    fp8 = TorchAttentionBackend([kv8], heads, kv_heads, head_dim, specs=[spec], dtype=torch.float32)
    want = exact.decode(0, q, k, v, rows.decode_meta())
    got = fp8.decode(0, q, k, v, rows.decode_meta())
    error = (got - want).norm() / want.norm()  # E4M3 keeps 3 mantissa bits: 2-3% per element, rms
    assert 0 < error < 0.06, float(error)


@needs_kernels
def test_kernels_refuse_an_fp8_cache_with_float16_queries():
    rows = Fp8Rows([5, 9], 4, 2, 32)
    q = torch.randn(2, 1, 4, 32).half()
    with pytest.raises(ValueError, match="rejected"):
        cpu_kernels().paged_attention(torch.empty_like(q), q, rows.kv, rows.block_table,
                                      seq_lens=torch.tensor([5, 9], dtype=torch.int32), scale=0.2)
    backend = TorchAttentionBackend([rows.kv], 4, 2, 32, dtype=torch.float16)
    assert backend.kernels is None  # the gathering reference runs float16 over FP8 instead


# ------------------------------------------------------------------------------------------- FlashInfer
@pytest.fixture
def flashinfer_kernels(monkeypatch):
    pytest.importorskip("flashinfer")
    from tests.device.test_flashinfer_dryrun import kernels as fixture

    return fixture.__wrapped__(monkeypatch)


def test_flashinfer_plans_the_fp8_cache_and_passes_each_layers_scales(flashinfer_kernels, monkeypatch):
    import flashinfer

    from graphdecode.attention import flashinfer_backend, flashinfer_probe
    from tests.device.test_flashinfer_dryrun import _state

    monkeypatch.setattr(flashinfer_probe, "variant_unavailable_reason", lambda *a: None)  # the module "exists"
    modules = []  # the (backend, q, kv, o dtypes, ...) each wrapper asks its kernel module for
    for module in (flashinfer.decode, flashinfer.prefill):
        monkeypatch.setattr(module, "get_batch_prefill_module",
                            lambda *a, **k: modules.append(a) or flashinfer_kernels)
    heads, kv_heads, head_dim = 4, 2, 16
    g = torch.Generator().manual_seed(0)
    cache = to_fp8(torch.randn(64, 2, PAGE // 2, kv_heads, head_dim, generator=g), 1.0)
    specs = [AttentionSpec(k_scale=K_SCALE, v_scale=V_SCALE)]
    backend = flashinfer_backend.FlashInferBackend([cache.clone()], heads, kv_heads, head_dim, device="cpu",
                                                   specs=specs, dtype=torch.bfloat16)
    reference = TorchAttentionBackend([cache.clone()], heads, kv_heads, head_dim, specs=specs, dtype=torch.bfloat16)
    reference.kernels = None
    assert backend.layer_variant == [0] and backend.kv_dtype == FP8
    state = _state({0: 3, 1: 9, 2: 17})
    meta = state.decode_metadata(4, state.max_pages)
    backend.plan_decode(4, meta)
    assert len(flashinfer_kernels.plans) == 1 and modules and all(m[1:4] == (torch.bfloat16, FP8, torch.bfloat16)
                                                                  for m in modules)
    state.advance(4, state.input_ids[:4], PAGE // 2, advance=False)
    meta = state.decode_metadata(4, state.max_pages)
    q = torch.randn(4, heads, head_dim, generator=g).bfloat16()
    k = torch.randn(4, kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(4, kv_heads, head_dim, generator=g).bfloat16()
    got = backend.decode(0, q, k, v, meta)
    want = reference.decode(0, q, k, v, meta)
    live = ~state.done[:4]
    torch.testing.assert_close(got[live].float(), want[live].float(), rtol=3e-2, atol=3e-2)
    assert torch.equal(backend.kv_caches[0].view(torch.uint8), reference.kv_caches[0].view(torch.uint8))


def test_flashinfer_without_the_fp8_module_runs_the_reference(flashinfer_kernels, monkeypatch, caplog):
    from graphdecode.attention import flashinfer_backend, flashinfer_probe

    flashinfer_probe.variant_unavailable_reason.cache_clear()
    monkeypatch.setattr(flashinfer_probe, "_module_present", lambda name: False)
    monkeypatch.setattr(flashinfer_probe, "_can_compile", lambda: "nvcc is not available to compile it")
    cache = torch.zeros(8, 2, 4, 2, 16, dtype=FP8)
    try:
        with caplog.at_level(logging.WARNING, logger="graphdecode"):
            backend = flashinfer_backend.FlashInferBackend([cache], 4, 2, 16, device="cpu", dtype=torch.bfloat16)
    finally:
        flashinfer_probe.variant_unavailable_reason.cache_clear()
    assert backend.layer_variant == [None] and backend.reference is not None
    assert backend.reference.dtype == torch.bfloat16 and backend.reference.kv_dtype == FP8
    assert "FP8-KV" in caplog.text and "e4m3" in caplog.text
