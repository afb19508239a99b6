"""vLLM's offline semantics that tools built on vLLM rely on: allowed_token_ids (on the device,
in the window), logprobs=0 and whole-vocabulary logprobs, logprobs_mode, and priority scheduling.

Oracle: transformers' fp32 logits of the same model, teacher-forced on the engine's tokens."""

from __future__ import annotations

import math

import pytest
import torch

from graphdecode import LLM, SamplingParams
from tests.helpers import SMALL_ENGINE, first_tokens, generate_tokens, hf_logits, random_prompts, token_prompts

MODEL = "llama_gqa_llama3"
ENGINE = dict(SMALL_ENGINE, max_model_len=128, buckets=[1, 8])
ALLOWED = [7, 19, 42, 77, 100, 256, 300, 511]
@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models[MODEL]


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, **ENGINE)


# ------------------------------------------------------------ allowed_token_ids
def test_allowed_token_ids_greedy_is_the_argmax_over_the_allowed_set(llm, path):
    prompts = random_prompts(3, [6, 17, 30], seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=ALLOWED)
    outs = llm.generate(token_prompts(prompts), params)
    changed = 0
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 12 and set(tokens) <= set(ALLOWED)
        logits = hf_logits(path, prompt + tokens)
        for i, token in enumerate(tokens):
            step = logits[len(prompt) - 1 + i]
            restricted = step[ALLOWED]
            assert step[token] >= restricted.max() - 1e-4, (i, token)
            changed += int(step.argmax()) not in ALLOWED
    assert changed > 0  # the mask did change what plain greedy would have produced


def test_allowed_token_ids_sampled_rows_stay_in_the_set_and_others_are_untouched(llm):
    prompts = random_prompts(6, [5, 12, 20], seed=8)
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    alone = generate_tokens(llm, prompts, free)
    masked = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, allowed_token_ids=ALLOWED[:3])
    mixed = llm.generate(token_prompts(prompts), [masked if i % 2 else free for i in range(len(prompts))])
    for i, out in enumerate(mixed):
        tokens = out.outputs[0].token_ids
        if i % 2:
            assert set(tokens) <= set(ALLOWED[:3]) and len(set(tokens)) > 1
        else:
            assert tokens == alone[i]  # bit-identical to running without masked company


def test_allowed_token_ids_survive_speculation_and_are_checked_against_the_vocabulary(path, llm):
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8, 9])
    plain = llm.generate(token_prompts([prompt]), params)[0].outputs[0].token_ids
    spec = LLM(path, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert spec.generate(token_prompts([prompt]), params)[0].outputs[0].token_ids == plain
    with pytest.raises(ValueError, match=r"prompts\[0\]: allowed_token_ids: token id 512 is outside"):
        llm.generate(token_prompts([prompt]), SamplingParams(allowed_token_ids=[3, 512]))


# -------------------------------------------------------------------- logprobs
def test_logprobs_zero_returns_only_the_sampled_token(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=0)
    out = llm.generate(token_prompts([[4, 5, 6]]), params)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert list(entry) == [token] and entry[token].rank >= 1


def test_max_logprobs_zero_reports_the_sampled_and_prompt_tokens_only(path, llm):
    """vLLM's max_logprobs=0: logprobs=0 / prompt_logprobs=0 give each token's own logprob, the values the
    default engine reports; more is refused by name."""
    zero = LLM(path, **ENGINE, max_logprobs=0)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, prompt_logprobs=0)
    got, want = (e.generate(token_prompts([[4, 5, 6]]), params)[0] for e in (zero, llm))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for mine, theirs in zip(got.outputs[0].logprobs + got.prompt_logprobs[1:],
                            want.outputs[0].logprobs + want.prompt_logprobs[1:]):
        assert list(mine) == list(theirs) and len(mine) == 1
        assert math.isclose(next(iter(mine.values())).logprob, next(iter(theirs.values())).logprob, abs_tol=1e-5)
    with pytest.raises(ValueError, match=r"prompts\[0\]: logprobs: 1 exceeds max_logprobs \(0"):
        zero.generate(token_prompts([[4, 5]]), SamplingParams(logprobs=1))
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0"):
        LLM(path, **ENGINE, max_logprobs=-2)


def test_whole_vocabulary_logprobs_when_the_cap_covers_it(path, llm):
    """vLLM's rule: logprobs=-1 / prompt_logprobs=-1 are allowed whenever max_logprobs is at least the
    vocabulary, not only with -1."""
    vocab = llm.config.model_config.vocab_size
    covered = LLM(path, **ENGINE, max_logprobs=vocab)
    out = covered.generate(token_prompts([[4, 5, 6]]), SamplingParams(temperature=0, max_tokens=2, logprobs=-1,
                                                                      prompt_logprobs=-1))[0]
    assert all(len(entry) == vocab for entry in out.outputs[0].logprobs + out.prompt_logprobs[1:])


