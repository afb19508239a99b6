"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) on the device.

For a row sampled at temperature > 0 without a user seed, draft j (drawn from the drafter's distribution
q_j) is accepted with probability min(1, p_j(x) / q_j(x)), p_j the target's distribution at that position
after the processing plain decoding applies (constraint masks, logit bias and bad words, min_tokens,
temperature, top-k / top-p / min-p); at the first rejection the row emits a sample of the normalised
max(0, p_j - q_j), and after d accepted drafts a sample of p_d. Each emitted token is then distributed as
plain decoding's at its position, and a draft is accepted with probability 1 - TV(p, q), above the chance
that coupled Gumbel-max samples of p and q coincide (the exact-match verify, speculative.py).

All randomness is keyed by (seed, position) like the sampler's, in streams of their own (a salted seed):
the acceptance uniforms, and the residual's Gumbel noise; the drafts use the sampler's own stream (the
bonus token at p + d + 1 is the only other draw from it, at a position no draft was drawn for).

Rows with a user seed keep the exact-match verify: their tokens are then plain decoding's bit for bit,
whatever the batch, k, d or the policy's speculate-or-plain choices, which decide where a row's rounds
fall. Rejection sampling's tokens depend on those (a position sampled in a plain window, or as a
residual, or as an accepted draft, draws different noise), so only its distribution is plain decoding's.
"""

from __future__ import annotations

import torch

from .sampler import NOISE_BITS, Prepared, Sampler, _srl, hash32_i32, row_keys, to_i32, unit_interval

ACCEPT_SALT = 0x2545F491  # the acceptance uniforms' stream
RESIDUAL_SALT = 0x68E31DA4  # the residual samples' stream


def uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[...] seeds and positions -> [...] float32 uniform in (0, 1), one per (seed, position)."""
    return unit_interval(_srl(hash32_i32(to_i32(row_keys(seed, position))), 32 - NOISE_BITS))


def rejection_sample(sampler: Sampler, prepared: Prepared, seed: torch.Tensor, next_pos: torch.Tensor,
                     drafts: torch.Tensor, proposal: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """The tokens each position emits under rejection sampling, where drafts are accepted.

    prepared: the verify's [B * Q] rows; seed, next_pos [B, Q]; drafts [B, d]; proposal [B, d, V] (q);
    plain [B, Q]: the sampler's own draws (the token after d accepted drafts). Returns [B, Q]: column j
    the draft where it is accepted, else the residual sample (accept-while-equal then stops there)."""
    rows, d = drafts.shape
    vocab = proposal.shape[-1]
    p = torch.softmax(prepared.processed.view(rows, d + 1, vocab)[:, :d], dim=-1)  # [B, d, V]
    target_p = p.gather(2, drafts[..., None])[..., 0]
    draft_q = proposal.gather(2, drafts[..., None])[..., 0]
    accept = uniform(seed[:, :d] ^ ACCEPT_SALT, next_pos[:, :d]) * draft_q < target_p
    residual = (p - proposal).clamp(min=0)
    resampled = sampler.gumbel_argmax(residual.log().view(rows * d, vocab), (seed[:, :d] ^ RESIDUAL_SALT).reshape(-1),
                                      next_pos[:, :d].reshape(-1)).view(rows, d)
    # p <= q everywhere (p = q up to rounding): nothing left to resample from; p itself then
    resampled = torch.where(residual.sum(dim=-1) > 0, resampled, plain[:, :d])
    return torch.cat([torch.where(accept, drafts, resampled), plain[:, d:]], dim=1)
