"""On-device sampling with per-row parameters and no host synchronisation.

Randomness is counter-based: the noise for (seed, position, token id) is a hash,
turned into Gumbel noise and added to the tempered logits (Gumbel-max). A request
with seed s therefore draws the same tokens whatever batch row it lands in, whoever
shares the batch, and after a preemption recomputes it. Only plain tensor ops are
used, so the sampler is captured inside the decode-window CUDA graph.

The [R, V] part of the hash runs on int32 (wrapping multiplies, masked logical
shifts): half the bytes of an int64 hash, bit for bit the same noise (hash32 is the int64
reference the tests compare with).

A variant is chosen by the host per window from what the rows need (like vLLM's
all_greedy), by one function (`RowCounts.variant`): GREEDY skips the noise, SAMPLE
adds temperature + noise, FILTERED also applies min_p / top_k / top_p (top_filter.py: on an
eager CPU among each row's most likely tokens, in a graph a sort over the vocabulary); logprobs
only when a row asks; stop ids masked (min_tokens) only when a row has min_tokens; the
constraint masks only when a row has a constraint (structured outputs or allowed_token_ids, one
automaton each); the penalty path (logit_bias, bad_words, repetition, presence and frequency
penalties) only when a row has one of them.

Order of logit processing (vLLM's), after the raw logprobs:
0. constraints: a constrained row's automaton state masks every token its state does not
   allow (device/structured_tables.py: structured outputs, and allowed_token_ids as a
   one-state automaton), and after sampling the window moves the state by the sampled token;
1. logit_bias added, bad words masked (-inf on a word's last token when the row's last
   output tokens are the word's other tokens; one-token words always);
2. repetition penalty over prompt and output tokens: positive logits divided by it,
   negative ones multiplied;
3. frequency / presence penalties over output tokens: - count * f - (count > 0) * p;
4. min_tokens: stop ids masked (not for a constrained row whose constraint is complete);
5. temperature (greedy rows: 1), filters, Gumbel noise (GREEDY: argmax).
What logprobs report is the engine's `logprobs_mode` (vLLM's names): "raw_logprobs"
(the default) and "raw_logits" are taken before step 0; "processed_logprobs" and
"processed_logits" after step 5's temperature and filters (before the noise).

Each feature's inputs and logit processing live with its state (device/features/):
penalties.py's `PenaltyRows.apply`, constraints.py's `ConstraintRows.mask_`; the order
above is this sampler's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..kernels.cpu import cpu_kernels_for
from .features.constraints import ConstraintRows
from .features.penalties import PenaltyRows
from .token_mask import TokenMaskUnpacker
from .top_filter import filter_logits

_M32 = 0xFFFFFFFF


def _i32(value: int) -> int:
    """A 32-bit pattern as the int32 value with the same bits."""
    value &= _M32
    return value - (1 << 32) if value >= 1 << 31 else value


_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_MUL1_I32, _MUL2_I32 = _i32(_MUL1), _i32(_MUL2)


class SamplerMode(enum.IntEnum):
    GREEDY = 0
    SAMPLE = 1
    FILTERED = 2


@dataclass(frozen=True)
class SamplerVariant:
    """What a window's (or a prefill's) sampler computes; part of a CUDA graph's key."""

    mode: SamplerMode = SamplerMode.GREEDY
    num_logprobs: int = 0  # 0 = no logprobs, else the engine's max_logprobs
    mask_stops: bool = False  # some row has min_tokens: stop ids are masked until it is reached
    penalties: bool = False  # some row has logit_bias, bad_words or a repetition/presence/frequency penalty
    structured: bool = False  # some row has a constraint (structured outputs, allowed_token_ids): its automaton masks and advances
    speculative: bool = False  # the window drafts and verifies (device/speculative.py); the host decides


GREEDY = SamplerVariant()


