"""The model families of 2026 (issue 21): Qwen3, Phi-3 / Phi-4-mini (fused checkpoints, partial rotary,
longrope), Mistral and Qwen3 with sliding windows, Gemma 3 text. Each gives transformers' greedy
tokens exactly across buckets, k, page sizes, chunked prefill, prefix-cache hits and speculative
decoding; TP=2 gives TP=1's tokens on a fused Phi-3 checkpoint; the FlashInfer backend plans
windows per layer (CPU dry run) and runs the layers it has no kernel for with the torch reference."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.attention import PrefillMetadata, TorchAttentionBackend
from graphdecode.attention.kv_cache import allocate_kv_caches
from graphdecode.attention.spec import AttentionSpec
from graphdecode.device.decode_state import DecodeState
from graphdecode.device.speculative import verify_metadata
from graphdecode.models.model_config import FULL, SLIDING, load_model_config, parse_model_config
from graphdecode.models.registry import FAMILIES as REGISTERED
from graphdecode.models.registry import MODEL_CLASSES
from tests.helpers import SMALL_ENGINE, generate_tokens, hf_greedy, random_prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
# windows are 16-40 tokens; phi3_longrope's original length is 64: prompts of 50 and 60 cross it while
# decoding, 100 and 150 are prefilled past it, 3 and 17 stay below
LENGTHS = [3, 17, 50, 60, 100, 150]
FAMILIES = ["qwen3_untied", "qwen3_tied_swa", "mistral_swa", "phi3_partial_swa", "phi3_longrope", "gemma3_text",
            "mixtral", "qwen3_moe", "gpt_oss"]  # the last three: mixtures of experts (issue 23, test_moe.py)
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _prompts(seed: int) -> list[list[int]]:
    prompts = random_prompts(6, LENGTHS, seed=seed)
    return prompts + [prompts[4][:53] + prompts[1]]  # shares 53 tokens with a longer prompt: a partial hit


@pytest.mark.parametrize("model", FAMILIES)
def test_greedy_parity_with_transformers(tiny_models, model):
    path = tiny_models[model]
    prompts = _prompts(seed=21)
    expected = hf_greedy(path, prompts, MAX_NEW)
    buckets = set()

    llm = LLM(path, num_decode_steps=1, page_size=16, max_model_len=256, max_batch_size=8)
    assert generate_tokens(llm, prompts, GREEDY) == expected
    buckets |= set(llm.stats()["windows_per_bucket"])

    # chunked prefill (32 tokens a step, windows attend across chunk boundaries), k=4, page 32, 4 rows;
    # then the same prompts again: every prompt hits the pages the first pass cached
    llm = LLM(path, num_decode_steps=4, page_size=32, max_model_len=256, max_batch_size=4,
              max_num_batched_tokens=32)
    assert generate_tokens(llm, prompts, GREEDY) == expected
    hits = llm.stats()["prefix_cache_hits"]
    assert generate_tokens(llm, prompts, GREEDY) == expected
    assert llm.stats()["prefix_cache_hits"] > hits
    buckets |= set(llm.stats()["windows_per_bucket"])

    # speculative decoding: the verify forward (d + 1 queries per row) honours the windows too
    llm = LLM(path, num_decode_steps=4, page_size=16, max_model_len=256, max_batch_size=8, speculative_config=SPEC)
    assert generate_tokens(llm, prompts, GREEDY) == expected
    assert llm.stats()["spec_windows"] > 0
    assert len(buckets) >= 3, buckets


@pytest.mark.parametrize("model", FAMILIES)
def test_seeded_sampling_does_not_depend_on_batch_company(tiny_models, model):
    prompts = _prompts(seed=5)[:4]
    llm = LLM(tiny_models[model], num_decode_steps=4, page_size=16, max_model_len=256, max_batch_size=8)
    params = SamplingParams(temperature=1.0, seed=17, max_tokens=12, ignore_eos=True)
    alone = [generate_tokens(llm, [p], params)[0] for p in prompts]
    assert generate_tokens(llm, prompts, params) == alone
    assert generate_tokens(llm, prompts[::-1], params) == alone[::-1]


@pytest.mark.parametrize("model", ["mistral_swa", "gemma3_text"])
def test_windows_on_the_gathering_reference(tiny_models, model):
    """The torch reference a CUDA torch backend (or a CPU without a compiler) runs: decode and verify
    gather only the pages a window can reach, padded and ragged, and still give transformers' tokens."""
    path = tiny_models[model]
    prompts = _prompts(seed=4)
    expected = hf_greedy(path, prompts, MAX_NEW)
    for extra in ({"page_size": 16}, {"page_size": 32, "speculative_config": SPEC}):
        llm = LLM(path, **SMALL_ENGINE, **extra)
        llm.engine.runner.backend.kernels = None  # as cpu_kernels() leaves it where nothing can build the kernel
        assert generate_tokens(llm, prompts, GREEDY) == expected


