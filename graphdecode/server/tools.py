"""Tool calls on /v1/chat/completions: the request's tools checked, the constraint
`tool_choice` implies, and the model's output turned into OpenAI `tool_calls`.

* `check_tools` / `check_tool_choice`: the request's `tools` (OpenAI's
  `[{"type": "function", "function": {"name", "description", "parameters"}}]`) and
  `tool_choice` ("none", "auto", "required" or `{"type": "function", "function":
  {"name": ...}}`), every problem a ValueError whose message starts with the field.
* `required_schema`: the JSON schema of `tool_choice="required"`, vLLM's shape: a
  non-empty array of `{"name": <a tool's name>, "parameters": <its parameters>}`, an
  `anyOf` over the tools (their `$defs` hoisted to the top, where `#/$defs/...` refers).
* Three output parsers with one interface, `feed(text) -> (content, tool-call deltas)`
  then `finish()`; the streamed path feeds each delta, the non-streamed path feeds the
  whole text once, so both give the same content and the same arguments:
  `RequiredCalls` (the JSON array above: each element's `parameters` text is streamed as
  that call's arguments, as the model writes it), `NamedCall` (the whole output is the
  arguments), `HermesCalls` ("auto": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, the Hermes / Qwen templates' format, become calls when their block closes).

A tool-call delta is OpenAI's streaming form: `{"index", "id", "type": "function",
"function": {"name", "arguments"}}` for a call's first delta, `{"index", "function":
{"arguments": <more>}}` after it; `merge_calls` folds them into the message's tool_calls.
"""

from __future__ import annotations

import copy
import json
import uuid

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a tool without parameters (vLLM's default)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------ the request's tools
def check_tools(tools: list) -> list[dict]:
    """The tools' function definitions ({"name", "description", "parameters"}), in order;
    ValueError naming `tools[i]...` for a malformed one or a repeated name."""
    if not isinstance(tools, list):
        raise ValueError(f"tools: expected a list of tools, got {type(tools).__name__}")
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: expected an object, got {type(tool).__name__}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported, got {kind!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function: this field is required (an object with a name)")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name: this field is required (a non-empty string)")
        if name in seen:
            raise ValueError(f"{where}.function.name: {name!r} is the name of an earlier tool too")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description: expected a string, got {type(description).__name__}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters: expected a JSON schema object, "
                             f"got {type(parameters).__name__}")
        functions.append({"name": name, "description": description, "parameters": parameters})
    return functions


def check_tool_choice(tool_choice, functions: list[dict] | None) -> str | dict:
    """"none" / "auto" / "required", or the named function's definition; ValueError naming
    `tool_choice`. Without tools, any tool_choice is an error (OpenAI's rule)."""
    if tool_choice is None:
        return "auto" if functions else "none"
    if not functions:
        raise ValueError("tool_choice: only allowed when tools are given")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: expected 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
        return tool_choice
    if not isinstance(tool_choice, dict):
        raise ValueError(f"tool_choice: expected a string or an object, got {type(tool_choice).__name__}")
    if tool_choice.get("type", "function") != "function":
        raise ValueError(f"tool_choice.type: only 'function' is supported, got {tool_choice.get('type')!r}")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice.function.name: this field is required (the tool to call)")
    for f in functions:
        if f["name"] == name:
            return f
    known = ", ".join(repr(f["name"]) for f in functions)
    raise ValueError(f"tool_choice: {name!r} is not one of the tools given ({known})")


def parameters_schema(function: dict) -> dict:
    return function["parameters"] if function["parameters"] is not None else dict(_EMPTY_PARAMETERS)


