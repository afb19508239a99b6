"""The constraint a chat reply runs under, as one automaton on the device: the request's own constraint, tool
calls that are constrained from the moment they start, and room for the reasoning before both.

* `tool_choice="auto"` with a call format that has a marker (`<tool_call>` for Hermes): the reply is free text
  that never contains the marker (`avoiding`), then zero or more call blocks whose body is one of the tools'
  calls, each `{"name": <its name>, "arguments": <its parameters schema>}`. The automaton is free (every
  token allowed but those that would complete the marker out of place) until the marker is written; from
  there the call's JSON is constrained token by token, in the window, with no host round trip, so a model
  cannot write a malformed call even at temperature 1. With a response_format too, the reply is either
  content in that format or calls.
* With a reasoning parser, a JSON format (response_format, vLLM's json / json_object) and tool calls
  ("auto", "required", named) come after the reasoning: `<think>` (or nothing, when the template opened
  the block in the prompt), free text without `</think>`, `</think>`, at most two newlines, then the
  constrained answer. The block is optional where the output opens it, and must close where the prompt
  opened it. A regex or choice constrains the whole output as written (a think block included, if the
  pattern writes one).

Everything is a regular expression over the reply's text (outlines-core compiles it with the vocabulary, as
any constraint; the compile cache keys it), so the window runs it as it runs any constraint.
"""

from __future__ import annotations

from ..structured.compiler import constraint_regex, escape_literal
from .constraints import ConstraintSource, build_constraint
from .reasoning import CLOSE, OPEN
from .tool_parsers import schema_types
from .tools import END_TAG, START_TAG, parameters_schema

REASONING_GAP = r"\n{0,2}"  # between </think> and the answer
CALL_GAP = r"\n?"  # around a call block's body and after it


def avoiding(marker: str, then: str | None = None) -> str:
    """A regex (Rust syntax) of every string that does not contain `marker`, whose first character must not
    occur again in it (true of `<tool_call>`, `</think>`, `[TOOL_CALLS]`); with `then`, also of such a string
    followed by the marker and then `then`. From the marker's matching automaton: outside it any character
    but the first; after the first, any run of repeated first characters and partial prefixes, left by a
    character that is neither the next one nor the first; the string may end inside a partial marker.

    outlines-core builds its DFA with leftmost-first priorities, where a branch that completes the match
    drops the lower-priority branches still running: so every alternative that may end the string comes
    after the ones that continue it (the longer partial prefixes first, the marker's completion before
    them), and nothing else is ambiguous."""
    if not marker or marker[0] in marker[1:]:
        raise ValueError(f"avoiding: the marker's first character must not recur in it, got {marker!r}")
    first = escape_literal(marker[0])

    def other(*chars: str) -> str:
        return "[^" + "".join(escape_literal(c) for c in chars) + "]"

    # from state k (k characters matched), back to the start by a character that is neither marker[k] nor the first
    back = other(marker[0], marker[-1])
    for k in range(len(marker) - 2, 0, -1):
        back = f"(?:{other(marker[0], marker[k])}|{escape_literal(marker[k])}{back})"
    loops = "(?:" + "|".join(escape_literal(marker[1:j]) for j in range(1, len(marker))) + ")"
    restart = f"{first}(?:{loops}{first})*"  # the first character, and partial prefixes each ended by it
    ends = [escape_literal(marker[1:j]) for j in range(len(marker) - 1, 0, -1)]  # longest first, "" last
    if then is not None:
        ends.insert(0, escape_literal(marker[1:]) + then)
    return f"(?:{other(marker[0])}|{restart}{back})*(?:{restart}(?:{'|'.join(ends)}))?"


def avoiding_all(markers: tuple[str, ...]) -> str:
    """A regex (Rust syntax) of every string that contains none of `markers`, which all start with one character
    that occurs nowhere else in them (`</parameter>`, `<parameter=`, `</function>`): avoiding's automaton over the
    markers' trie. From the start, any character but the first; after the first, a walk down the trie that either
    leaves it by a character that continues no marker (back to the start), or meets the first character again
    (a restart); the string may end inside a partial marker. Every alternative that may end the string comes
    last (outlines-core's leftmost-first priorities, as in `avoiding`)."""
    first = markers[0][:1]
    if not first or any(not m.startswith(first) or first in m[1:] for m in markers):
        raise ValueError(f"avoiding_all: the markers must share a first character that recurs in none, got {markers!r}")
    trie: dict = {}
    for marker in markers:
        node = trie
        for char in marker[1:]:
            node = node.setdefault(char, {})
        node[None] = True  # a whole marker ends here

    def live(node: dict) -> list[tuple[str, dict]]:  # children that do not complete a marker
        return [(c, child) for c, child in node.items() if c is not None and None not in child]

    def leave(node: dict) -> str:  # a walk from `node` that leaves the trie
        exits = "[^" + escape_literal(first) + "".join(escape_literal(c) for c in node if c is not None) + "]"
        return "(?:" + "|".join([exits] + [escape_literal(c) + leave(child) for c, child in live(node)]) + ")"

    def restart(node: dict) -> str:  # a walk from `node` that meets the first character again
        return "(?:" + "|".join([escape_literal(c) + restart(child) for c, child in live(node)] + [escape_literal(first)]) + ")"

    def partial(node: dict) -> str:  # a walk from `node` that ends the string inside the trie
        return "(?:" + "|".join([escape_literal(c) + partial(child) for c, child in live(node)] + [""]) + ")"

    head = f"{escape_literal(first)}{restart(trie)}*"
    return f"(?:[^{escape_literal(first)}]|{head}{leave(trie)})*(?:{head}{partial(trie)})?"


