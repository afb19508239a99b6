"""On-device sampling with per-row parameters and no host synchronisation.

Randomness is counter-based: the noise for (seed, position, token id) is a hash,
turned into Gumbel noise and added to the tempered logits (Gumbel-max). A request
with seed s therefore draws the same tokens whatever batch row it lands in, whoever
shares the batch, and after a preemption recomputes it. Only plain tensor ops are
used, so the sampler is captured inside the decode-window CUDA graph.

Modes are chosen by the host per window from what the rows need (like vLLM's
all_greedy): GREEDY skips the noise, SAMPLE adds temperature + noise, FILTERED
also applies min_p / top_k / top_p (a sort over the vocabulary).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


class SamplerMode(enum.IntEnum):
    GREEDY = 0
    SAMPLE = 1
    FILTERED = 2


@dataclass
class SamplingRows:
    """Per-row sampling and stop parameters for R rows (views or gathers of the decode state)."""

    temperature: torch.Tensor  # [R] float32; 0 = greedy
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int32; 0 = off
    min_p: torch.Tensor  # [R] float32
    seed: torch.Tensor  # [R] int64
    stop_ids: torch.Tensor  # [R, S] int64; -1 = unused
    min_len: torch.Tensor  # [R] int32: stop ids are masked while the next index < min_len
    max_len: torch.Tensor  # [R] int32: done once the sequence holds max_len tokens


@dataclass
class LogprobsOut:
    sampled: torch.Tensor  # [R] float32: logprob of the sampled token
    rank: torch.Tensor  # [R] int64: 1-based rank of the sampled token
    top_ids: torch.Tensor  # [R, N] int64
    top_logprobs: torch.Tensor  # [R, N] float32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds and token indices -> [R] 32-bit keys."""
    key = hash32((seed & _M32) ^ 0x9E3779B9)
    key = hash32(key ^ ((seed >> 32) & _M32))
    return hash32(key ^ (position & _M32))


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """[R] seeds, [R] positions, [V] vocab keys -> [R, V] float32 uniform in (0, 1)."""
    bits = hash32(row_keys(seed, position)[:, None] ^ vocab_keys[None, :]) >> 8  # 24 random bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


class Sampler:
    def __init__(self, vocab_size: int, device):
        self.vocab_keys = hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x5BD1E995)  # [V]

    def __call__(self, logits, rows: SamplingRows, next_pos, mode: SamplerMode, num_logprobs: int = 0):
        """logits [R, V] float32, next_pos [R] int64 (index of the token being sampled).

        Returns (tokens [R] int64, LogprobsOut | None).
        """
        logprobs = _logprobs(logits, num_logprobs) if num_logprobs else None
        logits = _mask_stop_ids(logits, rows, next_pos)
        greedy = logits.argmax(dim=-1)
        if mode == SamplerMode.GREEDY:
            tokens = greedy
        else:
            temperature = torch.where(rows.temperature > 0, rows.temperature, 1.0)
            scaled = logits / temperature[:, None]
            if mode == SamplerMode.FILTERED:
                scaled = _filter(scaled, rows)
            u = uniform_noise(rows.seed, next_pos, self.vocab_keys)
            gumbel = -torch.log(-torch.log(u))
            sampled = (scaled + gumbel).argmax(dim=-1)
            tokens = torch.where(rows.temperature > 0, sampled, greedy)
        if logprobs is None:
            return tokens, None
        full, top_logprobs, top_ids = logprobs
        sampled_lp = full.gather(1, tokens[:, None])[:, 0]
        rank = (full > sampled_lp[:, None]).sum(dim=-1) + 1
        return tokens, LogprobsOut(sampled_lp, rank, top_ids, top_logprobs)


def _logprobs(logits, num: int):
    """Raw logprobs (before temperature, filters and min_tokens), as vLLM reports them."""
    full = torch.log_softmax(logits, dim=-1)
    top_logprobs, top_ids = full.topk(num, dim=-1)
    return full, top_logprobs, top_ids


def _mask_stop_ids(logits, rows: SamplingRows, next_pos):
    """min_tokens: stop ids cannot be sampled before the row holds min_len tokens."""
    blocked = (next_pos < rows.min_len)[:, None] & (rows.stop_ids >= 0)  # [R, S]
    penalty = torch.where(blocked, float("-inf"), 0.0)
    return logits.scatter_add(1, rows.stop_ids.clamp(min=0), penalty)


def stop_check(tokens, rows: SamplingRows, next_pos, done):
    """New done flags after sampling `tokens` at index next_pos (all [R])."""
    hit_stop = (tokens[:, None] == rows.stop_ids).any(dim=-1)
    return done | hit_stop | (next_pos + 1 >= rows.max_len)


def _filter(scaled, rows: SamplingRows):
    """min_p, then top_k, then top_p renormalised over what is left; others -> -inf."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    top_k = torch.where(rows.top_k > 0, rows.top_k, vocab)
    keep = ranks < top_k[:, None]
    keep &= probs >= rows.min_p[:, None] * probs[:, :1]
    kept = torch.where(keep, probs, 0.0)
    before = kept.cumsum(dim=-1) - kept
    keep &= before < rows.top_p[:, None] * kept.sum(dim=-1, keepdim=True)
    mask = torch.zeros_like(keep).scatter(1, order, keep)
    return scaled.masked_fill(~mask, float("-inf"))
