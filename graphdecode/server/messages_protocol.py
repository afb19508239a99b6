"""The Anthropic Messages wire format (POST /v1/messages): the request model, checked field by field, and the
Chat Completions request it runs as (the same template rendering, sampling, constraints and tool-call parsing).

What maps to what:

* `system` (a string or text blocks) -> a system message first;
* `messages[i].content` (a string or blocks): `text` blocks join into the message's content; an assistant's
  `tool_use` blocks become its `tool_calls` (`input` as the arguments object, as templates take them) and
  its `thinking` blocks its `reasoning_content`; a user's `tool_result` blocks become `tool` messages
  (`tool_call_id`, the result's text) before the user's own text. `image`, `document` and other block types
  are refused by name (this server runs text models);
* `tools` (`name`, `description`, `input_schema`) -> function tools; Anthropic's server tools (a `type` such
  as `web_search_20250305`) are refused by name;
* `tool_choice`: `auto` -> "auto", `any` -> "required" (one or more calls, constrained), `tool` -> that
  function (constrained), `none` -> "none";
* `max_tokens` (required), `stop_sequences`; `temperature`, `top_p`, `top_k` where a client still sends them
  (Anthropic's current SDK has none: sampling is then the model's recommendation, generation_defaults.py,
  else temperature 1);
  `output_config.format` (`{"type": "json_schema", "schema": ...}`) -> a JSON-schema constraint;
  `thinking` (`enabled` with its `budget_tokens`, `adaptive`, `between_tools`, or `disabled`) -> the template's
  `enable_thinking` (the budget is not enforced: the model thinks until it closes its block or max_tokens
  ends it; `display: "omitted"` returns the thinking blocks empty); `metadata`, `service_tier`,
  `output_config.effort` and the other request options are accepted and unused.

Errors are 400s whose message starts with the field in this API's own terms (`messages[1].content[0].type`,
`tools[0].input_schema`, `stop_sequences`); the server sends them in Anthropic's error shape.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError, validation_error
from .protocol import ChatCompletionRequest


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class MessageParam(_Base):
    role: str
    content: str | list[dict[str, Any]]


class MessagesRequest(_Base):
    model: str
    max_tokens: int
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @property
    def thinking_omitted(self) -> bool:
        """thinking.display "omitted": thinking blocks come back empty."""
        return isinstance(self.thinking, dict) and self.thinking.get("display") == "omitted"

    def to_chat(self) -> ChatCompletionRequest:
        """The Chat Completions request this one runs as; a 400 naming this API's field otherwise."""
        body: dict[str, Any] = {"model": self.model, "messages": self._conversation(), "max_tokens": self.max_tokens,
                                "stream": bool(self.stream)}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        thinking = _thinking(self.thinking)
        if thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": thinking}
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise APIError("output_config.format: expected {'type': 'json_schema', 'schema': {...}}",
                               param="output_config")
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt["schema"]}}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def _conversation(self) -> list[dict]:
        out: list[dict] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else _text_of(self.system, "system")
            out.append({"role": "system", "content": text})
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            if message.role not in ("user", "assistant"):
                raise APIError(f"{where}.role: must be 'user' or 'assistant', got {message.role!r}", param="messages")
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            out.extend(_blocks(message.role, message.content, where))
        return out


def _text_of(blocks: list[dict], where: str) -> str:
    parts = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise APIError(f"{where}[{j}]: expected a text block ({{'type': 'text', 'text': ...}}), got type "
                           f"{kind!r}", param=where.split("[", 1)[0])
        parts.append(block["text"])
    return "\n".join(parts)


def _blocks(role: str, blocks: list[dict], where: str) -> list[dict]:
    """One message's content blocks as chat messages (tool results first, as their own `tool` messages)."""
    text, calls, thinking, results = [], [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise APIError(f"{at}: a tool_use block needs a string name and an object input", param="messages")
            calls.append({"id": str(block.get("id", f"toolu_{j}")), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and role == "user":
            content = block.get("content", "")
            if isinstance(content, list):
                content = _text_of(content, f"{at}.content")
            elif not isinstance(content, str):
                raise APIError(f"{at}.content: expected a string or text blocks", param="messages")
            if block.get("is_error"):
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": content})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if kind == "thinking" and isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        else:
            allowed = "text, tool_use, thinking" if role == "assistant" else "text, tool_result"
            raise APIError(f"{at}.type: {kind!r} blocks are not supported in a {role} message (this server takes "
                           f"{allowed})", param="messages")
    out = list(results)
    if text or calls or thinking or not results:
        message: dict[str, Any] = {"role": role, "content": "\n".join(text)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "\n".join(thinking)
        out.append(message)
    return out


def _tool(i: int, tool: dict) -> dict:
    where = f"tools[{i}]"
    kind = tool.get("type", "custom")
    if kind not in ("custom", None):
        raise APIError(f"{where}.type: Anthropic's server tools ({kind!r}) are not run here; give client tools "
                       f"(name, description, input_schema)", param="tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(f"{where}.name: this field is required (a non-empty string)", param="tools")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise APIError(f"{where}.input_schema: this field is required (a JSON schema object)", param="tools")
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description"),
                                             "parameters": schema}}


def _tool_choice(choice: dict) -> str | dict:
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError("tool_choice.name: this field is required with type 'tool'", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got {kind!r}", param="tool_choice")


def _thinking(thinking: dict | None) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind in ("adaptive", "between_tools"):
        return True
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise APIError(f"thinking.budget_tokens: expected a positive integer, got {budget!r}", param="thinking")
        return True
    if kind == "disabled":
        return False
    raise APIError(f"thinking.type: expected 'enabled', 'adaptive', 'between_tools' or 'disabled', got {kind!r}",
                   param="thinking")


# the Chat Completions fields an error may name -> this API's
RENAMES = {"stop": "stop_sequences", "response_format": "output_config"}


def renamed(err: APIError) -> APIError:
    """A Chat Completions error in this API's terms (`tools[0].function.parameters` is `tools[0].input_schema`,
    `stop` is `stop_sequences`)."""
    message = err.message.replace(".function.parameters", ".input_schema").replace(".function.name", ".name")
    for ours, theirs in (("stop", "stop_sequences"), ("response_format", "output_config.format")):
        if message.startswith((ours + ":", ours + " ")):
            message = theirs + message[len(ours):]
    return APIError(message, param=RENAMES.get(err.param, err.param), status=err.status, type=err.type,
                    code=err.code)


def tool_input(arguments: str) -> dict | None:
    """A call's arguments as the tool_use block's input object (None: not a JSON object)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