class RowCounts:
    """How many rows of a set need each sampler feature; `variant()` is the one place a
    variant is decided. O(1) per row added or removed."""

    def __init__(self, max_logprobs: int, params=()):
        self.max_logprobs = max_logprobs
        self.sampled = self.filtered = self.logprobs = self.min_tokens = self.penalized = self.constrained = 0
        for p in params:
            self.add(p)

    def add(self, params, sign: int = 1) -> None:
        self.sampled += sign * (not params.is_greedy)
        self.filtered += sign * params.needs_filter
        self.logprobs += sign * (params.logprobs is not None)
        self.min_tokens += sign * (params.min_tokens > 0)
        self.penalized += sign * params.needs_penalties
        self.constrained += sign * params.constrained

    def remove(self, params) -> None:
        self.add(params, -1)

    def variant(self) -> SamplerVariant:
        mode = SamplerMode.FILTERED if self.filtered else SamplerMode.SAMPLE if self.sampled else SamplerMode.GREEDY
        return SamplerVariant(
            mode, self.max_logprobs if self.logprobs else 0, self.min_tokens > 0, self.penalized > 0,
            structured=self.constrained > 0,
        )


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
    # the features' inputs, only for variants that read them (None otherwise)
    penalties: PenaltyRows | None = None
    constraint: ConstraintRows | None = None
    # [R] bool: the rows whose token is read (None: every row); the others' (done rows, a verify's queries past
    # a row's drafts) may come out of cheaper work
    live: torch.Tensor | None = None


@dataclass
class Prepared:
    """One sampling step's logits before the noise."""

    raw: torch.Tensor | None  # [R, V]: raw logprobs or logits, where logprobs_mode reports them
    processed: torch.Tensor  # [R, V]: masked, penalised, tempered and filtered (GREEDY: not tempered)
    greedy: torch.Tensor  # [R] int64: the argmax before temperature


@dataclass
class LogprobsOut:
    sampled: torch.Tensor  # [R] float32: logprob of the sampled token
    rank: torch.Tensor  # [R] int64: 1-based rank of the sampled token
    top_ids: torch.Tensor  # [R, N] int64
    top_logprobs: torch.Tensor  # [R, N] float32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding values in [0, 2**32) (the reference)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (>> on int32 is arithmetic)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def hash32_i32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors: the same bits as hash32, with wrapping int32 multiplies."""
    x = x ^ _srl(x, 16)
    x = x * _MUL1_I32
    x = x ^ _srl(x, 15)
    x = x * _MUL2_I32
    return x ^ _srl(x, 16)


def to_i32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 tensors with the same bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds and token indices -> [R] 32-bit keys (int64, [R] only: cheap)."""
    key = hash32((seed & _M32) ^ 0x9E3779B9)
    key = hash32(key ^ ((seed >> 32) & _M32))
    return hash32(key ^ (position & _M32))


NOISE_BITS = 23  # (bits + 0.5) / 2**23 is exact in float32 for every 23-bit value, so u < 1 always


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """NOISE_BITS-bit integers -> float32 in (0, 1), both ends excluded exactly: the largest is
    1 - 2**-24. (With 24 bits, (2**24 - 1 + 0.5) rounds to 2**24 in float32: u = 1, Gumbel
    noise +inf, and +inf on a masked token's -inf logit is NaN, which argmax picks.)"""
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << NOISE_BITS))


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """[R] seeds, [R] positions, [V] int32 vocab keys -> [R, V] float32 uniform in (0, 1)."""
    hashed = hash32_i32(to_i32(row_keys(seed, position))[:, None] ^ vocab_keys[None, :])
    return unit_interval(_srl(hashed, 32 - NOISE_BITS))  # the hash's top NOISE_BITS bits


def make_vocab_keys(vocab_size: int, device) -> torch.Tensor:
    """[V] int32: each token id's hashed key."""
    return to_i32(hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x5BD1E995))


