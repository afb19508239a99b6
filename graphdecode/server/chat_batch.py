"""POST /v1/chat/completions/batch (vLLM's): N conversations in one request, one choice each.

The body is a chat request whose `messages` is a list of conversations; every other field
applies to all of them. Each conversation becomes its own chat request (chat.start_chat:
rendered, checked, constrained, sent to the engine), so they run side by side in the engine's
batch; the response is one `chat.completion` whose choice i answers conversation i, with the
usage summed. A conversation's bad field is a 400 naming it (`messages[i][j].role`); the
conversations already started are then aborted, as they are when the client leaves or one of
them fails.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from .chat import start_chat, whole_choices
from .errors import APIError, validation_error
from .protocol import BatchChatCompletionRequest, ChatCompletionRequest
from .responses import json_response
from .serving import INLINE_BODY, Job, OpenAIServer, off_loop


async def create_batch_chat_completion(server: OpenAIServer, request: Request) -> Response:
    arrival = time.perf_counter()
    server.check_ready()
    batch: BatchChatCompletionRequest = await server.parse(request, BatchChatCompletionRequest)
    shared = batch.shared()
    size = sum(len(str(m.get("content", ""))) for conversation in batch.messages for m in conversation)
    reqs = await off_loop(size, INLINE_BODY, _requests, shared, batch.messages)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    jobs: list[Job] = []
    try:
        for i, req in enumerate(reqs):
            try:
                jobs.append(await start_chat(server, request, req, arrival, f"{rid}_{i}"))
            except APIError as exc:
                raise _in_conversation(exc, i) from None
    except BaseException:
        await _abort(jobs)
        raise
    return await server.unless_client_leaves(request, _whole(server, rid, jobs))


def _requests(shared: dict, conversations: list[list[dict]]) -> list[ChatCompletionRequest]:
    """One chat request per conversation, validated as the single endpoint validates its body."""
    reqs = []
    for i, messages in enumerate(conversations):
        try:
            reqs.append(ChatCompletionRequest.model_validate_json(json.dumps({**shared, "messages": messages})))
        except ValidationError as exc:
            raise _in_conversation(validation_error(exc), i) from None
    return reqs


def _in_conversation(exc: APIError, i: int) -> APIError:
    """A conversation's error, its `messages...` param naming the conversation too (messages[i]...)."""
    param = exc.param
    if not param or not param.startswith("messages"):
        return exc
    named = f"messages[{i}]{param.removeprefix('messages')}"
    message = exc.message
    message = named + message.removeprefix(param) if message.startswith(param) else f"{named}: {message}"
    return APIError(message, param=named, status=exc.status, type=exc.type, code=exc.code)


async def _abort(jobs: list[Job]) -> None:
    for job in jobs:
        for _, stream in job.streams:
            await stream.aclose()


async def _whole(server: OpenAIServer, rid: str, jobs: list[Job]) -> Response:
    """Every conversation collected side by side; one failing (or the client leaving) aborts the rest."""
    tasks = [asyncio.ensure_future(server.collect(job, {"prompt": "messages"})) for job in jobs]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await _abort(jobs)  # a task cancelled before it ran never opened its stream to close it
    choices = [c for i, (job, got) in enumerate(zip(jobs, results)) for c in whole_choices(job, got, i)]
    usages = [got.usage() for got in results]
    usage = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    if all("prompt_tokens_details" in u for u in usages):
        usage["prompt_tokens_details"] = {
            "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}
    return json_response({
        "id": rid, "object": "chat.completion", "created": jobs[0].created, "model": jobs[0].model,
        "choices": choices, "usage": usage, "prompt_logprobs": None, "prompt_token_ids": None,
    })
