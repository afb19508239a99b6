"""The formats tool_choice "auto" reads a model's calls in (`--tool-call-parser`, vLLM's names).

Every parser has HermesCalls' interface (tools.py): `feed(text) -> (content, tool-call deltas)`, `finish()`,
`num_calls`, and is built as `tool_parser(name, functions)` (`functions`: the request's checked tools, or None).
Text may be cut anywhere between feeds: the same output gives the same content and calls however it is cut.
`markers` is the text that opens a call (llama3_json's `{` and pythonic's `[` only at the output's start);
`special_markers` says whether one of them is a special token the detokenizer drops unless
`skip_special_tokens` is off (the server turns it off for "auto" then).

* `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5 / Qwen3).
* `llama3_json` (Llama 3.1 / 3.2 JSON calls): the whole output, after leading whitespace and an optional
  `<|python_tag|>`, is `{"name": ..., "parameters": {...}}` objects ("arguments" is read too) separated by `;`
  and whitespace. An output that does not start so is content, as written (the tag included). Each object
  becomes a call when it closes (the `;` and whitespace after it are dropped); the first one that is not a
  call (not JSON, no string name, arguments not an object) and everything after it is content, as written.
* `mistral`: content, then `[TOOL_CALLS]` and either a JSON array of `{"name": ..., "arguments": {...}}`
  objects or `NAME[ARGS]{...}` (also `NAME{...}`), the marker repeated before each further call; content may
  follow the calls. Each call is sent when its JSON closes, with a 9-character alphanumeric id (Mistral's
  rule). A marker not followed by a call is content, as written, from the marker to where the call broke off.
* `qwen3_coder` (Qwen3-Coder's XML): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
  </function>\n</tool_call>` blocks among content. A value loses one leading and one trailing newline and is
  then read as its key's type in the tool's parameters schema: "integer" / "number" (finite numbers),
  "boolean" (true / false), "object" / "array" (JSON, or a Python literal), "null" (null); a value of another
  type, of an unknown key or that does not read as its type stays a string. A block whose body is not
  `<function=...>` elements is content, as written.
* `glm45` (GLM-4.5 / 4.6; also `glm47`, GLM-4.7's tighter spacing): `<tool_call>NAME\n<arg_key>KEY</arg_key>\n
  <arg_value>VALUE</arg_value>\n...</tool_call>` blocks among content, one call each, whitespace around the
  name and the tags optional. A value is read as qwen3_coder's are (its key's type in the tool's schema; GLM's
  template writes non-strings as JSON), except that it keeps its newlines. A block whose body is not a name and
  such pairs is content, as written; `<tool_call>` is a special token of GLM's vocabulary.
* `pythonic` (Llama 3.2 / Llama 4): the whole output, after leading whitespace and an optional
  `<|python_start|>`, is a Python list of calls `[get_weather(city="Paris"), ping()]`, then an optional
  `<|python_end|>`; keyword arguments only, each a literal (string, number, boolean, None, list, dict with
  string keys). The calls are sent when the list closes; an output that does not start with `[`, a list
  with an element that does not begin `name(`, or one that does not parse as such calls is content, as
  written (it is known to be content as soon as an element begins otherwise). Content may follow the list.

Around the calls: whitespace between content and a call, and right after a call, is the template's formatting
and is dropped; content is held back only while it could be the start of a marker (and, in hermes, mistral
and qwen3_coder, while it is whitespace a call may follow). At finish, a call cut short is content, as
written, except a block missing only its closing tag (hermes, qwen3_coder: `</tool_call>`) or a list missing
only its `]` (pythonic).
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string

from .tools import HermesCalls, _first

PYTHON_TAG = "<|python_tag|>"
PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
MISTRAL_MARKER = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
QWEN_START, QWEN_END = "<tool_call>", "</tool_call>"
_ALNUM = string.ascii_letters + string.digits


class Hermes(HermesCalls):
    markers = ("<tool_call>",)
    special_markers = False
    constrained = "hermes"  # "auto" calls are constrained from their marker on, in this format (call_formats.py)

    def __init__(self, functions: list[dict] | None = None):
        super().__init__()


def mistral_call_id() -> str:
    """Mistral's call ids are 9 alphanumeric characters (its chat template refuses others)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


