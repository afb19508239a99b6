"""Structured outputs and tool calls on the OpenAI server, live on a loopback port (one
server for the module), driven by the real `openai` client: response_format (json_schema,
json_object), vLLM's structured_outputs and guided_* fields, 400s naming the field while
other requests run on, and tools with tool_choice none / auto / required / a named function,
streamed and not (the streamed arguments concatenate to the non-streamed ones).

The model is the tiny random Llama (`text_model`) with a chat template that shows the tools
and the assistant's tool calls, so what reaches the template can be checked. A random model
never writes `<tool_call>` blocks by itself: the "auto" parser is checked on sample texts,
and end to end with a guided_regex that makes the model write one."""

from __future__ import annotations

import json
import os
import re
import threading

import jsonschema
import pytest
from openai import BadRequestError
from transformers import AutoTokenizer

from graphdecode.server import tools as tool_calls
from tests.cache_roots import fresh_cache
from tests.helpers import live_server, with_chat_template

MODEL = "structured-model"
TEMPLATE = (
    "{% if tools %}<s>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</s>\n{% endif %}"
    "{% for message in messages %}<s>{{ message['role'] }}\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ message['content'] }}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "owl"]},
    },
    "required": ["name", "age", "kind"],
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(text_model, tmp_path_factory):
    return with_chat_template(text_model, tmp_path_factory.mktemp("structured") / "model", TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # compiles for real (an empty structured/ cache); the CPU kernels are the session's, not rebuilt
    env = {**os.environ, "GRAPHDECODE_CACHE": fresh_cache(tmp_path_factory.mktemp("cache"))}
    with live_server(model_dir, tmp_path_factory.mktemp("server_structured"), MODEL, "-k", "4", "--max-model-len",
                     "1024", "--max-batch-size", "16", env=env) as url:
        yield url


def _chat(client, stream=False, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=MODEL, stream=stream, **kwargs)


def _streamed_chat(client, **kwargs):
    """(content, tool_calls as (id, name, arguments), finish_reason, chunks) of a streamed chat."""
    content, calls, finish, chunks = "", {}, None, []
    for chunk in _chat(client, stream=True, **kwargs):
        chunks.append(chunk)
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name, d
                    calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    assert d.id is None and not d.function.name, d
                    calls[d.index][2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, chunks


def _error(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def test_response_format_json_schema_on_both_endpoints(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    chat = _chat(client, response_format=fmt).choices[0]
    assert chat.finish_reason == "stop", chat
    jsonschema.validate(json.loads(chat.message.content), SCHEMA)
    streamed, _, finish, _ = _streamed_chat(client, response_format=fmt)
    assert finish == "stop" and streamed == chat.message.content
    done = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=200, temperature=0,
                                     extra_body={"response_format": fmt}).choices[0]
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(done.text), SCHEMA)
    pieces = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"response_format": fmt})
    assert "".join(c.choices[0].text for c in pieces) == done.text
    # vLLM's spellings of the same constraint
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}):
        again = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=200, temperature=0,
                                          extra_body=extra).choices[0]
        assert again.text == done.text
    plain = _chat(client, response_format={"type": "text"}, max_tokens=5).choices[0]  # "text": no constraint
    assert plain.finish_reason in ("stop", "length")


