"""Structured outputs under sampling, on a real 49k vocabulary (SmolLM2-135M-Instruct).

Greedy decoding follows one path through a constraint's automaton; sampling at temperature
1 wanders into every corner of it, and draws noise at its extremes. These tests check:
* the automaton's tables against outlines-core's index for every (state, token) pair, not
  only the pairs a walk reaches;
* many seeded requests at temperature 1, with top-p / top-k, penalties, n > 1 and
  speculation, through `LLM.generate`: every output's every token is allowed where it was
  sampled, every output parses and validates with `jsonschema`, and speculation changes
  no token.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from graphdecode import LLM, SamplingParams, StructuredOutputsParams
from graphdecode.structured import compile_constraint, compiler
from graphdecode.structured.vocabulary import tokenizer_vocab

# the schema of the report: bounded string, integer range, array of enums, nested numbers, boolean
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"enum": ["old", "big", "coastal", "green"]}, "minItems": 1,
                 "maxItems": 3},
        "coords": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                   "required": ["lat", "lon"], "additionalProperties": False},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "tags", "coords", "capital"],
    "additionalProperties": False,
}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "Describe a city as JSON. "
ENGINE = dict(num_decode_steps=8, max_model_len=384, max_batch_size=16, buckets=[1, 4, 16])


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, **ENGINE)


def _automaton(llm, schema):
    """The tables the engine compiles for `schema` (the same compile and cache key)."""
    cfg = llm.config.model_config
    return compile_constraint(StructuredOutputsParams(json=schema), llm.get_tokenizer(), cfg.vocab_size,
                              cfg.eos_token_ids)


def assert_follows_automaton(automaton, token_ids: list[int], finished: bool) -> None:
    """Every token is allowed in the state the tokens before it lead to; a finished ("stop")
    output ends with EOS from an accepting state."""
    state = automaton.initial_state
    for i, token in enumerate(token_ids):
        assert automaton.is_allowed(state, token), f"token {i} ({token}) is not allowed in state {state}"
        state = automaton.next_state(state, token)
        if state < 0:
            assert i == len(token_ids) - 1 and token in automaton.eos_token_ids
            return
    assert not finished, "a stop without EOS"


def check_outputs(llm, outputs, schema) -> list[list[int]]:
    """Each output follows the automaton token by token; each that stopped parses and validates
    (one cut by max_tokens is a valid prefix). Most stop: the check is not vacuous."""
    automaton = _automaton(llm, schema)
    tokens, stopped = [], 0
    for out in outputs:
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length"), c
            assert_follows_automaton(automaton, c.token_ids, c.finish_reason == "stop")
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)
                stopped += 1
            tokens.append(list(c.token_ids))
    assert stopped >= len(tokens) / 2, f"only {stopped} of {len(tokens)} outputs finished"
    return tokens


def test_automaton_agrees_with_outlines_core_on_every_state_and_token(llm):
    """Pair each of our states with outlines-core's (from the initial pair, over every allowed
    token) and compare whole rows: the allowed set (outlines-core's, less tokens into states
    that cannot finish, EOS exactly where final) and every token's next state."""
    tokenizer = llm.get_tokenizer()
    vocab_size = llm.config.model_config.vocab_size
    eos = tuple(llm.config.model_config.eos_token_ids)
    automaton = _automaton(llm, CITY)
    vocab = tokenizer_vocab(tokenizer, vocab_size, eos)
    index = compiler.build_index(compiler.constraint_regex(StructuredOutputsParams(json=CITY)), vocab)
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    eos_outlines = vocab.eos_token_ids[0]
    # outlines-core states that can reach a final state (computed here, not by the compiler)
    reverse: dict[int, set[int]] = {}
    for s, row in transitions.items():
        for t, nxt in row.items():
            if t != eos_outlines:
                reverse.setdefault(nxt, set()).add(s)
    live, work = set(finals), list(finals)
    while work:
        for s in reverse.get(work.pop(), ()):
            if s not in live:
                live.add(s)
                work.append(s)
    ours_of: dict[int, int] = {}
    pending = [(automaton.initial_state, index.get_initial_state())]
    seen = {automaton.initial_state: index.get_initial_state()}
    while pending:
        s, o = pending.pop()
        row = {t: n for t, n in transitions.get(o, {}).items() if t != eos_outlines and n in live}
        theirs = np.array(sorted(row), dtype=np.int64)
        ours = automaton.allowed_tokens(s)
        ours_non_eos = ours[~np.isin(ours, eos)]
        assert np.array_equal(ours_non_eos, theirs), f"state {s}: allowed tokens differ from outlines-core's"
        assert bool(automaton.accepting[s]) == (o in finals)
        assert np.isin(eos, ours).all() == (o in finals) and (np.isin(eos, ours).any() == (o in finals))
        # every token's next state, vectorised: the default, then the exceptions
        nxt = np.full(len(theirs), automaton.default_next[s], dtype=np.int64)
        lo, hi = automaton.exc_offsets[s], automaton.exc_offsets[s + 1]
        at = np.searchsorted(theirs, automaton.exc_tokens[lo:hi])
        nxt[at] = automaton.exc_next[lo:hi]
        their_next = np.array([row[t] for t in theirs.tolist()], dtype=np.int64)
        for ours_next, o_next in set(zip(nxt.tolist(), their_next.tolist())):
            assert ours_of.setdefault(o_next, ours_next) == ours_next, "one of our states per outlines-core state"
            if ours_next not in seen:
                seen[ours_next] = o_next
                pending.append((ours_next, o_next))
            assert seen[ours_next] == o_next, "one outlines-core state per state of ours"
    assert len(seen) == automaton.num_states  # every state was compared


