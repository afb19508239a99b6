"""The agent-facing API, live on a loopback port (one server for the module, `--reasoning-parser qwen3`): the
Anthropic Messages API driven by the real `anthropic` SDK, the Responses API and reasoning in Chat Completions
driven by the real `openai` SDK, streamed and whole, tools, errors in each API's own shape.

The model is the tiny random Llama (`text_model`) with a chat template that shows tools, tool calls, tool
results and reasoning, and opens a `<think>` block itself when `enable_thinking` is on. A random model never
writes a reasoning block or a call by itself: a guided_regex makes it write one where the API allows it,
tool_choice "required" / named / `any` / `tool` constrain its calls, and with thinking on the template's
open block makes all it writes reasoning."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest
from openai import NotFoundError, OpenAI
from transformers import AutoTokenizer

from tests.helpers import live_server, with_chat_template

MODEL = "agent-model"
TEMPLATE = (
    "{% if tools %}<s>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</s>\n{% endif %}"
    "{% for message in messages %}<s>{{ message['role'] }}\n"
    "{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}</tool_call>"
    "{% endfor %}{% if message['role'] == 'tool' %}[{{ message['tool_call_id'] }}] {% endif %}"
    "{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": WEATHER}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
                    "parameters": WEATHER}]
HI = [{"role": "user", "content": "Say hi."}]
GREEDY = {"temperature": 0}  # Anthropic's current SDK has no sampling fields; the server still reads them


@pytest.fixture(scope="module")
def agent_model(text_model, tmp_path_factory) -> str:
    return with_chat_template(text_model, tmp_path_factory.mktemp("agentic") / "model", TEMPLATE)


@pytest.fixture(scope="module")
def server(agent_model, tmp_path_factory):
    with live_server(agent_model, tmp_path_factory.mktemp("server_agentic"), MODEL, "-k", "4", "--max-model-len",
                     "1024", "--max-batch-size", "8", "--reasoning-parser", "qwen3") as url:
        yield url


@pytest.fixture(scope="module")
def openai_client(server):
    with OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _greedy_chat(client, messages, max_tokens, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens,
                                          **kwargs)


# ------------------------------------------------------------------ reasoning in Chat Completions
def test_chat_separates_a_think_block_whole_and_streamed(openai_client):
    """A model made to write `<think>abc</think>defg` returns reasoning "abc" and content "defg"."""
    body = {"guided_regex": r"<think>[a-z]{3}</think>[a-z]{4}"}
    whole = _greedy_chat(openai_client, HI, 40, extra_body=body).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{3}", reasoning) and re.fullmatch("[a-z]{4}", whole.message.content)
    chunks = list(_greedy_chat(openai_client, HI, 40, extra_body=body, stream=True))
    streamed_reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                                 for c in chunks if c.choices)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_reasoning, streamed) == (reasoning, whole.message.content)


def test_a_template_that_opens_the_block_makes_the_whole_reply_reasoning(openai_client):
    thinking = _greedy_chat(openai_client, HI, 12, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    plain = _greedy_chat(openai_client, HI, 12)
    reply = thinking.choices[0].message
    assert reply.model_extra["reasoning_content"] and not reply.content  # no </think>: all of it reasoning
    assert plain.choices[0].message.model_extra["reasoning_content"] is None and plain.choices[0].message.content


# ------------------------------------------------------------------ the Messages API
def test_messages_whole_and_streamed_give_the_chat_reply(claude, openai_client):
    chat = _greedy_chat(openai_client, [{"role": "system", "content": "Be brief."}, *HI], 10)
    message = claude.messages.create(model=MODEL, max_tokens=10, system="Be brief.", messages=HI, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.role == "assistant" and message.id.startswith("msg_")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens, 10)
    with claude.messages.stream(model=MODEL, max_tokens=10, system="Be brief.", messages=HI,
                                extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds


def test_messages_stop_sequences(claude):
    text = claude.messages.create(model=MODEL, max_tokens=12, messages=HI, extra_body=GREEDY).content[0].text
    stop = text[4:6]
    message = claude.messages.create(model=MODEL, max_tokens=12, messages=HI, extra_body=GREEDY,
                                     stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.find(stop)]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_messages_tool_use_whole_and_streamed(claude, choice):
    kwargs = dict(model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=ANTHROPIC_TOOLS, tool_choice=choice,  # the default temperature: 1
                  thinking={"type": "disabled"})  # (else the calls may come after a think block)
    message = claude.messages.create(**kwargs)
    uses = [b for b in message.content if b.type == "tool_use"]  # (a cut call would be a text block)
    assert uses and message.stop_reason in ("tool_use", "max_tokens")
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(**kwargs) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason in ("tool_use", "max_tokens") and streamed
    if final.stop_reason == "tool_use":
        for use in streamed:
            jsonschema.validate(use.input, WEATHER)
    if len(streamed) == 1 and final.stop_reason == "tool_use":
        assert json.loads(partial) == streamed[0].input


def test_messages_thinking_block_and_a_tool_round_trip(claude, openai_client):
    thinking = claude.messages.create(model=MODEL, max_tokens=8, messages=HI, extra_body=GREEDY,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in thinking.content] == ["thinking"] and thinking.content[0].thinking
    omitted = claude.messages.create(model=MODEL, max_tokens=8, messages=HI, extra_body=GREEDY,
                                     thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, b.thinking) for b in omitted.content] == [("thinking", "")]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
    structured = claude.messages.create(model=MODEL, max_tokens=60, messages=HI, extra_body=GREEDY,
                                        thinking={"type": "disabled"},
                                        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(structured.content[0].text), schema)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, {
            "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                                     {"type": "text", "text": "Thanks."}]},
    ]
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=history, tools=ANTHROPIC_TOOLS,
                                     extra_body=GREEDY)
    same = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{
            "id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
        {"role": "user", "content": "Thanks."},
    ]
    chat = _greedy_chat(openai_client, same, 4, tools=CHAT_TOOLS)
    assert message.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt, the same template
    assert message.content[0].text == chat.choices[0].message.content


def test_messages_errors_are_anthropic_shaped(claude, server):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert bad.value.body["error"]["message"].startswith("messages[0].content[0].type: 'image' blocks")
    r = httpx.post(f"{server}/v1/messages", json={"model": MODEL, "messages": HI})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens:")
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-nonesuch", max_tokens=4, messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": HI,
                                                   "stop_sequences": [""]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("stop_sequences")
    r = httpx.post(f"{server}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": HI, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools[0].type")


# ------------------------------------------------------------------ the Responses API
def test_responses_whole_and_streamed_give_the_chat_reply(openai_client):
    chat = _greedy_chat(openai_client, [{"role": "system", "content": "Be brief."}, *HI], 10)
    response = openai_client.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.",
                                              max_output_tokens=10, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 10)
    events = list(openai_client.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.",
                                                 max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_function_calls_whole_and_streamed(openai_client, tool_choice):
    kwargs = dict(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS, tool_choice=tool_choice,
                  max_output_tokens=300, temperature=1.0, reasoning={"effort": "none"})
    response = openai_client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    complete = calls if response.status == "completed" else calls[:-1]  # a cut reply's last call is unfinished
    for call in complete:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(openai_client.responses.create(stream=True, **kwargs))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done and deltas == "".join(c.arguments for c in done)
    for call in done if events[-1].type == "response.completed" else done[:-1]:
        jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_responses_continue_a_stored_conversation_and_give_json(openai_client):
    first = openai_client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6, temperature=0)
    second = openai_client.responses.create(model=MODEL, input="Again.", previous_response_id=first.id,
                                            max_output_tokens=6, temperature=0)
    alone = openai_client.responses.create(model=MODEL, input="Again.", max_output_tokens=6, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert openai_client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(NotFoundError, match="previous_response_id"):
        openai_client.responses.create(model=MODEL, input="x", previous_response_id="resp_nonesuch")
    with pytest.raises(NotFoundError, match=r"previous_response_id: .*\(100000 chars\)") as huge:
        openai_client.responses.create(model=MODEL, input="x", previous_response_id="r" * 100_000)
    assert len(huge.value.message) < 400  # an absurd id is not echoed whole
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
    structured = openai_client.responses.create(model=MODEL, input="A name?", max_output_tokens=60, temperature=0,
                                                reasoning={"effort": "none"},
                                                text={"format": {"type": "json_schema", "name": "n",
                                                                 "schema": schema}})
    jsonschema.validate(json.loads(structured.output_text), schema)


def test_responses_reasoning_items_and_errors(openai_client, server):
    response = openai_client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0,
                                              reasoning={"effort": "low"})
    assert [item.type for item in response.output] == ["reasoning"]  # the template opened the block
    assert response.output[0].content[0].text
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 8
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert r.json()["error"]["message"].startswith("input[0].content[0].type")
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_output_tokens")
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools[0].type")


def test_qwen3_coder_auto_calls_are_constrained_once_they_start(agent_model, tmp_path_factory):
    """`--tool-call-parser qwen3_coder`: "auto" calls follow the tools' schemas from their `<tool_call>` on, on the
    device (reply_constraint.qwen3_coder_call): the random model's greedy and sampled calls parse, name the tool
    and carry arguments that validate, streamed as whole."""
    # the random model writes no marker by itself: a reply of "x" or calls (a guided_regex beside "auto" calls),
    # and "<" pushed, so that it opens a call, from which the constraint alone writes it
    (less,) = AutoTokenizer.from_pretrained(agent_model)("<", add_special_tokens=False)["input_ids"]
    bias = {str(less): 100}
    with live_server(agent_model, tmp_path_factory.mktemp("server_qwen3_coder"), MODEL, "--max-model-len", "512",
                     "--tool-call-parser", "qwen3_coder") as url, \
            OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        calls = 0
        for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "seed": 4}):
            kwargs = dict(model=MODEL, messages=HI, tools=CHAT_TOOLS, max_tokens=200, logit_bias=bias,
                          extra_body={"guided_regex": "x"}, **extra)
            whole = client.chat.completions.create(**kwargs).choices[0]
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
            for call in whole.message.tool_calls or ():
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), WEATHER)
                calls += 1
            assert [d.function.arguments for d in streamed if d.function.arguments] == \
                [c.function.arguments for c in whole.message.tool_calls or ()]
            content = whole.message.content or ""  # a marker always opened a call; only one cut by max_tokens stays
            assert content.count("<tool_call>") == 0 or (whole.finish_reason == "length" and
                                                          content.count("<tool_call>") == 1 and
                                                          content.startswith("<tool_call>")), content
        assert calls >= 1


@pytest.mark.parametrize("parser, forced", [
    ("mistral", r'Checking\.\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Paris", "unit": "c"\}'),
    ("glm45", r"Checking\.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              r"<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>"),
])
def test_another_call_format_by_its_parser_name(agent_model, tmp_path_factory, parser, forced):
    """`--tool-call-parser mistral` / `glm45` on a second server: a reply written (by a guided_regex) in that
    format comes back as OpenAI tool calls, streamed and whole (Mistral's with its 9-character ids); "auto"
    calls that the model starts are constrained in that format (call_formats.py) and come back valid."""
    model = agent_model
    with live_server(model, tmp_path_factory.mktemp(f"server_{parser}"), MODEL, "--max-model-len", "512",
                     "--tool-call-parser", parser) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        # the reply is the forced text or calls ("auto" calls are constrained too): "C" pushed, the forced text
        tokenizer = AutoTokenizer.from_pretrained(model)
        (c,) = tokenizer("C", add_special_tokens=False)["input_ids"]
        kwargs = dict(model=MODEL, messages=HI, tools=CHAT_TOOLS, temperature=0, max_tokens=200,
                      logit_bias={str(c): 100}, extra_body={"guided_regex": forced})
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
        [call] = whole.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                              "unit": "c"}
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id) or parser != "mistral"
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert len(streamed) == 1 and streamed[0].function.arguments == call.function.arguments
        # "x" or calls, the marker's first character pushed: the constraint alone writes the calls from there (more
        # of them while the push lasts, the last one cut by max_tokens)
        (first,) = tokenizer({"mistral": "[", "glm45": "<"}[parser], add_special_tokens=False)["input_ids"]
        for seed in (5, 6):
            sampled = client.chat.completions.create(
                model=MODEL, messages=HI, tools=CHAT_TOOLS, max_tokens=200, temperature=1.0, seed=seed,
                logit_bias={str(first): 100}, extra_body={"guided_regex": "x"}).choices[0]
            assert sampled.message.tool_calls and sampled.finish_reason in ("tool_calls", "length"), sampled
            for call in sampled.message.tool_calls:
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("parser, opener", [("llama3_json", "{"), ("pythonic", "[")])
def test_whole_reply_call_formats_are_constrained_once_they_start(agent_model, tmp_path_factory, parser, opener):
    """`--tool-call-parser llama3_json` / `pythonic`, whose calls are the whole reply: a reply that starts with the
    format's opener ("x" or calls, the opener pushed) is the tools' calls, sampled at temperature 1, valid against
    their schema, streamed as whole; a reply that starts otherwise ("x" pushed) is content."""
    tokenizer = AutoTokenizer.from_pretrained(agent_model)
    (first,), (x,) = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (opener, "x"))
    with live_server(agent_model, tmp_path_factory.mktemp(f"server_{parser}"), MODEL, "--max-model-len", "512",
                     "--tool-call-parser", parser) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        text = client.chat.completions.create(model=MODEL, messages=HI, tools=CHAT_TOOLS, temperature=0, max_tokens=8,
                                              logit_bias={str(x): 100}, extra_body={"guided_regex": "x"}).choices[0]
        assert text.message.content == "x" and not text.message.tool_calls
        for seed in (5, 6):
            kwargs = dict(model=MODEL, messages=HI, tools=CHAT_TOOLS, max_tokens=200, temperature=1.0, seed=seed,
                          logit_bias={str(first): 100}, extra_body={"guided_regex": "x"})
            whole = client.chat.completions.create(**kwargs).choices[0]
            assert whole.message.tool_calls and whole.finish_reason in ("tool_calls", "length"), whole
            for call in whole.message.tool_calls:
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
            assert [d.function.arguments for d in streamed if d.function.arguments] == \
                [c.function.arguments for c in whole.message.tool_calls]
