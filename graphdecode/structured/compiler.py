"""Constraint -> regular expression -> token-level DFA (a TokenAutomaton).

1. The regex: `choice` is an alternation of the escaped strings; `regex` is used as
   given; `json` goes through outlines-core's `build_regex_from_schema` with the
   whitespace pattern `WHITESPACE = "[ ]?"`: at most one space around `:` `,` and
   inside brackets, no newlines (so both `{"a":1}` and json.dumps' `{"a": 1}` style
   are allowed, and the model cannot spend tokens on free whitespace); `json_object`
   is any JSON object through our own pattern with bounded nesting:
   `JSON_OBJECT_DEPTH = 2` levels of containers, the top-level object included (so
   `{"a": {"b": 1}, "c": [1, "x"]}` is allowed, `{"a": [{"b": 1}]}` and `{"a": [[1]]}`
   are not: see the measurements for why not 3), the same whitespace rule, strings
   with all the JSON escapes (`\\uXXXX` included).
2. The token DFA: outlines-core's `Index(regex, Vocabulary)`, the Vocabulary made
   offline from our tokenizer (vocabulary.py: the bytes each token stands for).
3. The tables: outlines-core's states renumbered densely in BFS order from the initial
   state (so it is 0), states that cannot reach an accepting state pruned (and the
   tokens leading to them), EOS allowed exactly in accepting states, each state's most
   common next state as its default and the other tokens as sorted exceptions.

The end marker: outlines-core (0.2.14) keeps a token only if the text before its last byte is
not already a whole match, or the text with it is one (its DFA reports matches a byte late),
so from a state where the output could end, it drops every token that goes on into text that
is not yet complete: with `cat|category`, "category" could not be written, nor `(ab)+` past
one "ab", nor an integer past its first digit, nor text free until a marker opens something
that must close (a tool call). So the index is built for the regex followed by an end marker,
a NUL byte (`END`) the vocabulary gives a token of its own (vocabulary.end_token): no prefix
of an output is ever a whole match, every continuation is kept, and a state accepts where the
end marker's token leads to a final state. The marker's token, and any transition into a
state after a NUL, is then dropped (a NUL never appears in an output).

Measured (SmolLM2-135M's 49,152-token vocabulary, V = 49,152; 2 shared CPU cores): an
8-field schema (3 free strings, an integer, a number, a boolean, a 3-value enum, an
array of 1-4 strings, a nested object with 2 required + 1 optional string fields;
tests/unit/test_structured_compile.py::test_smollm2_schema_measurement re-measures it):
  286 states, 3,721 exceptions (at most 319 in one state), 1.79 MB of tables (the
  [286, 1536] int32 masks are nearly all of it; 120 distinct rows); compile 0.5-0.6 s
  cold (outlines-core Index 0.30 s, tables 0.22 s, plus the .npz write), and once per
  tokenizer 0.17 s to read its vocabulary + 0.04-0.2 s for outlines-core's Vocabulary;
  a memory hit ~6 us, a disk hit ~2-2.5 ms (a 0.78 MB .npz: masks stored once per
  distinct row). With no free whitespace ("") the same schema is 237 states, 1.49 MB.
  json_object at depth 2: 444 states, 12,353 exceptions, 2.83 MB, 1.2-1.3 s; at depth 3
  it would be 1,804 states, 11.5 MB and 13-14 s (each level repeats the one below 4
  times in the regex; most of the time is outlines-core's DFA build, which for this
  pattern is oddly slow: the same pattern after a literal prefix builds ~100x faster),
  hence depth 2. A schema with a free-form `{"type": "object"}` property gets
  outlines-core's own depth-3 pattern: 1,636 states, 10.3 MB, 3.6 s. outlines-core's
  Index releases the GIL while it builds (a compile thread does not stall the host).
Known outlines-core limits (0.2.14): schema strings accept no `\\uXXXX` escapes; numeric
bounds (minimum, maximum) are not enforced by it: integer ranges of at most
MAX_ENUMERATED_INTEGERS values are rewritten to the enum of their values here (exact),
wider integer ranges and number bounds stay unenforced; `regex` is Rust syntax.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict

import numpy as np

from .automaton import TokenAutomaton
from .budget import (
    CAPPED_FROM,
    MAX_ESTIMATED_STATES,
    CompileBudget,
    cap_repetitions,
    check_states,
    estimate_states,
)
from .params import StructuredOutputsParams
from .vocabulary import TokenizerVocab, end_token, outlines_vocabulary

COMPILER_VERSION = 3  # bump when the tables for the same constraint would change
END = r"\x00"  # the end marker after every constraint's regex (see the module docstring)
WHITESPACE = r"[ ]?"
JSON_OBJECT_DEPTH = 2
MAX_ENUMERATED_INTEGERS = 1024  # integer ranges up to this many values are enforced exactly (as an enum)

_META = set("\\.+*?()|[]{}^$#&-~")


def escape_literal(text: str) -> str:
    """`text` as a regex (Rust syntax) matching exactly itself."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            out.append(f"\\x{{{ord(ch):X}}}")
    return "".join(out)


