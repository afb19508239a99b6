"""Speculative decoding with a draft model (`method: draft_model`): drafts from d small forwards inside
the window, verified by the target; always the tokens plain decoding gives. With the target as its own
draft every draft is accepted, except at a request's end, which is how these tests see that the draft's
K/V stays right through prefix hits, preemption, chunked prefill, n > 1 forks and windows that ran plain
(a stale K/V entry makes the identical draft disagree: 53-70% accepted in the bugs this found)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from graphdecode import LLM, SamplingParams
from tests.helpers import (
    SMALL_ENGINE,
    assert_same_outputs,
    completions,
    random_prompts,
    staged_spec_state,
    token_prompts,
)

TARGET = "llama_gqa_llama3"
D = 3


def spec_config(draft: str, d: int = D) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": d}


def prompts(count: int = 8, seed: int = 3) -> list[dict]:
    return token_prompts(random_prompts(count, [4, 30, 60], seed=seed))


def assert_every_draft_accepted(llm: LLM, requests: int, d: int = D) -> None:
    """The identical draft: each request loses at most the d drafts of its last round (cut by its end)."""
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0
    assert stats["spec_accepted_tokens"] >= stats["spec_draft_tokens"] - d * requests, stats


@pytest.fixture(scope="module")
def plain(tiny_models):
    return LLM(tiny_models[TARGET], **SMALL_ENGINE)


@pytest.fixture(scope="module")
def self_drafted(tiny_models):
    path = tiny_models[TARGET]
    return LLM(path, speculative_config=spec_config(path), **SMALL_ENGINE)


def test_a_draft_model_gives_the_plain_tokens(tiny_models, plain, self_drafted):
    """Greedy, seeded sampling with n = 2 and top-k, stops with logprobs: the target's tokens and
    logprobs whatever the draft (itself: all accepted; another family with other heads: few)."""
    cases = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, top_k=20, seed=4, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[17, 300], logprobs=2),
    ]
    batch = prompts()
    other = LLM(tiny_models[TARGET], speculative_config=spec_config(tiny_models["qwen2_tied"]), **SMALL_ENGINE)
    for params in cases:
        want = plain.generate(batch, params)
        for spec in (self_drafted, other):
            assert_same_outputs(spec.generate(batch, params), want)
    assert_every_draft_accepted(self_drafted, requests=len(batch) * 4)  # 8 prompts, cases of 1 + 2 + 1 rows
    assert other.stats()["spec_windows"] > 0  # probed at least; the policy may then run plain


def test_the_draft_kv_follows_prefix_hits_preemption_chunks_and_forks(tiny_models):
    """A tight pool (preemption), the same prompts again (prefix-cache hits on pages holding the draft's
    K/V too), prompts prefilled in chunks of 32, and n = 2 forks (the partial page copied for both
    models): the plain tokens, and the identical draft still accepts everything."""
    path = tiny_models[TARGET]
    tight = dict(SMALL_ENGINE, max_batch_size=16, num_pages=18, max_num_batched_tokens=32)  # 16 pages a sequence
    batch = prompts(10, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    reference = LLM(path, **tight)
    want = [completions(reference.generate(batch, p)) for p in (greedy, greedy, forked)]
    spec = LLM(path, speculative_config=spec_config(path), **tight)
    got = [completions(spec.generate(batch, p)) for p in (greedy, greedy, forked)]
    assert got == want
    stats = spec.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["spec_windows"] > 0
    assert_every_draft_accepted(spec, requests=stats["preemptions"] + 4 * len(batch))


def test_plain_windows_between_speculative_ones_keep_the_draft_current(tiny_models):
    """A penalty request admitted mid-run (a short request frees its row) makes windows run plain
    between speculative ones, so the draft misses tokens, among them the last draft of a round that
    accepted all (its next round would have rewritten it). The next speculative window first catches
    the draft's K/V up from the rows' history: the identical draft accepts every draft again."""
    path = tiny_models[TARGET]
    engine = dict(SMALL_ENGINE, max_batch_size=4, buckets=[4])
    spec = LLM(path, speculative_config=spec_config(path), **engine)
    batch = prompts(5, seed=8)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 90, 90, 90)]
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.5))
    want = completions(LLM(path, **engine).generate(batch, params))
    assert completions(spec.generate(batch, params)) == want
    stats = spec.stats()
    assert 0 < stats["spec_window_share"] < 1  # both kinds of window ran
    assert_every_draft_accepted(spec, requests=len(batch))


def test_graph_twin_and_bounds_checked_windows_with_a_draft_model(tiny_models, plain):
    """The CPU twin of CUDA graphs (captured draft-model windows, the first replay refusing host copies)
    and the bounds-checked mode (every draft query's position and slot checked): the plain tokens."""
    path = tiny_models[TARGET]
    spec = LLM(path, speculative_config=spec_config(tiny_models["qwen2_tied"]), cuda_graphs=True,
               check_bounds=True, **SMALL_ENGINE)
    batch = prompts(6, seed=9)
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)):
        assert completions(spec.generate(batch, params)) == completions(plain.generate(batch, params))
    assert spec.stats()["spec_windows"] > 0


