"""A decode step's layers in one C++ call (models/cpu_decode.py, csrc/cpu_layers.cpp).

* an engine whose plain layers take it decodes transformers' greedy tokens (GQA with llama3 rope, qkv bias
  and a tied head, a sliding window), the same tokens as its eager forward, in fp32 and bf16, also with its
  windows captured and replayed by the CPU graph twin in the bounds-checked mode, and the call really ran;
* one decode forward through it equals the eager forward's logits and KV writes;
* inert rows (done, or a bucket's padding: the scratch slot) are left out of the call, the live rows' bits unchanged;
* a speculative verify (Q queries a sequence) runs through it as Q rows a sequence: the eager verify's logits and
  K/V, and in an engine (n-gram and a draft model) the plain tokens;
* an EAGLE-3 head's layer (q/k/v over the rows the head concatenates) runs through it too: its eager step's
  output and K/V;
* it is built only for the layers it runs (not for qk-norm, Gemma's norms, MoE, or weights without panels);
* a position past the rotary table or a slot outside the cache is refused before any work.
"""

from __future__ import annotations

import math

import pytest
import torch

from graphdecode.attention import DecodeMetadata, ForwardContext, TorchAttentionBackend
from graphdecode.attention.kv_cache import allocate_kv_caches
from graphdecode.attention.metadata import VerifyMetadata
from graphdecode.kernels import cpu as cpu_kernels_module
from graphdecode.models import cpu_linear
from graphdecode.models.loader import load_model
from graphdecode.models.model_config import load_model_config
from tests.helpers import generate_tokens, hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(cpu_kernels_module.cpu_kernels() is None or not cpu_linear.can_prepack(
    torch.device("cpu"), torch.float32), reason="no C++ compiler for the CPU kernels, or no oneDNN")
PAGE = 8


@pytest.fixture
def panels(monkeypatch):
    """The tiny models counted as models that stream their weights: their projections take the panels."""
    monkeypatch.setattr(cpu_linear, "STREAM_BYTES", 0)
    calls = []
    real = cpu_kernels_module.CpuKernels.decoder_layers
    monkeypatch.setattr(cpu_kernels_module.CpuKernels, "decoder_layers",
                        lambda self, *a, **kw: (calls.append(a[4].shape[0]), real(self, *a, **kw))[1])
    return calls


@pytest.mark.parametrize("name, dtype, twin", [("qwen2_tied", "float32", False), ("llama_gqa_llama3", "float32", False),
                                               ("mistral_swa", "float32", False), ("qwen2_tied", "bfloat16", False),
                                               ("qwen2_tied", "float32", True)])
def test_an_engine_decodes_through_one_call_per_step(tiny_models, panels, name, dtype, twin):
    """twin: the windows captured and replayed by the CUDA-graph owner's CPU twin, in the bounds-checked mode."""
    from graphdecode import LLM, SamplingParams

    extra = dict(cuda_graphs=True, check_bounds=True) if twin else {}
    llm = LLM(tiny_models[name], dtype=dtype, max_model_len=96, max_batch_size=4, **extra)
    model = llm.engine.runner.model
    assert model.cpu_decode is not None
    prompts = random_prompts(3, [5, 40, 3], seed=41)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = generate_tokens(llm, prompts, sp)
    assert panels and max(panels) <= 4  # every decode step (its bucket of up to 4 rows) ran the call
    assert llm.engine.config.buckets[-1] == 4 and 3 not in llm.engine.config.buckets
    assert max(panels) == 3  # ... over its live rows: the 4-row bucket's padding row left out
    assert not twin or llm.stats()["graphs_captured"] > 0
    layers, model.cpu_decode = model.cpu_decode, None
    try:
        assert generate_tokens(llm, prompts, sp) == got  # the eager forward's tokens
    finally:
        model.cpu_decode = layers
    if dtype == "float32":
        assert got == hf_greedy(tiny_models[name], prompts, 10)