# ------------------------------------------------------------------ shared pieces
def _skip_ws(text: str, i: int, also: str = "") -> int:
    while i < len(text) and (text[i].isspace() or text[i] in also):
        i += 1
    return i


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _json_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a JSON call object: a non-empty string "name" and an object "arguments" or
    "parameters" (a string holding a JSON object, null or none: {}); None when `text` is not one."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call["arguments"] if "arguments" in call else call.get("parameters")
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class _JsonEnd:
    """Where the JSON object or array opening at `start` closes (brackets balanced outside strings), read as
    the text grows: `scan(text)` is the index after it, or -1 while it is open."""

    def __init__(self, start: int):
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escape = False

    def scan(self, text: str) -> int:
        i, n = self.pos, len(text)
        while i < n:
            ch = text[i]
            i += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return -1


def _object_opens(text: str, start: int) -> bool | None:
    """Whether the `{` at `start` opens a JSON object (a key or `}` comes next); None: not known yet."""
    i = _skip_ws(text, start + 1)
    if i == len(text):
        return None
    return text[i] in '"}'


class _Parser:
    """The interface, the output gathered per feed, and the whitespace rule around calls (HermesCalls')."""

    markers: tuple[str, ...] = ()
    special_markers = False
    constrained: str | None = None  # the format "auto" calls are constrained in (call_formats.py)
    hold_ws = True  # calls may follow content: whitespace after content waits to see whether one does

    def __init__(self, functions: list[dict] | None = None):
        self.functions = {f["name"]: f for f in functions or []}
        self.num_calls = 0
        self.buf = ""
        self._pending_ws = ""
        self._after_call = False
        self._text: list[str] = []
        self._calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        self._run(False)
        return self._take()

    def finish(self) -> tuple[str, list[dict]]:
        self._run(True)
        self.buf = ""
        if self._pending_ws and not self._after_call:
            self._text.append(self._pending_ws)
        self._pending_ws = ""
        return self._take()

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def _opening(self, buf: str, tag: str, opener: str, final: bool) -> int | None:
        """For formats whose calls are the whole output: where `opener` stands after leading whitespace and an
        optional `tag`; -1 when the output starts otherwise (it is content; so is an empty one at the end);
        None while it cannot be told yet."""
        i = _skip_ws(buf, 0)
        if buf.startswith(tag, i):
            i = _skip_ws(buf, i + len(tag))
        elif i < len(buf) and tag.startswith(buf[i:]) and not final:
            return None
        if i == len(buf):
            return -1 if final else None
        return i if buf[i] == opener else -1

    def _take(self) -> tuple[str, list[dict]]:
        text, calls = "".join(self._text), self._calls
        self._text, self._calls = [], []
        return text, calls

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        if not self.hold_ws:
            self._text.append(text)
            return
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        self._text.append(self._pending_ws + body)
        self._pending_ws = text[len(body):]

    def _call(self, name: str, arguments: str) -> dict:
        delta = _first(self.num_calls, name, arguments)
        self.num_calls += 1
        self._pending_ws = ""
        self._after_call = True
        self._calls.append(delta)
        return delta