def test_the_pool_holds_both_models_per_page(tiny_models):
    """kv_cache_memory_bytes buys pages of the target's and the draft's K/V together."""
    path, draft = tiny_models[TARGET], tiny_models["qwen2_tied"]
    budget = 1 << 20
    alone = LLM(path, kv_cache_memory_bytes=budget, **SMALL_ENGINE)
    both = LLM(path, kv_cache_memory_bytes=budget, speculative_config=spec_config(draft), **SMALL_ENGINE)
    # llama_gqa_llama3: 2 layers x 2 KV heads x 16; qwen2_tied: 2 layers x 1 KV head x 16 (fp32, 16-token pages)
    page = lambda layers, heads: layers * 2 * 16 * heads * 16 * 4  # noqa: E731
    assert alone.config.num_pages == budget // page(2, 2)
    assert both.config.num_pages == budget // (page(2, 2) + page(2, 1))
    assert both.engine.runner.memory_sizes()["kv_cache_bytes"] == both.config.num_pages * (page(2, 2) + page(2, 1))


def test_draft_model_config_is_validated_before_any_weight_is_read(tiny_models, tmp_path):
    path = tiny_models[TARGET]
    other_vocab = tmp_path / "vocab256"
    other_vocab.mkdir()
    config = json.load(open(os.path.join(tiny_models["qwen2_tied"], "config.json")))
    json.dump({**config, "vocab_size": 256}, open(other_vocab / "config.json", "w"))
    (other_vocab / "model.safetensors").write_bytes(b"not a checkpoint")  # never opened
    short = tmp_path / "short"
    short.mkdir()
    json.dump({**config, "max_position_embeddings": 64}, open(short / "config.json", "w"))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    json.dump({**config, "model_type": "no_such_family", "architectures": ["NoSuchForCausalLM"]},
              open(unknown / "config.json", "w"))
    cases = [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "draft_model", "model": str(tmp_path / "missing")}, "speculative_config.model"),
        (spec_config(str(other_vocab)), r"vocab_size \(256\) differs from the target's \(512\)"),
        (spec_config(str(short)), "max_position_embeddings"),
        (spec_config(str(unknown)), "speculative_config.model: .*no_such_family.* is not supported"),
        ({**spec_config(path), "prompt_lookup_max": 3}, "unknown key 'prompt_lookup_max' for method 'draft_model'"),
        ({"method": "eagle", "model": path}, "not supported yet"),
        ({"method": "eagle3", "model": path}, "architectures must name an EAGLE-3 head"),
        ({"method": "mtp"}, "method"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(path, max_model_len=256, speculative_config=bad)


def test_the_draft_is_sampled_with_the_rows_own_noise():
    """ModelDrafter on a model that always predicts token + 1: at temperature 0 every draft is that token;
    at temperature 1 (where a sample is mostly not the argmax) the draft is the Gumbel-max sample of the
    draft's logits under the position-keyed noise the verify uses, so drafting with the target's own
    logits proposes exactly the target's tokens: every draft accepted (noise keyed one position off: few)."""
    from graphdecode.attention import TorchAttentionBackend
    from graphdecode.device.drafters import ModelDrafter
    from graphdecode.device.sampler import Sampler, SamplerMode, SamplerVariant
    from graphdecode.device.speculative import speculative_window

    vocab, d, page = 12, 3, 16

    def counting(tokens, positions, ctx):  # flat enough that a sample is mostly not the argmax (e / (e + 11))
        return torch.nn.functional.one_hot((tokens + 1) % vocab, vocab).float()

    for variant in (SamplerVariant(), SamplerVariant(SamplerMode.SAMPLE)):
        state = staged_spec_state([[3, 4, 5], [9]], vocab, d, steps=3)
        state.temperature[:2] = 0.0 if variant.mode == SamplerMode.GREEDY else 1.0
        state.seed[:2] = torch.tensor([5, 6])
        sampler = Sampler(vocab, "cpu")
        caches = [torch.zeros(20, 2, page, 1, 4)]
        drafter = ModelDrafter(counting, TorchAttentionBackend([torch.zeros(20, 2, page, 1, 4)], 1, 1, 4), sampler)
        speculative_window(counting, sampler, TorchAttentionBackend(caches, 1, 1, 4), state, 2, 3, page, variant,
                           4, drafter)
        spec = state.speculation
        assert spec.spec_drafted[:2].tolist() == [3 * d, 3 * d]
        assert spec.spec_accepted[:2].tolist() == [3 * d, 3 * d]  # drafts from the target's logits: all accepted
        assert state.out_count[:2].tolist() == [3 * (d + 1)] * 2
