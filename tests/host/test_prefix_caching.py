"""Automatic prefix caching: never wrong (outputs identical with caching on and off), hit
counts exact, LRU eviction harmless, a cached page never written; and the plan rule
(the scheduler never touches staging or device state)."""

from __future__ import annotations

import re

import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.host.page_pool import PagePool, page_key
from tests.helpers import REPO, first_tokens, hf_greedy, random_prompts, token_prompts

PACKAGE = REPO / "graphdecode"
GREEDY = SamplingParams(temperature=0, max_tokens=20)


def shared_prefix_prompts(count: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[dict]:
    prefix = random_prompts(1, [prefix_len], seed=seed)[0]
    suffixes = random_prompts(count, [suffix_len], seed=seed + 1)
    return [{"prompt_token_ids": prefix + s} for s in suffixes]


def run(llm: LLM, prompts, params, first_alone: bool = True):
    """The first prompt alone, then the rest together (so they can hit its pages)."""
    outs = llm.generate(prompts[:1], params) if first_alone else []
    outs += llm.generate(prompts[1:] if first_alone else prompts, params)
    return [[c.token_ids for c in o.outputs] for o in outs]


def pages_written_are_never_cached(llm: LLM) -> list[str]:
    """No step writes a page that holds, under the same key, content cached before the step
    (a page evicted and keyed anew in the step holds new content; pages keyed during the step
    are the ones its own prefill computes)."""
    engine, problems = llm.engine, []
    pool, size = engine.pool, llm.config.page_size
    schedule, prefill = engine.scheduler.schedule, engine.runner.prefill
    before: dict[int, bytes] = {}

    def snapshot_schedule(*args):
        before.clear()
        before.update((p, pool.key_of(p)) for p in range(pool.num_pages) if pool.is_cached(p))
        for seq in engine.scheduler.running.values():  # a window writes from the last known token on
            for page in seq.pages[(seq.num_tokens - 1) // size :]:
                if page in before:
                    problems.append(f"a window may write cached page {page}")
        return schedule(*args)

    def checked_prefill(chunks):
        for c in chunks:
            for index in range(c.start // size, -(-c.end // size)):
                page = c.pages[index]
                if page in before and pool.key_of(page) == before[page]:
                    problems.append(f"prefill writes page {page}, cached before the step")
        return prefill(chunks)

    engine.scheduler.schedule, engine.runner.prefill = snapshot_schedule, checked_prefill
    return problems


@pytest.mark.parametrize("model", ["llama_gqa_llama3", "qwen2_tied", "llama_head_dim"])
def test_outputs_identical_with_caching_on_and_off(tiny_models, model):
    path = tiny_models[model]
    prompts = shared_prefix_prompts(8, 70, 9) + token_prompts(random_prompts(3, [5, 40, 90]))
    prompts.append(dict(prompts[2]))  # an exact repeat: wholly cached but for its last token
    common = dict(num_decode_steps=4, page_size=16, max_model_len=256, max_batch_size=16)
    cases = [
        GREEDY,
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20),
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[17, 99, 250], min_tokens=3),
    ]
    for params in cases:
        on = LLM(path, **common)
        problems = pages_written_are_never_cached(on)
        got = run(on, prompts, params)
        off = LLM(path, enable_prefix_caching=False, **common)
        assert got == run(off, prompts, params), params
        assert on.stats()["prefix_cache_hits"] > 0 and off.stats()["prefix_cache_hits"] == 0
        assert problems == []
    expected = hf_greedy(path, [p["prompt_token_ids"] for p in prompts], 20)
    assert [g[0] for g in run(LLM(path, **common), prompts, GREEDY)] == expected


def test_hit_counts_are_exact(tiny_models):
    """10 prompts sharing a 100-token prefix, page size 16: 6 full pages per later prompt are hits,
    and the 4 prefix tokens of the 7th page are a partial hit (copied from the first prompt's page)."""
    llm = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, page_size=16, max_model_len=256)
    prompts = shared_prefix_prompts(10, 100, 20)
    run(llm, prompts, GREEDY)
    stats = llm.stats()
    assert stats["prefix_cache_queries"] == 10 * 120
    assert stats["prefix_cache_hits"] == 9 * 100
    assert stats["prefill_tokens"] == 120 + 9 * 20  # the prefix is computed once
    # requests admitted in the same step hit the pages that step's prefill computes (one forward
    # writes every layer's K/V, then copies the partial hits, before attending), so arriving
    # together computes the prefix once
    fresh = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, page_size=16, max_model_len=256)
    together = run(fresh, shared_prefix_prompts(4, 100, 20, seed=7), GREEDY, first_alone=False)
    assert fresh.stats()["prefix_cache_hits"] == 3 * 100 and fresh.stats()["prefill_batches"] == 1
    assert fresh.stats()["prefill_tokens"] == 120 + 3 * 20
    off = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, page_size=16, max_model_len=256,
              enable_prefix_caching=False)
    assert together == run(off, shared_prefix_prompts(4, 100, 20, seed=7), GREEDY, first_alone=False)
    # a repeated prompt recomputes only its last token: 7 full pages, and 7 of the 8th page's
    # tokens from the earlier request's page (prompt tokens 112..119, then its answer)
    again = fresh.stats()
    fresh.generate(shared_prefix_prompts(1, 100, 20, seed=7), GREEDY)
    assert fresh.stats()["prefix_cache_hits"] - again["prefix_cache_hits"] == 7 * 16 + 7
    assert fresh.stats()["prefill_tokens"] - again["prefill_tokens"] == 1
    assert fresh.stats()["cached_pages"] > 0
    # a prompt's last, partial page is a candidate too: prompts arriving together whose shared
    # part ends inside the first prompt's last page copy those tokens (37 = 2 pages + 5)
    short = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, page_size=16, max_model_len=256)
    short_prompts = shared_prefix_prompts(4, 37, 5, seed=9)
    got = run(short, short_prompts, GREEDY, first_alone=False)
    assert short.stats()["prefix_cache_hits"] == 3 * 37 and short.stats()["prefill_tokens"] == 42 + 3 * 5
    assert got == run(off, short_prompts, GREEDY, first_alone=False)
    # with caching off nothing is a hit, partial or not
    assert off.stats()["prefix_cache_hits"] == 0 and off.stats()["prefill_tokens"] == 4 * 120 + 4 * 42


