"""TokenAutomaton: a constraint as token-level tables, ready to upload to the device.

A state's allowed tokens are a packed bitmask row (`allowed[s]`, ceil(V / 32) int32
words, bit b of word w = token 32 w + b: the packing of device/token_mask.py). The
next state after an allowed token is `default_next[s]` unless the token is one of the
state's exceptions (`exc_tokens[exc_offsets[s]:exc_offsets[s + 1]]`, sorted, with
`exc_next`); the default is the state's most common next state, so exceptions are few
(inside a free JSON string almost every token stays in the string state; only those
with a quote or a backslash leave it).

Invariants (built by compiler.py, relied on by the device half):
* states are 0 .. S-1, dense; `initial_state` is 0 as built;
* every EOS id is allowed exactly in the accepting states and has no next state (the
  row finishes, finish_reason "stop"); a state whose only way on is EOS allows only EOS;
* every non-accepting state allows at least one token (dead ends are pruned), and
  every allowed non-EOS token has a next state (default or exception);
* ids >= the tokenizer's size (padding rows of the embedding, up to V) are never allowed.

allowed_token_ids is a constraint too (`allowed_ids_automaton`): one state, which allows
exactly the listed ids and loops to itself, never complete (EOS ends the row only if it is
listed, like any stop id, and min_tokens masks it as usual). A request with both a
structured-outputs constraint and allowed_token_ids gets the constraint's automaton with
every state's mask cut to the listed ids (`restrict`). So the device has one masking path
for both, and the table store shares a repeated list like a repeated schema.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, eq=False)
class TokenAutomaton:
    vocab_size: int  # the model's V (config vocab_size; may exceed the tokenizer's)
    initial_state: int  # 0 .. num_states-1
    allowed: np.ndarray  # [S, ceil(V/32)] int32: bit b of word w = token 32w+b allowed
    default_next: np.ndarray  # [S] int32: next state for an allowed token without exception (-1: none)
    exc_offsets: np.ndarray  # [S+1] int32
    exc_tokens: np.ndarray  # [E] int32, ascending within each state
    exc_next: np.ndarray  # [E] int32
    accepting: np.ndarray  # [S] bool: the constraint is complete here (EOS allowed)
    eos_token_ids: tuple[int, ...]
    compile_seconds: float
    key: str
    field: str = "structured_outputs"  # the request field it comes from (errors name it)

    @property
    def num_states(self) -> int:
        return int(self.default_next.shape[0])

    @property
    def num_exceptions(self) -> int:
        return int(self.exc_tokens.shape[0])

    @property
    def max_exceptions(self) -> int:
        return int(np.diff(self.exc_offsets).max(initial=0))

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in (self.allowed, self.default_next, self.exc_offsets, self.exc_tokens,
                                          self.exc_next, self.accepting)))

    def is_allowed(self, state: int, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            return False
        return bool((int(self.allowed[state, token >> 5]) >> (token & 31)) & 1)

    def next_state(self, state: int, token: int) -> int:
        """The state after `token` in `state`; -1 if the token is not allowed there, or is EOS."""
        if not self.is_allowed(state, token) or token in self.eos_token_ids:
            return -1
        lo, hi = int(self.exc_offsets[state]), int(self.exc_offsets[state + 1])
        if hi > lo:
            i = lo + int(np.searchsorted(self.exc_tokens[lo:hi], token))
            if i < hi and int(self.exc_tokens[i]) == token:
                return int(self.exc_next[i])
        return int(self.default_next[state])

    def allowed_tokens(self, state: int) -> np.ndarray:
        """The allowed token ids in `state`, ascending (int64), EOS included where accepting."""
        bits = np.unpackbits(self.allowed[state].astype("<i4").view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.vocab_size])

    def __repr__(self) -> str:
        return (f"TokenAutomaton(key={self.key[:60]!r}, states={self.num_states}, "
                f"exceptions={self.num_exceptions}, max_exceptions={self.max_exceptions}, "
                f"bytes={self.nbytes}, compile_seconds={self.compile_seconds:.3f})")


def num_words(vocab_size: int) -> int:
    """Packed int32 words per mask row: ceil(V / 32)."""
    return -(-vocab_size // 32)


def pack_token_ids(token_ids, vocab_size: int) -> np.ndarray:
    """The mask allowing exactly `token_ids` (each in [0, vocab_size)): [ceil(V / 32)] int32."""
    bits = np.zeros(num_words(vocab_size) * 32, dtype=bool)
    bits[np.asarray(list(token_ids), dtype=np.int64)] = True
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view(np.int32)[:, 0]


def _ids_key(token_ids) -> str:
    ids = np.unique(np.asarray(list(token_ids), dtype=np.int64))
    return hashlib.sha256(ids.tobytes()).hexdigest()[:32]


def allowed_ids_automaton(token_ids, vocab_size: int) -> TokenAutomaton:
    """allowed_token_ids as a one-state constraint: the ids allowed, each looping back."""
    return TokenAutomaton(
        vocab_size=vocab_size, initial_state=0,
        allowed=pack_token_ids(token_ids, vocab_size)[None, :],
        default_next=np.zeros(1, dtype=np.int32),
        exc_offsets=np.zeros(2, dtype=np.int32),
        exc_tokens=np.zeros(0, dtype=np.int32),
        exc_next=np.zeros(0, dtype=np.int32),
        accepting=np.zeros(1, dtype=bool),
        eos_token_ids=(), compile_seconds=0.0,
        key=f"allowed_token_ids:{vocab_size}:{_ids_key(token_ids)}", field="allowed_token_ids",
    )


def restrict(automaton: TokenAutomaton, token_ids) -> TokenAutomaton:
    """The automaton with every state's mask cut to `token_ids` (both fields of a request)."""
    allowed = automaton.allowed & pack_token_ids(token_ids, automaton.vocab_size)[None, :]
    return replace(automaton, allowed=allowed, key=f"{automaton.key}|allowed_token_ids:{_ids_key(token_ids)}")
