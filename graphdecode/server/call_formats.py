"""Each tool-call format's calls as a regular expression over the reply's text, so that "auto" calls are
constrained on the device from the moment they start (reply_constraint.py composes them with the rest of the
reply). Every format here writes what its parser in tool_parsers.py reads back as calls of the given tools,
their arguments valid against each tool's parameters schema:

* `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among free text.
* `qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n
  </tool_call>` blocks among free text.
* `glm45`: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>` blocks among
  free text (GLM-4.7's tighter spacing is read too; the constraint writes GLM-4.5's).
* `mistral`: free text, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`; with a
  tokenizer that has an `[ARGS]` token (Mistral's v11 tokenizers), `[TOOL_CALLS]NAME[ARGS]{...}` instead, the
  marker again before each further call. Nothing follows the calls.
* `llama3_json`: the whole reply, after leading whitespace and an optional `<|python_tag|>`, is
  `{"name": ..., "parameters": {...}}` objects separated by `;`, or it is text that starts otherwise.
* `pythonic`: the whole reply, after leading whitespace and an optional `<|python_start|>`, is a Python list of
  calls with keyword arguments, `[get_weather(city="Paris", days=3)]`, then an optional `<|python_end|>`; or text
  that starts otherwise. Values are Python literals of their schema: strings in double quotes, numbers as JSON
  writes them, True / False / None, lists and dicts (a dict's properties in the schema's order); a schema this
  does not read (no type, `$ref`, ...) allows any literal up to two levels deep.

Values that qwen3_coder and glm45 read as text (a schema that allows a string) are free text that cannot end
the value early (none of the format's closing tags in it); an enum of strings is one of them exactly; a
`maxLength` up to MAX_BOUNDED bounds the text and keeps "<" out of it. Other values are JSON of their schema.

`specials` are the format's tags that some vocabularies hold as special tokens (Mistral's `[TOOL_CALLS]`, GLM's
`<tool_call>`, Llama's `<|python_tag|>`): the constraint reads those tokens as their text (the server keeps
special tokens in the text for such formats, so the parser sees them).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from ..structured.compiler import constraint_regex, escape_literal
from .constraints import ConstraintSource, build_constraint
from .text_regex import avoiding, avoiding_all, listing, not_starting
from .tool_parsers import MISTRAL_ARGS, MISTRAL_MARKER, PYTHON_END, PYTHON_START, PYTHON_TAG, schema_types
from .tools import END_TAG, START_TAG, parameters_schema

CALL_GAP = r"\n?"  # around a call block's body and after it
MAX_BOUNDED = 1024  # a string parameter's maxLength up to which its value is bounded (longer: free text)
QWEN_VALUE_STOPS = ("</parameter>", "<parameter=", "</function>")  # what would end a qwen3_coder value
GLM_TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
GLM_VALUE_STOPS = ("</arg_value>", "</tool_call>")  # what would end a glm45 value
LITERAL_DEPTH = 2  # how deep a pythonic value of a schema this does not read may nest


def _regex(label: str, schema: dict, error_param: str = "tools") -> str:
    return constraint_regex(build_constraint(ConstraintSource("tools", label, {"json": schema}, error_param)))


def _properties(function: dict) -> tuple[dict, set]:
    parameters = parameters_schema(function)
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    return properties, set(parameters.get("required") or ())


def json_call_schema(function: dict, arguments: str = "arguments") -> dict:
    """One tool's call as a JSON object: {"name": <its name>, <arguments>: <its parameters>}."""
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                             arguments: parameters_schema(function)},
            "required": ["name", arguments]}


def _json_calls(functions: list[dict], arguments: str = "arguments") -> str:
    return "|".join(_regex(f"tools[{i}].function.parameters", json_call_schema(f, arguments),
                           f"tools[{i}].function.parameters") for i, f in enumerate(functions))


# ------------------------------------------------------------------ XML-like formats: values as text
def _typed(schema: dict) -> bool:
    """Whether the parser reads the value as a type other than text (tool_parsers.typed_parameter): a schema
    whose types are given and include no string."""
    kinds = schema_types(schema)
    return bool(kinds) and "string" not in kinds


def _text_value(schema, label: str, stops: tuple[str, ...]) -> str:
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return "(?:" + "|".join(escape_literal(v) for v in schema["enum"]) + ")"
    if not _typed(schema) and isinstance(schema.get("maxLength"), int) and schema["maxLength"] <= MAX_BOUNDED:
        # a bounded string: up to maxLength characters, none of them "<" (no tag can start in it)
        return f"[^<]{{{max(0, int(schema.get('minLength') or 0))},{schema['maxLength']}}}"
    if not _typed(schema):
        return avoiding_all(stops)
    return _regex(label, schema)