def test_partial_hits_identical_across_page_sizes_and_budgets(tiny_models):
    """Partial hits wherever the shared part ends (inside a page, on its edge, in the first page),
    in the same step as their source or later, with chunks smaller than a page: the tokens of
    caching off."""
    path = tiny_models["qwen2_tied"]
    prompts = []
    for length, seed in ((37, 1), (48, 2), (5, 3)):
        prompts += shared_prefix_prompts(3, length, 6, seed=seed)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10)
    for page_size, budget in ((16, 8192), (16, 7), (32, 64)):
        common = dict(num_decode_steps=4, page_size=page_size, max_model_len=128, max_batch_size=8,
                      max_num_batched_tokens=budget)
        on, off = LLM(path, **common), LLM(path, enable_prefix_caching=False, **common)
        problems = pages_written_are_never_cached(on)
        for first_alone in (True, False):
            assert run(on, prompts, params, first_alone) == run(off, prompts, params, first_alone), (page_size, budget)
        assert problems == []
        assert on.stats()["prefill_tokens"] < off.stats()["prefill_tokens"]


def test_generated_pages_are_cached_for_the_next_turn(tiny_models):
    """A chat's next turn resends prompt + answer: the answer's pages are hits too."""
    llm = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, page_size=16, max_model_len=256)
    prompt = random_prompts(1, [40], seed=3)[0]
    answer = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=60))
    turn2 = prompt + answer[0].outputs[0].token_ids + random_prompts(1, [5], seed=4)[0]
    before = llm.stats()["prefix_cache_hits"]
    out = llm.generate({"prompt_token_ids": turn2}, GREEDY)
    hits = llm.stats()["prefix_cache_hits"] - before
    assert hits >= 16 * ((40 + 60 - 16) // 16)  # all but the last window's worth of the answer
    off = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, page_size=16, max_model_len=256,
              enable_prefix_caching=False)
    assert out[0].outputs[0].token_ids == off.generate({"prompt_token_ids": turn2}, GREEDY)[0].outputs[0].token_ids


