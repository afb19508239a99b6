"""On-device sampling: reproducible per request whatever the batch, and the right distribution."""

from __future__ import annotations

import math

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.device.sampler import GREEDY, Sampler, SamplerMode, SamplerVariant, SamplingRows
from graphdecode.device.top_filter import filter_logits, filter_sorted
from tests.helpers import first_tokens, random_prompts, token_prompts


def _rows(r: int, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, stop_ids=None) -> SamplingRows:
    return SamplingRows(
        temperature=torch.full((r,), temperature),
        top_p=torch.full((r,), top_p),
        top_k=torch.full((r,), top_k, dtype=torch.int32),
        min_p=torch.full((r,), min_p),
        seed=torch.full((r,), seed, dtype=torch.int64) if isinstance(seed, int) else seed,
        stop_ids=stop_ids if stop_ids is not None else torch.full((r, 2), -1, dtype=torch.int64),
        min_len=torch.zeros(r, dtype=torch.int32),
        max_len=torch.full((r,), 10_000, dtype=torch.int32),
    )


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, max_model_len=256, max_batch_size=32)


def test_seeded_request_same_alone_and_in_a_batch_of_30(llm):
    prompt = {"prompt_token_ids": random_prompts(1, [21], seed=11)[0]}
    mine = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=40)
    alone = llm.generate([prompt], mine)[0].outputs[0].token_ids

    others = random_prompts(30, [3, 17, 60, 120, 9], seed=12)
    other_params = [
        SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], seed=i if i % 2 else None, max_tokens=10 + i)
        for i in range(30)
    ]
    # put it in the middle of the batch, so it lands in another row than when alone
    prompts = token_prompts(others[:13]) + [prompt] + token_prompts(others[13:])
    params = other_params[:13] + [mine] + other_params[13:]
    batched = llm.generate(prompts, params)[13].outputs[0].token_ids
    assert batched == alone
    assert len(set(alone)) > 5  # really sampled, not a degenerate repeat


def test_seeded_sampling_reproducible_and_seed_dependent(llm):
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    a = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=30))[0].outputs[0].token_ids
    b = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=30))[0].outputs[0].token_ids
    c = llm.generate(prompt, SamplingParams(temperature=1.0, seed=8, max_tokens=30))[0].outputs[0].token_ids
    assert a == b
    assert a != c


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    prompts = token_prompts(random_prompts(4, [4, 30], seed=13))
    greedy = first_tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20)))
    top_k = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=20))
    top_p = llm.generate(prompts, SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_tokens=20))
    assert first_tokens(top_k) == greedy
    assert first_tokens(top_p) == greedy