def test_configs_read_as_transformers_does(tiny_models):
    qwen = load_model_config(tiny_models["qwen3_tied_swa"])
    assert qwen.qk_norm and qwen.tie_word_embeddings and qwen.head_dim == 16
    assert [qwen.layer_window(i) for i in range(2)] == [None, 24]  # max_window_layers=1
    assert load_model_config(tiny_models["qwen3_untied"]).layer_window(1) is None
    base = dict(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2)
    assert parse_model_config(dict(base, sliding_window=4, use_sliding_window=False)).sliding_window is None
    assert parse_model_config(base).head_dim == 128  # Qwen3Config's default head_dim
    explicit = parse_model_config(dict(base, sliding_window=4, use_sliding_window=True,
                                       layer_types=[SLIDING, FULL]))
    assert [explicit.layer_window(i) for i in range(2)] == [4, None]

    phi = load_model_config(tiny_models["phi3_longrope"])
    assert phi.rope.rope_type == "longrope" and phi.rope.rotary_dim(phi.head_dim) == 12
    assert phi.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(1024 / 64) / math.log(64)))
    assert phi.num_hidden_layers == 2 and phi.num_layers == 4  # the long stream's KV-cache layers
    assert load_model_config(tiny_models["phi3_partial_swa"]).num_layers == 2

    gemma = load_model_config(tiny_models["gemma3_text"])
    assert gemma.layer_types == (SLIDING, FULL, SLIDING) and gemma.local_rope.theta == 10_000.0
    assert gemma.rope.theta == 1_000_000.0 and gemma.attn_scale == 24**-0.5 and gemma.hidden_act == "gelu_pytorch_tanh"

    # the Hub's 4.x layouts: Phi-4-mini (rope_scaling "type", top-level partial_rotary_factor) and Gemma 3
    phi4 = parse_model_config(dict(base, model_type="phi3", hidden_size=48, num_attention_heads=2,
                                   partial_rotary_factor=0.75, max_position_embeddings=131072,
                                   original_max_position_embeddings=4096, rope_theta=10000.0, sliding_window=262144,
                                   rope_scaling={"type": "longrope", "short_factor": [1.0] * 9,
                                                 "long_factor": [2.0] * 9}))
    assert phi4.rope.rotary_dim(24) == 18 and phi4.rope.long_factor == (2.0,) * 9 and phi4.long_rope_streams
    assert phi4.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    gemma_hub = parse_model_config(dict(base, model_type="gemma3_text", num_hidden_layers=12, head_dim=4,
                                        rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=512,
                                        sliding_window_pattern=6, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert [gemma_hub.layer_window(i) for i in (4, 5, 6, 11)] == [512, None, 512, None]
    assert gemma_hub.rope.rope_type == "linear" and gemma_hub.local_rope.rope_type == "default"
    assert gemma_hub.tie_word_embeddings and gemma_hub.attn_scale == 256**-0.5


def test_each_family_file_declares_its_config():
    """Every family file's Family is registered, in the registry's order (the order the error lists),
    and names the model class that runs it."""
    types = ", ".join(family.model_type for family in REGISTERED)
    assert types == ("llama, mistral, qwen2, qwen3, phi3, gemma3_text, mixtral, qwen3_moe, gpt_oss, glm4_moe, "
                     "deepseek_v3, qwen3_5_text, qwen3_5, qwen3_5_moe_text, qwen3_5_moe, qwen3_next, nemotron_h, "
                     "granitemoehybrid")
    with pytest.raises(ValueError, match=rf"^config.json: model_type: 'gpt2' is not supported \(supported: {types}\)$"):
        parse_model_config({"model_type": "gpt2"})
    assert all(MODEL_CLASSES[family.model_type] is family.model_class is not None for family in REGISTERED)


def test_longrope_within_the_original_length_runs_one_stream(tiny_models):
    """max_model_len <= original_max_position_embeddings: no sequence can cross, so only the short
    factors run (the long stream's cache layers stay idle) and the tokens are still transformers'."""
    path = tiny_models["phi3_longrope"]
    prompts = random_prompts(4, [3, 12, 30, 39], seed=5)
    expected = hf_greedy(path, prompts, MAX_NEW)  # every prompt + output within 64 positions
    llm = LLM(path, num_decode_steps=4, page_size=16, max_model_len=64, max_batch_size=4)
    assert not llm.engine.runner.model.two_streams
    assert generate_tokens(llm, prompts, GREEDY) == expected
    llm = LLM(path, num_decode_steps=4, page_size=16, max_model_len=128, max_batch_size=4)
    assert llm.engine.runner.model.two_streams and len(llm.engine.runner.kv_caches) == 4


def test_longrope_streams_in_a_compiled_window(tiny_models):
    """torch.compile (what CUDA graphs capture) traces the two stacked streams in one graph."""
    path = tiny_models["phi3_longrope"]
    prompts = random_prompts(3, [50, 100, 5], seed=6)
    llm = LLM(path, num_decode_steps=4, page_size=16, max_model_len=256, max_batch_size=4, buckets=[4],
              compile=True)  # one bucket: one compile
    assert generate_tokens(llm, prompts, GREEDY) == hf_greedy(path, prompts, MAX_NEW)


def test_tp2_splits_fused_phi3_tensors_like_tp1(tiny_models):
    """Phi-3's fused qkv_proj / gate_up_proj split across two ranks (2 query and 1 KV head each),
    with both longrope streams: TP=2 gives TP=1's (and transformers') tokens."""
    path = tiny_models["phi3_longrope"]
    prompts = random_prompts(4, [17, 50, 100, 5], seed=8)
    engine = dict(num_decode_steps=4, max_model_len=256, max_batch_size=4)
    single = generate_tokens(LLM(path, **engine), prompts, GREEDY)
    assert single == hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, tensor_parallel_size=2, **engine) as tp2:
        assert generate_tokens(tp2, prompts, GREEDY) == single


# ------------------------------------------------------------- FlashInfer windows, dry run on CPU
H, H_KV, D, P, NUM_PAGES = 4, 2, 16, 4, 80
SPECS = [AttentionSpec(sliding_window=5), AttentionSpec()]  # a local layer, a global layer


def windowed_csr_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, causal, scale,
                           window_left, soft_cap):
    """What a FlashInfer kernel computes from its CSR buffers, with window_left and soft-cap;
    queries aligned to the end of their KV (one loop per sequence, float32). Also the softmax's
    log-sum-exp [T, H] in FlashInfer's base 2."""
    page_size, heads_kv, dim = k_cache.shape[1:]
    groups = q.shape[1] // heads_kv
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32)
    qo, kv, idx, last = (t.cpu().long() for t in (qo_indptr, kv_indptr, kv_indices, last_page_len))
    for g in range(qo.numel() - 1):
        rows = q[qo[g]:qo[g + 1]].float()
        pages = idx[kv[g]:kv[g + 1]]
        kv_len = int((pages.numel() - 1) * page_size + last[g])
        keys = k_cache[pages].float().reshape(-1, heads_kv, dim)[:kv_len].repeat_interleave(groups, dim=1)
        values = v_cache[pages].float().reshape(-1, heads_kv, dim)[:kv_len].repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(kv_len - rows.shape[0], kv_len)[None, :, None]
        k_pos = torch.arange(kv_len)[None, None, :]
        hidden = (k_pos > q_pos) if causal else torch.zeros_like(k_pos > q_pos)
        if window_left >= 0:
            hidden = hidden | (k_pos < q_pos - window_left)
        scores = scores.masked_fill(hidden, -math.inf)
        out[qo[g]:qo[g + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values)
        lse[qo[g]:qo[g + 1]] = (torch.logsumexp(scores, -1) / math.log(2)).transpose(0, 1)
    return out, lse


class FakeKernels:
    """Stands in for the compiled module get_batch_prefill_module returns; records plans and runs."""

    def __init__(self, causal: int):
        self.plans, self.runs = [], []
        self.causal = causal  # flashinfer's MaskMode.CAUSAL

    def plan(self, *args):
        self.plans.append(args)
        return [len(self.plans)]

    def paged_run(self, *args):
        (_, _, _, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, out, lse, mask_mode, _,
         window_left, _, *rest) = args
        soft_cap, scale = rest[6], rest[7]
        self.runs.append(dict(window_left=window_left, soft_cap=soft_cap, kv_indptr=kv_indptr, lse=lse is not None))
        o, log2_sum = windowed_csr_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len,
                                             mask_mode == self.causal, scale, window_left, soft_cap)
        out.copy_(o.to(out.dtype))
        if lse is not None:
            lse.copy_(log2_sum)


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def kernels(monkeypatch):
    flashinfer = pytest.importorskip("flashinfer")  # not a dependency; the GPU tests run the real kernels
    fake = FakeKernels(flashinfer.utils.MaskMode.CAUSAL.value)
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