def required_schema(functions: list[dict]) -> dict:
    """tool_choice="required": one or more calls, each {"name": one of the tools, "parameters":
    that tool's parameters} (vLLM's schema); `$defs` of every tool are hoisted to the top.
    ValueError naming the tool whose `$defs` clash with another's."""
    defs: dict = {}
    options = []
    for i, function in enumerate(functions):
        parameters = copy.deepcopy(parameters_schema(function))
        for name, schema in (parameters.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise ValueError(f"tools[{i}].function.parameters: its $defs {name!r} differs from another "
                                 f"tool's $defs of that name (tool_choice='required' joins them)")
            defs[name] = schema
        options.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                       "parameters": parameters},
                        "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates want them (vLLM's rule): an assistant message's tool call
    arguments given as a JSON string become the object it spells; an empty tool_calls list
    is dropped. Everything else reaches the template as sent."""
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or calls is None:
            continue
        if isinstance(calls, list) and not calls:
            del message["tool_calls"]
            continue
        if not isinstance(calls, list):
            continue
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    parsed = json.loads(function["arguments"]) if function["arguments"].strip() else {}
                except json.JSONDecodeError:
                    continue
                if isinstance(parsed, dict):
                    function["arguments"] = parsed
    return messages


# ------------------------------------------------------------------ output parsers
def _first(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _more(index: int, arguments: str) -> dict:
    return {"index": index, "function": {"arguments": arguments}}


def merge_calls(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas folded into the message's tool_calls (arguments concatenated)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}}
        else:
            call["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


class NamedCall:
    """A named tool_choice: the whole output is that function's arguments."""

    def __init__(self, name: str):
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.num_calls == 0:
            if not text:
                return "", []
            self.num_calls = 1
            return "", [_first(0, self.name, text)]
        return "", [_more(0, text)] if text else []

    def finish(self) -> tuple[str, list[dict]]:
        if self.num_calls == 0:  # nothing generated: still one call, with no arguments written
            self.num_calls = 1
            return "", [_first(0, self.name, "")]
        return "", []


