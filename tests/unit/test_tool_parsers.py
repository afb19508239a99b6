"""Tool-call formats of tool_choice "auto" (server/tool_parsers.py): each format's outputs read into content and
calls, the same however the output is cut across feeds, malformed calls kept as content, qwen3_coder's values
typed by the tool's schema, mistral's ids, the registry."""

from __future__ import annotations

import json
import random
import re

import pytest

from graphdecode.server.tool_parsers import (
    TOOL_PARSERS,
    Glm45,
    Hermes,
    Llama3Json,
    Mistral,
    Pythonic,
    Qwen3Coder,
    mistral_call_id,
    tool_parser,
    typed_parameter,
)
from graphdecode.server.tools import check_tools, merge_calls

FUNCTIONS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": "string", "enum": ["C", "F"]}}}}},
    {"type": "function", "function": {"name": "set", "parameters": {
        "type": "object", "properties": {
            "n": {"type": "integer"}, "x": {"type": "number"}, "on": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "object"},
            "note": {"type": "string"}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "either": {"type": ["integer", "string"]}}}}},
    {"type": "function", "function": {"name": "ping"}},
])

WEATHER = ("get_weather", {"city": "Paris"})
PING = ("ping", {})
NESTED = ("set", {"opts": {"a": [1, {"b": None}], "c": {"d": "}{]["}}, "tags": []})
UNICODE = ("get_weather", {"city": "Zürich ☃ 東京", "note": 'say "hi"\\ \n'})