def test_lru_eviction_under_a_tight_pool_keeps_outputs(tiny_models):
    path = tiny_models["qwen2_tied"]
    groups = [shared_prefix_prompts(4, 48, 8, seed=s) for s in range(5)]
    common = dict(num_decode_steps=4, page_size=16, max_model_len=128, max_batch_size=4, num_pages=30)
    on, off = LLM(path, **common), LLM(path, enable_prefix_caching=False, **common)
    problems = pages_written_are_never_cached(on)
    for prompts in groups + groups[:2]:  # the first groups come back after being evicted (or not)
        assert run(on, prompts, GREEDY) == run(off, prompts, GREEDY)
    assert on.engine.pool.num_evictions > 0 and on.stats()["prefix_cache_hits"] > 0
    assert problems == []


def test_preemption_with_cached_pages(tiny_models):
    """Preempted sequences find their own pages (prompt and produced tokens) when they come back."""
    path = tiny_models["llama_gqa_llama3"]
    prompts = token_prompts(random_prompts(12, [10, 30, 60]))
    common = dict(num_decode_steps=8, page_size=16, max_model_len=256, max_batch_size=16, num_pages=24)
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=40)
    on = LLM(path, **common)
    got = first_tokens(on.generate(prompts, params))
    off = LLM(path, enable_prefix_caching=False, **common)
    assert got == first_tokens(off.generate(prompts, params))
    assert on.stats()["preemptions"] > 0 and on.stats()["prefix_cache_hits"] > 0


def test_page_pool_cache_and_lru():
    pool = PagePool(6)
    a = pool.allocate(3)
    keys = [page_key(b"", [i]) for i in range(3)]
    for page, key in zip(a, keys):
        pool.cache_page(page, key)
    assert pool.lookup(keys) == a and pool.lookup([keys[1]]) == [a[1]] and pool.lookup([b"x"] + keys) == []
    pool.free(a)  # freed in reverse: a[2] least recently used first
    assert pool.num_free == 5 and pool.num_cached == 3
    b = pool.allocate(2)  # the never-keyed pages go first
    assert set(b).isdisjoint(a) and pool.num_cached == 3
    c = pool.allocate(1)  # then the LRU cached page: the tail a[2]
    assert c == [a[2]] and pool.lookup(keys) == a[:2] and pool.num_evictions == 1
    assert pool.free_after_sharing(a[:2]) == 0
    pool.share(a[:2])  # hits on pages nobody held
    assert pool.num_free == 0 and pool.refcount(a[0]) == 1
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.cache_page(b[0], keys[0])  # the key is cached already: b[0] stays unkeyed
    assert not pool.is_cached(b[0])
    off = PagePool(4, enable_caching=False)
    p = off.allocate(1)
    off.cache_page(p[0], keys[0])
    assert off.lookup(keys) == [] and off.num_cached == 0