def qwen3_coder_call(function: dict) -> str:
    """One tool's call as qwen3_coder writes it (tool_parsers.Qwen3Coder reads it), its parameters in the
    schema's order, the required ones present."""
    properties, required = _properties(function)
    items = []
    for key, schema in properties.items():
        value = _text_value(schema, f"{function['name']}.{key}", QWEN_VALUE_STOPS)
        tag, close = escape_literal("<parameter=" + key + ">"), escape_literal("</parameter>")
        items.append((f"{tag}\\n{value}\\n{close}\\n", key in required))
    name = escape_literal("<function=" + function["name"] + ">")
    return f"{name}\\n{listing(items, '')}{escape_literal('</function>')}\\n"


def glm45_call(function: dict) -> str:
    """One tool's call as GLM-4.5 writes it (tool_parsers.Glm45 reads it): the name, then key / value pairs in
    the schema's order, the required ones present."""
    properties, required = _properties(function)
    items = []
    for key, schema in properties.items():
        value = _text_value(schema, f"{function['name']}.{key}", GLM_VALUE_STOPS)
        pair = f"<arg_key>{escape_literal(key)}</arg_key>\\n<arg_value>{value}</arg_value>\\n"
        items.append((pair, key in required))
    return f"{escape_literal(function['name'])}\\n{listing(items, '')}"