# ------------------------------------------------------------------ llama3_json
class Llama3Json(_Parser):
    """Llama 3.1 / 3.2 JSON calls (see the module docstring); `{` opens calls only at the output's start."""

    markers = (PYTHON_TAG, "{")
    special_markers = True
    constrained = "llama3_json"
    hold_ws = False

    def __init__(self, functions: list[dict] | None = None):
        super().__init__(functions)
        self.state = "start"  # start, open ("{" seen), object, between (after a call), content
        self.start = 0  # where the object being read opens in buf
        self.scanner: _JsonEnd | None = None

    def _run(self, final: bool) -> None:
        while True:
            buf = self.buf
            if self.state == "content":
                self._content(buf)
                self.buf = ""
                return
            if self.state == "start":
                i = self._opening(buf, PYTHON_TAG, "{", final)
                if i is None:
                    return
                if i < 0:
                    self.state = "content"
                    continue
                self.state, self.start = "open", i
            if self.state == "between":  # separators after a call are dropped
                i = _skip_ws(buf, 0, ";")
                self.buf = buf = buf[i:]
                if not buf:
                    return
                if buf[0] != "{":
                    self.state = "content"
                    continue
                self.state, self.start = "open", 0
            if self.state == "open":
                opens = _object_opens(buf, self.start)
                if opens is None and not final:
                    return
                if not opens:
                    self.state = "content"
                    continue
                self.state, self.scanner = "object", _JsonEnd(self.start)
            end = self.scanner.scan(buf)
            if end < 0:
                if final:
                    self.state = "content"
                    continue
                return
            call = _json_call(buf[self.start:end])
            if call is None:
                self.state = "content"
                continue
            self._call(*call)
            self.buf, self.state = buf[end:], "between"


# ------------------------------------------------------------------ mistral
def _name_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_-."


class Mistral(_Parser):
    """Mistral's `[TOOL_CALLS]` calls, both syntaxes (see the module docstring)."""

    markers = (MISTRAL_MARKER,)
    special_markers = True
    constrained = "mistral"  # "mistral_args" where the tokenizer has an [ARGS] token (call_formats.format_for)

    def __init__(self, functions: list[dict] | None = None):
        super().__init__(functions)
        # text; after the marker: marker, name, args (after [ARGS]), open ("{" seen), object; in an array:
        # item (an element may start), item_open, item_object, item_next (after an element)
        self.state = "text"
        self.i = 0  # where the scan is in buf; buf starts where the call being read does
        self.name = ""
        self.start = 0
        self.scanner: _JsonEnd | None = None

    def _run(self, final: bool) -> None:
        while True:
            buf, i, state = self.buf, self.i, self.state
            if state == "text":
                at = buf.find(MISTRAL_MARKER)
                if at < 0:
                    keep = 0 if final else _partial(buf, MISTRAL_MARKER)
                    self._content(buf[:len(buf) - keep])
                    self.buf = buf[len(buf) - keep:]
                    return
                self._content(buf[:at])
                self.buf, self.i, self.state = buf[at:], len(MISTRAL_MARKER), "marker"
                continue
            if state in ("object", "item_object"):
                end = self.scanner.scan(buf)
                if end < 0:
                    if final:
                        self._broken(len(buf))
                        continue
                    return
                if state == "object":
                    arguments = _loads_object(buf[self.start:end])
                    call = None if arguments is None else (self.name, json.dumps(arguments, ensure_ascii=False))
                else:
                    call = _json_call(buf[self.start:end])
                if call is None:
                    self._broken(end)
                    continue
                self._call(*call)["id"] = mistral_call_id()
                self.buf, self.i = buf[end:], 0
                self.state = "text" if state == "object" else "item_next"
                continue
            if state == "name":
                while i < len(buf) and _name_char(buf[i]):
                    i += 1
                self.i = i
            elif state in ("marker", "args", "item", "item_next"):
                self.i = i = _skip_ws(buf, i)
            if i == len(buf):
                if final:
                    self._broken(i)
                    continue
                return
            ch = buf[i]
            if state == "marker":
                if ch == "[":
                    self.i, self.state = i + 1, "item"
                elif _name_char(ch):
                    self.start, self.state = i, "name"
                else:
                    self._broken(i)
            elif state == "name":
                self.name = buf[self.start:i]
                if not self.name:
                    self._broken(i)
                elif ch == "{":
                    self.start, self.state = i, "open"
                elif buf.startswith(MISTRAL_ARGS, i):
                    self.i, self.state = i + len(MISTRAL_ARGS), "args"
                elif MISTRAL_ARGS.startswith(buf[i:]) and not final:
                    return
                else:
                    self._broken(i)
            elif state == "args":
                if ch == "{":
                    self.start, self.state = i, "open"
                else:
                    self._broken(i)
            elif state == "item":
                if ch == "{":
                    self.start, self.state = i, "item_open"
                else:
                    self._broken(i)
            elif state == "item_next":
                if ch == ",":
                    self.i, self.state = i + 1, "item"
                elif ch == "]":
                    self.buf, self.i, self.state = buf[i + 1:], 0, "text"
                else:
                    self._broken(i)
            else:  # open, item_open
                opens = _object_opens(buf, self.start)
                if opens is None and not final:
                    return
                if not opens:
                    self._broken(self.start + 1)
                    continue
                self.scanner = _JsonEnd(self.start)
                self.state = "object" if state == "open" else "item_object"

    def _broken(self, upto: int) -> None:
        """The call being read is not one: its text up to `upto` is content, and content is read on from there."""
        self._content(self.buf[:upto])
        self.buf, self.i, self.state = self.buf[upto:], 0, "text"


