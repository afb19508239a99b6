"""A request's structured-output fields (OpenAI's response_format, vLLM's structured_outputs and
guided_* fields, a tool_choice's schema) as the StructuredOutputsParams they ask for, with each
400 naming the field the client sent rather than the engine's `structured_outputs.<field>`."""

from __future__ import annotations

import dataclasses
import re

from .errors import APIError


@dataclasses.dataclass(frozen=True)
class ConstraintSource:
    """Where a request's constraint comes from: `param` (the field the client sent, what a 400
    names), `label` (what replaces `structured_outputs.<field>` in the engine's messages; None
    keeps them: the client sent structured_outputs itself) and StructuredOutputsParams' kwargs."""

    param: str
    label: str | None
    kwargs: dict
    error_param: str | None = None  # what a 400 about the constraint itself names, when not `param`


_SO_PREFIX = re.compile(r"^structured_outputs(\.[A-Za-z_]+(\[\d+\])?)?")
# vLLM's StructuredOutputsParams knobs that do not change what is allowed here (accepted, ignored)
_SO_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def constraint_error(source: ConstraintSource, exc: Exception) -> APIError:
    """A constraint's ValueError / TypeError (which names structured_outputs.<field>) as a 400
    naming the field the client sent."""
    message = str(exc)
    if source.label is None:  # their own structured_outputs: the engine's names are theirs
        match = _SO_PREFIX.match(message)
        param = match.group(0) if match else source.param
        return APIError(message, param=param)
    rest = _SO_PREFIX.sub("", message, count=1) if _SO_PREFIX.match(message) else ": " + message
    return APIError(source.label + rest, param=source.error_param or source.param)


def build_constraint(source: ConstraintSource):
    """StructuredOutputsParams of `source` (its checks: schema turned into a regex, regex compiled
    over bytes), a 400 naming the client's field when they fail."""
    from ..structured import StructuredOutputsParams

    try:
        return StructuredOutputsParams(**source.kwargs)
    except (ValueError, TypeError) as exc:
        raise constraint_error(source, exc) from None


def response_format_source(fmt: dict) -> ConstraintSource | None:
    """OpenAI's response_format: text (no constraint), json_object, json_schema {name, schema, strict}."""
    kind = fmt.get("type")
    if kind is None:
        raise APIError("response_format.type: this field is required", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSource("response_format", "response_format", {"json_object": True})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema: this field is required (an object with name and schema)",
                           param="response_format")
        schema = spec.get("schema")
        if schema is None:
            raise APIError("response_format.json_schema.schema: this field is required", param="response_format")
        if not isinstance(schema, dict):
            raise APIError(f"response_format.json_schema.schema: expected a JSON schema object, "
                           f"got {type(schema).__name__}", param="response_format")
        return ConstraintSource("response_format", "response_format.json_schema.schema", {"json": schema})
    raise APIError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format")


def structured_outputs_source(spec: dict) -> ConstraintSource:
    """vLLM's structured_outputs: a dict of StructuredOutputsParams' fields (null ones are not given)."""
    from ..structured.params import FIELDS

    kwargs = {}
    for key, value in spec.items():
        if key in FIELDS:
            if value is not None:
                kwargs[key] = value
        elif key == "structural_tag":
            if value is not None:
                raise APIError("structured_outputs.structural_tag: structural tags are not supported; "
                               "use json, regex, choice or json_object", param="structured_outputs.structural_tag")
        elif key not in _SO_IGNORED:
            raise APIError(f"structured_outputs.{key}: unknown field (the fields are {', '.join(FIELDS)})",
                           param=f"structured_outputs.{key}")
    return ConstraintSource("structured_outputs", None, kwargs)
