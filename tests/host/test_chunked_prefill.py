"""Chunked prefill: per step at most max_num_batched_tokens prefill tokens; running rows get a
decode window in every step; a prompt is sampled only after its last chunk; outputs
identical for any budget and page size; preemption of a partially prefilled group."""

from __future__ import annotations

import pytest

from graphdecode import LLM, SamplingParams
from tests.helpers import random_prompts, token_prompts


def prompts_of(lengths, seed=0):
    return token_prompts(random_prompts(len(lengths), lengths, seed=seed))


def record_plans(llm: LLM) -> list:
    plans, schedule = [], llm.engine.scheduler.schedule

    def recording(*args):
        plan = schedule(*args)
        plans.append(plan)
        return plan

    llm.engine.scheduler.schedule = recording
    return plans


@pytest.mark.parametrize("model", ["llama_gqa_llama3", "qwen2_tied", "llama_head_dim"])
def test_outputs_identical_for_any_budget_and_page_size(tiny_models, model):
    path = tiny_models[model]
    prompts = prompts_of([3, 17, 40, 100, 150, 64], seed=2)
    cases = [SamplingParams(temperature=0, max_tokens=24),
             SamplingParams(n=2, temperature=0.8, top_k=40, seed=3, max_tokens=16)]
    for params in cases:
        results = []
        for budget, page_size in [(8192, 16), (16, 16), (64, 32), (17, 16)]:
            llm = LLM(path, num_decode_steps=4, page_size=page_size, max_model_len=256, max_batch_size=16,
                      max_num_batched_tokens=budget)
            plans = record_plans(llm)
            engine, requests = llm.engine, []
            for i, p in enumerate(prompts):  # staggered arrivals: chunks and windows interleave
                requests.append(engine.add_request(p, params))
                if i % 2:
                    engine.step()
            while engine.has_unfinished():
                engine.step()
            results.append([[s.output_token_ids for s in r.seqs] for r in requests])
            assert max(plan.num_prefill_tokens for plan in plans) <= budget
            if budget < 150:
                assert any(c.start > 0 and not c.sample_rows for plan in plans for c in plan.prefill_chunks)
        assert all(r == results[0] for r in results[1:]), params


def test_a_prompt_is_sampled_only_after_its_last_chunk(tiny_models):
    llm = LLM(tiny_models["llama_head_dim"], num_decode_steps=4, max_model_len=256, max_num_batched_tokens=16)
    plans = record_plans(llm)
    out = llm.generate(prompts_of([100]), SamplingParams(temperature=0, max_tokens=5))
    chunks = [c for plan in plans for c in plan.prefill_chunks]
    assert [(c.start, c.end) for c in chunks] == [(i, min(i + 16, 100)) for i in range(0, 100, 16)]
    assert [bool(c.sample_rows) for c in chunks] == [False] * 6 + [True]
    first_started = next(i for i, plan in enumerate(plans) if plan.started_rows)
    assert first_started == 6 and all(plan.window is None for plan in plans[:6])
    assert len(out[0].outputs[0].token_ids) == 5


def test_running_streams_get_a_window_in_every_step_of_a_long_prefill(tiny_models):
    llm = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=2, max_model_len=512, max_num_batched_tokens=32)
    engine = llm.engine
    streams = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
               for p in prompts_of([5, 9])]
    for _ in range(3):
        engine.step()
    plans = record_plans(llm)
    long_prompt = engine.add_request(prompts_of([300], seed=9)[0], SamplingParams(temperature=0, max_tokens=4))
    while long_prompt.seqs[0].row is None:
        engine.step()
    prefill_steps = [plan for plan in plans if plan.prefill_chunks]
    assert len(prefill_steps) == -(-300 // 32)
    assert all(plan.window is not None and plan.window.decode for plan in prefill_steps)
    assert all(plan.num_prefill_tokens <= 32 for plan in plans)
    assert all(not s.seqs[0].is_finished for s in streams)
    while engine.has_unfinished():
        engine.step()


def test_cache_hits_count_as_computed(tiny_models):
    llm = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, page_size=16, max_model_len=256,
              max_num_batched_tokens=20)
    prefix = random_prompts(1, [96], seed=4)[0]
    llm.generate({"prompt_token_ids": prefix + [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3))
    plans = record_plans(llm)
    llm.generate({"prompt_token_ids": prefix + [8, 9, 10, 11]}, SamplingParams(temperature=0, max_tokens=3))
    chunks = [c for plan in plans for c in plan.prefill_chunks]
    assert [(c.start, c.end) for c in chunks] == [(96, 100)]


def test_preempting_a_partially_prefilled_group(tiny_models):
    """Running rows that grow take the pages of a group still prefilling: it goes back to the
    queue and comes back; outputs are those of a roomy pool."""
    path = tiny_models["qwen2_tied"]
    prompts = prompts_of([20, 20, 150], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)] * 2 + \
             [SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=10)]
    common = dict(num_decode_steps=8, page_size=16, max_model_len=256, max_batch_size=4, max_num_batched_tokens=16)

    def run(**extra):
        llm = LLM(path, **common, **extra)
        engine = llm.engine
        preempted_prefilling = 0
        preempt = engine.scheduler._preempt

        def counting():
            nonlocal preempted_prefilling
            preempted_prefilling += bool(engine.scheduler.prefilling)
            preempt()

        engine.scheduler._preempt = counting
        requests = [engine.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
        for _ in range(4):
            engine.step()
        requests.append(engine.add_request(prompts[2], params[2]))
        while engine.has_unfinished():
            engine.step()
        return [[s.output_token_ids for s in r.seqs] for r in requests], preempted_prefilling, llm

    tight, preempted, llm = run(num_pages=22)
    roomy, none, _ = run()
    assert tight == roomy and preempted > 0 and none == 0
    assert llm.engine.pool.num_free == 21  # every page came back