def test_sampled_outputs_validate_for_many_seeds(client):
    """Temperature 1 (and top_p / top_k) over many seeds, through response_format and tool calls:
    every choice parses and validates; none stops with a token its schema forbids."""
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for seed, extra in ((1, {}), (2, {"top_p": 0.9}), (3, {"extra_body": {"top_k": 20}})):
        response = _chat(client, response_format=fmt, temperature=1.0, seed=seed, n=8, **extra)
        for choice in response.choices:
            assert choice.finish_reason in ("stop", "length"), choice
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert sum(c.finish_reason == "stop" for c in response.choices) >= 4
    for seed in (4, 5):
        response = _chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, n=8)
        for choice in response.choices:
            if choice.finish_reason == "length":
                continue
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_json_object_regex_and_choice(client):
    for prompt in ("JSON please", "1 2 3"):
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=300, temperature=0,
                                      extra_body={"response_format": {"type": "json_object"}}).choices[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # a random model may keep adding members: what it wrote is an object's start
            assert c.finish_reason == "length" and c.text.startswith("{")
    regex = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex, "choice": None}}):
        c = client.completions.create(model=MODEL, prompt="Code:", max_tokens=40, temperature=1.0, seed=3, n=3,
                                      extra_body=extra)
        assert all(re.fullmatch(regex, x.text) and x.finish_reason == "stop" for x in c.choices), c
    choices = ["red", "green", "blue and yellow"]
    chat = _chat(client, temperature=1.0, seed=5, n=4, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in chat.choices)
    streamed, _, finish, _ = _streamed_chat(client, extra_body={"structured_outputs": {"choice": choices}})
    assert streamed in choices and finish == "stop"


