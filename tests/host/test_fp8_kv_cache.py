"""The engine with an FP8 KV cache (kv_cache_dtype="fp8"): the pool holds 4x float32's tokens in the same bytes,
greedy tokens equal the float cache's on a margin model, the checkpoint's per-layer scales are read (and written
by the calibration tool), the one-call decode layers, CUDA-graph windows (the CPU twin), the bounds-checked mode,
compiled windows, preemption, prefix hits and two tensor-parallel ranks all run it, and bad settings or
scales are refused by name."""

from __future__ import annotations

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.attention.kv_cache import FP8
from graphdecode.config import EngineConfig
from graphdecode.models.quant.kv_scales import calibrate_kv_scales, write_kv_scales
from tests.helpers import SMALL_ENGINE, copy_model, edit_tensors, rewrite_config
from tests.hf_parity_models import CPU_SMALL, build_model, random_prompts

ENGINE = dict(SMALL_ENGINE, max_model_len=128)


@pytest.fixture
def panels(monkeypatch):
    """The margin model counted as one that streams its weights: its projections take the panels, so its decode
    steps run as one call (csrc/cpu_layers.cpp) where the CPU kernels build."""
    from graphdecode.models import cpu_linear

    monkeypatch.setattr(cpu_linear, "STREAM_BYTES", 0)
    return cpu_linear.can_prepack(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def margin_model(tmp_path_factory):
    """A float32 Llama with planted greedy margins (tests/hf_parity_models.py): tokens robust to FP8's rounding."""
    return build_model(str(tmp_path_factory.mktemp("fp8kv") / "cpu_small"), CPU_SMALL, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([20, 9, 33, 50, 3, 41], CPU_SMALL.vocab_size, seed=9)


def _tokens(llm, prompts, max_tokens=24, **params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def float_tokens(margin_model, prompts):
    with LLM(margin_model, **ENGINE) as llm:
        return _tokens(llm, prompts)


@pytest.mark.parametrize("dtype, ratio", [("float32", 4), ("bfloat16", 2)])
def test_the_same_pool_bytes_hold_more_sequences(margin_model, dtype, ratio):
    """kv_cache_memory_bytes fixed: an FP8 pool has 4x float32's pages (2x bf16's), so 4x (2x) the sequences of
    max_model_len fit at once."""
    budget = 1 << 20
    auto = EngineConfig(margin_model, device="cpu", dtype=dtype, kv_cache_memory_bytes=budget, max_model_len=128)
    fp8 = EngineConfig(margin_model, device="cpu", dtype=dtype, kv_cache_memory_bytes=budget, max_model_len=128,
                       kv_cache_dtype="fp8")
    assert auto.kv_torch_dtype == auto.torch_dtype and fp8.kv_torch_dtype == FP8
    assert fp8.num_pages == ratio * auto.num_pages
    per_seq = auto.max_pages_per_seq
    assert (fp8.num_pages - 1) // per_seq >= ratio * ((auto.num_pages - 1) // per_seq)


def test_fp8_cache_gives_the_float_caches_tokens(margin_model, prompts, float_tokens, panels):
    with LLM(margin_model, kv_cache_dtype="fp8", **ENGINE) as llm:
        runner = llm.engine.runner
        assert all(c.dtype == FP8 and c.element_size() == 1 for c in runner.kv_caches)
        kernels = runner.backend.kernels is not None
        assert (runner.model.cpu_decode is not None) == (kernels and panels)
        assert _tokens(llm, prompts) == float_tokens


def test_one_call_decode_layers_read_fp8_like_the_eager_forward(margin_model, prompts, panels):
    """csrc/cpu_layers.cpp writes and attends the FP8 cache as the per-op path does: the same tokens, logprobs
    to float rounding (the K/V they round to FP8 may differ in a last bit where the two sum in other orders)."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    with LLM(margin_model, kv_cache_dtype="fp8", **ENGINE) as llm:
        if llm.engine.runner.model.cpu_decode is None:
            pytest.skip("no one-call decode layers here (no C++ compiler, or no oneDNN panels)")
        one_call = llm.generate(batch, params)
        llm.engine.runner.model.cpu_decode = None
        eager = llm.generate(batch, params)
    for a, b in zip(one_call, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[t].logprob - y[t].logprob) < 2e-3 for t in x)


@pytest.mark.parametrize("compile", [False, True])
def test_graph_twin_bounds_preemption_and_prefix_hits_on_fp8(margin_model, prompts, compile, panels):
    """Windows captured in the CPU twin of CUDA graphs, every index bounds-checked, a pool so tight that rows are
    preempted and recomputed, prompts repeated for prefix hits, and (compile=True) compiled windows: the tokens of
    the plain FP8 engine."""
    batch = prompts + prompts[:2]  # the repeats hit the prefix cache
    tight = dict(ENGINE, max_model_len=96, num_pages=12, page_size=16, kv_cache_dtype="fp8")
    with LLM(margin_model, **tight) as plain:
        want = _tokens(plain, batch)
    with LLM(margin_model, cuda_graphs=True, check_bounds=True, compile=compile, **tight,
             **(dict(buckets=[tight["max_batch_size"]]) if compile else {})) as llm:  # compiled: one bucket
        assert _tokens(llm, batch) == want
        stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["graphs_captured"] > 0 and stats["prefix_cache_hits"] > 0


def test_calibrated_checkpoint_scales_are_read_and_applied(margin_model, prompts, float_tokens, tmp_path):
    """calibrate_kv_scales / write_kv_scales write compressed-tensors' kv_cache_scheme and each layer's
    self_attn.k_scale / v_scale; the engine gives every layer its scales, and its FP8 tokens are the float
    cache's. With kv_cache_dtype "auto" the scales are read but the cache stays float32."""
    scales = calibrate_kv_scales(margin_model, prompts)
    assert len(scales) == CPU_SMALL.num_layers and all(0 < k < 1 and 0 < v < 1 for k, v in scales)
    assert len({k for k, _ in scales} | {v for _, v in scales}) == 2 * len(scales)  # each its own
    path = write_kv_scales(margin_model, str(tmp_path / "scaled"), scales)
    with LLM(path, kv_cache_dtype="fp8", **ENGINE) as llm:
        specs = llm.engine.runner.backend.specs
        assert [(s.k_scale, s.v_scale) for s in specs] == [(pytest.approx(k), pytest.approx(v)) for k, v in scales]
        cache = llm.engine.runner.kv_caches[0]
        assert _tokens(llm, prompts) == float_tokens
        peak = cache[1:, 0].float().abs().amax()
        assert 100 < peak <= 448  # the calibration's largest key lands near E4M3's largest value
    with LLM(path, **ENGINE) as llm:
        assert llm.engine.runner.kv_caches[0].dtype == torch.float32
        assert _tokens(llm, prompts) == float_tokens


def test_tp2_fp8_gives_the_tp1_fp8_tokens(margin_model, prompts):
    engine = dict(ENGINE, max_batch_size=4, kv_cache_dtype="fp8")
    with LLM(margin_model, **engine) as one, LLM(margin_model, tensor_parallel_size=2, **engine) as two:
        assert _tokens(two, prompts[:4], max_tokens=12) == _tokens(one, prompts[:4], max_tokens=12)


@pytest.mark.parametrize("value, message", [
    ("fp8_e5m2", "kv_cache_dtype 'fp8_e5m2' is not supported"),
    ("int8", "kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got 'int8'"),
    (None, "kv_cache_dtype must be"),
])
def test_bad_kv_cache_dtypes_are_refused_by_name(margin_model, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(margin_model, device="cpu", kv_cache_dtype=value)


def _scaled_copy(tiny_models, tmp_path, scale, scheme=None):
    path = copy_model(tiny_models, "llama_gqa_llama3", tmp_path)
    rewrite_config(path, lambda raw: raw.update(quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {},
        "kv_cache_scheme": scheme or {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}))
    edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.k_scale": scale,
                                           "model.layers.0.self_attn.v_scale": torch.tensor(1.0)}))
    return path


@pytest.mark.parametrize("scale, message", [
    (torch.ones(2), r"model.layers.0.self_attn.k_scale.*one floating-point number per layer"),
    (torch.tensor(0.0), r"model.layers.0.self_attn.k_scale.*is 0.0: a KV-cache scale must be finite and > 0"),
    (torch.tensor(float("nan")), r"model.layers.0.self_attn.k_scale.*is nan"),
    (torch.tensor(3, dtype=torch.int32), r"model.layers.0.self_attn.k_scale.*I32"),
])
def test_malformed_checkpoint_scales_name_the_tensor(tiny_models, tmp_path, scale, message):
    with pytest.raises(ValueError, match=message):
        LLM(_scaled_copy(tiny_models, tmp_path, scale), kv_cache_dtype="fp8", **ENGINE)


@pytest.mark.parametrize("scheme, message", [
    ({"num_bits": 8, "type": "float", "strategy": "attn_head"}, "kv_cache_scheme.strategy: 'attn_head'"),
    ({"num_bits": 8, "type": "int", "strategy": "tensor"}, "kv_cache_scheme: 8-bit 'int' KV caches"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}, "kv_cache_scheme.dynamic"),
])
def test_unsupported_kv_cache_schemes_are_refused_by_name(tiny_models, tmp_path, scheme, message):
    with pytest.raises(ValueError, match=message):
        LLM(_scaled_copy(tiny_models, tmp_path, torch.tensor(0.5), scheme), kv_cache_dtype="fp8", **ENGINE)