def _loads_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# ------------------------------------------------------------------ qwen3_coder
_NOT = object()  # a value that does not read as the type asked for


def schema_types(schema) -> list[str]:
    """The JSON types a parameter's schema allows (its type or type list, or its anyOf / oneOf options')."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types += schema_types(option)
    return types


def _as_type(value: str, kind: str):
    text = value.strip()
    if kind in ("integer", "number"):
        try:
            number = json.loads(text)
        except (ValueError, RecursionError):
            return _NOT
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            return _NOT
        if kind == "integer":
            return number if isinstance(number, int) else _NOT
        return number if math.isfinite(number) else _NOT
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NOT)
    if kind == "null":
        return None if text == "null" else _NOT
    if kind in ("object", "array"):
        wanted = dict if kind == "object" else list
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):
            try:
                parsed = ast.literal_eval(text)
                json.dumps(parsed, allow_nan=False)
            except Exception:  # not a literal, or one JSON cannot hold (a set, bytes, a tuple key...)
                return _NOT
        return parsed if isinstance(parsed, wanted) else _NOT
    return _NOT


def typed_parameter(value: str, schema) -> object:
    """A qwen3_coder parameter's text as its schema's type (the string itself when it does not read as one)."""
    for kind in schema_types(schema):
        if kind != "string":
            parsed = _as_type(value, kind)
            if parsed is not _NOT:
                return parsed
    return value


class Qwen3Coder(_Parser):
    """Qwen3-Coder's XML calls in `<tool_call>` blocks (see the module docstring)."""

    markers = (QWEN_START,)
    special_markers = False
    constrained = "qwen3_coder"

    def __init__(self, functions: list[dict] | None = None):
        super().__init__(functions)
        self.in_block = False
        self.search = 0  # where the search for </tool_call> goes on in buf

    def _run(self, final: bool) -> None:
        while True:
            buf = self.buf
            if not self.in_block:
                at = buf.find(QWEN_START)
                if at < 0:
                    keep = 0 if final else _partial(buf, QWEN_START)
                    self._content(buf[:len(buf) - keep])
                    self.buf = buf[len(buf) - keep:]
                    return
                self._content(buf[:at])
                self.buf, self.in_block, self.search = buf[at:], True, len(QWEN_START)
                continue
            at = buf.find(QWEN_END, self.search)
            if at < 0:
                self.search = max(len(QWEN_START), len(buf) - len(QWEN_END) + 1)
                if final:
                    self._block(buf[len(QWEN_START):], buf, False)
                    self.buf, self.in_block = "", False
                return
            end = at + len(QWEN_END)
            self._block(buf[len(QWEN_START):at], buf[:end], True)
            self.buf, self.in_block = buf[end:], False

    def _properties(self, name: str) -> dict:
        """The parameters' schemas of the request's tool `name` (empty where it has none, or no such tool)."""
        function = self.functions.get(name) or {}
        properties = (function.get("parameters") or {}).get("properties")
        return properties if isinstance(properties, dict) else {}

    def _block(self, body: str, written: str, closed: bool) -> None:
        calls = self._parse(body, closed)
        if calls is None:
            self._content(written)
            return
        for name, arguments in calls:
            self._call(name, arguments)

    def _parse(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        """The block's calls: one or more `<function=NAME>` elements, each of `<parameter=KEY>VALUE</parameter>`
        elements (a missing `</parameter>` ends at the next element); a block cut short at the output's end
        must have closed its last function."""
        calls, i, n = [], _skip_ws(body, 0), len(body)
        while i < n:
            if not body.startswith("<function=", i):
                return None
            gt = body.find(">", i)
            name = body[i + len("<function="):gt].strip() if gt >= 0 else ""
            if not name or "\n" in name or "<" in name:
                return None
            properties = self._properties(name)
            arguments, i = {}, _skip_ws(body, gt + 1)
            while not body.startswith("</function>", i):
                if i == n:
                    if not closed:
                        return None
                    break
                if not body.startswith("<parameter=", i):
                    return None
                gt = body.find(">", i)
                key = body[i + len("<parameter="):gt].strip() if gt >= 0 else ""
                if not key or "\n" in key or "<" in key:
                    return None
                ends = [at for at in (body.find(tag, gt + 1) for tag in ("</parameter>", "<parameter=", "</function>"))
                        if at >= 0]
                if not ends:
                    return None
                stop = min(ends)
                value = body[gt + 1:stop]
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                arguments[key] = typed_parameter(value, properties.get(key)) if key in properties else value
                if body.startswith("</parameter>", stop):
                    stop += len("</parameter>")
                i = _skip_ws(body, stop)
            if i < n:
                i = _skip_ws(body, i + len("</function>"))
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return calls or None


_GLM_NAME = re.compile(r"[\w.:-]+")  # a function's name: letters, digits, _ . : -


class Glm45(Qwen3Coder):
    """GLM-4.5's calls in `<tool_call>` blocks: a name, then key / value pairs (see the module docstring)."""

    special_markers = True
    constrained = "glm45"

    def _parse(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        """The block's one call: NAME, then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs (whitespace
        between them optional); a block cut short at the output's end must have closed its last value."""
        at = body.find("<arg_key>")
        i = len(body) if at < 0 else at
        name = body[:i].strip()
        if not _GLM_NAME.fullmatch(name):
            return None
        properties = self._properties(name)
        arguments = {}
        while (i := _skip_ws(body, i)) < len(body):
            if not body.startswith("<arg_key>", i):
                return None
            key_end = body.find("</arg_key>", i)
            key = body[i + len("<arg_key>"):key_end].strip() if key_end >= 0 else ""
            if not key or "<" in key:
                return None
            j = _skip_ws(body, key_end + len("</arg_key>"))
            value_end = body.find("</arg_value>", j)
            if not body.startswith("<arg_value>", j) or value_end < 0:
                return None
            value = body[j + len("<arg_value>"):value_end]
            arguments[key] = typed_parameter(value, properties.get(key)) if key in properties else value
            i = value_end + len("</arg_value>")
        return [(name, json.dumps(arguments, ensure_ascii=False))]


# ------------------------------------------------------------------ pythonic
_CLOSES = {"(": ")", "[": "]", "{": "}"}


def _literal(node: ast.expr):
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and not isinstance(node.operand.value, bool) \
            and isinstance(node.operand.value, (int, float)):
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
        if math.isfinite(value):
            return value
    elif isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            raise ValueError("a dict's keys must be strings")
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


def pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of a Python list of calls with literal keyword arguments; None otherwise."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for call in tree.body.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return None
            arguments = {}
            for keyword in call.keywords:
                if keyword.arg is None:
                    return None
                arguments[keyword.arg] = _literal(keyword.value)
            calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class Pythonic(_Parser):
    """Llama 3.2 / Llama 4 pythonic calls (see the module docstring); `[` opens calls only at the output's start."""

    markers = (PYTHON_START, "[")
    special_markers = True
    constrained = "pythonic"
    hold_ws = False

    def __init__(self, functions: list[dict] | None = None):
        super().__init__(functions)
        self.state = "start"  # start, list, after (the list closed), content
        self.start = 0  # where the list opens in buf
        self.i = 0  # the scan's position in the list
        self.stack: list[str] = []  # open brackets
        self.quote = ""  # the string being read: its quotes (', ", ''' or """), "" outside strings
        self.escape = False
        self.expect = "item"  # between the list's elements: item, name, paren, next
        self.started = 0  # calls begun in the list

    def _run(self, final: bool) -> None:
        while True:
            buf = self.buf
            if self.state == "content":
                self._content(buf)
                self.buf = ""
                return
            if self.state == "start":
                i = self._opening(buf, PYTHON_START, "[", final)
                if i is None:
                    return
                if i < 0:
                    self.state = "content"
                    continue
                self.state, self.start, self.i, self.stack = "list", i, i + 1, ["["]
            if self.state == "after":  # whitespace and <|python_end|> after the list are dropped
                i = _skip_ws(buf, 0)
                if buf.startswith(PYTHON_END, i):
                    self.buf, self.state = buf[i + len(PYTHON_END):], "content"
                elif i < len(buf) and not PYTHON_END.startswith(buf[i:]) or final:
                    self.state = "content"
                else:
                    return
                continue
            end = self._scan(final)
            if end is None:  # still open
                if not final:
                    return
                calls = pythonic_calls(buf[self.start:] + "]")
                if calls is None:
                    self.state = "content"
                    continue
                end = len(buf)
            elif end < 0:
                self.state = "content"
                continue
            else:
                calls = pythonic_calls(buf[self.start:end])
                if calls is None:
                    self.state = "content"
                    continue
            for name, arguments in calls:
                self._call(name, arguments)
            self.buf, self.state = buf[end:], "after"

    def _scan(self, final: bool) -> int | None:
        """The index after the list's `]`; -1 once the text cannot be a list of calls; None while open."""
        buf, i, n = self.buf, self.i, len(self.buf)
        while i < n:
            ch = buf[i]
            if self.quote:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == "\n" and len(self.quote) == 1:
                    return -1
                elif ch == self.quote[0]:
                    if len(self.quote) == 1 or buf.startswith(self.quote, i):
                        i += len(self.quote)
                        self.quote = ""
                        continue
                    if not final and n - i < 3 and self.quote.startswith(buf[i:]):
                        break  # may be the closing quotes
                i += 1
                continue
            if len(self.stack) > 1:  # inside a call's parentheses
                if ch in "'\"":
                    if not final and n - i < 3 and (ch * 3).startswith(buf[i:]):
                        break  # may open a triple-quoted string
                    self.quote = ch * 3 if buf.startswith(ch * 3, i) else ch
                    i += len(self.quote)
                    continue
                if ch in _CLOSES:
                    self.stack.append(ch)
                elif ch in ")]}":
                    if _CLOSES[self.stack.pop()] != ch:
                        return -1
                    if len(self.stack) == 1:
                        self.expect = "next"
                elif ch == "#":
                    return -1
                i += 1
                continue
            if self.expect == "name":
                if ch.isalnum() or ch == "_":
                    i += 1
                    continue
                self.expect = "paren"
            if ch.isspace():
                i += 1
                continue
            if self.expect == "item":
                if ch.isalpha() or ch == "_":
                    self.expect = "name"
                elif ch == "]" and self.started:
                    return i + 1
                else:
                    return -1
            elif self.expect == "paren":
                if ch != "(":
                    return -1
                self.stack.append("(")
                self.started += 1
            elif ch == ",":
                self.expect = "item"
            elif ch == "]":
                return i + 1
            else:
                return -1
            i += 1
        self.i = i
        return None


TOOL_PARSERS: dict[str, type] = {
    "hermes": Hermes,
    "llama3_json": Llama3Json,
    "mistral": Mistral,
    "qwen3_coder": Qwen3Coder,
    "glm45": Glm45,
    "glm47": Glm45,
    "pythonic": Pythonic,
}


def tool_parser(name: str, functions: list[dict] | None):
    """A fresh parser of one reply in format `name`; ValueError naming --tool-call-parser otherwise."""
    try:
        return TOOL_PARSERS[name](functions)
    except KeyError:
        raise ValueError(f"--tool-call-parser: {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}") from None