def _caches(seed=0, layers=len(SPECS)):
    caches = allocate_kv_caches(layers, NUM_PAGES, P, H_KV, D, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.normal_(generator=g)
    return caches


def _state(lengths: dict[int, int], max_pages=8):
    state = DecodeState(8, max_pages, 2, 4, 2, "cpu")
    g = torch.Generator().manual_seed(1)
    state.block_table.copy_(torch.randperm(NUM_PAGES - 1, generator=g)[: 8 * max_pages].add(1).int().view(8, -1))
    for row, length in lengths.items():
        state.seq_lens[row], state.positions[row], state.done[row] = length, length - 1, False
        state.max_len[row] = max_pages * P
    return state


def _backends(monkeypatch, available: bool, specs=SPECS):
    from graphdecode.attention import flashinfer_probe
    from graphdecode.attention.flashinfer_backend import FlashInferBackend

    monkeypatch.setattr(flashinfer_probe, "variant_unavailable_reason",
                        lambda head_dim, dtype, window, soft_cap, kv_dtype=None: None if available or not window
                        else "no module")
    fi_caches, ref_caches = _caches(layers=len(specs)), _caches(layers=len(specs))
    return (FlashInferBackend(fi_caches, H, H_KV, D, device="cpu", specs=specs),
            TorchAttentionBackend(ref_caches, H, H_KV, D, specs=specs), fi_caches, ref_caches)


def _close(got, want, rows=slice(None)):
    torch.testing.assert_close(got[rows].float(), want[rows].float(), rtol=2e-2, atol=2e-2)


def _prefill_meta():
    query_lens = [9, 1, 14]
    table = torch.tensor([[3, 9, 5, 0], [4, 0, 0, 0], [11, 2, 7, 8]], dtype=torch.int32)
    slots = torch.cat([table[g, torch.arange(n) // P].long() * P + torch.arange(n) % P
                       for g, n in enumerate(query_lens)])
    return PrefillMetadata(
        cu_query_lens=torch.tensor([0, 9, 10, 24], dtype=torch.int32), seq_lens=torch.tensor(query_lens),
        block_table=table, slot_mapping=slots, query_lens_host=query_lens, seq_lens_host=query_lens,
        block_table_host=table,
    )


def _run_all_paths(backend, reference, fi_caches, ref_caches):
    """Prefill, 10 decode steps and a verify through both layers; FlashInfer against the torch reference."""
    meta = _prefill_meta()
    backend.plan_prefill(meta)
    q, k, v = torch.randn(24, H, D).bfloat16(), torch.randn(24, H_KV, D).bfloat16(), torch.randn(24, H_KV, D).bfloat16()
    for layer in range(len(backend.specs)):
        _close(backend.prefill(layer, q, k, v, meta), reference.prefill(layer, q, k, v, meta))
    bucket = 4
    state = _state({0: 2, 1: 7, 2: 13})  # row 3 is padding
    backend.plan_decode(bucket, state.decode_metadata(bucket, state.max_pages))
    state.advance(bucket, state.input_ids[:bucket], P, advance=False)
    live = ~state.done[:bucket]
    for step in range(10):  # lengths grow past the window and past page boundaries
        meta = state.decode_metadata(bucket, state.max_pages)
        q = torch.randn(bucket, H, D).bfloat16()
        k, v = torch.randn(bucket, H_KV, D).bfloat16(), torch.randn(bucket, H_KV, D).bfloat16()
        for layer in range(len(backend.specs)):
            _close(backend.decode(layer, q, k, v, meta), reference.decode(layer, q, k, v, meta), live)
        state.advance(bucket, torch.full((bucket,), step, dtype=torch.int64), P, advance=True)
    queries = 3
    backend.plan_verify(bucket, queries, state.max_rows, state.verify_pages)
    meta = verify_metadata(state, bucket, queries, P, state.max_pages, live)
    backend.prepare_verify(bucket, meta, state, P)
    q = torch.randn(bucket * queries, H, D).bfloat16()
    k, v = torch.randn(bucket * queries, H_KV, D).bfloat16(), torch.randn(bucket * queries, H_KV, D).bfloat16()
    for layer in range(len(backend.specs)):
        got = backend.verify(layer, q, k, v, meta).view(bucket, queries, H, D)
        _close(got, reference.verify(layer, q, k, v, meta).view(bucket, queries, H, D), live)
    for layer in range(len(backend.specs)):
        assert torch.equal(fi_caches[layer][1:], ref_caches[layer][1:])  # K/V written by slot alike


def test_flashinfer_plans_a_window_per_layer_variant(kernels, monkeypatch):
    """Layers with and without a window get their own plans (window_left 4 and -1) in prefill, decode
    and verify; both give the torch reference's attention."""
    backend, reference, fi_caches, ref_caches = _backends(monkeypatch, available=True)
    assert backend.variants == [(4, 0.0, None), (-1, 0.0, None)] and backend.layer_variant == [0, 1]
    assert backend.reference is None
    _run_all_paths(backend, reference, fi_caches, ref_caches)
    assert {run["window_left"] for run in kernels.runs} == {4, -1}
    assert backend._decode_by_variant[4, 0]._window_left == 4 and backend._decode_by_variant[4, 1]._window_left == -1
    assert backend._verify_by_variant[4, 0]._window_left == 4
    assert len(kernels.plans) == 2 + 2 + 2  # one prefill, one decode and one verify plan per variant


def test_flashinfer_without_the_window_kernel_runs_those_layers_with_the_reference(kernels, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="graphdecode"):
        backend, reference, fi_caches, ref_caches = _backends(monkeypatch, available=False)
    lines = [r.getMessage() for r in caplog.records if "sliding-window" in r.getMessage()]
    assert len(lines) == 1 and "layers [0]" in lines[0] and "no module" in lines[0]
    assert backend.layer_variant == [None, 0] and backend.reference is not None
    _run_all_paths(backend, reference, fi_caches, ref_caches)
    assert {run["window_left"] for run in kernels.runs} == {-1}  # FlashInfer ran only the global layer


def test_flashinfer_runs_sink_layers_through_the_softmax_lse(kernels, monkeypatch):
    """gpt-oss's sinks on FlashInfer: a sink layer's run returns the base-2 LSE and its output is scaled
    by sigmoid(ln Z - sink); prefill, decode and verify give the torch backend's sink attention, and a
    layer without sinks asks for no LSE."""
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    specs = [AttentionSpec(sliding_window=5, sinks=sinks), AttentionSpec(sinks=-sinks), AttentionSpec()]
    backend, reference, fi_caches, ref_caches = _backends(monkeypatch, available=True, specs=specs)
    assert backend.sinks[0] is not None and backend.sinks[2] is None
    _run_all_paths(backend, reference, fi_caches, ref_caches)
    with_lse = {run["lse"] for run in kernels.runs if run["window_left"] == 4}
    assert with_lse == {True}  # the windowed layer has sinks
    assert {run["lse"] for run in kernels.runs} == {True, False}