# ------------------------------------------------------------------ pythonic: values as Python literals
def _python_source(value) -> str:
    """A JSON value as the Python literal the pythonic parser reads back to it."""
    if value is None or isinstance(value, bool):
        return {None: "None", True: "True", False: "False"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_python_source(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_python_source(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


@functools.cache
def _any_literal(depth: int) -> str:
    """Any Python literal the pythonic parser reads, containers nested up to `depth` deep (the same for every
    call: built once)."""
    scalar = f"(?:{_regex('tools', {'type': 'string'})}|{_regex('tools', {'type': 'number'})}|True|False|None)"
    if depth <= 0:
        return scalar
    inner, key = _any_literal(depth - 1), _regex("tools", {"type": "string"})
    return (f"(?:\\[(?:{inner}(?:, {inner})*)?\\]|\\{{(?:{key}: {inner}(?:, {key}: {inner})*)?\\}}|{scalar})")


def python_value(schema, label: str, depth: int = 0) -> str:
    """A regex of the Python literals that are valid values of `schema` (see the module docstring)."""
    if not isinstance(schema, dict) or depth > 4:
        return _any_literal(LITERAL_DEPTH)
    if "const" in schema:
        return escape_literal(_python_source(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(?:" + "|".join(escape_literal(_python_source(v)) for v in schema["enum"]) + ")"
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return "(?:" + "|".join(python_value(s, label, depth + 1) for s in schema[key]) + ")"
    kinds = [schema["type"]] if isinstance(schema.get("type"), str) else schema.get("type")
    if not isinstance(kinds, list) or not kinds or "$ref" in schema:
        return _any_literal(LITERAL_DEPTH)
    options = []
    for kind in kinds:
        if kind in ("string", "integer", "number"):  # JSON writes these as Python does
            options.append(_regex(label, {k: v for k, v in schema.items() if k != "type"} | {"type": kind}))
        elif kind == "boolean":
            options.append("True|False")
        elif kind == "null":
            options.append("None")
        elif kind == "array":
            item = python_value(schema.get("items"), f"{label}[]", depth + 1) if "items" in schema \
                else _any_literal(LITERAL_DEPTH - 1)
            low, high = int(schema.get("minItems") or 0), schema.get("maxItems")
            more = f"{{{max(low - 1, 0)},{'' if high is None else max(int(high) - 1, 0)}}}"
            items = f"{item}(?:, {item}){more}"
            if high is not None and int(high) <= 0:
                options.append("\\[\\]")
            else:
                options.append(f"\\[{items}\\]" if low > 0 else f"\\[(?:{items})?\\]")
        elif kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
            required = set(schema.get("required") or ())
            entries = [(f"{escape_literal(json.dumps(k))}: {python_value(v, f'{label}.{k}', depth + 1)}",
                        k in required) for k, v in schema["properties"].items()]
            options.append(f"\\{{{listing(entries, ', ')}\\}}")
        else:
            return _any_literal(LITERAL_DEPTH)
    return "(?:" + "|".join(options) + ")"


def pythonic_call(function: dict) -> str:
    """One tool's call as a Python call with keyword arguments, in the schema's order, the required ones present."""
    properties, required = _properties(function)
    name = function["name"]
    items = [(f"{key}={python_value(schema, f'{name}.{key}')}", key in required) for key, schema in properties.items()]
    return f"{escape_literal(name)}\\({listing(items, ', ')}\\)"


# ------------------------------------------------------------------ the formats
def _blocks(marker: str, block: str) -> tuple[str, str]:
    """(calls, reply) of a format whose calls are blocks opened by `marker` among free text."""
    calls = f"(?:{block})+"
    return calls, avoiding(marker, f"{block[len(escape_literal(marker)):]}(?:{block})*")


def _whole_output(tag: str, opener: str, core: str) -> tuple[str, str]:
    """(calls, reply) of a format whose calls are the whole output (after whitespace and an optional tag), and
    whose reply is text otherwise: text that starts with neither the tag nor `opener`."""
    text = not_starting(tag, r"\s" + escape_literal(opener))
    return core, f"\\s*(?:{core}|{text})?"


def hermes(functions: list[dict]) -> tuple[str, str]:
    block = f"{escape_literal(START_TAG)}{CALL_GAP}(?:{_json_calls(functions)}){CALL_GAP}" \
            f"{escape_literal(END_TAG)}{CALL_GAP}"
    return _blocks(START_TAG, block)


def qwen3_coder(functions: list[dict]) -> tuple[str, str]:
    union = "|".join(qwen3_coder_call(f) for f in functions)
    return _blocks(START_TAG, f"{escape_literal(START_TAG)}\\n(?:{union}){escape_literal(END_TAG)}{CALL_GAP}")


def glm45(functions: list[dict]) -> tuple[str, str]:
    union = "|".join(glm45_call(f) for f in functions)
    return _blocks(START_TAG, f"{escape_literal(START_TAG)}(?:{union}){escape_literal(END_TAG)}{CALL_GAP}")


def mistral(functions: list[dict]) -> tuple[str, str]:
    union = _json_calls(functions)
    body = f"\\[(?:{union})(?:, ?(?:{union}))*\\]"
    return escape_literal(MISTRAL_MARKER) + body, avoiding(MISTRAL_MARKER, body)


def mistral_args(functions: list[dict]) -> tuple[str, str]:
    where = [f"tools[{i}].function.parameters" for i in range(len(functions))]
    union = "|".join(f"{escape_literal(f['name'])}{escape_literal(MISTRAL_ARGS)}{_regex(w, parameters_schema(f), w)}"
                     for w, f in zip(where, functions))
    body = f"(?:{union})(?:{escape_literal(MISTRAL_MARKER)}(?:{union}))*"
    return escape_literal(MISTRAL_MARKER) + body, avoiding(MISTRAL_MARKER, body)


def llama3_json(functions: list[dict]) -> tuple[str, str]:
    union = _json_calls(functions, "parameters")
    core = f"(?:{escape_literal(PYTHON_TAG)})?(?:{union})(?:; ?(?:{union}))*"
    return _whole_output(PYTHON_TAG, "{", core)


def pythonic(functions: list[dict]) -> tuple[str, str]:
    union = "|".join(pythonic_call(f) for f in functions)
    core = f"(?:{escape_literal(PYTHON_START)})?\\[(?:{union})(?:, (?:{union}))*\\](?:{escape_literal(PYTHON_END)})?"
    return _whole_output(PYTHON_START, "[", core)


@dataclass(frozen=True)
class CallFormat:
    """A tool-call format whose "auto" calls can be constrained: `build(functions)` gives (calls, reply), the
    regex of the calls from their marker on and the regex of a whole reply (text, then maybe calls)."""

    build: object
    specials: tuple[str, ...] = ()


CALL_FORMATS = {
    "hermes": CallFormat(hermes),
    "qwen3_coder": CallFormat(qwen3_coder),
    "glm45": CallFormat(glm45, GLM_TAGS),
    "mistral": CallFormat(mistral, (MISTRAL_MARKER,)),
    "mistral_args": CallFormat(mistral_args, (MISTRAL_MARKER, MISTRAL_ARGS)),
    "llama3_json": CallFormat(llama3_json, (PYTHON_TAG,)),
    "pythonic": CallFormat(pythonic, (PYTHON_START, PYTHON_END)),
}


def format_for(constrained: str | None, tokenizer) -> str | None:
    """The call format "auto" calls are constrained in, for a parser's `constrained` name and the model's
    tokenizer: Mistral's [ARGS] syntax where the vocabulary has that token, its JSON array otherwise."""
    if constrained == "mistral" and MISTRAL_ARGS in tokenizer.get_vocab():
        return "mistral_args"
    return constrained
