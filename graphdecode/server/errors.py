"""The server's error bodies: `APIError` (an HTTP status with OpenAI's error body) and the
400s made from what failed: a pydantic validation error or a body that is JSON but not Unicode
(naming the first offending field), and the field a graphdecode ValueError names first."""

from __future__ import annotations

import json
import re

from pydantic import ValidationError


class APIError(Exception):
    """An HTTP error with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def model_not_found(name) -> APIError:
    return APIError(f"The model `{name}` does not exist.", param="model", status=404, code="model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(message, status=503, type="service_unavailable_error")


def request_failed(message: str) -> APIError:
    """The engine failed this one request (an error inside it, not a bad request): a 500."""
    return APIError(f"the engine failed while running this request: {message}", status=500, type="server_error")


_FIELD = re.compile(r"^([A-Za-z_]+)")


def param_of(message: str, renames: dict[str, str] | None = None) -> str | None:
    """The field a graphdecode ValueError names first (`top_p must be ...`, `prompts[0]: ...`)."""
    match = _FIELD.match(message)
    if match is None:
        return None
    name = match.group(1)
    if name in ("prompts", "prompt_token_ids"):
        name = "prompt"
    return (renames or {}).get(name, name)


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first offending field."""
    errors = exc.errors(include_url=False)
    if not errors:
        return APIError(str(exc))
    loc = errors[0]["loc"]
    if not loc:  # the body itself: not JSON, or not an object
        return APIError(f"the request body must be a JSON object: {errors[0]['msg']}")
    param = loc[0] if isinstance(loc[0], str) else None
    if loc[0] == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        param = f"messages[{loc[1]}]" + (f".{loc[2]}" if len(loc) > 2 and isinstance(loc[2], str) else "")
    messages = []
    for error in errors:
        if error["loc"][:1] != loc[:1]:
            continue
        text = error["msg"]
        if error["type"] == "missing":
            text = "this field is required"
        if text not in messages:
            messages.append(text)
    return APIError(f"{param}: {' or '.join(messages)}", param=param)


def lone_surrogate_error(exc: ValidationError, body: bytes) -> APIError | None:
    """The 400 for a body that is JSON but not Unicode: a string escaping a lone surrogate (`"ab\\ud800cd"`),
    which the parser reports as a broken hex escape. It names the field and the character; None for any
    other error (a body that Python's parser, which takes lone surrogates, cannot read either)."""
    errors = exc.errors(include_url=False)
    if not errors or errors[0]["type"] != "json_invalid" or "escape" not in errors[0]["msg"]:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[tuple, object]] = [((), value)]
    while stack:  # depth first, in document order
        path, node = stack.pop()
        if isinstance(node, dict):
            for key in node:
                if _surrogate_at(key) is not None:
                    return _surrogate_error(path, key, f"the key {key!r} is")
            stack.extend(reversed([((*path, key), item) for key, item in node.items()]))
        elif isinstance(node, list):
            stack.extend(reversed([((*path, i), item) for i, item in enumerate(node)]))
        elif isinstance(node, str) and _surrogate_at(node) is not None:
            return _surrogate_error(path, node, "the text is")
    return None


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _surrogate_error(path: tuple, text: str, subject: str) -> APIError:
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "the request body"
    param = path[0] if path and isinstance(path[0], str) else None
    if param == "messages" and len(path) > 1 and isinstance(path[1], int):  # as validation_error names them
        param = f"messages[{path[1]}]" + (f".{path[2]}" if len(path) > 2 and isinstance(path[2], str) else "")
    at = _surrogate_at(text)
    return APIError(f"{where}: {subject} not valid Unicode: lone surrogate {text[at]!r} at character {at}",
                    param=param)
