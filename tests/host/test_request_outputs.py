"""What vLLM users read from outputs: prompt_logprobs, RequestOutput.metrics, and the
SamplingParams conveniences (clone, detokenize=False, output_kind, any int seed)."""

from __future__ import annotations

import pytest

from graphdecode import LLM, RequestOutputKind, SamplingParams
from tests.helpers import SMALL_ENGINE, hf_prompt_logprobs, random_prompts, token_prompts


@pytest.mark.parametrize("budget", [8192, 16])
def test_prompt_logprobs_match_transformers(tiny_models, budget):
    path = tiny_models["llama_gqa_llama3"]
    prompt = random_prompts(1, [70], seed=8)[0]
    ref = hf_prompt_logprobs(path, prompt)
    llm = LLM(path, max_num_batched_tokens=budget, **SMALL_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4)
    for _ in range(2):  # the second time the prompt is in the prefix cache: still computed, same values
        (out,) = llm.generate({"prompt_token_ids": prompt}, params)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for j in range(1, len(prompt)):
            row, token = ref[j - 1], prompt[j]
            assert abs(got[j][token].logprob - row[token].item()) < 1e-4
            assert got[j][token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(4)
            for place, tid in enumerate(top.indices.tolist()):
                assert abs(got[j][tid].logprob - top.values[place].item()) < 1e-4
    assert llm.stats()["prefix_cache_hits"] == 0  # a prompt_logprobs request does not read the cache
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3))
    assert plain[0].prompt_logprobs is None and plain[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_in_the_first_stream_delta(text_model):
    llm = LLM(text_model, **SMALL_ENGINE)
    deltas = list(llm.stream("The capital of France is", SamplingParams(max_tokens=6, prompt_logprobs=0, seed=1)))
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is deltas[0]
    assert len(carrying[0].prompt_logprobs) == len(deltas[0].prompt_token_ids)
    assert all(len(entry) == 1 for entry in carrying[0].prompt_logprobs[1:])  # N=0: the token's own only
    assert all(e.decoded_token is not None for entry in carrying[0].prompt_logprobs[1:] for e in entry.values())


def test_request_metrics(tiny_models):
    path = tiny_models["llama_gqa_llama3"]
    prompts = token_prompts(random_prompts(10, [10, 30, 60]))
    llm = LLM(path, num_decode_steps=8, max_model_len=256, max_batch_size=16, num_pages=24)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.time_in_queue >= 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.stats()["preemptions"] > 0


def test_clone_detokenize_and_seeds(text_model):
    params = SamplingParams(stop=["a"], stop_token_ids=[5], logit_bias={3: 1.0}, bad_words=["xyz"], seed=2)
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("b")
    copy.logit_bias[4] = 2.0
    assert params.stop == ["a"] and params.logit_bias == {3: 1.0}

    llm = LLM(text_model, **SMALL_ENGINE)
    prompt = "Once upon a time"
    with_text = llm.generate(prompt, SamplingParams(max_tokens=8, seed=3, logprobs=2))[0].outputs[0]
    bare = llm.generate(prompt, SamplingParams(max_tokens=8, seed=3, logprobs=2, detokenize=False))[0].outputs[0]
    assert bare.token_ids == with_text.token_ids and with_text.text and bare.text == ""
    assert all(lp.decoded_token is None for entry in bare.logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["."], detokenize=False)

    def tokens(seed):
        return llm.generate(prompt, SamplingParams(max_tokens=12, seed=seed))[0].outputs[0].token_ids

    assert tokens(2**70) != tokens(2**70 + 2**64)  # no longer truncated to the low 64 bits
    assert tokens(2**70) == tokens(2**70) and tokens(-(2**80)) == tokens(-(2**80))
    assert tokens(-(2**80)) != tokens(2**80)


def test_output_kinds_of_stream(text_model):
    llm = LLM(text_model, **SMALL_ENGINE)
    prompts = ["The quick brown fox", "Pack my box"]
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    want = {o.prompt: o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**base))}
    cumulative = list(llm.stream(prompts, SamplingParams(**base, output_kind="cumulative")))
    for prompt in prompts:
        mine = [o.outputs[0].token_ids for o in cumulative if o.prompt == prompt]
        assert len(mine) > 1 and all(a == b[: len(a)] for a, b in zip(mine, mine[1:])) and mine[-1] == want[prompt]
    final = list(llm.stream(prompts, SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY)))
    assert sorted(o.prompt for o in final) == sorted(prompts) and all(o.finished for o in final)
    assert {o.prompt: o.outputs[0].token_ids for o in final} == want
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="sometimes")