def test_sampler_draws_follow_softmax():
    """20k independent draws (distinct seeds) of a 6-token distribution match its probabilities."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    draws = 20_000
    sampler = Sampler(6, "cpu")
    rows = _rows(draws, temperature=1.0, seed=torch.arange(draws, dtype=torch.int64) * 7919 + 1)
    tokens, _ = sampler(logits.expand(draws, 6), rows, torch.full((draws,), 3, dtype=torch.int64), SamplerVariant(SamplerMode.SAMPLE))
    freq = torch.bincount(tokens, minlength=6).float() / draws
    probs = torch.softmax(logits[0], -1)
    sigma = torch.sqrt(probs * (1 - probs) / draws)
    assert torch.all((freq - probs).abs() < 5 * sigma + 1e-4), (freq, probs)


def test_sampler_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    sampler = Sampler(3, "cpu")
    n = 5000
    seeds = torch.arange(n, dtype=torch.int64)
    pos = torch.zeros(n, dtype=torch.int64)
    hot, _ = sampler(logits.expand(n, 3), _rows(n, temperature=2.0, seed=seeds), pos, SamplerVariant(SamplerMode.SAMPLE))
    cold, _ = sampler(logits.expand(n, 3), _rows(n, temperature=0.25, seed=seeds), pos, SamplerVariant(SamplerMode.SAMPLE))
    assert (cold == 0).float().mean() > 0.95
    assert 0.4 < (hot == 0).float().mean() < 0.6  # softmax([.5, 0, -.5]) -> 0.506


def test_filters_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    def keep(**kw):
        rows = _rows(1, **kw)
        return torch.isfinite(filter_logits(logits.clone(), rows.top_k, rows.top_p, rows.min_p))[0].tolist()

    assert keep(top_k=2) == [True, True, False, False, False]
    assert keep(top_p=0.6) == [True, True, False, False, False]  # 0.5 < 0.6, then 0.7 >= 0.6 stops
    assert keep(top_p=0.5) == [True, False, False, False, False]
    assert keep(min_p=0.25) == [True, True, True, False, False]  # >= 0.125
    # top_p renormalised after top_k: within the top 3 (0.5, 0.2, 0.15 -> .59, .24, .18), p=0.8 keeps 2
    assert keep(top_k=3, top_p=0.8) == [True, True, False, False, False]


def test_the_filters_among_each_rows_likeliest_tokens_keep_what_a_sort_keeps():
    """An eager CPU window looks for each row's kept prefix among its `width` most likely tokens and sorts only
    the rows whose prefix reaches past them (top_k or top_p cutting beyond the candidates); it keeps what sorting
    every row keeps, row for row, whatever the batch company. top_p = 1 cuts nothing, also the sort's."""
    generator = torch.Generator().manual_seed(3)
    vocab, rows = 300, 96
    logits = torch.randn(rows, vocab, generator=generator) * torch.rand(rows, 1, generator=generator) * 6
    logits[::7, 0] += 12  # some rows all but certain
    top_k = torch.randint(0, 4, (rows,), generator=generator) * torch.randint(0, 90, (rows,), generator=generator)
    top_p = torch.where(torch.rand(rows, generator=generator) < 0.3, 1.0,
                        torch.rand(rows, generator=generator)).to(torch.float32)
    min_p = torch.where(torch.rand(rows, generator=generator) < 0.5, 0.0,
                        torch.rand(rows, generator=generator) * 0.2).to(torch.float32)
    top_k = top_k.to(torch.int32)
    want = torch.isfinite(filter_sorted(logits, top_k, top_p, min_p))
    for width in (1, 8, 64, 299):
        got = torch.isfinite(filter_logits(logits, top_k, top_p, min_p, width=width))
        assert torch.equal(got, want), width
        one = torch.isfinite(torch.cat([filter_logits(logits[i:i + 1], top_k[i:i + 1], top_p[i:i + 1],
                                                      min_p[i:i + 1], width=width) for i in range(rows)]))
        assert torch.equal(one, want), width  # a row alone keeps what it keeps in the batch
    kept = want.sum(dim=-1)
    assert (kept < 8).any() and (kept > 64).any() and (kept == vocab).any()  # short prefixes, long ones, none cut
    from graphdecode.device.top_filter import _filter_candidates

    _, unresolved = _filter_candidates(logits, top_k, top_p, min_p, 8)
    assert unresolved.any() and not unresolved.all()  # both paths ran
    # rows whose token is not read (a done row, an inert query: flat logits) are never sorted
    import graphdecode.device.top_filter as top_filter

    sorted_rows = []
    real_sorted = top_filter.filter_sorted

    def counting(scaled, *a):
        sorted_rows.append(scaled.shape[0])
        return real_sorted(scaled, *a)

    top_filter.filter_sorted = counting
    try:
        live = ~unresolved
        live[unresolved.nonzero()[0, 0]] = True  # one unresolved row is read
        got = torch.isfinite(filter_logits(logits, top_k, top_p, min_p, width=8, live=live))
        assert sorted_rows == [1] and torch.equal(got[live], want[live])
    finally:
        top_filter.filter_sorted = real_sorted
    flat = torch.zeros(1, vocab)  # top_p = 1 keeps every token (no rounding of a cumulative sum cuts the tail)
    one = torch.ones(1)
    assert torch.isfinite(filter_sorted(flat, torch.zeros(1, dtype=torch.int32), one, 0 * one)).all()


def test_min_tokens_masks_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 1.0]])  # token 1 (the stop id) would win
    sampler = Sampler(3, "cpu")
    rows = _rows(1, temperature=0.0, stop_ids=torch.tensor([[1, -1]]))
    rows.min_len = torch.tensor([10], dtype=torch.int32)
    masking = SamplerVariant(mask_stops=True)
    tok, _ = sampler(logits.clone(), rows, torch.tensor([4]), masking)
    assert tok.item() == 2
    tok, _ = sampler(logits.clone(), rows, torch.tensor([10]), masking)
    assert tok.item() == 1
    tok, _ = sampler(logits.clone(), rows, torch.tensor([4]), GREEDY)  # the variant without masking
    assert tok.item() == 1


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(50, "cpu")
    rows = _rows(3, temperature=0.5, seed=1)
    tokens, lp = sampler(logits, rows, torch.zeros(3, dtype=torch.int64), SamplerVariant(SamplerMode.SAMPLE, num_logprobs=5))
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp.sampled, ref.gather(1, tokens[:, None])[:, 0], atol=1e-6)
    assert torch.allclose(lp.top_logprobs, ref.topk(5, -1).values, atol=1e-6)
    expected_rank = (ref > ref.gather(1, tokens[:, None])).sum(-1) + 1
    assert torch.equal(lp.rank, expected_rank)
    assert math.isclose(float(lp.top_logprobs[0, 0]), float(ref[0].max()), abs_tol=1e-6)