def test_page_pool_partial_lookup():
    pool = PagePool(8)
    parent = page_key(b"", [1, 2])
    a, b = pool.allocate(2)
    pool.cache_page(a, page_key(parent, [5, 6, 7, 8]), parent, [5, 6, 7, 8])
    pool.cache_page(b, page_key(parent, [5, 6, 0, 0]), parent, [5, 6, 0, 0])
    assert pool.partial_lookup(parent, [5, 6, 7]) == (a, 3)  # the longest common start wins
    assert pool.partial_lookup(parent, [5, 6, 9]) in ((a, 2), (b, 2))
    assert pool.partial_lookup(parent, [4]) == (0, 0) and pool.partial_lookup(b"other", [5]) == (0, 0)
    pool.free([a, b])
    pool.allocate(6)  # 5 never-keyed pages, then the LRU keyed one (b, freed first): forgotten
    assert pool.partial_lookup(parent, [5, 6, 0]) == (a, 2) and pool.num_evictions == 1
    pool.allocate(1)
    assert pool.partial_lookup(parent, [5]) == (0, 0) and pool.num_cached == 0
    # a partial (never keyed) page is listed while held and unlisted when its last holder frees it
    fresh = PagePool(4)
    (c,) = fresh.allocate(1)
    fresh.list_child(c, parent, [7, 7])
    fresh.share([c])
    fresh.free([c])
    assert fresh.partial_lookup(parent, [7, 7, 1]) == (c, 2)
    fresh.free([c])
    assert fresh.partial_lookup(parent, [7, 7, 1]) == (0, 0) and fresh.num_free == 3


def test_scheduler_never_touches_staging_or_the_device():
    """The plan is the scheduler's only word to the runner."""
    source = (PACKAGE / "host" / "scheduler.py").read_text()
    imports = re.findall(r"^(?:from|import) (\S+)", source, flags=re.M)
    allowed = {"__future__", "heapq", "time", "collections", "collections.abc", "dataclasses", ".page_pool", "..plan",
               ".sequence", ".waiting_queue", ".state_slots", ".lora_slots"}
    assert set(imports) <= allowed, set(imports) - allowed
    for word in ("staging", "torch", "DecodeState", "backend", "sampler", "Sampler", "kv_width"):
        assert word not in source, word
    from graphdecode.host.scheduler import Scheduler

    assert "staging" not in Scheduler.__init__.__code__.co_varnames


def test_cache_salt_separates_prefix_cache_entries(tiny_models):
    """vLLM's cache_salt: a request reuses prefix-cache pages only from requests with the same salt (none is
    a salt of its own); the tokens are the same either way; an empty or non-string salt is refused by name."""
    llm = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, max_model_len=256, max_batch_size=4, page_size=8)
    prompt = list(range(5, 45))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def cached(**salt) -> tuple[int, list[int]]:
        out = llm.generate([{"prompt_token_ids": prompt, **salt}], greedy)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first, tokens = cached(cache_salt="alice")
    hit, again = cached(cache_salt="alice")
    assert first == 0 and hit == len(prompt) - 1 and again == tokens  # all but the last token, which is computed
    assert cached(cache_salt="bob") == (0, tokens)
    assert cached() == (0, tokens)  # unsalted: its own entries
    assert cached() == (hit, tokens)
    for bad in ("", 5):
        with pytest.raises(ValueError, match=r"prompts\[0\]: cache_salt must be a non-empty string"):
            llm.generate([{"prompt_token_ids": prompt, "cache_salt": bad}], greedy)


def test_reset_prefix_cache(tiny_models):
    """LLM.reset_prefix_cache (vLLM's): the next prompt computes from scratch, with the same tokens; refused
    (False, nothing forgotten) while a request holds pages; one 'cleared' KV event for routers."""
    llm = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, page_size=16, max_model_len=256)
    prompt = shared_prefix_prompts(1, 60, 4)
    first = llm.generate(prompt, GREEDY)[0]
    again = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    stream = llm.stream(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream)  # running: its pages are held
    assert llm.reset_prefix_cache() is False and llm.stats()["cached_pages"] > 0
    stream.close()
    llm.engine.pool.events = []  # what a KV-event publisher would be handed
    assert llm.reset_prefix_cache() is True
    assert llm.engine.pool.take_events() == [("cleared",)] and llm.stats()["cached_pages"] == 0
    cold = llm.generate(prompt, GREEDY)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    pool = PagePool(4)
    pool.cache_page(pool.allocate(1)[0], page_key(b"", [1]))
    assert pool.reset_cache() is False and pool.num_cached == 1  # held
