"""Structured outputs inside the decode window: constraints compiled to automata whose tables
live on the device; every constrained row masks, samples and advances its state there, k steps
per window, with no host in the loop.

Model: the built-in default model's recipe (a tiny Llama with a real byte-level BPE tokenizer)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.structured import StructuredOutputsParams
from tests.helpers import first_tokens

ENGINE = dict(num_decode_steps=8, max_model_len=512, max_batch_size=16, buckets=[1, 4, 16])
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                 "required": ["city"]},
    },
    "required": ["name", "age", "kind", "tags", "home"],
}
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{3}"
CHOICES = ["red", "green", "blue and yellow"]
PROMPTS = ["Describe a pet:", "Once upon a time", "JSON please", "1 2 3"]


def constrained(max_tokens=120, **kwargs) -> SamplingParams:
    sampling = {key: kwargs.pop(key) for key in ("temperature", "seed", "n", "min_tokens") if key in kwargs}
    sampling.setdefault("temperature", 0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kwargs), **sampling)


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, **ENGINE)


def test_json_schema_greedy_and_seeded_outputs_validate(llm):
    outs = llm.generate(PROMPTS, constrained(json=SCHEMA))
    stats = llm.stats()  # the engine's own cache compiled it (or read it from disk), once for the four prompts
    assert stats["structured_compiles"] + stats["structured_cache_hits"] >= 1 and stats["structured_uploads"] == 1
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    sampled = llm.generate(PROMPTS[:2], constrained(json=SCHEMA, temperature=1.0, seed=7, n=3))
    texts = [c.text for out in sampled for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1


def test_regex_and_choice_outputs(llm):
    for out in llm.generate(PROMPTS, constrained(regex=REGEX, temperature=1.0, seed=3)):
        assert re.fullmatch(REGEX, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    picks = {out.outputs[0].text for out in llm.generate(PROMPTS, constrained(choice=CHOICES, temperature=1.0,
                                                                              seed=5, n=4))
             for _ in [0]}
    assert picks <= set(CHOICES)
    for out in llm.generate(PROMPTS, constrained(choice=CHOICES, temperature=1.0, seed=5, n=4)):
        assert {c.text for c in out.outputs} <= set(CHOICES)


def test_json_object(llm):
    for out in llm.generate(PROMPTS[:2], constrained(json_object=True, max_tokens=200)):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # a tiny random model may keep adding members; what it wrote is still an object's prefix
            assert c.text.startswith("{")


def test_unconstrained_company_is_untouched_and_seeded_rows_do_not_depend_on_it(llm):
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    alone = first_tokens(llm.generate(PROMPTS, free))
    json_params = constrained(json=SCHEMA, temperature=1.0, seed=2)
    json_alone = llm.generate(PROMPTS[1], json_params)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS + [PROMPTS[1]], [free, json_params, free, free, json_params])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert mixed[1].outputs[0].token_ids == mixed[4].outputs[0].token_ids == json_alone


def test_a_complete_constraint_wins_over_min_tokens(text_model, llm):
    """min_tokens past the constraint's end: once the automaton allows only EOS, the stop ids are
    no longer masked (masking them left nothing to sample, and a forbidden token was drawn)."""
    for temperature in (0, 1.0):
        params = constrained(regex="ab", min_tokens=6, max_tokens=20, temperature=temperature, seed=1)
        out = llm.generate("hi", params)[0].outputs[0]
        assert out.text == "ab" and out.finish_reason == "stop"
    spec = LLM(text_model, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec.engine.spec_policy.speculate = lambda bucket, rows=(): True
    for temperature in (0, 1.0):
        params = constrained(regex="(ab){3}", min_tokens=12, max_tokens=16, temperature=temperature, seed=2)
        out = spec.generate("ab ab ab", params)[0].outputs[0]
        assert out.text == "ababab" and out.finish_reason == "stop"


def test_the_host_is_not_in_the_loop(llm):
    """A 48-token constrained output at k=8 takes about 6 windows, not 48."""
    params = constrained(regex="a{48}", max_tokens=60)
    before = llm.stats()["windows"]
    out = llm.generate("go", params)[0].outputs[0]
    assert out.text == "a" * 48 or len(out.token_ids) >= 6
    assert llm.stats()["windows"] - before <= -(-len(out.token_ids) // 8) + 2


def test_preemption_prefix_hits_and_speculation_keep_constrained_outputs(text_model, llm):
    params = constrained(json=SCHEMA, temperature=1.0, seed=9)
    prompts = [p + " and more words to share a page or two" for p in PROMPTS]
    expected = first_tokens(llm.generate(prompts, params))
    assert first_tokens(llm.generate(prompts, params)) == expected  # prefix-cache hits now
    tight = LLM(text_model, **{**ENGINE, "max_model_len": 256, "num_pages": 20, "page_size": 16})
    outs = tight.generate(prompts, params)
    assert tight.stats()["preemptions"] > 0
    assert first_tokens(outs) == expected
    spec = LLM(text_model, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    # drafts are accepted inside a constraint (the automaton walks them), and change nothing
    repeat = constrained(regex="(ab){20}", max_tokens=60)
    plain = llm.generate("go", repeat)[0].outputs[0]
    assert spec.generate("go", repeat)[0].outputs[0].token_ids == plain.token_ids and plain.text == "ab" * 20
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert first_tokens(spec.generate(prompts, params)) == expected
    # a draft model (here the target itself) drafts under the automaton too: its drafts are the target's tokens
    drafted = LLM(text_model, **ENGINE, speculative_config={"method": "draft_model", "model": text_model,
                                                            "num_speculative_tokens": 3})
    assert drafted.generate("go", repeat)[0].outputs[0].token_ids == plain.token_ids
    assert first_tokens(drafted.generate(prompts, params)) == expected
    stats = drafted.stats()
    assert stats["spec_accepted_tokens"] >= stats["spec_draft_tokens"] - 3 * (1 + len(prompts))


def test_allowed_token_ids_cut_a_constraint_and_share_the_table_store(llm):
    tok = llm.get_tokenizer()
    letters = tok.convert_tokens_to_ids(list("abcdef"))
    both = constrained(regex="[a-z]{3,6}", temperature=1.0, seed=9, n=4)
    both.allowed_token_ids = letters + [tok.eos_token_id]  # every state keeps a way on: no dead end
    before = llm.stats()["structured_uploads"]
    texts = [c.text for out in llm.generate(PROMPTS, both) for c in out.outputs]
    assert all(re.fullmatch("[a-f]{3,6}", t) for t in texts) and len(set(texts)) > 1
    only = SamplingParams(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True, allowed_token_ids=letters[:2])
    outs = llm.generate(PROMPTS, only)
    assert all(set(o.outputs[0].token_ids) <= set(letters[:2]) for o in outs)
    assert llm.stats()["structured_uploads"] == before + 2  # one placement per distinct table, shared by its requests


def test_bad_constraints_are_refused_by_name_before_any_work(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        StructuredOutputsParams(regex="[unclosed")
    with pytest.raises(ValueError, match=r"structured_outputs: give exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar"):
        StructuredOutputsParams(grammar="root ::= 'a'")
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    small = LLM(llm.config.model, **ENGINE, structured_max_states=4)
    with pytest.raises(ValueError, match=r"prompts\[0\]: structured_outputs: the constraint compiles to"):
        small.generate("x", constrained(json=SCHEMA))
    assert not small.engine.has_unfinished()


def test_tensor_parallel_ranks_follow_the_same_automaton(text_model, llm):
    params = constrained(json=SCHEMA, temperature=1.0, seed=21)
    want = first_tokens(llm.generate(PROMPTS[:2], params))
    with LLM(text_model, tensor_parallel_size=2, **ENGINE) as tp2:
        assert first_tokens(tp2.generate(PROMPTS[:2], params)) == want
