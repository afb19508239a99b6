"""Penalties: logit_bias, bad words, and repetition / presence / frequency penalties.

Buffers, [B_max, ...] by row:
* `penalized` bool: the row's logit_bias and bad words apply (stale entries of other rows
  stay inert), and its `repetition_penalty`, `presence_penalty`, `frequency_penalty`
  float32 (neutral: 1, 0, 0, which leave logits bit for bit unchanged);
* `token_counts` [B_max, V] int16: bits 0..13 count the row's output tokens (saturating
  at 16383), bit 14 (PROMPT_BIT) marks tokens of its prompt. 2 bytes per (row, token):
  65.7 MB for 256 rows of Llama-3's 128256 tokens;
* `bias_ids` [B_max, L] int64 (-1 unused) and `bias_values` [B_max, L] float32, L =
  max_logit_bias (192 KiB for 256 rows, L = 64);
* `bad_words` [B_max, W, T] int64: W = 2 * max_bad_words token sequences of up to T =
  max_bad_word_tokens, right-aligned, -1 padded (512 KiB for 256 rows, 32 x 8);
* `recent` [B_max, T] int64: the row's last T output tokens, newest last.

A row with penalties is staged when it starts (also after a preemption or a prefix-cache
hit): its parameters, bias entries, bad words, recent tokens, and its token counts as
sparse (token, value) pairs from the prompt and the tokens so far. A row without
penalties sends nothing, unless the previous occupant of its row had some (then its
neutral parameters). Windows with a penalized row update counts and recent tokens as
they sample (`record`); other windows never read these buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import SparseRows, buffer

COUNT_MASK = 0x3FFF  # token_counts bits 0..13: output count, saturating
PROMPT_BIT = 0x4000  # token_counts bit 14: the token is in the prompt
_NEUTRAL = (1.0, 0.0, 0.0)  # repetition, presence, frequency


@dataclass
class PenaltyRows:
    """The penalty inputs of R rows (views or gathers of the buffers)."""

    penalized: torch.Tensor  # [R] bool
    repetition_penalty: torch.Tensor  # [R] float32; 1 = off
    presence_penalty: torch.Tensor  # [R] float32; 0 = off
    frequency_penalty: torch.Tensor  # [R] float32; 0 = off
    token_counts: torch.Tensor  # [R, V] int16: output count | PROMPT_BIT
    bias_ids: torch.Tensor  # [R, L] int64; -1 = unused
    bias_values: torch.Tensor  # [R, L] float32
    bad_words: torch.Tensor  # [R, W, T] int64
    recent: torch.Tensor  # [R, T] int64; -1 = none

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logit_bias, bad words, repetition, then frequency / presence penalties. Modifies
        `logits` [R, V] in place for the first two; returns the processed logits."""
        live = self.penalized[:, None]
        bias = torch.where(live & (self.bias_ids >= 0), self.bias_values, 0.0)  # [R, L]
        logits.scatter_add_(1, self.bias_ids.clamp(min=0), bias)
        last = self.bad_words[:, :, -1]  # [R, W]: the token a word bans
        prefix = self.bad_words[:, :, :-1]  # [R, W, T - 1]: what must just have been produced (-1: nothing)
        produced = (prefix < 0) | (prefix == self.recent[:, None, 1:])
        banned = produced.all(dim=-1) & (last >= 0) & live
        logits.scatter_add_(1, last.clamp(min=0), torch.where(banned, float("-inf"), 0.0))
        counts = self.token_counts
        factor = torch.where(counts != 0, self.repetition_penalty[:, None], 1.0)  # seen in prompt or output
        logits = torch.where(logits > 0, logits / factor, logits * factor)
        output = (counts & COUNT_MASK).to(logits.dtype)  # output counts
        logits -= output * self.frequency_penalty[:, None]
        logits -= output.clamp_(max=1.0).mul_(self.presence_penalty[:, None])  # (count > 0) * presence
        return logits


