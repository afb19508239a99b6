"""Speculative rejection sampling (device/rejection.py): unseeded sampled rows with a model drafter emit
tokens distributed as the target's, and accept a draft with probability 1 - TV(p, q); seeded rows keep the
exact-match verify (plain decoding's tokens)."""

from __future__ import annotations

import torch

from graphdecode.attention import TorchAttentionBackend
from graphdecode.device.drafters import ModelDrafter
from graphdecode.device.sampler import Sampler, SamplerMode, SamplerVariant
from graphdecode.device.speculative import speculative_window
from tests.helpers import staged_spec_state

P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])  # the target's next-token distribution
Q = torch.tensor([0.05, 0.10, 0.30, 0.20, 0.05, 0.10, 0.10, 0.10])  # the draft's
D, ROWS, STEPS, PAGE = 3, 48, 4, 16


def fixed(dist: torch.Tensor):
    """A model whose next-token distribution is `dist` whatever the context."""
    return lambda tokens, positions, ctx: dist.log().expand(tokens.shape[0], -1).clone()


def run(seeded: bool, trial: int) -> tuple[list[list[int]], int, int]:
    """One speculative window of STEPS rounds over ROWS rows at temperature 1 (row r's seed
    r + 1000 * trial): (each row's emitted tokens, drafted, accepted)."""
    vocab = P.numel()
    state = staged_spec_state([[3]] * ROWS, vocab, D, steps=STEPS)
    state.temperature[:ROWS] = 1.0
    state.seed[:ROWS] = torch.arange(ROWS) + 1000 * trial
    state.seeded[:ROWS] = seeded
    sampler = Sampler(vocab, "cpu")
    pages = 8 * ROWS + 1

    def backend():
        return TorchAttentionBackend([torch.zeros(pages, 2, PAGE, 1, 4)], 1, 1, 4)

    drafter = ModelDrafter(fixed(Q), backend(), sampler)
    speculative_window(fixed(P), sampler, backend(), state, ROWS, STEPS, PAGE, SamplerVariant(SamplerMode.SAMPLE),
                       4, drafter)
    tokens = [state.out_tokens[row, 1 : 1 + state.out_count[row]].tolist() for row in range(ROWS)]
    spec = state.speculation
    return tokens, int(spec.spec_drafted[:ROWS].sum()), int(spec.spec_accepted[:ROWS].sum())


def test_rejection_sampling_keeps_the_target_distribution():
    tokens, drafted, accepted = [], 0, 0
    for trial in range(4):
        rows, dr, ac = run(seeded=False, trial=trial)
        tokens += [t for row in rows for t in row]
        drafted += dr
        accepted += ac
    counts = torch.bincount(torch.tensor(tokens), minlength=P.numel()).float()
    expected = P * counts.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (chi2, counts.tolist(), expected.tolist())  # 7 degrees of freedom, p = 0.001
    # each draft is accepted with probability a = sum(min(p, q)) = 0.6 while the ones before it were:
    # (a + a^2 + a^3) / 3 of the drafts
    a = float(torch.minimum(P, Q).sum())
    assert abs(accepted / drafted - sum(a**i for i in range(1, D + 1)) / D) < 0.04, accepted / drafted


def test_seeded_rows_keep_the_exact_match_verify():
    """A user seed: every token is the one plain decoding draws at its position (the Gumbel-max of the
    target's logits under the (seed, position) noise), whatever the drafts."""
    sampler = Sampler(P.numel(), "cpu")
    rows, _, accepted = run(seeded=True, trial=0)
    assert accepted > 0
    for row, got in enumerate(rows):
        seed = torch.tensor([row])
        want = [int((P.log() + sampler.gumbel(seed, torch.tensor([i]))[0]).argmax()) for i in range(1, len(got) + 1)]
        assert got == want
