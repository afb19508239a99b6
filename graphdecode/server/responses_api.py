"""POST /v1/responses (and GET /v1/responses/{id}): the OpenAI Responses API, run as a chat
(responses_protocol.py maps the request) and answered as Response objects, streamed or whole.

The output items, in order: a `reasoning` item (with --reasoning-parser; its text as a `reasoning_text`
part), a `message` item (the answer, one `output_text` part), a `function_call` item per call. `status` is
"completed", or "incomplete" with `incomplete_details.reason` "max_output_tokens"; `usage` counts input,
output and reasoning tokens (and the prompt's tokens found in the prefix cache).

A stream is the typed events the SDK expects, each with its `sequence_number`: `response.created`,
`response.in_progress`, per item `response.output_item.added`, its deltas (`response.reasoning_text.delta`,
`response.content_part.added` + `response.output_text.delta`, `response.function_call_arguments.delta`),
their `.done` events and `response.output_item.done`, then `response.completed` (or `response.incomplete`)
with the whole Response; an error after the start is an `error` event.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from .chat import start_chat
from .choices import Choices
from .errors import APIError
from .responses import dumps, event_stream, json_response
from .responses_protocol import ResponsesRequest, ResponseStore, renamed
from .serving import OpenAIServer, outputs_error


async def create_response(server: OpenAIServer, store: ResponseStore, request: Request) -> Response:
    arrival = time.perf_counter()
    server.check_ready()
    req: ResponsesRequest = await server.parse(request, ResponsesRequest)
    previous = store.get(req.previous_response_id)[1] if req.previous_response_id else None
    try:
        chat, conversation = req.to_chat(previous)
        job = await start_chat(server, request, chat, arrival, f"resp_{uuid.uuid4().hex}")
    except APIError as err:
        raise renamed(err) from None
    response = _Response(server, req, job)
    if req.stream:
        return event_stream(_stream(server, store, job, response, conversation))
    return await server.unless_client_leaves(request, _whole(server, store, job, response, conversation))


def get_response(store: ResponseStore, response_id: str) -> Response:
    return json_response(store.get(response_id, "response_id")[0])


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """The Response object of one request, as it grows."""

    def __init__(self, server: OpenAIServer, req: ResponsesRequest, job):
        self.req, self.job = req, job
        self.created = time.time()
        self.model = job.model  # the adapter's name where the request chose one
        self.output: list[dict] = []

    def body(self, status: str, choice=None, cached: int = 0) -> dict:
        """The Response object now; with `choice` (the finished reply) its usage too."""
        usage = None
        if choice is not None:
            usage = {"input_tokens": self.job.prompt_lens[0], "output_tokens": choice.num_tokens,
                     "total_tokens": self.job.prompt_lens[0] + choice.num_tokens,
                     "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                     "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens}}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.job.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "usage": usage, "incomplete_details": incomplete,
                "error": None, **self.req.echo()}


def _status(choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def _items(thought: str, content: str, calls: list[dict]) -> list[dict]:
    items: list[dict] = []
    if thought:
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": thought}], "status": "completed"})
    if content or not (thought or calls):
        items.append({"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]})
    for call in calls:
        items.append({"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


async def _whole(server: OpenAIServer, store: ResponseStore, job, response: _Response,
                 conversation: list[dict]) -> Response:
    try:
        choices = await server.collect(job, {"prompt": "input"})
    except APIError as err:
        raise renamed(err) from None
    choice = next(iter(choices))
    thought, content, calls, _ = choice.whole_parts()
    response.output = _items(thought, content, calls)
    body = response.body(_status(choice), choice, sum(choices.cached.values()))
    if response.req.store:
        store.put(body, conversation)
    return json_response(body)


class _Events:
    """The stream's events, numbered, and its output items as they open and close."""

    def __init__(self, response: _Response):
        self.response = response
        self.sequence = 0
        self.item: dict | None = None  # the open item
        self.kind: str | None = None  # "reasoning", "message", or ("call", index)
        self.text: list[str] = []

    def event(self, kind: str, body: dict) -> bytes:
        body = {"type": kind, **body, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + dumps(body).encode() + b"\n\n"

    @property
    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.response.output) - 1}

    def _open(self, kind, item: dict) -> list[bytes]:
        out = self.close()
        self.item, self.kind, self.text = item, kind, []
        self.response.output.append(item)
        out.append(self.event("response.output_item.added", {"output_index": len(self.response.output) - 1,
                                                              "item": {**item, "status": "in_progress"}}))
        if kind == "message":
            out.append(self.event("response.content_part.added", {**self._where, "content_index": 0, "part": {
                "type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        return out

    def close(self) -> list[bytes]:
        if self.item is None:
            return []
        item, text, out = self.item, "".join(self.text), []
        where = self._where
        if self.kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self.event("response.reasoning_text.done", {**where, "content_index": 0, "text": text}))
        elif self.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(self.event("response.output_text.done", {**where, "content_index": 0, "text": text,
                                                                 "logprobs": []}))
            out.append(self.event("response.content_part.done", {**where, "content_index": 0, "part": part}))
        else:
            item["arguments"] = text
            out.append(self.event("response.function_call_arguments.done", {**where, "arguments": text}))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", {"output_index": where["output_index"], "item": item}))
        self.item = self.kind = None
        return out

    def reasoning(self, text: str) -> list[bytes]:
        out = [] if self.kind == "reasoning" else self._open("reasoning", {
            "type": "reasoning", "id": _id("rs"), "summary": [], "content": []})
        self.text.append(text)
        return out + [self.event("response.reasoning_text.delta", {**self._where, "content_index": 0,
                                                                    "delta": text})]

    def content(self, text: str) -> list[bytes]:
        out = [] if self.kind == "message" else self._open("message", {
            "type": "message", "id": _id("msg"), "role": "assistant", "content": []})
        self.text.append(text)
        return out + [self.event("response.output_text.delta", {**self._where, "content_index": 0, "delta": text,
                                                                 "logprobs": []})]

    def call(self, delta: dict) -> list[bytes]:
        out = []
        if "id" in delta:
            out = self._open(("call", delta["index"]), {"type": "function_call", "id": _id("fc"),
                                                        "call_id": delta["id"], "name": delta["function"]["name"],
                                                        "arguments": ""})
        arguments = delta["function"].get("arguments") or ""
        if arguments and self.kind == ("call", delta["index"]):
            self.text.append(arguments)
            out.append(self.event("response.function_call_arguments.delta", {**self._where, "delta": arguments}))
        return out


async def _stream(server: OpenAIServer, store: ResponseStore, job, response: _Response, conversation: list[dict]):
    events = _Events(response)
    yield events.event("response.created", {"response": response.body("in_progress")})
    yield events.event("response.in_progress", {"response": response.body("in_progress")})
    choices = Choices(job, server.prefix_caching)
    choice = None
    try:
        async for p, out in server.outputs(job):
            for choice, delta in choices.fold(p, out):
                thought, content, calls, _ = choice.parts(delta)
                for chunk in ((events.reasoning(thought) if thought else [])
                              + (events.content(content) if content else [])
                              + [c for call in calls for c in events.call(call)]):
                    yield chunk
        if not response.output and events.item is None:  # nothing generated: an empty message, as whole
            for chunk in events.content(""):
                yield chunk
        for chunk in events.close():
            yield chunk
        status = _status(choice) if choice is not None else "completed"
        body = response.body(status, choice, sum(choices.cached.values()))
        if response.req.store:
            store.put(body, conversation)
        yield events.event(f"response.{status}", {"response": body})
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
        err = renamed(outputs_error(exc, {"prompt": "input"}))
        yield events.event("error", {"message": err.message, "code": err.code, "param": err.param})
