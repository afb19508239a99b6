"""StructuredTables: constraint automata on the device, read by the window to mask and advance.

One store for every constraint in use (host/structured_store.py places them):
* `allowed`      [S_max, ceil(V / 32)] int32: each state's allowed tokens, a packed
                 bitmask (token_mask.py), expanded per row by the sampler;
* `default_next` [S_max] int32: the next state of an allowed token without an exception;
* `exc_start`, `exc_count` [S_max] int32: each state's slice of the exception arrays;
* `exc_tokens`, `exc_next` [E_max] int32: (token, next state) pairs, sorted by token
                 within a state.
Sizes come from measurement, not a dense states x vocab table: most tokens of a state go
to one next state, so a default per state plus the exceptions is a few MB where the
dense table would be tens (see graphdecode/structured/compiler.py for the numbers).

`advance` finds a row's token among its state's exceptions by a binary search of a fixed
number of steps (enough for min(E_max, V) entries: 16 at a 49k vocabulary), so shapes are
static and the whole mask-sample-advance step runs inside the window (and its CUDA graph)
with no host sync. An eager CPU window calls the C++ twin instead (csrc/cpu_fused.cpp: one
std::lower_bound per row, where the torch search is ~110 small ops). State ids are global
(a constraint's local id + its placement's base). Uploads happen in stream order before
the rows that read them start; tables of a constraint no live row uses may be
overwritten by a later upload, after every window already launched.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.cpu import cpu_kernels_for
from .token_mask import num_words

_NO_TOKEN = (1 << 31) - 1  # pads the exception arrays: greater than every token id


class StructuredTables:
    def __init__(self, max_states: int, max_exceptions: int, vocab_size: int, device):
        def buf(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.int32, device=device)

        self.device = device
        self.allowed = buf(max_states, num_words(vocab_size))
        self.default_next = buf(max_states, fill=-1)
        self.exc_start = buf(max_states)
        self.exc_count = buf(max_states)
        self.exc_tokens = buf(max(1, max_exceptions), fill=_NO_TOKEN)
        self.exc_next = buf(max(1, max_exceptions), fill=-1)
        # lower_bound over any state's slice: a state has at most one exception per token
        self.search_steps = max(1, min(max_exceptions, vocab_size)).bit_length()
        self.automata: dict[str, tuple[object, object]] = {}  # key -> (placement, automaton): host walks
        self.kernels = cpu_kernels_for(device)  # the CPU's advance (eager: one call, not the search's ~110 ops)

    def upload(self, placement, automaton) -> None:
        """Copy one constraint's tables into its placement (state ids made global)."""
        s0, e0 = placement.state_base, placement.exc_base
        states, exceptions = placement.num_states, placement.num_exceptions

        def send(array) -> torch.Tensor:
            host = torch.from_numpy(np.array(array, dtype=np.int32))  # a copy: cached tables may be read-only
            if self.device.type == "cuda":
                host = host.pin_memory()
            return host.to(self.device, non_blocking=True)

        offsets = np.asarray(automaton.exc_offsets, dtype=np.int64)
        default = np.asarray(automaton.default_next, dtype=np.int64)
        self.allowed[s0 : s0 + states] = send(automaton.allowed)
        self.default_next[s0 : s0 + states] = send(np.where(default >= 0, default + s0, -1))
        self.exc_start[s0 : s0 + states] = send(offsets[:-1] + e0)
        self.exc_count[s0 : s0 + states] = send(np.diff(offsets))
        if exceptions:
            self.exc_tokens[e0 : e0 + exceptions] = send(automaton.exc_tokens)
            self.exc_next[e0 : e0 + exceptions] = send(np.asarray(automaton.exc_next, dtype=np.int64) + s0)
        self.automata[placement.key] = (placement, automaton)

    def initial_state(self, placement, output_tokens) -> int:
        """A row's global state after `output_tokens` (a resumed row recomputes it from its outputs)."""
        _, automaton = self.automata[placement.key]
        state = automaton.initial_state
        for token in output_tokens:
            nxt = automaton.next_state(state, token)
            if nxt < 0:  # EOS (or a token past the end): the row stays where it was
                break
            state = nxt
        return placement.state(state)

    def allowed_words(self, states: torch.Tensor) -> torch.Tensor:
        """[R] state ids -> [R, ceil(V / 32)] int32 masks."""
        return self.allowed.index_select(0, states.to(torch.int64))

    def row_inputs(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the sampler reads for rows in `states` [R]: the states, their masks, and whether
        each state allows nothing but EOS (its constraint is complete: min_tokens yields to it)."""
        index = states.to(torch.int64)
        return {"state": states, "words": self.allowed.index_select(0, index),
                "complete": self.default_next.index_select(0, index) < 0}

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[R] state ids and [R] sampled tokens -> [R] next state ids (-1: none, e.g. EOS)."""
        if self.kernels is not None and not torch.compiler.is_compiling():
            return self.kernels.automaton_advance(self, states, tokens)
        index = states.to(torch.int64)
        start = self.exc_start.index_select(0, index).to(torch.int64)
        count = self.exc_count.index_select(0, index).to(torch.int64)
        token = tokens.to(torch.int32)
        last = self.exc_tokens.shape[0] - 1
        lo, length = start, count
        for _ in range(self.search_steps):  # lower_bound(token) in exc_tokens[start : start + count]
            half = length // 2
            probe = self.exc_tokens.index_select(0, (lo + half).clamp(max=last))
            right = (length > 0) & (probe < token)
            lo = torch.where(right, lo + half + 1, lo)
            length = torch.where(right, length - half - 1, half)
        at = lo.clamp(max=last)
        found = (lo < start + count) & (self.exc_tokens.index_select(0, at) == token)
        return torch.where(found, self.exc_next.index_select(0, at), self.default_next.index_select(0, index))