def _random_cache(model, cfg, dtype, seed: int):
    """32 pages of random K/V in every layer, and the torch backend over them."""
    caches = allocate_kv_caches(cfg.num_layers, 32, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return caches, TorchAttentionBackend(caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                         specs=model.attention_specs)


def _decode_step(model, cfg, dtype, ids, seq_lens):
    caches, backend = _random_cache(model, cfg, dtype, 5)
    rows = len(ids)
    table = torch.arange(1, 1 + 4 * rows, dtype=torch.int32).view(rows, 4)
    positions = (seq_lens - 1).long()
    slots = table[torch.arange(rows), positions // PAGE].long() * PAGE + positions % PAGE
    meta = DecodeMetadata(seq_lens=seq_lens, block_table=table, slot_mapping=slots, kv_indptr=None, kv_indices=None,
                          kv_last_page_len=None)
    with torch.inference_mode():
        logits = model.decode_logits(ids, positions, ForwardContext(backend, decode=meta))
    return logits, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_equals_the_eager_forward(tiny_models, panels, dtype):
    path = tiny_models["qwen2_tied"]
    cfg = load_model_config(path)
    model = load_model(path, cfg, dtype, torch.device("cpu"), 256)
    assert model.cpu_decode.rows == math.inf  # batch-invariant (the default): the panels take every row count
    # batch_invariant=False: bf16's panels take 4 rows in the eager forward, 8 inside the one call (MIN_ROWS)
    variant = load_model(path, cfg, dtype, torch.device("cpu"), 256, batch_invariant=False)
    if dtype == torch.bfloat16 and not cpu_linear.onednn_packs(dtype):  # no oneDNN bf16 (AVX2): panels throughout
        assert variant.cpu_decode.rows == math.inf
    else:
        assert variant.cpu_decode.rows == (8 if dtype == torch.bfloat16 else cpu_linear.PANEL_ROWS[torch.float32])
    del variant
    ids, seq_lens = torch.tensor([5, 9, 100]), torch.tensor([5, 17, 30], dtype=torch.int32)
    fast, fast_caches = _decode_step(model, cfg, dtype, ids, seq_lens)
    assert panels == [3]
    layers, model.cpu_decode = model.cpu_decode, None
    eager, eager_caches = _decode_step(model, cfg, dtype, ids, seq_lens)
    model.cpu_decode = layers
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, eager, **tol)
    assert torch.equal(fast_caches[0], eager_caches[0])  # layer 0's K/V: the same kernels on the same inputs
    for f, e in zip(fast_caches, eager_caches):
        torch.testing.assert_close(f.float(), e.float(), **tol)


def test_inert_rows_are_left_out_of_the_call(tiny_models, panels):
    """A bucket of 4 rows whose rows 0 and 2 are inert (done or padding: the scratch slot, page 0): the call runs
    rows 1 and 3 alone, whose logits, K/V and hidden states are the bits the two give as a batch of their own;
    the inert rows come out as zeros (finite logits) and write nothing."""
    path = tiny_models["llama_gqa_llama3"]
    cfg = load_model_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 256)

    def step(ids, seq_lens, table, live):
        caches, backend = _random_cache(model, cfg, torch.float32, 5)
        table = table * live[:, None].int()
        positions = (seq_lens - 1).long()
        slots = table[torch.arange(len(ids)), positions // PAGE].long() * PAGE + positions % PAGE
        meta = DecodeMetadata(seq_lens=seq_lens, block_table=table, slot_mapping=slots * live, kv_indptr=None,
                              kv_indices=None, kv_last_page_len=None)
        with torch.inference_mode():
            out = model.forward_aux(ids, positions, ForwardContext(backend, decode=meta), (0, 1))
        return out, caches

    ids, seq_lens = torch.tensor([3, 5, 4, 9]), torch.tensor([1, 17, 1, 30], dtype=torch.int32)
    table = torch.arange(1, 17, dtype=torch.int32).view(4, 4)
    (logits, aux), caches = step(ids, seq_lens, table, torch.tensor([0, 1, 0, 1]))
    assert panels == [2]  # the live rows alone
    live = [1, 3]
    (alone, alone_aux), alone_caches = step(ids[live], seq_lens[live], table[live], torch.ones(2, dtype=torch.int64))
    assert panels == [2, 2]
    assert torch.equal(logits[live], alone) and torch.equal(aux[live], alone_aux)
    assert torch.count_nonzero(aux[[0, 2]]) == 0 and torch.isfinite(logits).all()
    for c, a in zip(caches, alone_caches):
        assert torch.equal(c, a)  # the same K/V written, nothing for the inert rows (not even the scratch page)
    panels.clear()
    step(ids, seq_lens, table, torch.zeros(4, dtype=torch.int64))  # every row inert: no call at all
    assert panels == []


def _verify_step(model, cfg, dtype, ids, starts, forward=None):
    """Q = ids.shape[1] queries a row from position starts[b], causal over the row's pages (K/V written first),
    through `forward` (default: the model's decode_logits)."""
    caches, backend = _random_cache(model, cfg, dtype, 6)
    rows, queries = ids.shape
    table = torch.arange(1, 1 + 4 * rows, dtype=torch.int32).view(rows, 4)
    positions = starts[:, None] + torch.arange(queries)
    slots = table.gather(1, positions // PAGE).long() * PAGE + positions % PAGE
    kv_lens = (starts + queries).to(torch.int32)
    meta = VerifyMetadata(block_table=table, query_positions=positions, slot_mapping=slots.reshape(-1),
                          live=torch.ones(rows, dtype=torch.bool), kv_lens=kv_lens, context_lens=kv_lens)
    with torch.inference_mode():
        logits = (forward or model.decode_logits)(ids.reshape(-1), positions.reshape(-1),
                                                  ForwardContext(backend, verify=meta))
    return logits, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_verify_equals_the_eager_verify(tiny_models, panels, dtype):
    """2 rows x 3 queries, one row crossing a page boundary: each query sees the K/V its row's earlier
    queries wrote in the same layer, as the eager verify's causal mask gives."""
    path = tiny_models["qwen2_tied"]
    cfg = load_model_config(path)
    model = load_model(path, cfg, dtype, torch.device("cpu"), 256)
    ids, starts = torch.tensor([[5, 9, 100], [7, 7, 300]]), torch.tensor([6, 22])
    fast, fast_caches = _verify_step(model, cfg, dtype, ids, starts)
    assert panels == [6]  # one call, 6 query rows
    layers, model.cpu_decode = model.cpu_decode, None
    eager, eager_caches = _verify_step(model, cfg, dtype, ids, starts)
    model.cpu_decode = layers
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, eager, **tol)
    for f, e in zip(fast_caches, eager_caches):
        torch.testing.assert_close(f.float(), e.float(), **tol)


def test_one_call_returns_the_hidden_states_an_eagle3_head_reads(tiny_models, panels):
    """forward_aux through the one call (its SAVE words copy each stop layer's input): the eager forward's
    hidden states entering each stop layer, and its final hidden states."""
    path = tiny_models["llama_gqa_llama3"]
    cfg = load_model_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 256)
    ids, starts = torch.tensor([[5, 9, 100], [7, 7, 300]]), torch.tensor([6, 22])
    results = []
    for layers in (model.cpu_decode, None):
        model.cpu_decode = layers
        out, _ = _verify_step(model, cfg, torch.float32, ids, starts,
                              forward=lambda tokens, positions, ctx: model.forward_aux(tokens, positions, ctx, (0, 1)))
        results.append(out)
        if layers is not None:
            assert panels == [6]  # one call, which copies each stop layer's input
    (fast, fast_aux), (eager, eager_aux) = results
    assert fast_aux.shape == (6, 2 * cfg.hidden_size)
    torch.testing.assert_close(fast_aux, eager_aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_windows_verify_through_one_call(tiny_models, panels, method):
    """Verify forwards (and a draft model's forwards) of up to the driver's rows take the one call; the
    tokens are the plain engine's."""
    from graphdecode import LLM, SamplingParams

    path = tiny_models["llama_gqa_llama3"]
    spec = {"method": "ngram", "num_speculative_tokens": 3} if method == "ngram" else \
        {"method": "draft_model", "model": tiny_models["qwen2_tied"], "num_speculative_tokens": 3}
    engine = dict(max_model_len=96, max_batch_size=2)
    llm = LLM(path, speculative_config=spec, **engine)
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
    prompts = [(b * 8)[:30] for b in random_prompts(2, [3, 5], seed=12)]  # repetitive: n-gram drafts exist
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = generate_tokens(llm, prompts, sp)
    if method == "draft_model":
        assert 2 * 4 in panels  # a verify of 2 rows x 4 queries ran as one call of 8 rows
    else:  # n-gram rows with fewer than 3 drafts leave their later queries out: one call of their live queries
        assert max(panels) > 2
    assert llm.stats()["spec_windows"] > 0
    assert got == generate_tokens(LLM(path, **engine), prompts, sp)


@pytest.mark.parametrize("queries", [1, 3])
def test_an_eagle3_heads_layer_in_one_call_equals_its_eager_step(text_model, panels, tmp_path, queries):
    """An EAGLE-3 head's layer through the one call, its q/k/v reading the rows the head concatenates ([normed
    embedding | normed hidden state], the IN words) and the hidden state its residual: the eager step's output
    and K/V, for a draft step (one query a row) and the forward over a verify's positions (three), with an inert
    row beside them (zeros out, nothing written)."""
    from graphdecode.models.eagle3 import load_eagle3_head, read_eagle3_config
    from graphdecode.models.eagle3_checkpoint import random_eagle3_head

    target = load_model_config(text_model)
    path = random_eagle3_head(str(tmp_path / "head"), text_model, draft_vocab_size=64, aux_layers=(0, 2, 3))
    head = load_eagle3_head(path, read_eagle3_config(path, target), torch.float32, torch.device("cpu"), 256)
    driver = head.cpu_decode
    assert driver is not None and driver.in_width == 2 * target.hidden_size and driver.num_layers == 1
    cfg = head.config
    g = torch.Generator().manual_seed(7)
    rows = 3
    embeds, hidden = (torch.randn(rows * queries, cfg.hidden_size, generator=g) for _ in range(2))
    live = torch.tensor([1, 0, 1]).repeat_interleave(queries)  # row 1 inert: the scratch slot
    starts = torch.tensor([5, 9, 22])

    def step():
        caches, backend = _random_cache(head, cfg, torch.float32, 3)
        table = torch.arange(1, 1 + 4 * rows, dtype=torch.int32).view(rows, 4)
        positions = starts[:, None] + torch.arange(queries)
        slots = (table.gather(1, positions // PAGE).long() * PAGE + positions % PAGE).reshape(-1) * live
        kv_lens = (starts + queries).to(torch.int32)
        if queries == 1:
            meta = DecodeMetadata(seq_lens=kv_lens, block_table=table, slot_mapping=slots, kv_indptr=None,
                                  kv_indices=None, kv_last_page_len=None)
            ctx = ForwardContext(backend, decode=meta)
        else:
            meta = VerifyMetadata(block_table=table, query_positions=positions, slot_mapping=slots,
                                  live=torch.tensor([True, False, True]), kv_lens=kv_lens, context_lens=kv_lens)
            ctx = ForwardContext(backend, verify=meta)
        with torch.inference_mode():
            return head(embeds, hidden, positions.reshape(-1), ctx), caches

    fast, fast_caches = step()
    assert panels == [2 * queries]  # one call, the live rows' queries
    head.cpu_decode = None
    eager, eager_caches = step()
    head.cpu_decode = driver
    kept = live.bool()
    torch.testing.assert_close(fast[kept], eager[kept], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(fast[~kept]) == 0
    torch.testing.assert_close(fast_caches[0][1:], eager_caches[0][1:], rtol=1e-5, atol=1e-5)  # page 0: scratch
    with pytest.raises(ValueError, match="pre"):
        driver.run(hidden, torch.zeros(hidden.shape[0], dtype=torch.int64), None)  # the head's rows are required


@pytest.mark.parametrize("name", ["qwen3_untied", "gemma3_text", "qwen3_moe"])
def test_only_plain_layers_get_the_one_call(tiny_models, panels, name):
    path = tiny_models[name]
    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"), 256)
    assert model.cpu_decode is None  # qk-norm, Gemma's offset norms, MoE: the eager forward


def test_without_panels_there_is_no_one_call(tiny_models):
    path = tiny_models["qwen2_tied"]  # batch_invariant=False, a 64-wide model fits in cache: column-major, no panels
    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"), 256, batch_invariant=False)
    assert model.cpu_decode is None


def test_bad_positions_and_slots_are_refused_before_any_work(tiny_models, panels):
    path = tiny_models["qwen2_tied"]
    cfg = load_model_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 256)
    layers = model.cpu_decode
    caches = allocate_kv_caches(cfg.num_layers, 8, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    layers.words[:, 7] = torch.tensor([c.data_ptr() for c in caches])
    x = torch.randn(1, cfg.hidden_size)
    before, kv_before = x.clone(), [c.clone() for c in caches]
    scratch = torch.empty(layers.kernels.layers_scratch(1, *layers.dims))
    table = torch.ones(1, 2, dtype=torch.int32)
    good = dict(positions=torch.tensor([3]), seq_lens=torch.tensor([4], dtype=torch.int32), slots=torch.tensor([11]))
    for bad in (dict(positions=torch.tensor([layers.rotary.cos.shape[0]])), dict(slots=torch.tensor([8 * PAGE])),
                dict(slots=torch.tensor([-1]))):
        args = dict(good, **bad)
        with pytest.raises(ValueError, match="decoder_layers rejected"):
            layers.kernels.decoder_layers(layers.words, layers.quant, layers.reals, layers.num_layers, x,
                                          args["positions"], args["seq_lens"], args["slots"], table, layers.rotary.cos,
                                          layers.rotary.sin, scratch, layers.dims, PAGE, 8, layers.eps)
        assert torch.equal(x, before) and all(torch.equal(c, k) for c, k in zip(caches, kv_before))
