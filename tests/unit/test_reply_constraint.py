"""The reply's constraint (server/reply_constraint.py): text that avoids a marker, tool calls constrained from
their marker on, room for reasoning before a JSON answer.

The automaton test walks the compiled token automaton as a model at any temperature could: every step a
random allowed token, pushed toward writing the call marker (nine times in ten the token that continues it,
when it is allowed) and, inside a call, toward its end, so calls start often. Every walk that ends (EOS) parses into content and calls whose
arguments validate against their tool's schema; the same biased walks without the constraint, for contrast,
write a marker followed by text that is no call (the failure rate the constraint removes)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from graphdecode.server.call_formats import CALL_FORMATS, QWEN_VALUE_STOPS, format_for
from graphdecode.server.constraints import ConstraintSource, build_constraint
from graphdecode.server.reasoning import split_reasoning
from graphdecode.server.reply_constraint import reasoning_prefix, reply_source
from graphdecode.server.text_regex import avoiding, avoiding_all, listing, not_starting
from graphdecode.server.tool_parsers import Qwen3Coder, tool_parser
from graphdecode.server.tools import START_TAG, HermesCalls, parse_all
from graphdecode.structured import StructuredOutputsParams
from graphdecode.structured.cache import AutomatonCache, compile_constraint
from tests.unit.test_structured_compile import distances

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
FUNCTIONS = [{"name": "get_weather", "description": None, "parameters": WEATHER},
             {"name": "add", "description": None, "parameters": ADD}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.mark.parametrize("marker", ["<tool_call>", "</think>", "[TOOL_CALLS]", "<|python_tag|>", "ab"])
def test_avoiding_matches_exactly_the_strings_without_the_marker(marker):
    pattern = re.compile(avoiding(marker), re.S)
    rng = random.Random(7)
    alphabet = sorted(set(marker)) + ["x", "\n"]
    for length in range(12):
        for _ in range(400):
            text = "".join(rng.choice(alphabet) for _ in range(length))
            if rng.random() < 0.5:  # a partial or whole marker somewhere
                at = rng.randrange(len(text) + 1)
                text = text[:at] + marker[:rng.randrange(len(marker) + 1)] + text[at:]
            assert (pattern.fullmatch(text) is not None) == (marker not in text), text
    with pytest.raises(ValueError, match="first character"):
        avoiding("abca")


def test_avoiding_all_matches_exactly_the_strings_without_any_marker():
    pattern = re.compile(avoiding_all(QWEN_VALUE_STOPS), re.S)
    rng = random.Random(11)
    alphabet = sorted(set("".join(QWEN_VALUE_STOPS))) + ["x", "\n"]
    for length in range(14):
        for _ in range(400):
            text = "".join(rng.choice(alphabet) for _ in range(length))
            if rng.random() < 0.6:  # a partial or whole marker somewhere
                marker = rng.choice(QWEN_VALUE_STOPS)
                at = rng.randrange(len(text) + 1)
                text = text[:at] + marker[:rng.randrange(len(marker) + 1)] + text[at:]
            assert (pattern.fullmatch(text) is not None) == (not any(m in text for m in QWEN_VALUE_STOPS)), text
    with pytest.raises(ValueError, match="first character"):
        avoiding_all(("<a", "b"))


def test_reasoning_prefix_and_sources():
    opened, optional = re.compile(reasoning_prefix(True), re.S), re.compile(reasoning_prefix(False), re.S)
    assert opened.fullmatch("some thought</think>\n\n") and not opened.fullmatch("")
    assert optional.fullmatch("") and optional.fullmatch("<think>a</think>") and not optional.fullmatch("a</think>")
    user = ConstraintSource("response_format", "response_format.json_schema.schema", {"json": WEATHER})
    assert reply_source(user, None, False, False, False) is user  # nothing added: the request's own, as is
    assert reply_source(None, FUNCTIONS, False, True, False) is None  # reasoning alone: unconstrained
    regex = ConstraintSource("guided_regex", "guided_regex", {"regex": "[a-z]+"})
    assert reply_source(regex, None, False, True, True) is regex  # a regex is the whole output as written
    source = reply_source(user, None, False, True, False)
    assert source.param == "response_format" and re.fullmatch(
        source.kwargs["regex"], '<think>hmm</think>\n{"city":"Paris","unit":"c"}')


def _walk(automaton, tokenizer, rng: random.Random, eos: int, max_tokens: int = 300,
          marker: str = START_TAG) -> str | None:
    """Random allowed tokens, pushed toward the marker and, inside a call, toward its end; the text (special
    tokens kept), or None when max_tokens came first."""
    marker_ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    dist = distances(automaton)
    state, ids, at = 0, [], 0
    for _ in range(max_tokens):
        allowed = [int(t) for t in automaton.allowed_tokens(state)]
        if eos in allowed and rng.random() < 0.08:
            return tokenizer.decode(ids, skip_special_tokens=False)
        choices = [t for t in allowed if t != eos] or [eos]
        if choices == [eos]:
            return tokenizer.decode(ids, skip_special_tokens=False)
        want = marker_ids[at] if at < len(marker_ids) else None
        closer = [t for t in choices if dist[automaton.next_state(state, t)] < dist[state]]
        if want in choices and rng.random() < 0.9:
            token = want
        else:
            token = rng.choice(closer if closer and rng.random() < 0.7 else choices)
        at = at + 1 if token == want else 0
        ids.append(token)
        state = automaton.next_state(state, token)
    return None


def test_auto_calls_are_well_formed_whatever_is_sampled(text_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    eos = tokenizer.eos_token_id
    source = reply_source(None, FUNCTIONS, "hermes", False, False)
    cache = AutomatonCache(str(tmp_path), disk=False)
    automaton = compile_constraint(build_constraint(source), tokenizer, len(tokenizer), (eos,), cache=cache)
    free = compile_constraint(build_constraint(ConstraintSource("x", None, {"regex": r"(?s:.*)"})), tokenizer,
                              len(tokenizer), (eos,), cache=cache)
    rng = random.Random(3)
    constrained_calls, free_marked, free_bad = 0, 0, 0
    for _ in range(60):
        text = _walk(automaton, tokenizer, rng, eos)
        if text is not None:
            content, calls = parse_all(HermesCalls(), text)
            assert START_TAG not in content, text  # a marker always opens a call
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
            constrained_calls += len(calls)
        text = _walk(free, tokenizer, rng, eos)
        if text is not None and START_TAG in text:
            free_marked += 1
            content, calls = parse_all(HermesCalls(), text)
            free_bad += START_TAG in content or not calls
    assert constrained_calls >= 5  # the walks did write calls
    assert free_marked >= 5 and free_bad == free_marked  # unconstrained, a marker is followed by no call


CODER_FUNCTIONS = [
    {"name": "write_file", "description": None, "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "mode": {"enum": ["w", "a"]},
                                         "lines": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["path", "mode"]}},
    {"name": "add", "description": None, "parameters": ADD},
]


def test_qwen3_coder_calls_are_well_formed_whatever_is_sampled(text_model, tmp_path):
    """qwen3_coder's "auto" calls under their constraint: every walk that opened a call wrote calls the parser
    reads, with the required parameters, typed values that validate and free text that does not end early."""
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    eos = tokenizer.eos_token_id
    source = reply_source(None, CODER_FUNCTIONS, "qwen3_coder", False, False)
    assert re.fullmatch(source.kwargs["regex"], "Sure.<tool_call>\n<function=write_file>\n<parameter=path>\na<b>\n"
                        "</parameter>\n<parameter=mode>\nw\n</parameter>\n</function>\n</tool_call>", re.S)
    automaton = compile_constraint(build_constraint(source), tokenizer, len(tokenizer), (eos,),
                                   cache=AutomatonCache(str(tmp_path), disk=False))
    schemas = {f["name"]: f["parameters"] for f in CODER_FUNCTIONS}
    rng = random.Random(5)
    calls_seen = 0
    for _ in range(60):
        text = _walk(automaton, tokenizer, rng, eos)
        if text is None:
            continue
        content, calls = parse_all(Qwen3Coder(CODER_FUNCTIONS), text)
        assert START_TAG not in content, text  # a marker always opens a call the parser reads
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        calls_seen += len(calls)
    assert calls_seen >= 5


def test_listing_and_not_starting():
    items = re.compile(listing([("a", False), ("b", True), ("c", False)], ", "))
    for text, ok in [("b", True), ("a, b", True), ("b, c", True), ("a, b, c", True), ("", False), ("a", False),
                     ("a, c", False), ("b, a", False), ("ab", False)]:
        assert bool(items.fullmatch(text)) == ok, text
    optional = re.compile(listing([("a", False), ("c", False)], ", "))
    assert all(optional.fullmatch(t) for t in ("", "a", "c", "a, c")) and not optional.fullmatch("c, a")
    other = re.compile(not_starting("<|tag|>", r"\s{"))
    for text in ("<", "<|ta", "<x", "<|tax|> and more", "<|tag|", "x", "x<|tag|>", "<|tag}"):
        assert other.fullmatch(text), text
    for text in ("<|tag|>", "<|tag|>x", "", " x", "{x", "\nx"):
        assert not other.fullmatch(text), text


RICH = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "flag": {"type": "boolean"},
    "limit": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
    "where": {"type": "object", "properties": {"x": {"type": "number"}, "name": {"enum": ["a", "b"]}},
              "required": ["x"]},
    "note": {"type": "string", "maxLength": 5}}, "required": ["flag", "where"]}
ALL_FUNCTIONS = CODER_FUNCTIONS + [{"name": "tag", "description": None, "parameters": RICH}]
ALL_SCHEMAS = {f["name"]: f["parameters"] for f in ALL_FUNCTIONS}
# format: (its parser, the marker the walk pushes, the special tokens of its vocabularies)
FORMAT_CASES = {
    "glm45": ("glm45", "<tool_call>", CALL_FORMATS["glm45"].specials),
    "mistral": ("mistral", "[TOOL_CALLS]", ("[TOOL_CALLS]",)),
    "mistral_args": ("mistral", "[TOOL_CALLS]", ("[TOOL_CALLS]", "[ARGS]")),
    "llama3_json": ("llama3_json", "<|python_tag|>", ("<|python_tag|>",)),
    "pythonic": ("pythonic", "[", ("<|python_start|>", "<|python_end|>")),
}


def _with_specials(text_model, specials):
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    return tokenizer


@pytest.mark.parametrize("fmt", sorted(FORMAT_CASES))
def test_every_call_format_writes_calls_its_parser_reads(text_model, tmp_path, fmt):
    """Each format's "auto" calls under their constraint (call_formats.py), its tags special tokens as in the
    model families' vocabularies: every walk that started a call wrote calls that the format's parser reads,
    of the given tools, with arguments that validate against their schemas; text never starts a call."""
    parser, marker, specials = FORMAT_CASES[fmt]
    tokenizer = _with_specials(text_model, specials)
    assert format_for(parser, tokenizer) == fmt
    eos = tokenizer.eos_token_id
    source = reply_source(None, ALL_FUNCTIONS, fmt, False, False)
    automaton = compile_constraint(build_constraint(source), tokenizer, len(tokenizer), (eos,),
                                   cache=AutomatonCache(str(tmp_path), disk=False))
    rng = random.Random(8)
    calls_seen, texts_seen = 0, 0
    for _ in range(50):
        text = _walk(automaton, tokenizer, rng, eos, marker=marker)
        if text is None:
            continue
        content, calls = parse_all(tool_parser(parser, ALL_FUNCTIONS), text)
        if fmt in ("llama3_json", "pythonic"):  # calls are the whole output; text starts otherwise
            assert content.strip() == "" if calls else not content.lstrip().startswith(("{", "[", marker)), text
        else:
            assert marker not in content, text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), ALL_SCHEMAS[call["function"]["name"]])
        calls_seen += len(calls)
        texts_seen += not calls
    assert calls_seen >= 5 and texts_seen >= 1


def test_a_format_reads_its_special_tokens_as_text(text_model, tmp_path):
    """A marker that is a special token is allowed by its format's constraint (as its text) and by no other."""
    tokenizer = _with_specials(text_model, ("[TOOL_CALLS]",))
    (marker,) = tokenizer.convert_tokens_to_ids(["[TOOL_CALLS]"])
    eos, cache = tokenizer.eos_token_id, AutomatonCache(str(tmp_path), disk=False)
    source = reply_source(None, FUNCTIONS, "mistral", False, False)
    assert source.kwargs["special_tokens"] == ("[TOOL_CALLS]",)
    auto = compile_constraint(build_constraint(source), tokenizer, len(tokenizer), (eos,), cache=cache)
    free = compile_constraint(build_constraint(ConstraintSource("x", None, {"regex": r"(?s:.*)"})), tokenizer,
                              len(tokenizer), (eos,), cache=cache)
    assert marker in set(auto.allowed_tokens(0).tolist()) and marker not in set(free.allowed_tokens(0).tolist())
    assert format_for("mistral", AutoTokenizer.from_pretrained(text_model)) == "mistral"  # no [ARGS] token
    with pytest.raises(TypeError, match="structured_outputs.special_tokens: expected a list"):
        StructuredOutputsParams(regex="a", special_tokens="[TOOL_CALLS]")
    keys = {StructuredOutputsParams(regex="a", special_tokens=t).key() for t in ((), ("[TOOL_CALLS]",))}
    assert len(keys) == 2  # the compile cache tells them apart


def test_a_reasoning_parser_reads_what_the_prefix_allows():
    prefix = reasoning_prefix(False)
    text = "<think>plan: call it</think>\n" + '{"city":"Paris","unit":"c"}'
    assert re.fullmatch(prefix + r"\{.*\}", text, re.S)
    assert split_reasoning("qwen3", text) == ("plan: call it", '{"city":"Paris","unit":"c"}')