def test_whole_vocabulary_logprobs_with_max_logprobs_unlimited(path, llm):
    with pytest.raises(ValueError, match=r"prompts\[0\]: logprobs: the whole vocabulary \(-1\) exceeds max_logprobs"):
        llm.generate(token_prompts([[4, 5]]), SamplingParams(logprobs=-1))
    full = LLM(path, **ENGINE, max_logprobs=-1)
    prompt = [4, 5, 6, 9]
    out = full.generate(token_prompts([prompt]), SamplingParams(temperature=0, max_tokens=3, logprobs=-1,
                                                      prompt_logprobs=-1))[0]
    vocab = full.config.model_config.vocab_size
    reference = torch.log_softmax(hf_logits(path, prompt + out.outputs[0].token_ids), dim=-1)
    for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert len(entry) == vocab
        step = reference[len(prompt) - 1 + i]
        values = torch.tensor([entry[t].logprob for t in range(vocab)])
        torch.testing.assert_close(values, step, atol=1e-4, rtol=1e-4)
        assert entry[token].rank == 1  # greedy
        worst = min(entry, key=lambda t: entry[t].logprob)
        assert entry[worst].rank == vocab
    assert out.prompt_logprobs[0] is None
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_mode(path, mode):
    engine = LLM(path, **ENGINE, logprobs_mode=mode)
    prompt = random_prompts(1, [9], seed=4)[0]
    bias = {17: 5.0, 33: -3.0}
    params = SamplingParams(temperature=0.5, seed=3, max_tokens=6, ignore_eos=True, logprobs=4, logit_bias=bias)
    out = engine.generate(token_prompts([prompt]), params)[0].outputs[0]
    logits = hf_logits(path, prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        raw = logits[len(prompt) - 1 + i]
        if mode == "raw_logits":
            expected = raw
        else:
            processed = raw.clone()
            for t, b in bias.items():
                processed[t] += b
            processed = processed / 0.5
            expected = torch.log_softmax(processed, dim=-1) if mode == "processed_logprobs" else processed
        assert math.isclose(entry[token].logprob, float(expected[token]), abs_tol=2e-4)
        assert entry[token].rank == 1 + int((expected > expected[token]).sum())
        assert {t for t, lp in entry.items() if lp.rank <= 4} == set(expected.topk(4).indices.tolist())
        for t, lp in entry.items():
            assert math.isclose(lp.logprob, float(expected[t]), abs_tol=2e-4)


# ------------------------------------------------------------------- priority
def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: priority: got 3, but priority scheduling is not enabled"):
        llm.generate(token_prompts([[4, 5], [6, 7]]), SamplingParams(max_tokens=2), priority=[0, 3])
    with pytest.raises(ValueError, match=r"prompts\[0\]: priority: got 2, but priority scheduling"):
        llm.generate(token_prompts([[4, 5], [6, 7]]), SamplingParams(max_tokens=2), priority=2)  # one for all
    with pytest.raises(TypeError, match="priority must be an integer or a list of integers, one per prompt"):
        llm.generate(token_prompts([[4, 5], [6, 7]]), SamplingParams(max_tokens=2), priority=[1])


def test_priority_orders_admission_and_keeps_the_tokens(path, llm):
    engine = LLM(path, num_decode_steps=4, max_model_len=128, max_batch_size=1, buckets=[1],
                 scheduling_policy="priority")
    prompts = random_prompts(5, [4, 9, 13], seed=12)
    priorities = [3, -1, 7, 0, 3]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = engine.generate(token_prompts(prompts), greedy, priority=priorities)
    order = sorted(range(5), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 3, 0, 4, 2]  # lowest value first, ties by arrival
    assert first_tokens(outs) == generate_tokens(llm, prompts, greedy)


def test_priority_preemption_takes_the_lowest_priority_first(path):
    # 12 pages of 16 tokens for rows that each grow to ~80 tokens: the engine must preempt
    engine = LLM(path, num_decode_steps=4, max_model_len=128, max_batch_size=4, buckets=[4], num_pages=13,
                 scheduling_policy="priority")
    scheduler = engine.engine.scheduler
    victims, choose = [], scheduler._victim

    def recording():
        group, seq = choose()
        candidates = [g.seqs[0].request.priority for g in scheduler.prefilling.values()]
        candidates += [s.request.priority for s in scheduler.running.values()]
        victim = (group.seqs[0] if group is not None else seq).request.priority
        victims.append((victim, max(candidates)))
        return group, seq

    scheduler._victim = recording
    prompts = random_prompts(4, [20], seed=2)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = engine.generate(token_prompts(prompts), params, priority=[2, 0, 9, 1])
    assert victims and all(v == worst for v, worst in victims)
    assert victims[0][0] == 9
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert outs[2].metrics.num_preemptions >= 1 and outs[1].metrics.num_preemptions == 0