class Sampler:
    def __init__(self, vocab_size: int, device, logprobs_mode: str = "raw_logprobs"):
        self.vocab_keys = make_vocab_keys(vocab_size, device)  # [V] int32
        self.kernels = cpu_kernels_for(device)  # the CPU's one-pass Gumbel-max (eager), or None
        self.masks = TokenMaskUnpacker(vocab_size, device)
        self.logprobs_mode = logprobs_mode  # engine-wide: fixed for every window and graph

    def __call__(self, logits, rows: SamplingRows, next_pos, variant: SamplerVariant = GREEDY):
        """logits [R, V] float32 (masked in place), next_pos [R] int64 (index of the token sampled).

        Returns (tokens [R] int64, LogprobsOut | None).
        """
        prepared = self.prepare(logits, rows, next_pos, variant)
        tokens = self.draw(prepared, rows, next_pos, variant)
        return tokens, self.logprobs(prepared, tokens, variant)

    def prepare(self, logits, rows: SamplingRows, next_pos, variant: SamplerVariant) -> Prepared:
        """Steps 0-5 up to the noise: the processed logits (tempered and filtered unless GREEDY)."""
        raw = None
        if variant.num_logprobs and self.logprobs_mode.startswith("raw"):
            raw = torch.log_softmax(logits, dim=-1) if self.logprobs_mode == "raw_logprobs" else logits.clone()
        if variant.structured:
            rows.constraint.mask_(logits, self.masks)
        if variant.penalties:
            logits = rows.penalties.apply(logits)
        if variant.mask_stops:
            _mask_stop_ids_(logits, rows, next_pos)
        greedy = logits.argmax(dim=-1)
        if variant.mode == SamplerMode.GREEDY:
            return Prepared(raw, logits, greedy)
        temperature = torch.where(rows.temperature > 0, rows.temperature, 1.0)
        processed = logits / temperature[:, None]
        if variant.mode == SamplerMode.FILTERED:
            processed = filter_logits(processed, rows.top_k, rows.top_p, rows.min_p, live=rows.live)
        return Prepared(raw, processed, greedy)

    def draw(self, prepared: Prepared, rows: SamplingRows, next_pos, variant: SamplerVariant) -> torch.Tensor:
        """Gumbel-max over the processed logits with the (seed, position)-keyed noise; greedy rows' argmax."""
        if variant.mode == SamplerMode.GREEDY:
            return prepared.greedy
        sampled = self.gumbel_argmax(prepared.processed, rows.seed, next_pos)
        return torch.where(rows.temperature > 0, sampled, prepared.greedy)

    def gumbel_argmax(self, logits: torch.Tensor, seed: torch.Tensor, next_pos: torch.Tensor) -> torch.Tensor:
        """[R] int64: argmax of logits [R, V] + gumbel(seed, next_pos). On the CPU (eager) in one pass
        (csrc/cpu_sampling.cpp: the same u, its own logarithms, within about an ulp of torch's); elsewhere
        torch's ops, whose ten [R, V] passes cost a CPU 3 ms a step at 16 rows of 49k tokens."""
        if self.kernels is not None and logits.dtype == torch.float32 and not torch.compiler.is_compiling():
            return self.kernels.gumbel_argmax(logits, seed, next_pos, self.vocab_keys)
        return (logits + self.gumbel(seed, next_pos)).argmax(dim=-1)

    def gumbel(self, seed: torch.Tensor, next_pos: torch.Tensor) -> torch.Tensor:
        """[R, V] Gumbel noise keyed by (seed, position, token)."""
        return -torch.log(-torch.log(uniform_noise(seed, next_pos, self.vocab_keys)))

    def logprobs(self, prepared: Prepared, tokens, variant: SamplerVariant) -> LogprobsOut | None:
        """What logprobs_mode reports for `tokens` [R] and the top entries (None without logprobs)."""
        if not variant.num_logprobs:
            return None
        if prepared.raw is not None:
            values = prepared.raw
        elif self.logprobs_mode == "processed_logprobs":
            values = torch.log_softmax(prepared.processed, dim=-1)
        else:
            values = prepared.processed
        return _logprobs_out(values, tokens, variant.num_logprobs)


def _logprobs_out(values, tokens, num: int) -> LogprobsOut:
    """The sampled token's value and 1-based rank, and the top `num`, of values [R, V] (log
    probabilities or logits, as logprobs_mode says)."""
    top_values, top_ids = values.topk(num, dim=-1)
    sampled = values.gather(1, tokens[:, None])[:, 0]
    rank = (values > sampled[:, None]).sum(dim=-1) + 1
    return LogprobsOut(sampled, rank, top_ids, top_values)


def _mask_stop_ids_(logits, rows: SamplingRows, next_pos) -> None:
    """min_tokens, in place: stop ids cannot be sampled before the row holds min_len tokens,
    except by a constrained row whose constraint is complete (its state allows only EOS: masking
    it would leave nothing to sample; the constraint wins)."""
    early = next_pos < rows.min_len  # [R]
    if rows.constraint is not None:
        early = early & ~(rows.constraint.constrained & rows.constraint.complete)
    blocked = early[:, None] & (rows.stop_ids >= 0)  # [R, S]
    penalty = torch.where(blocked, float("-inf"), 0.0)
    logits.scatter_add_(1, rows.stop_ids.clamp(min=0), penalty)


def stop_check(tokens, rows: SamplingRows, next_pos, done):
    """New done flags after sampling `tokens` at index next_pos (all [R])."""
    hit_stop = (tokens[:, None] == rows.stop_ids).any(dim=-1)
    return done | hit_stop | (next_pos + 1 >= rows.max_len)
