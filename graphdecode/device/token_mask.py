"""Packed token bitmasks: which token ids a row may sample, 32 ids per int32 word.

A mask over a V-token vocabulary is ceil(V / 32) int32 words (bit b of word w: token
32 w + b): V / 8 bytes on the device (6 KB for a 49k vocabulary), one per constraint
state (device/structured_tables.py; structured/automaton.py packs them on the host, for
structured outputs and for allowed_token_ids, a one-state automaton). The sampler masks
the logits of the rows' disallowed tokens with one gather, one and, one compare
(`mask_disallowed_`), inside the window: static shapes, no host involvement.
"""

from __future__ import annotations

import torch

from ..kernels.cpu import cpu_kernels_for


def num_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class TokenMaskUnpacker:
    """Per-vocabulary constants of the expansion: each token's word and bit."""

    def __init__(self, vocab_size: int, device):

        self.kernels = cpu_kernels_for(device)  # the CPU's one-pass mask (eager), or None
        ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
        self.word_of = ids // 32  # [V] int64
        bit = (ids % 32).to(torch.int32)
        self.bit_value = torch.bitwise_left_shift(torch.ones_like(bit), bit)  # [V] int32: 1 << (id % 32)

    def mask_disallowed_(self, logits: torch.Tensor, words: torch.Tensor, active: torch.Tensor) -> None:
        """In place: -inf on every token whose bit is clear, in the rows where `active` [R] is set.
        Four passes over [R, V] (gather, and, compare, fill): the window pays this per step."""
        if self.kernels is not None and not torch.compiler.is_compiling():
            return self.kernels.mask_words_(logits, words, active)
        clear = (words.index_select(1, self.word_of) & self.bit_value) == 0
        logits.masked_fill_(clear & active[:, None], float("-inf"))
