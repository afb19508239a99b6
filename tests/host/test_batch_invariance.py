"""A request's tokens and logprobs do not depend on its batch (EngineConfig.batch_invariant, the default):
the same bits alone, in a batch of 8, in a batch of 16 with other prompts between, prefilled in chunks,
and with its prefix from the cache, for a tiny Llama and a tiny Gemma 3, in bf16 and fp32, greedy and
seeded. Logprobs are compared exactly: any difference in any layer's arithmetic shows there first."""

from __future__ import annotations

import random

import pytest
import torch

from graphdecode import LLM, SamplingParams

PROMPTS = [[random.Random(i).randrange(3, 500) for _ in range(20 + 3 * i)] for i in range(8)]
OTHERS = [[random.Random(100 + i).randrange(3, 500) for _ in range(11 + 5 * i)] for i in range(8)]
TOKENS = 20
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0),
    "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=TOKENS, ignore_eos=True, logprobs=0),
}


def _runs(llm, prompts, params):
    """(token ids, their logprobs) of each prompt, in order."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                      o.outputs[0].logprobs)]) for o in outs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["llama_gqa_llama3", "gemma3_text"])
def test_the_same_bits_alone_batched_chunked_and_from_the_prefix_cache(tiny_models, model, dtype):
    engine = dict(dtype=dtype, max_model_len=256, num_decode_steps=4, max_batch_size=16)
    plain = LLM(tiny_models[model], **engine, enable_prefix_caching=False)
    chunked = LLM(tiny_models[model], **engine, max_num_batched_tokens=16)  # 16-token prefill chunks, cached
    for name, params in PARAMS.items():
        alone = [_runs(plain, [p], params)[0] for p in PROMPTS]
        assert _runs(plain, PROMPTS, params) == alone, (name, "batch of 8")
        mixed = [x for pair in zip(PROMPTS, OTHERS) for x in pair]
        assert _runs(plain, mixed, params)[0::2] == alone, (name, "batch of 16")
        cold = _runs(chunked, PROMPTS, params)
        assert cold == alone, (name, "chunked prefill")
        hits = chunked.engine.scheduler.prefix_cache_hits
        assert _runs(chunked, PROMPTS[::-1], params)[::-1] == alone, (name, "prefix-cache hits")
        assert chunked.engine.scheduler.prefix_cache_hits > hits


def test_batch_variance_is_allowed_only_when_asked(tiny_models):
    """The faster path is behind its flag: the default engine's linears are all fixed-order panels (and so are
    bf16's without the flag where oneDNN has no bf16 on this CPU: there is no faster path to take)."""
    from graphdecode.models.cpu_linear import PanelWeight, onednn_packs
    from graphdecode.models.layers import FusedLinear

    for invariant in (True, False):
        llm = LLM(tiny_models["llama_gqa_llama3"], dtype="bfloat16", max_model_len=64, batch_invariant=invariant)
        model = llm.engine.runner.model
        weights = [m.packed for m in model.modules() if isinstance(m, FusedLinear)] + [model.packed_head]
        panels = [isinstance(w, PanelWeight) and w.packed is None for w in weights]
        assert all(panels) if invariant or not onednn_packs(torch.bfloat16) else not any(panels)
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        LLM(tiny_models["llama_gqa_llama3"], batch_invariant="yes")


