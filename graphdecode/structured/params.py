"""StructuredOutputsParams: what a request's output must look like (vLLM's name and fields).

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice`
(a list of strings), `json_object` (True: any JSON object) or `grammar` must be given.
What can be checked without compiling is checked here, when the params are made; the
compile (in a worker, under a time and memory budget: budget.py) finds the rest, before
the request is admitted:

* `json`: must parse as JSON, be an object, and be a schema outlines-core can turn into
  a regular expression (its error is passed on, e.g. unsupported keywords or types);
* `regex`: Rust `regex` syntax (what outlines-core compiles: no lookaround, no
  backreferences; `\\d`, `\\w` are Unicode-aware), balanced, and at most
  MAX_ESTIMATED_STATES positions once its counted repetitions are expanded (a linear
  scan); that it compiles and matches some string is found by the compile;
* `choice`: a non-empty list (or tuple) of strings;
* `json_object`: True (False is the same as not giving it);
* `grammar` (EBNF / Lark): not supported, rejected with a ValueError; never ignored.

Beside the one field, `special_tokens` names special tokens of the tokenizer that the constraint reads as
their text (a tool-call format's markers, such as Mistral's `[TOOL_CALLS]`); every other special token is
never allowed, as always. Its strings must be non-empty; it is part of the key.

Wrong types raise TypeError, bad values ValueError; every message starts with
`structured_outputs.<field>`. `key()` is a stable string naming the constraint (the
compile cache's key; property order in a schema is kept, since it orders the output).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .budget import MAX_ESTIMATED_STATES, RegexSyntaxError, check_states, estimate_states

FIELDS = ("json", "regex", "choice", "json_object", "grammar")


def check_regex(regex: str, field: str = "regex") -> None:
    """What can be told of `regex` without compiling it (budget.py's scan, linear in its length):
    balanced, no lookaround or backreferences, and at most MAX_ESTIMATED_STATES positions. The
    rest (a construct outlines-core rejects, a regex matching no string, the engine's state
    limit) is found by the compile, in a worker under a time and memory budget."""
    try:
        estimate = estimate_states(regex)
    except RegexSyntaxError as e:
        if e.unsupported:
            raise ValueError(f"structured_outputs.{field}: unsupported regular expression ({e}); the syntax is "
                             "Rust `regex`: no lookaround, no backreferences") from None
        raise ValueError(f"structured_outputs.{field}: invalid regular expression: {e}") from None
    if estimate > MAX_ESTIMATED_STATES:
        check_states(regex, field, MAX_ESTIMATED_STATES, "no constraint may need more")


def _schema_text(schema) -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
    elif isinstance(schema, dict):
        parsed = schema
    else:
        raise TypeError(
            f"structured_outputs.json: expected a JSON schema as a dict or a string, got {type(schema).__name__}")
    if not isinstance(parsed, dict):
        raise ValueError(f"structured_outputs.json: a JSON schema must be an object, got {type(parsed).__name__}")  # noqa: TRY004 (a value)
    try:
        text = json.dumps(parsed, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json: not JSON-serializable: {e}") from None
    from outlines_core.json_schema import build_regex_from_schema

    try:
        regex = build_regex_from_schema(text)
    except (ValueError, TypeError) as e:
        msg = " ".join(str(e).split())
        raise ValueError(f"structured_outputs.json: unsupported or invalid JSON schema: {msg}") from None
    check_states(regex, "json", MAX_ESTIMATED_STATES, "no constraint may need more")
    return text


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    special_tokens: tuple[str, ...] = ()

    def __post_init__(self):
        given = [name for name in FIELDS if self._given(name)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(FIELDS)} (got {what})"
            )
        field = given[0]
        if field == "json":
            key = "json:" + _schema_text(self.json)
        elif field == "regex":
            if not isinstance(self.regex, str):
                raise TypeError(f"structured_outputs.regex: expected a string, got {type(self.regex).__name__}")
            check_regex(self.regex)
            key = "regex:" + self.regex
        elif field == "choice":
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                raise TypeError(
                    f"structured_outputs.choice: expected a list of strings, got {type(self.choice).__name__}"
                )
            if not self.choice:
                raise ValueError("structured_outputs.choice: must not be empty")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str):
                    raise TypeError(f"structured_outputs.choice[{i}]: expected a string, got {type(c).__name__}")
            check_states("", "choice", MAX_ESTIMATED_STATES, "no constraint may need more",
                         estimate=sum(len(c) for c in self.choice))
            key = "choice:" + json.dumps(list(self.choice), ensure_ascii=False)
        elif field == "json_object":
            if not isinstance(self.json_object, bool):
                raise TypeError(
                    f"structured_outputs.json_object: expected a bool, got {type(self.json_object).__name__}"
                )
            key = "json_object"
        else:
            if not isinstance(self.grammar, str):
                raise TypeError(f"structured_outputs.grammar: expected a string, got {type(self.grammar).__name__}")
            raise ValueError(
                "structured_outputs.grammar: grammars (EBNF / Lark) are not supported; "
                "use json, regex, choice or json_object"
            )
        specials = self.special_tokens
        if isinstance(specials, (str, bytes)) or not isinstance(specials, (list, tuple)):
            raise TypeError("structured_outputs.special_tokens: expected a list of strings, got "
                            f"{type(specials).__name__}")
        for i, token in enumerate(specials):
            if not isinstance(token, str) or not token:
                raise TypeError(f"structured_outputs.special_tokens[{i}]: expected a non-empty string, got {token!r}")
        specials = tuple(sorted(set(specials)))
        object.__setattr__(self, "special_tokens", specials)
        object.__setattr__(self, "_field_key", key)
        if specials:
            key += "|special_tokens:" + json.dumps(list(specials), ensure_ascii=False)
        object.__setattr__(self, "_key", key)

    def _given(self, name: str) -> bool:
        value = getattr(self, name)
        if name == "json_object":
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"structured_outputs.json_object: expected a bool, got {type(value).__name__}")
            return bool(value)
        return value is not None

    @property
    def kind(self) -> str:
        """Which field was given: 'json', 'regex', 'choice' or 'json_object'."""
        return self._field_key.split(":", 1)[0]

    def key(self) -> str:
        """A stable string naming the constraint, e.g. 'regex:[0-9]+', 'json:{...compact schema...}'."""
        return self._key

    def schema_text(self) -> str | None:
        """The JSON schema as compact JSON text (json only)."""
        return self._field_key[5:] if self._field_key.startswith("json:") else None

    def __hash__(self):
        return hash(self._key)