def test_int32_noise_has_the_int64_hash_bits():
    """The [R, V] hash on int32 gives the same bits as the int64 reference (so seeds keep their streams)."""
    from graphdecode.device.sampler import _M32, hash32, hash32_i32, make_vocab_keys, row_keys, to_i32, uniform_noise

    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 1 << 32, (10_000,), generator=g, dtype=torch.int64)
    x[:4] = torch.tensor([0, 1, (1 << 31) - 1, (1 << 32) - 1])
    assert torch.equal(hash32_i32(to_i32(x)).to(torch.int64) & _M32, hash32(x))
    seeds = torch.randint(-(1 << 62), 1 << 62, (7,), generator=g)
    pos = torch.randint(0, 5000, (7,), generator=g)
    keys64 = hash32(torch.arange(300, dtype=torch.int64) + 0x5BD1E995)
    bits64 = hash32(row_keys(seeds, pos)[:, None] ^ keys64[None, :]) >> 9
    want = (bits64.to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    got = uniform_noise(seeds, pos, make_vocab_keys(300, "cpu"))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert 0 < got.min() and got.max() < 1


def test_noise_stays_inside_the_open_interval_at_its_extremes():
    """Every noise value is strictly inside (0, 1) and its Gumbel transform finite, the largest
    hash included (a u of exactly 1 would give +inf noise, and NaN on a masked -inf logit)."""
    from graphdecode.device.sampler import NOISE_BITS, unit_interval

    extremes = unit_interval(torch.tensor([0, 1, (1 << NOISE_BITS) - 2, (1 << NOISE_BITS) - 1]))
    assert bool((extremes > 0).all() and (extremes < 1).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(extremes))).all())


def test_a_masked_token_is_never_sampled_where_its_noise_is_largest():
    """Search 4096 positions x 4096 tokens of one seed for the (position, token) with the
    largest noise (about one such draw per 16M: ~0.3% of steps over a 49k vocabulary), mask that
    token (top_k, allowed_token_ids and structured masks all write -inf) and sample there."""
    from graphdecode.device.sampler import make_vocab_keys, uniform_noise

    vocab, positions = 4096, torch.arange(4096, dtype=torch.int64)
    seeds = torch.zeros_like(positions)
    noise = uniform_noise(seeds, positions, make_vocab_keys(vocab, "cpu"))
    flat = int(noise.argmax())
    position, token = flat // vocab, flat % vocab
    logits = torch.zeros(1, vocab)
    logits[0, token] = float("-inf")
    sampler = Sampler(vocab, "cpu")
    got, _ = sampler(logits, _rows(1, seed=0), torch.tensor([position]), SamplerVariant(SamplerMode.SAMPLE))
    assert int(got[0]) != token
    top_k = _rows(1, top_k=5, seed=0)  # the token outside the top 5 (all others tie above it)
    logits = torch.zeros(1, vocab)
    logits[0, token] = -50.0
    got, _ = sampler(logits, top_k, torch.tensor([position]), SamplerVariant(SamplerMode.FILTERED))
    assert int(got[0]) != token


def test_row_counts_decide_the_variant():
    from graphdecode.device.sampler import RowCounts

    counts = RowCounts(max_logprobs=20)
    assert counts.variant() == GREEDY
    counts.add(SamplingParams(temperature=0.5))
    assert counts.variant() == SamplerVariant(SamplerMode.SAMPLE)
    counts.add(SamplingParams(temperature=0.5, top_k=3, logprobs=2, min_tokens=4))
    assert counts.variant() == SamplerVariant(SamplerMode.FILTERED, 20, True)
    counts.remove(SamplingParams(temperature=0.5, top_k=3, logprobs=2, min_tokens=4))
    assert counts.variant() == SamplerVariant(SamplerMode.SAMPLE)
    assert RowCounts(5, [SamplingParams(temperature=0, top_k=3)]).variant() == GREEDY  # filters need sampling


def test_stop_ids_are_masked_only_in_windows_with_min_tokens(llm):
    seen = []
    execute = llm.engine.runner.execute

    def recording(plan):
        pending = execute(plan)
        if plan.window is not None and plan.window.decode:
            seen.append(llm.engine.runner.row_counts.variant().mask_stops)
        return pending

    llm.engine.runner.execute = recording
    try:
        prompt = {"prompt_token_ids": [5, 6, 7]}
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=9))
        assert seen and not any(seen)
        seen.clear()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=9, min_tokens=9))
        assert all(seen) and len(out[0].outputs[0].token_ids) == 9
    finally:
        llm.engine.runner.execute = execute