class Penalties(SparseRows):
    def __init__(self, rows: int, vocab_size: int, max_logit_bias: int, bad_word_slots: int,
                 max_bad_word_tokens: int, device):
        super().__init__(rows, device)

        def buf(*shape, dtype, fill=0):
            return buffer(*shape, dtype=dtype, device=device, fill=fill)

        self.penalized = buf(rows, dtype=torch.bool)
        self.repetition_penalty = buf(rows, dtype=torch.float32, fill=1.0)
        self.presence_penalty = buf(rows, dtype=torch.float32)
        self.frequency_penalty = buf(rows, dtype=torch.float32)
        self.token_counts = buf(rows, vocab_size, dtype=torch.int16)
        self.bias_ids = buf(rows, max_logit_bias, dtype=torch.int64, fill=-1)
        self.bias_values = buf(rows, max_logit_bias, dtype=torch.float32)
        self.bad_words = buf(rows, bad_word_slots, max_bad_word_tokens, dtype=torch.int64, fill=-1)
        self.recent = buf(rows, max_bad_word_tokens, dtype=torch.int64, fill=-1)
        self.vocab_size = vocab_size
        self._last_counts: tuple | None = None  # (key, counts): n children share one computation

    # ------------------------------------------------------------------ host
    def add_row(self, start) -> None:
        params = start.params
        entries = self._entries(params, start.token_ids, start.num_prompt_tokens) if params.needs_penalties else None
        self.stage(start.row, entries)

    def _entries(self, params, token_ids, num_prompt_tokens: int):
        """(floats [3], ints [L + W * T + T]: bias ids, bad words right-aligned, last T output tokens;
        bias values [L]; sparse counts or None)."""
        width = self.bias_ids.shape[1]
        slots, size = self.bad_words.shape[1:]
        ints = np.full(width + slots * size + size, -1, dtype=np.int64)
        values = np.zeros(width, dtype=np.float32)
        if params.logit_bias:
            ids = list(params.logit_bias)
            ints[: len(ids)] = ids
            values[: len(ids)] = [params.logit_bias[t] for t in ids]
        words = ints[width : width + slots * size].reshape(slots, size)
        for i, word in enumerate(params.bad_words_token_ids):
            words[i, size - len(word) :] = word
        recent = tuple(token_ids[num_prompt_tokens:][-size:])
        if recent:
            ints[len(ints) - len(recent) :] = recent
        counts = self._token_counts(token_ids, num_prompt_tokens) if params.needs_token_counts else None
        floats = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
        return floats, ints, values, counts

    def _token_counts(self, token_ids, num_prompt_tokens: int):
        """Sparse token_counts row: (token ids [m] int64, values [m] int16 = output count | PROMPT_BIT)."""
        key = (num_prompt_tokens, tuple(token_ids))
        if self._last_counts is not None and self._last_counts[0] == key:
            return self._last_counts[1]
        tokens = np.asarray(key[1], dtype=np.int64)
        prompt = np.unique(tokens[:num_prompt_tokens])
        output, times = np.unique(tokens[num_prompt_tokens:], return_counts=True)
        ids = np.union1d(prompt, output)
        values = np.zeros(len(ids), dtype=np.int16)
        values[np.searchsorted(ids, prompt)] = PROMPT_BIT
        values[np.searchsorted(ids, output)] += np.minimum(times, COUNT_MASK).astype(np.int16)
        self._last_counts = (key, (ids, values))
        return ids, values

    def flush(self) -> None:
        if not self._pending:
            return
        rows, staged = self.take()
        width = self.bias_ids.shape[1]
        slots, size = self.bad_words.shape[1:]
        neutral = (_NEUTRAL, np.full(width + slots * size + size, -1, dtype=np.int64),
                   np.zeros(width, dtype=np.float32), None)
        staged = [entry if entry is not None else neutral for entry in staged]
        index = self.send(np.asarray(rows, dtype=np.int64))
        self.penalized.index_copy_(0, index, self.send(np.asarray([e is not neutral for e in staged])))
        floats = self.send(np.asarray([e[0] for e in staged], dtype=np.float32))
        for col, target in enumerate((self.repetition_penalty, self.presence_penalty, self.frequency_penalty)):
            target.index_copy_(0, index, floats[:, col])
        ints = self.send(np.stack([e[1] for e in staged]))
        self.bias_ids.index_copy_(0, index, ints[:, :width])
        self.bad_words.index_copy_(0, index, ints[:, width : width + slots * size].reshape(len(rows), slots, size))
        self.recent.index_copy_(0, index, ints[:, width + slots * size :])
        self.bias_values.index_copy_(0, index, self.send(np.stack([e[2] for e in staged])))
        counted = [(r, e[3]) for r, e in zip(rows, staged) if e[3] is not None]
        if counted:  # zero the rows, then set their (token, value) entries
            self.token_counts.index_fill_(0, self.send(np.asarray([r for r, _ in counted], dtype=np.int64)), 0)
            flat = np.concatenate([r * self.vocab_size + ids for r, (ids, _) in counted])
            values = np.concatenate([values for _, (_, values) in counted])
            self.token_counts.view(-1).index_copy_(0, self.send(flat), self.send(values))

    # ---------------------------------------------------------------- window
    def rows(self, rows) -> PenaltyRows:
        """`rows`: a slice (views, for the window) or an index tensor (gathers, for prefill)."""
        return PenaltyRows(**{name: t[rows] for name, t in self.tensors().items()})

    def record(self, rows, tokens: torch.Tensor, live: torch.Tensor) -> None:
        """After sampling `tokens` [R] for `rows` (slice or index): count them and push them on
        the recent-tokens ring, for rows that were live ([R] bool); others stay as they are.
        One token per row: a gather and a scatter of [R] entries, no [R, V] work."""
        index = tokens[:, None]
        if isinstance(rows, slice):
            counts = self.token_counts[rows]
            current = counts.gather(1, index)
        else:
            current = self.token_counts[rows[:, None], index]
        bumped = current + ((current & COUNT_MASK) < COUNT_MASK).to(current.dtype)
        updated = torch.where(live[:, None], bumped, current)
        if isinstance(rows, slice):
            counts.scatter_(1, index, updated)
        else:
            self.token_counts[rows[:, None], index] = updated
        recent = self.recent[rows]
        pushed = torch.cat([recent[:, 1:], index], dim=1)
        self.recent[rows] = torch.where(live[:, None], pushed, recent)