def test_bad_constraints_are_400s_naming_the_field_while_others_run(client, http):
    result = {}

    def long_request():  # a stream that must run through all the bad requests undisturbed
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=120,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        result["finish"] = chunks[-1].choices[0].finish_reason
        result["text"] = "".join(c.choices[0].text for c in chunks)

    worker = threading.Thread(target=long_request)
    worker.start()
    bad_schema = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}},
         "response_format", "frobnicate"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ({"guided_regex": "[unclosed"}, "guided_regex", "regular expression"),
        ({"guided_json": '{"type": '}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "lookaround"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "empty"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar", "not supported"),
        ({"structured_outputs": {"regex": None}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern", "unknown"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "not supported"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "response_format, structured_outputs"),
    ]
    for endpoint, base in (("/completions", {"prompt": "x"}), ("/chat/completions", {"messages": MESSAGES})):
        for extra, param, words in cases:
            r = http.post(endpoint, json={"model": MODEL, "max_tokens": 5, **base, **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], (extra, error)
            if param.startswith("guided_") or param == "response_format":
                assert "structured_outputs" not in error["message"], error  # the client's own field names
    assert http.get("/models").status_code == 200
    worker.join(60)
    assert result["finish"] == "length" and result["text"], result


def test_tool_choice_required_returns_calls_that_validate(client):
    message = _chat(client, tools=TOOLS, tool_choice="required").choices[0]
    assert message.finish_reason == "tool_calls", message
    assert message.message.content is None and message.message.tool_calls
    for call in message.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, finish, chunks = _streamed_chat(client, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls" and not content
    assert [(name, args) for _, name, args in calls] == [(c.function.name, c.function.arguments)
                                                         for c in message.message.tool_calls]
    assert len(chunks) > len(calls) + 2  # the arguments came in pieces, as they were written
    assert chunks[0].choices[0].delta.role == "assistant"


def test_named_tool_choice_returns_one_call(client):
    named = {"type": "function", "function": {"name": "add"}}
    choice = _chat(client, tools=TOOLS, tool_choice=named, temperature=1.0, seed=4).choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) finish for a named function
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and choice.message.content is None
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    content, calls, finish, _ = _streamed_chat(client, tools=TOOLS, tool_choice=named, temperature=1.0, seed=4)
    assert not content and finish == "stop"
    assert [(name, args) for _, name, args in calls] == [("add", call.function.arguments)]


def test_auto_parses_tool_call_blocks_and_tools_reach_the_template(client, http, model_dir):
    block = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    forced = {"guided_regex": "Sure\\." + re.escape(block)}  # a random model writes one only when made to
    choice = _chat(client, tools=TOOLS, extra_body=forced).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
    content, calls, finish, _ = _streamed_chat(client, tools=TOOLS, tool_choice="auto", extra_body=forced)
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(name, args) for _, name, args in calls] == [("add", call.function.arguments)]
    # "none": the block is content; the tools still reach the template (vLLM's rule)
    plain = _chat(client, tools=TOOLS, tool_choice="none", extra_body=forced).choices[0]
    assert plain.message.content == "Sure." + block and not plain.message.tool_calls
    assert plain.finish_reason == "stop"
    # what the template got: the tools, the assistant's calls with their arguments as objects, the tool's reply
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    r = http.post("/chat/completions", json={"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 1,
                                             "tool_choice": "none", "return_token_ids": True})
    assert r.status_code == 200, r.text
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calls_as_objects = json.loads(json.dumps(history))
    calls_as_objects[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "c"}
    calls_as_objects[1]["content"] = ""
    text = tokenizer.apply_chat_template(calls_as_objects, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "Tools: get_weather add" in text and '<tool_call>get_weather {"city": "Paris", "unit": "c"}' in text
    assert "<s>tool\n21 degrees" in text
    assert r.json()["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tool_requests_are_checked_by_field(client, http):
    cases = [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": TOOLS + [TOOLS[0]]}, "tools[2].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "echo": True}, "echo"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
          "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]
    for extra, param in cases:
        r = http.post("/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    with pytest.raises(BadRequestError) as info:
        _chat(client, tool_choice="none")
    assert _error(info)["param"] == "tool_choice"
    # tools with tool_choice "none" or a model that writes no blocks ("auto"): a plain reply
    for choice in ("none", "auto"):
        c = _chat(client, tools=TOOLS, tool_choice=choice, max_tokens=8, extra_body={"ignore_eos": True}).choices[0]
        assert c.finish_reason == "length" and c.message.content and not c.message.tool_calls


# ------------------------------------------------------------------ the parsers, on sample texts
def _fed(parser, text: str, step: int):
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = parser.feed(text[i:i + step])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    calls = tool_calls.merge_calls(deltas + d)
    return content + c, [(x["function"]["name"], x["function"]["arguments"]) for x in calls]


@pytest.mark.parametrize("step", [1, 2, 5, 10_000])
def test_hermes_parser_on_sample_texts(step):
    two = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>\n')
    assert _fed(tool_calls.HermesCalls(), two, step) == (
        "Let me look.", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1}')])
    samples = {
        "no calls here, a < b and <tool  \n": ("no calls here, a < b and <tool  \n", []),
        "x <tool_call>not json</tool_call> y": ("x <tool_call>not json</tool_call> y", []),
        '<tool_call>{"name": "f", "arguments": {}}': ("", [("f", "{}")]),  # unclosed at the end: still a call
        '<tool_call>{"name": "f"}</tool_call> and then': ("and then", [("f", "{}")]),
        '<tool_call>{"arguments": {}}</tool_call>': ('<tool_call>{"arguments": {}}</tool_call>', []),
    }
    for text, want in samples.items():
        assert _fed(tool_calls.HermesCalls(), text, step) == want, text


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_required_and_named_parsers_stream_the_raw_arguments(step):
    text = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"r}is", "n": [1, {"x": "]"}]}}, '
            '{ "name" : "add" , "parameters" : {"a": 3} } ]')
    want = [("get_weather", '{"city": "Pa\\"r}is", "n": [1, {"x": "]"}]}'), ("add", '{"a": 3}')]
    assert _fed(tool_calls.RequiredCalls(), text, step) == ("", want)
    assert [json.loads(args) for _, args in want] == [x["parameters"] for x in json.loads(text)]
    cut = _fed(tool_calls.RequiredCalls(), text[:60], step)  # cut short: the calls so far, arguments as written
    assert cut == ("", [("get_weather", want[0][1][:60 - text.index('{"city"')])])
    assert _fed(tool_calls.RequiredCalls(), '[{"na', step) == ('[{"na', [])  # no call yet: content
    assert _fed(tool_calls.NamedCall("f"), '{"a": 1}', step) == ("", [("f", '{"a": 1}')])
    schema = tool_calls.required_schema(tool_calls.check_tools(TOOLS))  # vLLM's shape: [{name, parameters}, ...]
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}},
                         {"name": "get_weather", "parameters": {"city": "P", "unit": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"city": "P", "unit": "c"}}], schema)
