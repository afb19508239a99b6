"""The CPU's one-pass Gumbel-max (csrc/cpu_sampling.cpp) against the sampler's torch form (device/sampler.py):
the same tokens, the same noise to the bit up to its logarithms, torch.argmax's ties, NaN and -inf rows, any
thread count; and the sampler and rejection sampling use it on a CPU."""

from __future__ import annotations

import pytest
import torch

from graphdecode.device.sampler import Sampler, uniform_noise
from graphdecode.kernels.cpu import cpu_kernels

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ compiler: the CPU kernels cannot be built here")


def _rows(count: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, vocab, generator=g) * 3
    logits[:, ::7] = float("-inf")  # masked tokens (constraints, top-k) are never drawn
    seeds = torch.randint(-(2**62), 2**62, (count,), generator=g)  # negative seeds too: their bit patterns
    positions = torch.randint(0, 10**6, (count,), generator=g)
    return logits, seeds, positions


@pytest.mark.parametrize("vocab", [49152, 50001, 515, 17])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_tokens_of_torchs_form_at_any_thread_count(vocab, rows):
    sampler = Sampler(vocab, "cpu")
    logits, seeds, positions = _rows(rows, vocab, vocab + rows)
    want = (logits + sampler.gumbel(seeds, positions)).argmax(dim=-1)
    for threads in (1, 2, 3):
        assert torch.equal(KERNELS.gumbel_argmax(logits, seeds, positions, sampler.vocab_keys, threads), want)
    # zero logits: the token of the largest u, which torch computes exactly: the hash and u are the sampler's
    zero = torch.zeros(rows, vocab)
    u = uniform_noise(seeds, positions, sampler.vocab_keys)
    assert torch.equal(KERNELS.gumbel_argmax(zero, seeds, positions, sampler.vocab_keys), u.argmax(dim=-1))


def test_the_noise_is_within_a_few_ulps_of_the_exact_one():
    """logits = -(the exact noise) + 1e-4 at one token: that token wins only if no token's noise is off by
    more than about 1e-4 (float32's ulp at the noise's largest values, ~16.6, is 2e-6)."""
    vocab = 49152
    sampler = Sampler(vocab, "cpu")
    seeds, positions = torch.arange(8) * 7919, torch.arange(8) + 123
    exact = -torch.log(-torch.log(uniform_noise(seeds, positions, sampler.vocab_keys).double()))
    targets = torch.tensor([0, 1, 8, 4095, 4096, 30000, vocab - 8, vocab - 1])
    logits = (-exact).float()
    logits[torch.arange(8), targets] += 1e-4
    assert torch.equal(KERNELS.gumbel_argmax(logits, seeds, positions, sampler.vocab_keys, 2), targets)


def test_ties_nan_and_masked_rows_as_torch_argmax():
    vocab = 515
    sampler = Sampler(vocab, "cpu")
    logits = torch.randn(5, vocab)
    logits[0] = float("-inf")  # nothing allowed: token 0, as torch.argmax
    logits[1, 40], logits[1, 9] = float("nan"), float("nan")  # the first NaN
    logits[2, 300], logits[2, 11] = float("inf"), float("inf")  # the first +inf
    logits[3, 514] = float("inf")  # in the tail past the last whole vector
    logits[4, :] = float("-inf")
    logits[4, 513] = 0.0  # one token allowed, in the tail
    seeds, positions = torch.arange(5), torch.arange(5)
    want = (logits + sampler.gumbel(seeds, positions)).argmax(dim=-1)
    assert want.tolist() == [0, 9, 11, 514, 513]
    for threads in (1, 2):
        assert torch.equal(KERNELS.gumbel_argmax(logits, seeds, positions, sampler.vocab_keys, threads), want)
    with pytest.raises(ValueError, match="gumbel_argmax rejected"):
        KERNELS.gumbel_argmax(logits.double(), seeds, positions, sampler.vocab_keys)


def test_the_sampler_and_rejection_sampling_draw_through_it(monkeypatch):
    """Sampler.draw and rejection_sample's residual draw go through the kernel on a CPU, with the tokens of
    torch's form (the sampler without kernels)."""
    from graphdecode.device import rejection
    from graphdecode.device.sampler import Prepared, SamplerMode, SamplerVariant, SamplingRows

    vocab, rows, d = 515, 4, 2
    sampler, reference = Sampler(vocab, "cpu"), Sampler(vocab, "cpu")
    reference.kernels = None
    calls = []
    real = KERNELS.gumbel_argmax
    monkeypatch.setattr(sampler.kernels, "gumbel_argmax", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(rows * (d + 1), vocab, generator=g)
    params = SamplingRows(temperature=torch.full((rows * (d + 1),), 0.7), top_p=torch.ones(rows * (d + 1)),
                          top_k=torch.zeros(rows * (d + 1), dtype=torch.int32), min_p=torch.zeros(rows * (d + 1)),
                          seed=torch.arange(rows * (d + 1)) + 11, stop_ids=torch.full((rows * (d + 1), 1), -1),
                          min_len=torch.zeros(rows * (d + 1), dtype=torch.int32),
                          max_len=torch.full((rows * (d + 1),), 100, dtype=torch.int32))
    next_pos = torch.arange(rows * (d + 1)) + 3
    variant = SamplerVariant(SamplerMode.SAMPLE)
    prepared = sampler.prepare(logits.clone(), params, next_pos, variant)
    tokens = sampler.draw(prepared, params, next_pos, variant)
    assert calls == [(rows * (d + 1), vocab)]
    assert torch.equal(tokens, reference.draw(reference.prepare(logits.clone(), params, next_pos, variant), params,
                                              next_pos, variant))
    drafts = torch.randint(0, vocab, (rows, d), generator=g)
    proposal = torch.softmax(torch.randn(rows, d, vocab, generator=g), dim=-1)
    args = (Prepared(None, prepared.processed, prepared.greedy), params.seed.view(rows, d + 1),
            next_pos.view(rows, d + 1), drafts, proposal, tokens.view(rows, d + 1))
    got = rejection.rejection_sample(sampler, *args)
    assert calls[-1] == (rows * d, vocab)
    assert torch.equal(got, rejection.rejection_sample(reference, *args))


@pytest.mark.parametrize("twin", [False, True])
def test_sampled_generations_through_llm_are_torchs_form_token_for_token(text_model, twin, monkeypatch):
    """What a user meets: seeded sampled requests (n = 2, top-p on one) through LLM, eager and in the CPU graph
    twin under bounds checks, give the tokens of the sampler's torch form (the kernel taken away), and the
    windows did draw through the kernel."""
    from graphdecode import LLM, SamplingParams

    llm = LLM(text_model, max_model_len=128, max_batch_size=4, cuda_graphs=twin, check_bounds=twin)
    prompts = ["The cat", "One two three", "Hello"]
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=16, n=2),
              SamplingParams(temperature=1.2, top_p=0.9, seed=5, max_tokens=16)]

    def run():
        return [[c.token_ids for c in o.outputs] for p in params for o in llm.generate(prompts, p)]

    sampler = llm.engine.runner.sampler
    calls = []
    real = sampler.kernels.gumbel_argmax
    monkeypatch.setattr(sampler.kernels, "gumbel_argmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    with_kernel = run()
    assert calls  # the windows sampled through the kernel
    sampler.kernels = None
    assert run() == with_kernel
    llm.close()