CASES = [  # (format, output, content, [(name, arguments)])
    # hermes (through the registry)
    ("hermes", "just text", "just text", []),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [WEATHER]),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    # llama3_json
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),
    ("llama3_json", ' \n<|python_tag|> {"name": "get_weather", "parameters": {"city": "Paris"}};\n'
                    '{"name": "ping", "parameters": {}}; ', "", [WEATHER, PING]),
    ("llama3_json", '{"name": "set", "parameters": {"opts": {"a": [1, {"b": null}], "c": {"d": "}{]["}}, "tags": []}}',
     "", [NESTED]),
    ("llama3_json", json.dumps({"name": UNICODE[0], "parameters": UNICODE[1]}, ensure_ascii=False), "", [UNICODE]),
    ("llama3_json", json.dumps({"name": UNICODE[0], "parameters": UNICODE[1]}), "", [UNICODE]),  # \u escapes
    ("llama3_json", '{"name": "ping"}', "", [PING]),
    ("llama3_json", '{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}', "", [WEATHER]),
    ("llama3_json", '{"name": "ping", "parameters": {}}\n\nI called ping.', "I called ping.", [PING]),
    ("llama3_json", 'Sure: {"name": "ping", "parameters": {}}', 'Sure: {"name": "ping", "parameters": {}}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # no name: a JSON answer
    ("llama3_json", '  {"name": 7, "parameters": {}}', '  {"name": 7, "parameters": {}}', []),
    ("llama3_json", '{"name": "ping", "parameters": [1]}', '{"name": "ping", "parameters": [1]}', []),
    ("llama3_json", "{not json} at all", "{not json} at all", []),
    ("llama3_json", '{"name": "ping", "parameters": {}', '{"name": "ping", "parameters": {}', []),  # cut short
    ("llama3_json", '{"name": "ping", "parameters": {}}; {"x": 1} tail', '{"x": 1} tail', [PING]),
    ("llama3_json", "<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ("llama3_json", "<|python", "<|python", []),
    ("llama3_json", "<b>bold</b>", "<b>bold</b>", []),
    ("llama3_json", "   ", "   ", []),
    ("llama3_json", "", "", []),
    # mistral: the JSON array
    ("mistral", "No tools needed.", "No tools needed.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [WEATHER]),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
                ' {"name": "ping", "arguments": {}}]', "Checking.", [WEATHER, PING]),
    ("mistral", '[TOOL_CALLS][{"name": "set", "arguments": {"opts": {"a": [1, {"b": null}], "c": {"d": "}{]["}}, '
                '"tags": []}}] Done.', "Done.", [NESTED]),
    ("mistral", "[TOOL_CALLS]" + json.dumps([{"name": UNICODE[0], "arguments": UNICODE[1]}], ensure_ascii=False),
     "", [UNICODE]),
    ("mistral", '[TOOL_CALLS][{"name": "ping", "arguments": {}}, 42]', ", 42]", [PING]),
    ("mistral", '[TOOL_CALLS][{"nom": "ping"}]', '[TOOL_CALLS][{"nom": "ping"}]', []),
    ("mistral", "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ("mistral", '[TOOL_CALLS][{"name": "ping", "arguments": {', '[TOOL_CALLS][{"name": "ping", "arguments": {', []),
    # mistral: NAME[ARGS]{...}, the marker before each call
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [WEATHER]),
    ("mistral", 'Sure!\n\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]ping[ARGS]{}',
     "Sure!", [WEATHER, PING]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"} [TOOL_CALLS]ping{}\nBoth sent.', "Both sent.",
     [WEATHER, PING]),
    ("mistral", '[TOOL_CALLS]set[ARGS]{"opts": {"a": [1, {"b": null}], "c": {"d": "}{]["}}, "tags": []}', "",
     [NESTED]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(UNICODE[1]), "", [UNICODE]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS][1, 2]", "[TOOL_CALLS]get_weather[ARGS][1, 2]", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARG]{}", "[TOOL_CALLS]get_weather[ARG]{}", []),
    ("mistral", "[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{nope}", "[TOOL_CALLS]get_weather[ARGS]{nope}", []),
    ("mistral", "[TOOL_CALLS]bad[TOOL_CALLS]ping[ARGS]{}", "[TOOL_CALLS]bad", [PING]),
    ("mistral", "[TOOL_CALLS] !", "[TOOL_CALLS] !", []),
    ("mistral", "[TOOLS are fine] [TOOL", "[TOOLS are fine] [TOOL", []),
    # qwen3_coder
    ("qwen3_coder", "Nothing to call.", "Nothing to call.", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>", "", [WEATHER]),
    ("qwen3_coder", "I'll check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
                    "\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>\nDone.",
     "I'll check both.Done.", [WEATHER, PING]),
    ("qwen3_coder", "<tool_call>\n<function=set>\n<parameter=opts>\n"
                    '{"a": [1, {"b": null}], "c": {"d": "}{]["}}'
                    "\n</parameter>\n<parameter=tags>\n[]\n</parameter>\n</function>\n</tool_call>", "", [NESTED]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich ☃ 東京\n</parameter>\n"
                    "<parameter=note>\nsay \"hi\"\\ \n\n</parameter>\n</function>\n</tool_call>", "", [UNICODE]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
     "", [WEATHER]),  # a </parameter> left out
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
     "", [WEATHER]),  # cut short before </tool_call>
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", []),
    ("qwen3_coder", '<tool_call>\n{"name": "ping"}\n</tool_call> x',
     '<tool_call>\n{"name": "ping"}\n</tool_call> x', []),
    ("qwen3_coder", "<tool_call><function=>\n</function></tool_call>",
     "<tool_call><function=>\n</function></tool_call>", []),
    ("qwen3_coder", "<tool_call><function=ping></function> junk</tool_call>",
     "<tool_call><function=ping></function> junk</tool_call>", []),
    ("qwen3_coder", "a <tool b <tool_cal", "a <tool b <tool_cal", []),
    # glm45 (GLM-4.5's spacing) and glm47 (GLM-4.7's, none)
    ("glm45", "No call needed.", "No call needed.", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "",
     [WEATHER]),
    ("glm47", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", "", [WEATHER]),
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "</tool_call>\n<tool_call>ping\n</tool_call>\nDone.", "Checking.Done.", [WEATHER, PING]),
    ("glm45", '<tool_call>set\n<arg_key>opts</arg_key>\n<arg_value>{"a": [1, {"b": null}], "c": {"d": "}{]["}}'
              '</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[]</arg_value>\n</tool_call>', "", [NESTED]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich ☃ 東京</arg_value>\n"
              '<arg_key>note</arg_key>\n<arg_value>say "hi"\\ \n</arg_value>\n</tool_call>', "", [UNICODE]),
    ("glm45", "<tool_call>set\n<arg_key>n</arg_key>\n<arg_value>-3</arg_value>\n<arg_key>on</arg_key>\n"
              "<arg_value>true</arg_value>\n<arg_key>note</arg_key>\n<arg_value>7</arg_value>\n<arg_key>extra</arg_key>"
              "\n<arg_value>[1]</arg_value>\n</tool_call>", "", [("set", {"n": -3, "on": True, "note": "7",
                                                                             "extra": "[1]"})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>", "", [WEATHER]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", []),
    ("glm45", "<tool_call>\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
     "<tool_call>\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>oops</tool_call> x",
     "<tool_call>get_weather\n<arg_key>city</arg_key>oops</tool_call> x", []),
    ("glm45", '<tool_call>{"name": "ping"}</tool_call>', '<tool_call>{"name": "ping"}</tool_call>', []),
    # pythonic
    ("pythonic", "It is sunny.", "It is sunny.", []),
    ("pythonic", '[get_weather(city="Paris")]', "", [WEATHER]),
    ("pythonic", "[get_weather(city='Paris'), ping()]", "", [WEATHER, PING]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris"), ping()]<|python_end|>', "", [WEATHER, PING]),
    ("pythonic", ' [\n  ping( ) ,\n  get_weather(city="Paris"),\n] \n\nCalled both.', "Called both.", [PING, WEATHER]),
    ("pythonic", "[set(opts={'a': [1, {'b': None}], 'c': {'d': '}{]['}}, tags=[])]", "", [NESTED]),
    ("pythonic", "[get_weather(city='Zürich ☃ 東京', note='say \"hi\"\\\\ \\n')]", "", [UNICODE]),
    ("pythonic", '[get_weather(city="""Paris""")]', "", [WEATHER]),
    ("pythonic", '[set(n=-3, x=2.5, on=True, note=None)]', "", [("set", {"n": -3, "x": 2.5, "on": True,
                                                                          "note": None})]),
    ("pythonic", "[get_weather(city='Paris'), ping(", "[get_weather(city='Paris'), ping(", []),
    ("pythonic", "[get_weather(city='Paris'), ping()", "", [WEATHER, PING]),  # only the ] left out
    ("pythonic", "[Click here](https://example.com)", "[Click here](https://example.com)", []),
    ("pythonic", "[1] Smith et al.", "[1] Smith et al.", []),
    ("pythonic", "[]", "[]", []),
    ("pythonic", "[ping(1)]", "[ping(1)]", []),  # positional arguments
    ("pythonic", "[ping(x=len('a'))]", "[ping(x=len('a'))]", []),  # not a literal
    ("pythonic", "[os.system(x='ls')]", "[os.system(x='ls')]", []),
    ("pythonic", "[ping(x={1: 2})]", "[ping(x={1: 2})]", []),
    ("pythonic", "[ping()] [ping()]", "[ping()]", [PING]),  # one list of calls, at the start
    ("pythonic", "See [ping()]", "See [ping()]", []),
    ("pythonic", "<|python_start|>oops", "<|python_start|>oops", []),
]


def run(name: str, chunks: list[str], functions=FUNCTIONS):
    """The parser's content and merged calls over `chunks`, after checking the deltas' form."""
    parser = tool_parser(name, functions)
    content, deltas = [], []
    for chunk in chunks + [None]:
        text, calls = parser.feed(chunk) if chunk is not None else parser.finish()
        assert isinstance(text, str)
        content.append(text)
        for delta in calls:
            if delta["index"] >= len({d["index"] for d in deltas}):  # a call's first delta
                assert delta["index"] == len({d["index"] for d in deltas})
                assert delta["type"] == "function" and delta["id"] and delta["function"]["name"]
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            deltas.append(delta)
    calls = merge_calls(deltas)
    assert parser.num_calls == len(calls)
    return "".join(content), calls


def simple(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_outputs(name, text, content, calls):
    got_content, got_calls = run(name, [text])
    assert got_content == content
    assert simple(got_calls) == calls


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_every_cut_gives_the_same(name, text, content, calls):
    rng = random.Random(text)
    cuts = [[i] for i in range(len(text) + 1)]  # every single split
    cuts.append(list(range(1, len(text))))  # one character at a time
    cuts += [sorted(rng.sample(range(1, len(text)), min(6, max(len(text) - 1, 0)))) for _ in range(10)]
    for points in cuts:
        bounds = [0] + points + [len(text)]
        chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        got_content, got_calls = run(name, chunks)
        assert (got_content, simple(got_calls)) == (content, calls), points


def test_the_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "qwen3_coder", "glm45", "glm47", "pythonic"}
    assert TOOL_PARSERS["glm45"] is TOOL_PARSERS["glm47"] is Glm45 and Glm45.special_markers
    for name, cls in TOOL_PARSERS.items():
        parser = tool_parser(name, None)
        assert type(parser) is cls and parser.num_calls == 0
        assert isinstance(cls.markers, tuple) and cls.markers and isinstance(cls.special_markers, bool)
    assert isinstance(tool_parser("hermes", FUNCTIONS), Hermes)
    assert [cls.special_markers for cls in (Hermes, Llama3Json, Mistral, Qwen3Coder, Pythonic)] == \
        [False, True, True, False, True]
    with pytest.raises(ValueError, match="--tool-call-parser") as error:
        tool_parser("llama4_json", FUNCTIONS)
    for name in TOOL_PARSERS:
        assert name in str(error.value)


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = run("mistral", ['[TOOL_CALLS]ping[ARGS]{}[TOOL_CALLS][{"name": "ping", "arguments": {}}]'])
    assert len(calls) == 2
    for call in calls:
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    assert calls[0]["id"] != calls[1]["id"]
    assert len({mistral_call_id() for _ in range(50)}) == 50


def test_content_is_held_only_while_it_could_be_a_marker():
    parser = tool_parser("mistral", FUNCTIONS)
    assert parser.feed("Hello [TOOL") == ("Hello", [])  # "[TOOL" may be the marker, " " may come before it
    assert parser.feed("S] x") == (" [TOOLS] x", [])
    assert parser.feed("[TOOL_CALLS]ping") == ("", [])  # the name may go on
    text, calls = parser.feed("[ARGS]{}")
    assert text == "" and simple(calls) == [PING]

    parser = tool_parser("qwen3_coder", FUNCTIONS)
    assert parser.feed("a <tool_c") == ("a", [])
    assert parser.feed("all>\n<function=ping>\n</function>\n") == ("", [])  # a block is sent when it closes
    text, calls = parser.feed("</tool_call>")
    assert text == "" and simple(calls) == [PING]

    parser = tool_parser("llama3_json", FUNCTIONS)
    assert parser.feed("  <|python") == ("", [])
    assert parser.feed("_tag|>{\"name\": \"ping\", \"parameters\": {\"a\": ") == ("", [])
    text, calls = parser.feed("1}}")
    assert text == "" and simple(calls) == [("ping", {"a": 1})]  # sent when its object closes

    parser = tool_parser("llama3_json", FUNCTIONS)
    assert parser.feed("{ oops") == ("{ oops", [])  # a "{" without a key after it is not a call

    parser = tool_parser("pythonic", FUNCTIONS)
    assert parser.feed("[Note") == ("", [])  # may be a call's name
    assert parser.feed(": long text") == ("[Note: long text", [])
    parser = tool_parser("pythonic", FUNCTIONS)
    assert parser.feed("[ping(x='])')") == ("", [])
    text, calls = parser.feed("]")
    assert text == "" and simple(calls) == [("ping", {"x": "])"})]


QWEN_TYPES = [  # (parameter, value text, value)
    ("n", "5", 5), ("n", " -12 ", -12), ("n", "5.5", "5.5"), ("n", "five", "five"), ("n", "true", "true"),
    ("x", "2.5", 2.5), ("x", "3", 3), ("x", "1e3", 1000.0), ("x", "NaN", "NaN"), ("x", "abc", "abc"),
    ("on", "true", True), ("on", "False", False), ("on", "yes", "yes"),
    ("tags", '["a", "b"]', ["a", "b"]), ("tags", "['a', 'b']", ["a", "b"]), ("tags", '{"a": 1}', '{"a": 1}'),
    ("opts", '{"k": {"v": [1, null]}}', {"k": {"v": [1, None]}}), ("opts", "{'k': None}", {"k": None}),
    ("opts", "{broken", "{broken"),
    ("note", "42", "42"), ("note", "  spaced  ", "  spaced  "), ("note", "line1\nline2", "line1\nline2"),
    ("maybe", "7", 7), ("maybe", "null", None), ("maybe", "x", "x"),
    ("either", "7", 7), ("either", "seven", "seven"),
    ("unknown", "7", "7"),
]


@pytest.mark.parametrize("key,text,value", QWEN_TYPES)
def test_qwen3_coder_values_take_their_schema_type(key, text, value):
    output = f"<tool_call>\n<function=set>\n<parameter={key}>\n{text}\n</parameter>\n</function>\n</tool_call>"
    content, calls = run("qwen3_coder", [output])
    assert content == ""
    assert simple(calls) == [("set", {key: value})]
    assert type(json.loads(calls[0]["function"]["arguments"])[key]) is type(value)


def test_qwen3_coder_values_without_tools_or_schema_stay_strings():
    output = "<tool_call>\n<function=set>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    assert simple(run("qwen3_coder", [output], functions=None)[1]) == [("set", {"n": "5"})]
    output = output.replace("=set>", "=ping>")  # a tool without parameters
    assert simple(run("qwen3_coder", [output])[1]) == [("ping", {"n": "5"})]
    assert typed_parameter("\n5", {"type": "integer"}) == 5
    assert typed_parameter("5", {"enum": [5]}) == "5"
    assert typed_parameter("5", None) == "5"


def test_qwen3_coder_keeps_only_one_newline_off_each_end():
    output = "<tool_call>\n<function=set>\n<parameter=note>\n\n  two  \n\n</parameter>\n</function>\n</tool_call>"
    assert simple(run("qwen3_coder", [output])[1]) == [("set", {"note": "\n  two  \n"})]
    output = "<tool_call><function=set><parameter=note>same line</parameter></function></tool_call>"
    assert simple(run("qwen3_coder", [output])[1]) == [("set", {"note": "same line"})]


def test_qwen3_coder_several_functions_in_one_block():
    output = ("<tool_call>\n<function=ping>\n</function>\n<function=get_weather>\n<parameter=city>\nParis\n"
              "</parameter>\n</function>\n</tool_call>")
    assert simple(run("qwen3_coder", [output])[1]) == [PING, WEATHER]


def test_arguments_are_json_text_with_unicode_as_written():
    _, calls = run("llama3_json", ['{"name": "get_weather", "parameters": {"city": "Zürich"}}'])
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'
    _, calls = run("pythonic", ["[get_weather(city='Zürich', days=3)]"])
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich", "days": 3}'


PIECES = {  # pieces of outputs, good and broken, for random outputs of each format
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "ping", "arguments": {}}', " ", "\n", "x", "<"],
    "llama3_json": ["<|python_tag|>", "<|py", '{"name": "ping", "parameters": {}}', ";", " ", "\n", "{", "}", '"',
                    '{"name": "get_weather", "arguments": {"city": "P\\"}"}}', "text", '{"a": 1}', "\\", "[", "]"],
    "mistral": ["[TOOL_CALLS]", "[TOOL", "[ARGS]", "[ARG", "ping", "get_weather", '{"city": "x]"}', "{}", "[", "]",
                ",", " ", "\n", '{"name": "ping", "arguments": {}}', '"', "{", "}", "hi", "[TOOL_CALLS]ping[ARGS]{}",
                '[TOOL_CALLS]get_weather{"city": "[TOOL_CALLS]"}', '[TOOL_CALLS][{"name": "ping", "arguments": {}}'],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<tool_c", "<function=set>", "<function=ping>", "</function>",
                    "<parameter=n>", "<parameter=note>", "</parameter>", "\n", " ", "5", "text", "<", ">", "true",
                    "<tool_call>\n<function=set>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"],
    "pythonic": ["[", "]", "(", ")", "ping", "get_weather", "city=", '"P"', "'x'", '"""', "'''", ",", " ", "\n",
                 "<|python_start|>", "<|python_end|>", "<|py", "True", "{", "}", ":", "\\", "#", "-1", "[ping()]",
                 "[get_weather(city='a')", "[set(note='''a\n\"b\"'''), ping()]"],
}


@pytest.mark.parametrize("name", sorted(PIECES))
def test_random_outputs_read_the_same_however_cut(name):
    rng = random.Random(name)
    for _ in range(150):
        text = "".join(rng.choice(PIECES[name]) for _ in range(rng.randint(0, 10)))
        whole = run(name, [text])
        if not whole[1] and name != "hermes":  # no call: every character is content, as written
            assert whole[0] == text
        for points in ([], list(range(1, len(text))), sorted(rng.sample(range(len(text) + 1), len(text) // 3))):
            bounds = [0] + points + [len(text)]
            got = run(name, [text[a:b] for a, b in zip(bounds, bounds[1:])])
            assert (got[0], simple(got[1])) == (whole[0], simple(whole[1])), (text, points)
