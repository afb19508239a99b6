"""The OpenAI Responses wire format (POST /v1/responses): the request model, checked field by field, the Chat
Completions request it runs as, and the bounded store `previous_response_id` reads.

What maps to what:

* `instructions` -> a system message first (not carried over to a later response, as at OpenAI);
* `input`: a string (one user message) or items: messages (`role` user / system / developer / assistant,
  `content` a string or `input_text` / `output_text` parts), `function_call` items (an assistant's tool
  calls; consecutive ones join one assistant message), `function_call_output` items (`tool` messages),
  `reasoning` items (the assistant's `reasoning_content`); images, files and other item types are refused
  by name;
* `tools` (function tools: `name`, `description`, `parameters`) and `tool_choice` ("auto", "none",
  "required", `{"type": "function", "name": ...}`); built-in tools (web search, file search, ...) are refused;
* `text.format`: `text`, `json_object`, `json_schema` (`name`, `schema`) -> response_format;
* `max_output_tokens`, `temperature`, `top_p`; `reasoning.effort` turns the template's thinking (its
  `enable_thinking`) off for "none" and on for any other effort (the effort itself is not a budget);
  `metadata`, `user`, `parallel_tool_calls`, `truncation` ("disabled") accepted;
* `previous_response_id`: the stored conversation of that response (its input and its output) comes before
  this input; `store` (default true) keeps this one for later. The store is in memory, bounded
  (`ResponseStore`: the least recently used are dropped), and a response not (or no longer) in it is a 404
  naming the field.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import APIError, validation_error
from .protocol import ChatCompletionRequest


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ResponsesRequest(_Base):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    truncation: str | None = "disabled"
    user: str | None = None
    background: bool | None = False

    def input_messages(self) -> list[dict]:
        """This request's own input as chat messages (without instructions or the previous conversation)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise APIError("input: the input is empty", param="input")
        out: list[dict] = []
        for i, item in enumerate(self.input):
            _item(i, item, out)
        return out

    def to_chat(self, previous: list[dict] | None) -> tuple[ChatCompletionRequest, list[dict]]:
        """(The Chat Completions request this one runs as, the conversation to store with its output)."""
        if self.background:
            raise APIError("background: background responses are not supported", param="background")
        if self.truncation not in (None, "disabled"):
            raise APIError(f"truncation: only 'disabled' is supported, got {self.truncation!r}", param="truncation")
        conversation = list(previous or []) + self.input_messages()
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream)}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.tools:
            body["tools"] = [_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        response_format = _text_format(self.text)
        if response_format is not None:
            body["response_format"] = response_format
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:  # "none": the template's thinking off; any other effort: on (no budget)
            body["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
        try:
            return ChatCompletionRequest.model_validate(body), conversation
        except ValidationError as exc:
            raise validation_error(exc) from None

    def echo(self) -> dict:
        """The request's fields a Response object repeats."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": bool(self.parallel_tool_calls),
                "previous_response_id": self.previous_response_id, "store": bool(self.store),
                "temperature": self.temperature if self.temperature is not None else 1.0,
                "top_p": self.top_p if self.top_p is not None else 1.0,
                "text": self.text or {"format": {"type": "text"}},
                "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
                "tools": self.tools or [], "truncation": "disabled", "user": self.user,
                "reasoning": {"effort": (self.reasoning or {}).get("effort"), "summary": None}}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: expected a string or a list of text parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(f"{where}[{j}].type: {kind!r} parts are not supported (this server takes input_text and "
                           f"output_text)", param="input")
        parts.append(part["text"])
    return "\n".join(parts)


def _item(i: int, item: dict, out: list[dict]) -> None:
    where = f"input[{i}]"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(f"{where}.role: expected 'user', 'system', 'developer' or 'assistant', got {role!r}",
                           param="input")
        out.append({"role": role, "content": _text(item.get("content", ""), f"{where}.content")})
    elif kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise APIError(f"{where}.{name}: this field is required (a string)", param="input")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if out and out[-1]["role"] == "assistant":  # the calls of the turn the assistant's message began
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise APIError(f"{where}.call_id: this field is required (a string)", param="input")
        output = item.get("output", "")
        out.append({"role": "tool", "tool_call_id": item["call_id"],
                    "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        text = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
        out.append({"role": "assistant", "content": "", "reasoning_content": text})
    else:
        raise APIError(f"{where}.type: {kind!r} items are not supported (this server takes message, function_call, "
                       f"function_call_output and reasoning items)", param="input")


def _tool(i: int, tool: dict) -> dict:
    kind = tool.get("type")
    if kind != "function":
        raise APIError(f"tools[{i}].type: only function tools are run here, got {kind!r}", param="tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(f"tools[{i}].name: this field is required (a non-empty string)", param="tools")
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description"),
                                             "parameters": tool.get("parameters")}}


def _tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(f"tool_choice: expected 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, "
                       f"got {choice!r}", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("text.format.schema: this field is required (a JSON schema object)", param="text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise APIError(f"text.format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}", param="text")


def renamed(err: APIError) -> APIError:
    """A Chat Completions error in this API's terms."""
    message = err.message.replace(".function.parameters", ".parameters").replace(".function.name", ".name")
    param = err.param
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("messages", "input"), ("response_format", "text")):
        if message.startswith(ours):
            message = theirs + message[len(ours):]
        if param == ours:
            param = theirs
    return APIError(message, param=param, status=err.status, type=err.type, code=err.code)


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a later response's conversation continues with."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(p["text"] for p in item.get("content", []))
        elif item["type"] == "message":
            message["content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return [message]


class ResponseStore:
    """Stored responses (`store`), at most `capacity`, the least recently used dropped first: each keeps its
    Response object (GET /v1/responses/{id}) and the conversation a later `previous_response_id` continues."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation + output_messages(response["output"]))
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> tuple[dict, list[dict]]:
        try:
            response, conversation = self._items[response_id]
        except KeyError:
            shown = (repr(response_id) if len(response_id) <= 80
                     else f"{response_id[:64]!r}... ({len(response_id)} chars)")
            raise APIError(f"{param}: no stored response with id {shown} (responses are kept in memory, the "
                           f"last {self.capacity}, and only with store true)", param=param, status=404,
                           type="not_found_error") from None
        self._items.move_to_end(response_id)
        return response, copy.deepcopy(conversation)