JSON_STRING = r'"(?:[^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
JSON_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"


def _json_value(depth: int, ws: str) -> str:
    alts = [JSON_STRING, JSON_NUMBER, "true", "false", "null"]
    if depth > 0:
        alts += [_json_object(depth, ws), _json_array(depth, ws)]
    return "(?:" + "|".join(alts) + ")"


def _json_object(depth: int, ws: str) -> str:
    member = JSON_STRING + ws + ":" + ws + _json_value(depth - 1, ws)
    return r"\{" + ws + "(?:" + member + "(?:" + ws + "," + ws + member + ")*" + ws + r")?\}"


def _json_array(depth: int, ws: str) -> str:
    item = _json_value(depth - 1, ws)
    return r"\[" + ws + "(?:" + item + "(?:" + ws + "," + ws + item + ")*" + ws + r")?\]"


def json_object_regex(depth: int = JSON_OBJECT_DEPTH, whitespace: str = WHITESPACE) -> str:
    """Any JSON object whose containers nest at most `depth` deep (the object itself is 1)."""
    if depth < 1:
        raise ValueError("depth must be >= 1")
    return _json_object(depth, whitespace)


def constraint_regex(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind == "regex":
        return params.regex
    if kind == "choice":
        return "(?:" + "|".join(escape_literal(c) for c in params.choice) + ")"
    if kind == "json_object":
        return json_object_regex()
    if kind == "json":
        from outlines_core.json_schema import build_regex_from_schema

        schema = _enumerate_bounded_integers(json.loads(params.schema_text()))
        return build_regex_from_schema(json.dumps(schema, separators=(",", ":"), ensure_ascii=False), WHITESPACE)
    raise ValueError(f"structured_outputs.{kind}: not supported")


def _enumerate_bounded_integers(node):
    """outlines-core does not enforce integer bounds: an integer with a minimum and a maximum
    (exclusive ones too) spanning at most MAX_ENUMERATED_INTEGERS values becomes the enum of
    them, which it enforces exactly. Wider ranges stay unbounded (docs/structured.md)."""
    if isinstance(node, list):
        return [_enumerate_bounded_integers(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _enumerate_bounded_integers(value) for key, value in node.items()}
    if node.get("type") != "integer":
        return node
    low, high = node.get("minimum"), node.get("maximum")
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
        low = max(low if low is not None else -math.inf, math.floor(node["exclusiveMinimum"]) + 1)
    if isinstance(node.get("exclusiveMaximum"), (int, float)) and not isinstance(node["exclusiveMaximum"], bool):
        high = min(high if high is not None else math.inf, math.ceil(node["exclusiveMaximum"]) - 1)
    if low is None or high is None or not math.isfinite(low) or not math.isfinite(high):
        return node
    low, high = math.ceil(low), math.floor(high)
    if high < low or high - low + 1 > MAX_ENUMERATED_INTEGERS:
        return node
    rest = {k: v for k, v in node.items() if k not in ("type", "minimum", "maximum", "exclusiveMinimum",
                                                        "exclusiveMaximum", "multipleOf")}
    step = node.get("multipleOf")
    values = [v for v in range(low, high + 1) if not (isinstance(step, int) and step > 0 and v % step)]
    return {**rest, "enum": values}


_OV_LOCK = threading.Lock()
_OUTLINES_VOCABS: OrderedDict[str, object] = OrderedDict()


def cached_outlines_vocabulary(vocab: TokenizerVocab):
    with _OV_LOCK:
        ov = _OUTLINES_VOCABS.get(vocab.fingerprint)
        if ov is not None:
            _OUTLINES_VOCABS.move_to_end(vocab.fingerprint)
            return ov
    ov = outlines_vocabulary(vocab)
    with _OV_LOCK:
        _OUTLINES_VOCABS[vocab.fingerprint] = ov
        while len(_OUTLINES_VOCABS) > 4:
            _OUTLINES_VOCABS.popitem(last=False)
    return ov


def build_index(regex: str, vocab: TokenizerVocab, field: str = "regex"):
    """outlines-core's Index of `regex` over `vocab` (ValueError naming the field if it fails)."""
    from outlines_core import Index

    try:
        return Index(regex, cached_outlines_vocabulary(vocab))
    except ValueError as e:
        raise ValueError(f"structured_outputs.{field}: cannot be compiled for this tokenizer: {e}") from None


def _pack_rows(state_of: np.ndarray, token_of: np.ndarray, num_states: int, vocab_size: int) -> np.ndarray:
    """[S, ceil(V/32)] int32 with bit (state_of[i], token_of[i]) set."""
    words = -(-vocab_size // 32)
    out = np.zeros((num_states, words), dtype="<i4")
    order = np.argsort(state_of, kind="stable")
    state_of, token_of = state_of[order], token_of[order]
    chunk = max(1, (64 << 20) // (words * 32))  # ~64 MB of booleans at a time
    for lo in range(0, num_states, chunk):
        hi = min(num_states, lo + chunk)
        a, b = np.searchsorted(state_of, [lo, hi])
        bits = np.zeros((hi - lo, words * 32), dtype=bool)
        bits[state_of[a:b] - lo, token_of[a:b]] = True
        packed = np.packbits(bits.reshape(hi - lo, words, 32), axis=2, bitorder="little")
        out[lo:hi] = packed.view("<i4")[:, :, 0]
    return out.astype(np.int32, copy=False)


def automaton_from_index(index, vocab: TokenizerVocab, key: str, started: float | None = None) -> TokenAutomaton:
    started = time.perf_counter() if started is None else started
    eos_outlines, end = vocab.eos_token_ids[0], end_token(vocab)
    transitions = index.get_transitions()  # {state: {token: next state}}
    initial = index.get_initial_state()
    ended = set(index.get_final_states())  # after the end marker
    finals = {s for s, row in transitions.items() if row.get(end) in ended}  # where the output may end
    edges: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for s, row in transitions.items():
        toks = np.fromiter(row.keys(), dtype=np.int64, count=len(row))
        nxt = np.fromiter(row.values(), dtype=np.int64, count=len(row))
        keep = (toks != eos_outlines) & (toks != end) & ~np.isin(nxt, list(ended))
        edges[s] = (toks[keep], nxt[keep])
    edges.setdefault(initial, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    for s in finals:
        edges.setdefault(s, (np.zeros(0, np.int64), np.zeros(0, np.int64)))

    # live: states from which an accepting state is reachable
    reverse: dict[int, set[int]] = {}
    for s, (_, nxt) in edges.items():
        for t in np.unique(nxt).tolist():
            reverse.setdefault(t, set()).add(s)
    live = set(finals)
    work = list(live)
    while work:
        t = work.pop()
        for s in reverse.get(t, ()):
            if s not in live:
                live.add(s)
                work.append(s)
    if initial not in live:
        raise ValueError(f"structured_outputs.{key.split(':', 1)[0]}: no output of this tokenizer's tokens "
                         "can satisfy the constraint")

    # BFS from the initial state over edges into live states: the dense numbering
    live_ids = np.array(sorted(live), dtype=np.int64)
    order = [initial]
    number = {initial: 0}
    pruned: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    i = 0
    while i < len(order):
        s = order[i]
        i += 1
        toks, nxt = edges.get(s, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        pos = np.searchsorted(live_ids, nxt)
        ok = (pos < len(live_ids)) & (live_ids[np.minimum(pos, len(live_ids) - 1)] == nxt)
        toks, nxt = toks[ok], nxt[ok]
        pruned[s] = (toks, nxt)
        for t in np.unique(nxt).tolist():
            if t not in number:
                number[t] = len(order)
                order.append(t)
    num_states = len(order)
    old_sorted = np.array(sorted(number), dtype=np.int64)
    new_of_sorted = np.array([number[o] for o in old_sorted.tolist()], dtype=np.int64)

    default_next = np.full(num_states, -1, dtype=np.int32)
    accepting = np.zeros(num_states, dtype=bool)
    exc_counts = np.zeros(num_states, dtype=np.int64)
    exc_tok_parts, exc_next_parts, state_parts, token_parts = [], [], [], []
    eos = np.asarray(vocab.eos_token_ids, dtype=np.int64)
    for new, old in enumerate(order):
        toks, nxt = pruned[old]
        srt = np.argsort(toks, kind="stable")
        toks = toks[srt]
        nxt_new = new_of_sorted[np.searchsorted(old_sorted, nxt[srt])]
        if len(toks):
            default = int(np.bincount(nxt_new).argmax())
            default_next[new] = default
            exc = nxt_new != default
            exc_tok_parts.append(toks[exc])
            exc_next_parts.append(nxt_new[exc])
            exc_counts[new] = int(exc.sum())
        allowed_ids = toks
        if old in finals:
            accepting[new] = True
            allowed_ids = np.concatenate([toks, eos])
        state_parts.append(np.full(len(allowed_ids), new, dtype=np.int64))
        token_parts.append(allowed_ids)

    cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64))
    allowed = _pack_rows(cat(state_parts), cat(token_parts), num_states, vocab.vocab_size)
    exc_offsets = np.zeros(num_states + 1, dtype=np.int32)
    np.cumsum(exc_counts, out=exc_offsets[1:])
    return TokenAutomaton(
        vocab_size=vocab.vocab_size,
        initial_state=0,
        allowed=allowed,
        default_next=default_next,
        exc_offsets=exc_offsets,
        exc_tokens=cat(exc_tok_parts).astype(np.int32),
        exc_next=cat(exc_next_parts).astype(np.int32),
        accepting=accepting,
        eos_token_ids=vocab.eos_token_ids,
        compile_seconds=time.perf_counter() - started,
        key=key,
    )


_BYTE_VOCAB = None
# outlines-core's index and the transitions dict read from it, per (state, token) transition:
# measured 106 bytes on SmolLM2 ([a-z]{1,300}: 3.44M transitions, +365 MB peak RSS)
BYTES_PER_TRANSITION = 110


def _byte_vocabulary():
    """outlines-core's Vocabulary of the 256 single bytes: any valid regex compiles over it."""
    global _BYTE_VOCAB
    if _BYTE_VOCAB is None:
        from outlines_core import Vocabulary

        _BYTE_VOCAB = Vocabulary(256, {bytes([b]): [b] for b in range(256)})
    return _BYTE_VOCAB


def byte_index(regex: str, field: str):
    """outlines-core's index of `regex` over single bytes (its DFA, about as costly to build):
    a ValueError naming the field if it is invalid, unsupported or matches no string."""
    from outlines_core import Index

    try:
        return Index(regex, _byte_vocabulary())
    except ValueError as e:
        msg = str(e)
        if "incompatible with the regex" in msg:
            raise ValueError(f"structured_outputs.{field}: the regular expression matches no string") from None
        raise ValueError(
            f"structured_outputs.{field}: unsupported or invalid regular expression ({msg}); the syntax is Rust "
            "`regex`: no lookaround, no backreferences"
        ) from None


def estimate_transitions(index, vocab: TokenizerVocab, stop_above: int | None = None) -> int:
    """An upper bound on the (state, token) transitions of the token index: over the byte DFA's
    states (walked from the initial one), the tokens whose first byte the state allows
    (outlines-core walks each of them). With `stop_above`, the walk stops as soon as the total
    passes it (an over-budget constraint is told after a few hundred states, not all of them)."""
    first = np.zeros(257, dtype=np.int64)
    for data in vocab.token_bytes:
        if data:
            first[data[0]] += 1
    total, start = 0, index.get_initial_state()
    seen, pending = {start}, [start]
    while pending:
        state = pending.pop()
        allowed = [b for b in index.get_allowed_tokens(state) if 0 <= b < 256]
        total += int(first[allowed].sum())
        if stop_above is not None and total > stop_above:
            return total
        for b in allowed:
            nxt = index.get_next_state(state, b)
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                pending.append(nxt)
    return total


def check_budget(index, vocab: TokenizerVocab, field: str, budget: CompileBudget) -> int:
    """The token index's estimated memory against the budget (ValueError naming the field)."""
    limit = budget.memory_bytes // BYTES_PER_TRANSITION
    transitions = estimate_transitions(index, vocab, stop_above=limit)
    if transitions > limit:
        raise ValueError(
            f"structured_outputs.{field}: the constraint needs more than {transitions:,} (state, token) transitions "
            f"over this vocabulary, more than {transitions * BYTES_PER_TRANSITION >> 20} MiB to compile, past its "
            f"memory budget of {budget.memory_bytes >> 20} MiB (structured_compile_memory_bytes); lower its "
            "repetition counts (maxLength, maxItems, {m,n}) or its number of choices")
    return transitions


def check_budget_growing(regex: str, vocab: TokenizerVocab, field: str, budget: CompileBudget,
                         first_cap: int = 64) -> int:
    """check_budget over byte DFAs of `regex` with its counted repetitions capped (at `first_cap`,
    then at least twice the last cap, as far as its transitions extrapolate to the budget), then
    of `regex` itself. Each capped automaton embeds in the next: a long repetition over the
    budget is refused from a DFA a fraction of the full one's size. Where `regex` has at most
    CAPPED_FROM positions, its own DFA only. The full regex's build reports what is wrong with
    it (a capped version that fails to build is passed over)."""
    limit = budget.memory_bytes // BYTES_PER_TRANSITION
    cap = first_cap if estimate_states(regex) > CAPPED_FROM else None
    while True:
        version = regex if cap is None else cap_repetitions(regex, cap)
        try:
            dfa = byte_index(version, field)
        except ValueError:
            if version == regex:
                raise
            dfa = None
        transitions = 0 if dfa is None else check_budget(dfa, vocab, field, budget)
        if version == regex:
            return transitions
        cap = max(2 * cap, math.ceil(1.5 * cap * limit / max(transitions, 1)))


def compile_automaton(params: StructuredOutputsParams, vocab: TokenizerVocab,
                      budget: CompileBudget | None = None) -> TokenAutomaton:
    """Compile (no caching): params -> regex -> outlines-core Index -> tables. The regex's byte-level
    DFA comes first (its errors name the field); with a budget, the token index's size is
    estimated from it and checked (budget.py) before the costly index is built."""
    started = time.perf_counter()
    regex = constraint_regex(params)
    field = params.kind
    check_states(regex, field, MAX_ESTIMATED_STATES, "no constraint may need more")
    if budget is None:
        byte_index(regex, field)  # clear errors for a regex outlines-core rejects or that matches nothing
    else:
        check_budget_growing(regex, vocab, field, budget)
    index = build_index(f"(?:{regex}){END}", vocab, field)
    return automaton_from_index(index, vocab, params.key(), started)
