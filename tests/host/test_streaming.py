"""Streaming deltas (OpenAI semantics) and incremental detokenization."""

from __future__ import annotations

from collections import defaultdict

import pytest
from transformers import AutoTokenizer

from graphdecode import LLM, SamplingParams
from graphdecode.host.detokenizer import Detokenizer

PROMPTS = ["The capital of France is", "Once upon a time", "def main():", "One, two, three"]


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, num_decode_steps=4, max_model_len=256, max_batch_size=16)


def _collect(llm, prompts, params):
    text, tokens, finish, deltas_per_window = defaultdict(str), defaultdict(list), {}, []
    for delta in llm.stream(prompts, params):
        for c in delta.outputs:
            key = (delta.request_id, c.index)
            text[key] += c.text
            tokens[key] += c.token_ids
            if c.finish_reason is not None:
                assert key not in finish, "a sequence finished twice"
                finish[key] = (c.finish_reason, c.stop_reason)
        deltas_per_window.append([(delta.request_id, c.index) for c in delta.outputs])
    return text, tokens, finish, deltas_per_window


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=25),
        SamplingParams(n=2, temperature=1.0, top_k=20, seed=2, max_tokens=40, stop=[" the", "e,"]),
    ],
)
def test_concatenated_deltas_equal_generate(llm, params):
    final = llm.generate(PROMPTS, params)
    text, tokens, finish, per_window = _collect(llm, PROMPTS, params)
    offset = int(final[-1].request_id) + 1  # stream() requests come after generate()'s
    for i, out in enumerate(final):
        for c in out.outputs:
            key = (str(offset + i), c.index)
            assert tokens[key] == c.token_ids
            assert text[key] == c.text
            assert finish[key] == (c.finish_reason, c.stop_reason)
    # at most one delta per sequence per window: a request never repeats an index in one output
    assert all(len(keys) == len(set(keys)) for keys in per_window)


def test_parallel_deltas_carry_index_and_interleave(llm):
    seen = []
    for delta in llm.stream(PROMPTS[0], SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=20)):
        seen.extend(c.index for c in delta.outputs)
    assert set(seen) == {0, 1, 2, 3}
    first_of = {i: seen.index(i) for i in range(4)}
    last_of = {i: len(seen) - 1 - seen[::-1].index(i) for i in range(4)}
    assert max(first_of.values()) < min(last_of.values())  # chunks of different indices interleave


def test_closing_a_stream_aborts_its_requests(llm):
    gen = llm.stream(PROMPTS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(gen)
    gen.close()
    assert not llm.engine.requests
    assert not llm.engine.scheduler.running


def test_incremental_detokenization_never_breaks_utf8(text_model):
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    text = "héllo wörld — 日本語 🎉 naïve café"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text) // 2  # multi-byte characters really are split across tokens
    detok = Detokenizer(tokenizer.backend_tokenizer, [1], True, (), False)
    pieces = []
    for tok in ids:
        before = len(detok.text)
        detok.add([tok])
        pieces.append(detok.text[before:])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_holdback_is_never_taken_back(text_model):
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    ids = tokenizer(" one two three four", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tokenizer.backend_tokenizer, [1], True, ("three f",), False)
    streamed = ""
    hit = None
    for tok in ids:
        hit = detok.add_and_match(tok)
        stable = detok.stable_len(hit is not None)
        assert detok.text.startswith(streamed)
        streamed = detok.text[:stable]
        if hit:
            break
    assert hit == "three f"
    assert streamed == detok.text == " one two "
