"""POST /v1/messages: the Anthropic Messages API, run as a chat (messages_protocol.py maps the request) and
answered in Anthropic's shapes, streamed or whole.

The reply's content blocks, in order: a `thinking` block (with --reasoning-parser: the model's reasoning), a
`text` block (the answer), a `tool_use` block per call (`input` the arguments object). `stop_reason`:
`end_turn` (the model ended), `max_tokens`, `stop_sequence` (with `stop_sequence` the one matched),
`tool_use` (the reply's calls are complete). `usage`: input and output tokens.

A stream is Anthropic's typed server-sent events: `message_start` (the message with empty content), `ping`,
per block `content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`, or `input_json_delta`
carrying a call's arguments as they are written) and `content_block_stop`, then `message_delta` (the stop
reason and the output tokens) and `message_stop`; an error after the start is an `error` event.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from .chat import start_chat
from .choices import Choice, Choices
from .errors import APIError
from .messages_protocol import MessagesRequest, renamed, tool_input
from .responses import dumps, event_stream, json_response
from .serving import OpenAIServer, outputs_error


async def create_message(server: OpenAIServer, request: Request) -> Response:
    arrival = time.perf_counter()
    server.check_ready()
    req: MessagesRequest = await server.parse(request, MessagesRequest)
    try:
        job = await start_chat(server, request, req.to_chat(), arrival, f"msg_{uuid.uuid4().hex[:24]}")
    except APIError as err:
        raise renamed(err) from None
    omit = req.thinking_omitted
    if req.stream:
        return event_stream(_stream(server, job, omit))
    return await server.unless_client_leaves(request, _whole(server, job, omit))


def anthropic_error(err: APIError) -> dict:
    """Anthropic's error body for one of this server's errors."""
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
            503: "overloaded_error"}.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _event(kind: str, body: dict) -> bytes:
    return f"event: {kind}\ndata: ".encode() + dumps(body).encode() + b"\n\n"


def stop_reason(choice: Choice, finish_reason: str | None, calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if calls and finish_reason in ("tool_calls", "stop"):
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _message(job, server: OpenAIServer, content: list, stop: tuple[str | None, str | None], output_tokens: int):
    return {"id": job.rid, "type": "message", "role": "assistant", "model": job.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": job.prompt_lens[0], "output_tokens": output_tokens}}


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


async def _whole(server: OpenAIServer, job, omit: bool) -> Response:
    try:
        choices = await server.collect(job, {"prompt": "messages"})
    except APIError as err:
        raise renamed(err) from None
    choice = next(iter(choices))
    thought, content, calls, finish_reason = choice.whole_parts()
    blocks: list[dict] = []
    if thought:
        blocks.append({"type": "thinking", "thinking": "" if omit else thought, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    for call in calls:
        arguments = call["function"]["arguments"]
        value = tool_input(arguments)
        if value is None:  # cut short (max_tokens) before its arguments closed: shown as written
            blocks.append({"type": "text", "text": arguments})
        else:
            blocks.append({"type": "tool_use", "id": _tool_id(), "name": call["function"]["name"], "input": value})
    stop = stop_reason(choice, finish_reason, bool(calls))
    return json_response(_message(job, server, blocks, stop, choice.num_tokens))


class _Blocks:
    """The stream's content blocks: one open at a time, each of one kind (thinking, text, a tool call)."""

    def __init__(self):
        self.index = -1
        self.open: str | int | None = None  # "thinking", "text", or the call's index
        self.calls = 0

    def _start(self, key, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = key
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def text(self, kind: str, text: str) -> list[bytes]:
        out = [] if self.open == kind else self._start(kind, {"type": kind, kind: "", **(
            {"signature": ""} if kind == "thinking" else {})})
        delta = {"type": f"{kind}_delta", kind: text}
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": delta}))
        return out

    def call(self, delta: dict) -> list[bytes]:
        out = []
        if "id" in delta:  # a call's first delta: its block starts
            self.calls += 1
            out = self._start(("call", delta["index"]), {"type": "tool_use", "id": _tool_id(),
                                                         "name": delta["function"]["name"], "input": {}})
        arguments = delta["function"].get("arguments") or ""
        if arguments and self.open == ("call", delta["index"]):
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": arguments}}))
        return out


async def _stream(server: OpenAIServer, job, omit: bool):
    yield _event("message_start", {"type": "message_start", "message": _message(job, server, [], (None, None), 0)})
    yield _event("ping", {"type": "ping"})
    choices = Choices(job, server.prefix_caching)
    blocks = _Blocks()
    choice, finish_reason = None, None
    try:
        async for p, out in server.outputs(job):
            for choice, delta in choices.fold(p, out):
                thought, content, calls, reason = choice.parts(delta)
                for chunk in ((blocks.text("thinking", "" if omit else thought) if thought else [])
                              + (blocks.text("text", content) if content else [])
                              + [c for call in calls for c in blocks.call(call)]):
                    yield chunk
                if reason is not None:
                    finish_reason = reason
        for chunk in blocks.close():
            yield chunk
        stop = stop_reason(choice, finish_reason, blocks.calls > 0)
        yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop[0],
                                                                          "stop_sequence": stop[1]},
                                       "usage": {"output_tokens": choice.num_tokens if choice else 0}})
        yield _event("message_stop", {"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
        yield _event("error", anthropic_error(renamed(outputs_error(exc))))
