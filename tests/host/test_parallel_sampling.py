"""n > 1: one prefill, shared prompt pages, a copied partial page, per-child random streams."""

from __future__ import annotations

import pytest

from graphdecode import LLM, SamplingParams
from tests.helpers import hf_greedy, random_prompts, token_prompts


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, max_model_len=512 + 64, max_batch_size=16)


def test_n8_prefills_a_512_token_prompt_once(llm):
    prompt = {"prompt_token_ids": random_prompts(1, [512], seed=31)[0]}
    before = llm.stats()["prefill_tokens"]
    out = llm.generate(prompt, SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=8))[0]
    assert llm.stats()["prefill_tokens"] - before == 512
    assert sorted(c.index for c in out.outputs) == list(range(8))
    assert all(len(c.token_ids) == 8 for c in out.outputs)


def test_seeded_n_is_reproducible_and_children_differ(llm):
    prompt = {"prompt_token_ids": random_prompts(1, [37], seed=32)[0]}  # 37 = 2 full pages + a partial one
    params = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=24)
    a = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    b = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    assert a == b
    assert len({tuple(t) for t in a}) == 6


def test_greedy_children_match_transformers(llm, tiny_models):
    """Shared prompt pages + copied partial page give every child the exact greedy continuation."""
    prompts = random_prompts(3, [16, 37, 50], seed=33)  # page-aligned, and two with a partial last page
    expected = hf_greedy(tiny_models["llama_gqa_llama3"], prompts, 20)
    outs = llm.generate(token_prompts(prompts), SamplingParams(n=3, temperature=0, max_tokens=20))
    for out, ref in zip(outs, expected):
        assert [c.token_ids for c in out.outputs] == [ref] * 3


def test_finished_child_frees_its_pages_while_siblings_go_on(llm):
    engine = llm.engine
    prompt = {"prompt_token_ids": random_prompts(1, [40], seed=34)[0]}
    # with this seed the children reach the stop token at different times
    request = engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=60, stop_token_ids=[7, 8, 9, 10, 11, 12]))
    checked = False
    while engine.has_unfinished():
        engine.step()
        done = [s for s in request.seqs if s.is_finished]
        alive = [s for s in request.seqs if s.is_running]
        if done and alive and not checked:
            shared = alive[0].pages[: 40 // llm.config.page_size]
            assert all(engine.pool.refcount(p) == len(alive) for p in shared)
            held = {p for s in alive for p in s.pages}
            free = engine.pool.num_free
            assert free == llm.config.num_pages - 1 - len(held)  # nothing else is held: the finished child's pages are free
            checked = True
    assert checked, "pick another seed: the children finished together"
    assert engine.pool.num_free == llm.config.num_pages - 1