class RequiredCalls:
    """tool_choice="required": the output is a JSON array of {"name": ..., "parameters": {...}}
    (required_schema). Scanned as it arrives: a call starts once its name is complete, and its
    arguments are the raw text of its `parameters` value (streamed up to the last character
    written while the value is an open object, array or string; a bare number or literal when
    it ends). `arguments` is accepted for `parameters` too. Output that never forms a call
    (cut short before any name) comes back as content at finish()."""

    def __init__(self):
        self.text = ""
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.expect = "key"  # inside an element (depth 2): "key", "colon", "value", "next"
        self.key_start = -1
        self.key = None
        self.value_start = -1  # where the current element-level value starts
        self.value_kind = None  # "container", "string", "literal"
        self._reset_element()
        self.num_calls = 0

    def _reset_element(self):
        self.key = None
        self.key_start = -1
        self.value_kind = None
        self.name = None
        self.args_start = -1  # parameters value: start, end (exclusive, -1 while open), sent up to
        self.args_end = -1
        self.args_sent = -1
        self.started = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        out: list[dict] = []
        text, n = self.text, len(self.text)
        i = self.pos
        while i < n:
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 2:
                        if self.expect == "key" and self.key_start >= 0:
                            self.key = _loads(text[self.key_start:i + 1])
                            self.key_start = -1
                            self.expect = "colon"
                        elif self.value_kind == "string":
                            self._value_end(i + 1, out)
                i += 1
                continue
            if ch in " \t\r\n":
                i += 1
                continue
            if self.depth == 2 and self.expect == "value":  # an element-level value begins here
                self.value_start = i
                self.value_kind = "container" if ch in "{[" else "string" if ch == '"' else "literal"
                if self.key in ("parameters", "arguments") and self.args_start < 0:
                    self.args_start = self.args_sent = i
                self.expect = "next"
            if self.depth == 2 and self.value_kind == "literal" and self.expect == "next" and ch in ",}":
                end = i
                while end > self.value_start and text[end - 1] in " \t\r\n":
                    end -= 1
                self._value_end(end, out)
            if ch == '"':
                self.in_string = True
                if self.depth == 2 and self.expect == "key":
                    self.key_start = i
            elif ch in "{[":
                self.depth += 1
                if self.depth == 2:
                    self._reset_element()
                    self.expect = "key"
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 2 and self.value_kind == "container":
                    self._value_end(i + 1, out)
                elif self.depth == 1:  # an element closed
                    self._send(out)
            elif ch == ":" and self.depth == 2 and self.expect == "colon":
                self.expect = "value"
            elif ch == "," and self.depth == 2:
                self.expect = "key"
                self.value_kind = None
            i += 1
        self.pos = n
        self._send(out)
        return "", out

    def _value_end(self, end: int, out: list[dict]) -> None:
        if self.value_start == self.args_start and self.args_start >= 0 and self.args_end < 0:
            self.args_end = end
        elif self.key == "name" and self.value_kind == "string" and self.name is None:
            name = _loads(self.text[self.value_start:end])
            self.name = name if isinstance(name, str) else None
        self.value_kind = None
        self._send(out)

    def _send(self, out: list[dict]) -> None:
        """What the current element's call has to say now: its start, then arguments written."""
        if self.name is None or self.args_start < 0:
            return
        if self.args_end >= 0:
            upto = self.args_end
        elif self.value_kind == "container" or (self.value_kind == "string" and self.value_start == self.args_start):
            upto = len(self.text)
        else:
            upto = self.args_sent  # a bare literal: sent when it ends
        fragment = self.text[self.args_sent:upto] if upto > self.args_sent else ""
        self.args_sent = max(self.args_sent, upto)
        if not self.started:
            self.started = True
            out.append(_first(self.num_calls, self.name, fragment))
            self.num_calls += 1
        elif fragment:
            out.append(_more(self.num_calls - 1, fragment))

    def finish(self) -> tuple[str, list[dict]]:
        if self.num_calls == 0:
            return self.text, []
        return "", []


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_hermes_block(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one `<tool_call>` block's body, or None when it is not
    a call: JSON of an object with a string "name" and an object "arguments" (or "parameters",
    or none: {}); a string "arguments" is taken as the JSON text it holds."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        return call["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class HermesCalls:
    """tool_choice="auto": `<tool_call>...</tool_call>` blocks (an unclosed last block too, at
    finish) whose body is a call become tool calls, sent whole when their block ends; every
    other character is content. Whitespace between content and a call block, and between
    blocks, is the template's formatting and is dropped; a block that is not a call stays in
    the content as written. Content is held back only while it could be the start of a tag
    (a trailing "<", "<tool", ...) or is whitespace that a block may follow."""

    def __init__(self):
        self.buf = ""
        self.in_block = False
        self.pending_ws = ""  # whitespace after content: sent before more content, dropped before a call
        self.after_call = False  # whitespace right after a call block is dropped
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content: list[str] = []
        calls: list[dict] = []
        while True:
            if not self.in_block:
                at = self.buf.find(START_TAG)
                if at >= 0:
                    self._content(self.buf[:at], content)
                    self.buf = self.buf[at + len(START_TAG):]
                    self.in_block = True
                    continue
                keep = _partial_tag(self.buf)
                self._content(self.buf[:len(self.buf) - keep], content)
                self.buf = self.buf[len(self.buf) - keep:]
                break
            at = self.buf.find(END_TAG)
            if at < 0:
                break
            body, self.buf = self.buf[:at], self.buf[at + len(END_TAG):]
            self.in_block = False
            self._block(body, True, content, calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        content: list[str] = []
        calls: list[dict] = []
        if self.in_block:
            self._block(self.buf, False, content, calls)
        else:
            self._content(self.buf, content)
        self.buf = ""
        self.in_block = False
        if self.pending_ws and not self.after_call:
            content.append(self.pending_ws)
        self.pending_ws = ""
        return "".join(content), calls

    def _content(self, text: str, out: list[str]) -> None:
        if not text:
            return
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        body = text.rstrip()
        if not body:
            self.pending_ws += text
            return
        out.append(self.pending_ws + body)
        self.pending_ws = text[len(body):]

    def _block(self, body: str, closed: bool, content: list[str], calls: list[dict]) -> None:
        call = parse_hermes_block(body)
        if call is None:  # not a call: the block is content, as written
            self._content(START_TAG + body + (END_TAG if closed else ""), content)
            return
        self.pending_ws = ""
        self.after_call = True
        calls.append(_first(self.num_calls, *call))
        self.num_calls += 1


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin START_TAG."""
    for k in range(min(len(text), len(START_TAG) - 1), 0, -1):
        if text.endswith(START_TAG[:k]):
            return k
    return 0


def parse_all(parser, text: str) -> tuple[str, list[dict]]:
    """The whole output through a parser: (content, tool_calls)."""
    content, deltas = parser.feed(text)
    more, last = parser.finish()
    return content + more, merge_calls(deltas + last)
