"""min_p / top_k / top_p through LLM on a real vocabulary (SmolLM2's 49,152 tokens, where an eager CPU window
finds each row's kept prefix among its likeliest tokens: device/top_filter.py)."""

from __future__ import annotations

import graphdecode.device.top_filter as top_filter
from graphdecode import LLM, SamplingParams
from tests.helpers import completions

PROMPTS = ["Write a short story about a dragon who is afraid of the dark.",
           "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "What are three good reasons to learn a second language?"]


def test_filtered_sampling_gives_the_sorts_tokens_plain_and_speculating(smollm2, monkeypatch):
    """Seeded filtered sampling gives the same tokens with the candidates as with every row sorted, on a plain
    engine and on one speculating in every window (its verify filters each row's queries; rows finishing early
    leave done rows and inert queries, which are not sorted)."""
    common = dict(num_decode_steps=4, max_model_len=256, max_batch_size=4, cpu_threads=1)
    plain = LLM(smollm2, **common)
    spec = LLM(smollm2, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **common)
    spec.engine.spec_policy.speculate = lambda bucket, rows=(): True
    vocab = plain.engine.runner.sampler.vocab_keys.numel()
    assert vocab > top_filter.WIDTH
    runs = [[SamplingParams(temperature=0.8, seed=11 + i, max_tokens=m, **filters) for i, m in enumerate((6, 20, 12))]
            for filters in (dict(top_p=0.9), dict(top_k=40, min_p=0.02))]
    candidates = [completions(plain.generate(PROMPTS, params)) for params in runs]
    assert [completions(spec.generate(PROMPTS, params)) for params in runs] == candidates
    assert spec.stats()["spec_windows"] > 0
    monkeypatch.setattr(top_filter, "WIDTH", vocab)  # every row sorted
    assert [completions(plain.generate(PROMPTS, params)) for params in runs] == candidates