def seeded_params(seeds) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                           structured_outputs=StructuredOutputsParams(json=CITY)) for seed in seeds]


@pytest.fixture(scope="module")
def seeded(llm):
    """The report's case: 16 seeds at temperature 1, 200 tokens (token ids, checked once)."""
    return check_outputs(llm, llm.generate([PROMPT] * 16, seeded_params(range(16))), CITY)


def test_many_seeds_at_temperature_one_stay_inside_the_schema(llm, seeded):
    assert len(seeded) == 16 and len({tuple(t) for t in seeded}) > 8
    person = SamplingParams(temperature=1.0, seed=0, n=8, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    check_outputs(llm, llm.generate(PROMPT, person), PERSON)


def _mixed_params():
    """Filters, penalties, n > 1 and min_tokens beside plain sampling, all constrained."""
    constraint = StructuredOutputsParams(json=CITY)
    base = dict(temperature=1.0, max_tokens=200, structured_outputs=constraint)
    return [
        SamplingParams(seed=100, top_p=0.9, **base),
        SamplingParams(seed=102, top_p=0.95, top_k=40, min_p=0.02, **base),
        SamplingParams(seed=103, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, **base),
        SamplingParams(seed=104, n=3, **base),
        SamplingParams(seed=106, min_tokens=30, **base),
    ]


def test_filters_penalties_and_parallel_samples_stay_inside_the_schema(llm):
    params = _mixed_params()
    check_outputs(llm, llm.generate([PROMPT] * len(params), params), CITY)


def test_speculation_changes_no_constrained_token(smollm2, seeded):
    """n-gram drafts inside JSON (keys and values repeat) are verified under the automaton; the
    tokens are the plain engine's, seed for seed."""
    spec = LLM(smollm2, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec.engine.spec_policy.speculate = lambda bucket, rows=(): True  # every window drafts and verifies
    got = check_outputs(spec, spec.generate([PROMPT] * 3, seeded_params(range(3))), CITY)
    assert got == seeded[:3]
    assert spec.stats()["spec_accepted_tokens"] > 0
