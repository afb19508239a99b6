"""POST /v1/completions: the request, its engine requests, and its response, streamed or whole.

`prompt` is a text, a list of texts, token ids or a list of token-id lists: one engine request
per prompt (SamplingParams(n=...) gives its n choices, indexed `prompt_index * n + i`). The
prompts are tokenized (long ones in a worker thread), cut to truncate_prompt_tokens (vLLM's:
the last N tokens), checked against the context, the constraint compiled, and with `echo`
the echoed text found (the prompt as sent; token ids decoded) with, for logprobs, where each
prompt token starts in it; then every prompt is sent to the core at once (one that fails
its checks cancels those sent before it). `echo` with max_tokens 0 returns the prompt alone.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from .choices import Choices
from .errors import APIError
from .logprobs import joined, prompt_logprobs_json, token_offsets
from .protocol import CompletionRequest
from .responses import DONE, dumps, error_event, event_stream, json_response
from .serving import INLINE_CHARS, INLINE_TOKENS, Job, OpenAIServer, off_loop


async def create_completion(server: OpenAIServer, request: Request) -> Response:
    arrival = time.perf_counter()
    server.check_ready()
    req: CompletionRequest = await server.parse(request, CompletionRequest)
    lora = server.check_model(req.model)
    truncate = req.truncation(server.max_model_len)
    params = req.sampling_params(server.vocab_size, server.sampling_defaults)
    prompts = req.prompts()
    try:  # long texts are tokenized in a worker thread: the event loop keeps serving meanwhile
        size = sum(len(p) if isinstance(p, str) else len(p["prompt_token_ids"]) for p in prompts)
        parsed = await off_loop(size, INLINE_CHARS, server.engine.inputs.tokenize_all, prompts)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param="prompt") from None
    if truncate is not None:  # vLLM's: N tokens kept; a cut text no longer matches them, the ids stand alone
        parsed = [(text, ids) if len(ids) <= truncate else (None, req.truncate(ids, truncate)) for text, ids in parsed]
    for _, ids in parsed:
        # the request's own max_tokens (not the recommended cap, which may pass the context: the engine then
        # stops at max_model_len with "length")
        server.check_length(len(ids), 1 if req.echo_only else req.max_tokens, "prompt", "max_tokens")
    renames = req.renames()
    await server.constrain(request, req, params, renames)
    echo = None
    if req.echo:  # the echoed text, and where each prompt token starts in it (for text_offset)
        echo = await off_loop(sum(len(ids) for _, ids in parsed), INLINE_TOKENS, _echoes, server.tokenizer, parsed,
                              params.logprobs is not None)
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = []
    try:
        for i, (text, ids) in enumerate(parsed):
            prompt = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
            streams.append((f"{rid}-{i}", server.start(req.salted(prompt), params, f"{rid}-{i}", renames,
                                                         req.priority, lora)))
    except BaseException:
        for _, stream in streams:  # the prompts before the bad one were sent to the core already
            stream.cancel()
        raise
    job = server.job(rid, streams, arrival, [ids for _, ids in parsed], params, req, echo, lora)
    job.echo_only = req.echo_only
    job.prompt_logprobs = req.wants_prompt_logprobs is not None
    if req.stream:
        return event_stream(_stream(server, job))
    return await server.unless_client_leaves(request, _whole(server, job))


def _echoes(tokenizer, parsed: list, with_offsets: bool) -> list[tuple[str, list[int] | None]]:
    """Per prompt: the text echo gives back (the prompt as sent; token ids decoded) and, with
    logprobs, the offset in it where each prompt token starts (None: no consistent offsets)."""
    out = []
    for text, ids in parsed:
        options: tuple[bool, ...] = (True, False)  # a text prompt: its special tokens (BOS) take no room
        if text is None:
            text, options = (tokenizer.decode(ids) if tokenizer is not None else ""), (False,)
        offsets = None
        if with_offsets and tokenizer is not None:
            for skip_special in options:
                offsets = token_offsets(tokenizer, ids, text, skip_special)
                if offsets is not None:
                    break
        out.append((text, offsets))
    return out


def _echo_logprobs(job: Job, p: int, prompt_logprobs) -> tuple[dict, int]:
    """Prompt `p`'s echoed part of a choice's logprobs, and the text_offset after it."""
    text, offsets = job.echo[p]
    return job.logprobs.echo(job.prompt_ids[p], text, offsets, prompt_logprobs)


async def _stream(server: OpenAIServer, job: Job):
    """A chunk per delta of each choice (the echo with its first), then the usage (include_usage)."""
    head = (f'data: {{"id":"{job.rid}","object":"text_completion","created":{job.created},'
            f'"model":{job.model_json},"choices":[').encode()
    echo, fmt = job.echo, job.logprobs
    choices = Choices(job, server.prefix_caching)
    try:
        async for p, out in server.outputs(job):
            for choice, delta in choices.fold(p, out):
                text, ids = delta.text, delta.token_ids
                echo_now = echo is not None and not choice.started
                if not echo_now and not text and not ids and delta.finish_reason is None:
                    continue
                # (a chunk is sent for new tokens whose text is held back, with text "", as vLLM does)
                logprobs = None
                if fmt is not None:
                    if echo_now:
                        logprobs, choice.offset = _echo_logprobs(job, p, choices.prompt_logprobs.get(p))
                    if ids:
                        part, choice.offset = fmt.completion(ids, delta.logprobs, choice.offset)
                        logprobs = joined(logprobs, part)
                if echo_now:
                    text = echo[p][0] + text
                body = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
                if delta.finish_reason is not None:
                    body["stop_reason"] = delta.stop_reason
                if job.token_ids:
                    if not choice.started:
                        body["prompt_token_ids"] = job.prompt_ids[p]
                    body["token_ids"] = list(ids)
                choice.started = True
                chunk = head + dumps(body).encode() + b"]"
                if job.continuous:  # vLLM's: this prompt's tokens, this choice's tokens so far
                    chunk += b',"usage":' + dumps(choices.running_usage(choice)).encode()
                yield chunk + b"}\n\n"
        if job.include_usage:
            yield head + b'],"usage":' + dumps(choices.usage()).encode() + b"}\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
        yield error_event(exc)
    yield DONE


async def _whole(server: OpenAIServer, job: Job) -> Response:
    """One body once every choice is done."""
    choices = await server.collect(job)
    out_choices = []
    for choice in choices:
        p = choice.prompt
        text = choice.whole_text()
        logprobs = None
        if job.logprobs is not None:
            offset = 0
            if job.echo is not None:
                logprobs, offset = _echo_logprobs(job, p, choices.prompt_logprobs.get(p))
            logprobs = joined(logprobs, job.logprobs.completion(choice.token_ids, choice.logprobs, offset)[0])
        if job.echo is not None:
            text = job.echo[p][0] + text
        # vLLM's optional fields are there, null, when not asked for (its clients read them)
        body = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason, "prompt_logprobs": None, "prompt_token_ids": None,
                "token_ids": None}
        if job.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_json(choices.prompt_logprobs.get(p))
        if job.token_ids:
            body["prompt_token_ids"] = job.prompt_ids[p]
            body["token_ids"] = choice.token_ids
        out_choices.append(body)
    return json_response({
        "id": job.rid, "object": "text_completion", "created": job.created, "model": job.model,
        "choices": out_choices, "usage": choices.usage(),
    })