# qwen3_coder's call: <function=NAME>, each parameter's <parameter=KEY>, its value on the following lines, and
# </parameter>; the value a string that the parser does not cut short (none of its three tags in it)
QWEN_VALUE_STOPS = ("</parameter>", "<parameter=", "</function>")
MAX_BOUNDED = 1024  # a string parameter's maxLength up to which its value is bounded (longer: free text)


def qwen3_coder_call(function: dict) -> str:
    """One tool's call as qwen3_coder writes it (server/tool_parsers.py's Qwen3Coder reads it), its parameters in
    the schema's order, the required ones present: a value is free text where the schema allows a string (an
    enum's strings exactly; with a maxLength, at most that many characters and no "<"), else the JSON of its
    schema, as the parser reads each key's type."""
    parameters = parameters_schema(function)
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    required = set(parameters.get("required") or ())
    parts = []
    for key, schema in properties.items():
        schema = schema if isinstance(schema, dict) else {}
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            value = "(?:" + "|".join(escape_literal(v) for v in schema["enum"]) + ")"
        elif not _typed(schema) and isinstance(schema.get("maxLength"), int) and schema["maxLength"] <= MAX_BOUNDED:
            # a bounded string: up to maxLength characters, none of them "<" (no tag can start in it)
            value = f"[^<]{{{max(0, int(schema.get('minLength') or 0))},{schema['maxLength']}}}"
        elif not _typed(schema):
            value = avoiding_all(QWEN_VALUE_STOPS)
        else:
            value = _regex(ConstraintSource("tools", f"{function['name']}.{key}", {"json": schema}, "tools"))
        opening, closing = escape_literal("<parameter=" + key + ">"), escape_literal("</parameter>")
        part = f"{opening}\\n{value}\\n{closing}\\n"
        parts.append(part if key in required else f"(?:{part})?")
    name = escape_literal("<function=" + function["name"] + ">")
    return f"{name}\\n{''.join(parts)}{escape_literal('</function>')}\\n"


def _typed(schema: dict) -> bool:
    """Whether qwen3_coder reads the value as a type other than text (tool_parsers.typed_parameter): a schema
    whose types are given and include no string."""
    kinds = schema_types(schema)
    return bool(kinds) and "string" not in kinds


def call_schema(function: dict) -> dict:
    """One tool's call in the Hermes body: {"name": <its name>, "arguments": <its parameters>}."""
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                             "arguments": parameters_schema(function)},
            "required": ["name", "arguments"]}


def _regex(source: ConstraintSource) -> str:
    return constraint_regex(build_constraint(source))


def reasoning_prefix(opened: bool) -> str:
    """Room for the reasoning before a constrained answer (see the module docstring)."""
    body = f"{avoiding(CLOSE)}{escape_literal(CLOSE)}{REASONING_GAP}"
    return body if opened else f"(?:{escape_literal(OPEN)}{body})?"


def reply_source(user: ConstraintSource | None, functions: list[dict] | None, auto_calls: str | None,
                 reasoning: bool, opened: bool) -> ConstraintSource | None:
    """The reply's one constraint: `user` (the request's own, or tool_choice "required" / named) as it is, or
    with the "auto" calls beside it (`auto_calls`: the call format, "hermes" or "qwen3_coder", whose blocks the
    constraint writes; None: none) and room for reasoning before it; None when nothing constrains the reply."""
    calls = bool(auto_calls) and bool(functions)
    json_like = user is not None and any(k in user.kwargs for k in ("json", "json_object"))
    think = reasoning and (calls or json_like)
    if not calls and not think:
        return user
    body = None
    if calls:
        if auto_calls == "qwen3_coder":
            union = "|".join(qwen3_coder_call(f) for f in functions)
            block = f"{escape_literal(START_TAG)}\\n(?:{union}){escape_literal(END_TAG)}{CALL_GAP}"
        else:
            union = "|".join(_regex(ConstraintSource("tools", f"tools[{i}].function.parameters",
                                                     {"json": call_schema(f)}, f"tools[{i}].function.parameters"))
                             for i, f in enumerate(functions))
            block = f"{escape_literal(START_TAG)}{CALL_GAP}(?:{union}){CALL_GAP}{escape_literal(END_TAG)}{CALL_GAP}"
        if user is not None:
            body = f"(?:{_regex(user)}|(?:{block})+)"
        else:  # free text, then (once the marker is written) the first call's body and any more blocks
            first = block[len(escape_literal(START_TAG)):]
            body = avoiding(START_TAG, f"{first}(?:{block})*")
    else:
        body = _regex(user)
    regex = (reasoning_prefix(opened) if think else "") + body
    if user is not None:
        return ConstraintSource(user.param, user.label, {"regex": regex}, user.error_param)
    return ConstraintSource("tools", "tools (the calls' constraint for tool_choice 'auto')", {"regex": regex},
                            "tools")