def test_bf16_panels_are_exact_products_in_a_fixed_order():
    """The bf16 panel kernel against float32 arithmetic on the same bf16 values, and one row alone against the
    same row among 130: the same bits."""
    from graphdecode.kernels.cpu import cpu_kernels
    from graphdecode.models.cpu_linear import PanelWeight

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels on this machine (no C++ compiler)")
    gen = torch.Generator().manual_seed(0)
    for k, n in ((576, 192), (63, 130), (129, 64)):  # odd K: the last k pairs with a zero
        weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16()
        x = torch.randn(130, k, generator=gen).bfloat16()
        panel = PanelWeight(weight, kernels, invariant=True)
        y = panel.run(x, bias)
        want = x.float() @ weight.float().T + bias.float()
        assert torch.allclose(y.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        rows = torch.cat([panel.run(x[i : i + 1], bias) for i in range(0, 130, 13)])
        assert torch.equal(rows, y[::13])
        assert torch.equal(panel.weight_rows(torch.tensor([0, n - 1, 5])), weight[[0, n - 1, 5]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["llama_gqa_llama3", "gemma3_text"])
def test_speculation_changes_no_bit(tiny_models, dtype, model):
    """n-gram drafts verified in the window: the accepted tokens and their logprobs are plain decoding's,
    in bf16 too (the verify's query rows run the decode rows' kernels: Llama's one-call layers, and Gemma 3's
    verify attention as decode rows)."""
    engine = dict(dtype=dtype, max_model_len=256, num_decode_steps=4, max_batch_size=8)
    repetitive = [(p * 4)[:40] for p in PROMPTS[:4]]  # repeats the n-gram drafter finds
    plain = _runs(LLM(tiny_models[model], **engine), repetitive, PARAMS["greedy"])
    spec = LLM(tiny_models[model], **engine,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert _runs(spec, repetitive, PARAMS["greedy"]) == plain
    assert spec.stats()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_linear_gives_a_row_the_same_bits_at_any_row_count(dtype):
    """The CUDA path's linears (models/blocked_linear.py): one GEMM shape whatever the rows, so a row's bits do
    not depend on the others; on this CPU aten's fp32 GEMM itself does change them (the control)."""
    from graphdecode.models.blocked_linear import blocked_linear

    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(320, 576, generator=gen).to(dtype), torch.randn(320, generator=gen).to(dtype)
    x = torch.randn(300, 576, generator=gen).to(dtype)
    full = blocked_linear(x, weight, bias, rows=64)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    tol = dict(rtol=1e-5, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.3)
    torch.testing.assert_close(full.double(), want, **tol)
    for rows in (1, 5, 64, 65, 299):
        assert torch.equal(blocked_linear(x[:rows], weight, bias, rows=64), full[:rows])
    assert blocked_linear(x[:6].view(2, 3, 576), weight, None, rows=64).shape == (2, 3, 320)
    assert blocked_linear(x[:0], weight, bias, rows=64).shape == (0, 320)


def test_the_cuda_linears_keep_a_batch_invariant_engine_invariant_on_the_cpu(tiny_models, monkeypatch):
    """The engine as CUDA loads it (every dense linear and the head a BlockedWeight, no CPU panels), run on the
    CPU twin in fp32, where aten's GEMM alone changes a row's bits with the batch: alone, in a batch of 8 and of
    16, the same tokens and logprobs, and transformers' greedy tokens."""
    from graphdecode.models import loader
    from graphdecode.models.blocked_linear import BlockedWeight
    from graphdecode.models.layers import FusedLinear
    from tests.helpers import hf_greedy

    monkeypatch.setattr(loader, "can_prepack", lambda device, dtype: False)
    monkeypatch.setattr(loader, "BLOCKED_DEVICES", ("cuda", "cpu"))
    llm = LLM(tiny_models["llama_gqa_llama3"], dtype="float32", max_model_len=256, num_decode_steps=4,
              max_batch_size=16, enable_prefix_caching=False)
    model = llm.engine.runner.model
    weights = [m.packed for m in model.modules() if isinstance(m, FusedLinear)] + [model.packed_head]
    assert weights and all(type(w) is BlockedWeight and w.weight.numel() > 0 for w in weights)
    for name, params in PARAMS.items():
        alone = [_runs(llm, [p], params)[0] for p in PROMPTS]
        assert _runs(llm, PROMPTS, params) == alone, (name, "batch of 8")
        mixed = [x for pair in zip(PROMPTS, OTHERS) for x in pair]
        assert _runs(llm, mixed, params)[0::2] == alone, (name, "batch of 16")
    greedy = [list(tokens) for tokens, _ in _runs(llm, PROMPTS[:3], PARAMS["greedy"])]
    assert greedy == hf_greedy(tiny_models["llama_gqa_llama3"], PROMPTS[:3], TOKENS)
