"""The OpenAI-compatible HTTP server: FastAPI + uvicorn over AsyncLLM.

    graphdecode serve [--model DIR] [--host 127.0.0.1] [--port 8000] [engine options]
    python -m graphdecode.server.openai_api [same options]

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent
events or not), GET /v1/models, GET /health, GET /metrics (Prometheus), GET /version.

All HTTP, JSON and SSE work happens in this process; the engine core process only
steps (AsyncLLM). A body over --max-request-body-bytes is refused with 413 before it is
read (by its Content-Length, or as soon as a chunked body passes the limit). Large
bodies are parsed, and long prompts tokenized (chat templates rendered), in a worker
thread, so /health and the streams of other requests never wait for them. A request is
parsed, validated, tokenized and handed to
`AsyncLLM.generate` (which runs the engine's own checks, then sends it to the core at
once) before its response starts, so a bad one is a 400 naming the field and costs the
engine nothing. One engine request per prompt: n > 1 is one request with
SamplingParams(n=...), prefilled once. SSE chunks are plain dicts through json.dumps.
A client that goes away mid-stream has its engine iterator closed, which aborts its
request and frees its pages. Structured outputs (response_format, structured_outputs,
guided_*) and tool calls (tools / tool_choice, parsed by tools.py) are described in
docs/serving.md; a constraint is checked and compiled in a worker thread before the
request is sent.

SIGTERM (or Ctrl+C): new requests get 503 and /health turns 503, running requests
finish (at most --shutdown-timeout seconds, then they are aborted), uvicorn closes,
the core process is shut down, exit status 0. A second signal exits at once.

A request the engine core fails (an error inside the engine, not a bad request) is a 500
(`server_error`; in a stream, an error event), and the core goes on serving the others.
A core that dies (its step loop raised: its state is unknown; or its process was killed)
is not restarted in place: its running requests get 503 (or an error event), /health turns
503, and within a tick (0.1 s) the server prints one ERROR line with the cause (the signal
that killed the core, its exit status, or the traceback it sent) and exits with status 1,
so that a supervisor (systemd, Kubernetes, ...) starts a fresh one instead of leaving a
server that answers 503 forever; a SIGTERM that comes after the death exits 1 too. A core
that stops beating (args.HEARTBEAT_INTERVAL_S) for --heartbeat-timeout seconds (a
stopped or frozen process) turns /health and new requests to 503 until it beats again.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from .. import __version__
from ..engine_args import HelpFormatter, engine_options, fail
from ..host.detokenizer import Detokenizer
from ..host.gc_heap import freeze_startup_heap
from ..sampling_params import SamplingParams
from ..structured.compile_worker import CompileCancelled
from . import tools as tool_calls
from .args import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DESCRIPTION,
    add_serve_args,
    check_serve_args,
)
from .async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ConstraintSource,
    build_constraint,
    constraint_error,
    lone_surrogate_error,
    model_not_found,
    param_of,
    request_failed,
    unavailable,
    validation_error,
)

DEFAULT_MODEL_NAME = "graphdecode-default"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Work done on the event loop only up to these sizes, a few ms at most on a slow core (a worker thread
# above them; its hop costs ~0.1 ms): JSON token-id lists parse at ~15 MB/s, text tokenizes at ~3 KB/ms,
# echo offsets take ~4 us per token.
_INLINE_BODY = 64 << 10  # body bytes parsed inline
_INLINE_CHARS = 4096  # prompt characters or ids (all prompts, or all message contents) tokenized inline
_INLINE_TOKENS = 1024  # prompt tokens echoed (decoded, offsets found) inline
_log = logging.getLogger("uvicorn.error")  # uvicorn's own lines ("INFO: ..."), at --log-level


class _ClientGone(Exception):
    """The client left before its request body was read in full: there is no one to answer."""


async def _off_loop(work: int, limit: int, fn, *args):
    """fn(*args), in a worker thread when `work` exceeds `limit`, so the event loop keeps serving."""
    if work > limit:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _finite(value: float) -> float:
    """JSON has no infinities: -inf logprobs are reported as -9999.0 (vLLM's convention)."""
    return value if value > -9999.0 else -9999.0


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, even when the client left
    while a chunk was being sent (closing it is what aborts the engine request)."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class _Choice:
    """What a choice accumulates (non-streamed), or what a streamed choice has sent so far."""

    __slots__ = ("text", "token_ids", "entries", "num_tokens", "offset", "started", "finish_reason", "stop_reason")

    def __init__(self):
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.entries: list = []  # logprobs: the engine's entries (completions) or their chat format (chat)
        self.num_tokens = 0  # streamed: tokens sent
        self.offset = 0  # streamed completions: text_offset of the next token
        self.started = False  # streamed: its first chunk went out
        self.finish_reason = None
        self.stop_reason = None


class _Job:
    """One HTTP request's engine requests, and what its response needs besides their outputs."""

    __slots__ = ("rid", "created", "streams", "arrival", "prompt_ids", "prompt_lens", "n", "want_logprobs", "top_n",
                 "as_ids", "token_ids", "include_usage", "continuous", "echo", "echo_only", "prompt_logprobs", "role",
                 "tool_mode", "tool_name")

    def __init__(self, rid: str, created: int, streams: list, arrival: float, prompt_ids: list[list[int]],
                 params: SamplingParams, req, echo):
        self.rid, self.created, self.streams, self.arrival = rid, created, streams, arrival
        self.prompt_ids = prompt_ids
        self.prompt_lens = [len(ids) for ids in prompt_ids]
        self.n = params.n
        self.want_logprobs = params.logprobs is not None
        self.top_n = params.logprobs if params.logprobs is not None else 0
        self.as_ids = bool(req.return_tokens_as_token_ids)  # tokens as "token_id:123" (vLLM's)
        self.token_ids = bool(req.return_token_ids)
        self.include_usage = req.include_usage
        self.continuous = req.continuous_usage
        self.echo = echo  # completions: per prompt (text, token offsets) or None; chat: the echoed content
        self.echo_only = False  # completions: echo with max_tokens 0
        self.prompt_logprobs = False  # the response carries prompt_logprobs
        self.role = "assistant"  # chat: the reply's role
        self.tool_mode = None  # chat: None, "auto", "required" or "named" (ChatCompletionRequest.tool_mode)
        self.tool_name = None  # chat, "named": the function called

    def tool_parser(self):
        """A fresh parser of one choice's output into content and tool calls (tools.py)."""
        if self.tool_mode == "auto":
            return tool_calls.HermesCalls()
        if self.tool_mode == "required":
            return tool_calls.RequiredCalls()
        return tool_calls.NamedCall(self.tool_name)

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """OpenAI's: "tool_calls" when the reply's calls are complete ("auto" that made some, or
        "required"); a named function's call ends with "stop", a cut one with "length"."""
        if engine_reason == "stop" and num_calls and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


class OpenAIServer:
    """Request handling, independent of the web framework's routing (see build_app)."""

    def __init__(self, engine: AsyncLLM, served_model_name: str, metrics_prefix: str | None = None,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S):
        self.engine = engine
        self.heartbeat_timeout = heartbeat_timeout  # seconds without a beat from the core: unresponsive
        self.model_name = served_model_name
        self.model_json = json.dumps(served_model_name)
        self.metrics = ServerMetrics(engine, served_model_name, metrics_prefix)
        self.draining = False
        self.created = int(time.time())
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.config.model_config.vocab_size
        self.prefix_caching = bool(engine.config.enable_prefix_caching)  # usage reports prompt_tokens_details

    # ------------------------------------------------------------- checks
    def health(self) -> tuple[int, dict]:
        """(HTTP status, body): 200 {"status": "ok"}, or 503 with the status "dead", "draining" or
        "unresponsive" and a "reason"."""
        if self.engine.is_dead:
            return 503, {"status": "dead", "reason": f"the engine core died ({self.engine.death_cause(0)})"}
        if self.draining:
            return 503, {"status": "draining", "reason": "the server is shutting down"}
        silent = self.unresponsive()
        if silent is not None:
            return 503, {"status": "unresponsive", "reason": silent}
        return 200, {"status": "ok"}

    def unresponsive(self) -> str | None:
        """Why the core counts as unresponsive (no beat for longer than the heartbeat timeout), or None."""
        age = self.engine.heartbeat_age
        if age <= self.heartbeat_timeout:
            return None
        return (f"the engine core has not answered for {age:.1f} s (--heartbeat-timeout "
                f"{self.heartbeat_timeout:g} s): it is stopped, frozen or starved")

    def _check_ready(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.engine.is_dead:
            raise unavailable("the engine is not running")
        silent = self.unresponsive()
        if silent is not None:
            raise unavailable(silent)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name)

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                      max_tokens_param: str) -> None:
        """The engine's one context rule (InputProcessor.check_length, the API's too), checked before
        any echo work; its error is a 400 naming the request's own field."""
        try:
            self.engine.inputs.check_length(num_prompt_tokens, max_tokens)
        except ValueError as exc:
            message = str(exc)
            field = "prompt" if message.startswith("prompt") else "max_tokens"
            param = prompt_param if field == "prompt" else max_tokens_param
            raise APIError(param + message[len(field):], param=param) from None

    def _start(self, prompt: dict, params: SamplingParams, request_id: str, renames: dict, priority: int = 0):
        """AsyncLLM.generate: validates (a 400 by name) and sends the request to the core now."""
        try:
            return self.engine.generate(prompt, params, request_id=request_id, priority=priority)
        except EngineDeadError:
            raise unavailable("the engine is not running") from None
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc), param=param_of(str(exc), renames)) from None

    async def _constrain(self, request: Request, req, params: SamplingParams, renames: dict) -> None:
        """The request's structured-output constraint (response_format, structured_outputs, guided_*,
        tool_choice) checked and compiled for this model in a worker thread (0.1-3 s the first time;
        the event loop keeps serving), then set on `params`; AsyncLLM.generate finds it compiled in the
        engine's cache. A bad one is a 400 naming the field the client sent."""
        source = req.constraint_source()
        if source is None:
            return
        cancelled = threading.Event()  # the compile worker is stopped when the client leaves
        compiling = asyncio.ensure_future(asyncio.to_thread(self._compile, req, source, cancelled))
        await self._until_done_or_gone(request, compiling, cancelled.set)
        try:
            params.structured_outputs = await compiling
        except CompileCancelled:
            if self.draining:
                raise unavailable("the server is shutting down") from None
            raise APIError("the client went away while its constraint compiled", status=499) from None
        renames["structured_outputs"] = source.error_param or source.param

    def _compile(self, req, source: ConstraintSource, cancelled: threading.Event):
        try:
            constraint = build_constraint(source)
        except APIError:
            if source.error_param == "tools":  # tool_choice "required": name the tool whose schema fails
                for each in req.tool_parameter_sources():
                    build_constraint(each)
            raise
        try:
            self.engine.inputs.compile_constraint(constraint, cancelled)  # now, into the engine's cache
        except (ValueError, TypeError) as exc:
            raise constraint_error(source, exc) from None
        return constraint

    @staticmethod
    async def _parse(request: Request, model):
        try:
            body = await request.body()
        except ClientDisconnect:  # hung up while sending its body: one line, nothing to answer
            client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
            _log.info("%s hung up while sending its %s %s body; nothing answered", client, request.method,
                      request.url.path)
            raise _ClientGone from None
        try:
            return await _off_loop(len(body), _INLINE_BODY, model.model_validate_json, body)
        except ValidationError as exc:
            surrogate = await _off_loop(len(body), _INLINE_BODY, lone_surrogate_error, exc, body)
            raise (surrogate or validation_error(exc)) from None

    # ------------------------------------------------------------- outputs
    async def _outputs(self, streams: list, arrival: float, prompt_lens: list[int]) -> AsyncIterator:
        """(prompt index, RequestOutput delta) of every engine request, metrics kept on the way.

        Closing this iterator (or cancelling its consumer) closes the engine iterators,
        which aborts their unfinished requests.
        """
        trackers = [self.metrics.track(rid, n, arrival) for (rid, _), n in zip(streams, prompt_lens)]
        try:
            if len(streams) == 1:
                tracker, (_, stream) = trackers[0], streams[0]
                try:
                    async for out in stream:
                        tracker.on_output(out)
                        yield 0, out
                finally:
                    await stream.aclose()
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, stream, tracker):
                try:
                    async for out in stream:
                        tracker.on_output(out)
                        queue.put_nowait((i, out))
                    queue.put_nowait((i, None))
                except Exception as exc:  # noqa: BLE001 - handed to the consumer
                    queue.put_nowait((i, exc))

            tasks = [asyncio.ensure_future(pump(i, s, t)) for i, ((_, s), t) in enumerate(zip(streams, trackers))]
            try:
                remaining = len(tasks)
                while remaining:
                    i, item = await queue.get()
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, Exception):
                        raise item
                    else:
                        yield i, item
            finally:
                for task in tasks:
                    task.cancel()  # a running pump's engine iterator aborts its request
        finally:
            for tracker in trackers:
                tracker.close()

    @staticmethod
    def _error_event(exc: Exception) -> bytes:
        if isinstance(exc, EngineDeadError):
            err = unavailable("the engine stopped while this request ran")
        elif isinstance(exc, RequestFailedError):
            err = request_failed(str(exc))
        elif isinstance(exc, ValueError):
            err = APIError(str(exc), param=param_of(str(exc)))
        else:
            err = APIError(f"{type(exc).__name__}: {exc}", status=500, type="server_error")
        return b"data: " + _dumps(err.body()).encode() + b"\n\n"

    @staticmethod
    async def _until_disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _until_done_or_gone(self, request: Request, task: asyncio.Future, on_gone) -> None:
        """Wait for `task` or the client's disconnect, whichever comes first; on_gone() if the client
        went first (or this wait was cancelled)."""
        watcher = asyncio.ensure_future(self._until_disconnected(request))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                on_gone()

    async def _unless_client_leaves(self, request: Request, work) -> Response:
        """Run a non-streamed request; if the client disconnects first, cancel it (aborting its requests)."""
        task = asyncio.ensure_future(work)
        await self._until_done_or_gone(request, task, task.cancel)
        if task.cancelled():
            return Response(status_code=499)  # nobody is listening
        return task.result()

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached: dict | None = None,
               num_prompts: int = 0) -> dict:
        """OpenAI's usage; with prefix caching on, prompt_tokens_details.cached_tokens (the prompt tokens
        found in the cache, over all prompts) once the engine reported it for every prompt."""
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if self.prefix_caching and cached is not None and num_prompts and len(cached) == num_prompts:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
        return usage

    # ------------------------------------------------------------- /v1/completions
    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_ready()
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        self._check_model(req.model)
        truncate = req.truncation(self.max_model_len)
        params = req.sampling_params(self.vocab_size)
        prompts = req.prompts()
        try:  # long texts are tokenized in a worker thread: the event loop keeps serving meanwhile
            size = sum(len(p) if isinstance(p, str) else len(p["prompt_token_ids"]) for p in prompts)
            parsed = await _off_loop(size, _INLINE_CHARS, self.engine.inputs.tokenize_all, prompts)
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc), param="prompt") from None
        if truncate is not None:  # vLLM's: the last N tokens; a cut text no longer matches them, the ids stand alone
            parsed = [(text, ids) if len(ids) <= truncate else (None, ids[-truncate:]) for text, ids in parsed]
        for text, ids in parsed:
            self._check_length(len(ids), params.max_tokens, "prompt", "max_tokens")
        renames = req.renames()
        await self._constrain(request, req, params, renames)
        echo = None
        if req.echo:  # the echoed text, and where each prompt token starts in it (for text_offset)
            echo = await _off_loop(sum(len(ids) for _, ids in parsed), _INLINE_TOKENS, self._echoes, parsed,
                                   params.logprobs is not None)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = []
        try:
            for i, (text, ids) in enumerate(parsed):
                prompt = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
                streams.append((f"{rid}-{i}", self._start(prompt, params, f"{rid}-{i}", renames, req.priority)))
        except BaseException:
            for _, stream in streams:  # the prompts before the bad one were sent to the core already
                stream.cancel()
            raise
        job = _Job(rid, int(time.time()), streams, arrival, [ids for _, ids in parsed], params, req, echo)
        job.echo_only = req.echo_only
        job.prompt_logprobs = req.wants_prompt_logprobs is not None
        if req.stream:
            return _SSEResponse(self._stream_completion(job), media_type="text/event-stream", headers=_SSE_HEADERS)
        return await self._unless_client_leaves(request, self._full_completion(job))

    def _echoes(self, parsed: list, with_offsets: bool) -> list[tuple[str, list[int] | None]]:
        """Per prompt: the text echo gives back (the prompt as sent; token ids decoded) and, with
        logprobs, the offset in it where each prompt token starts (None: no consistent offsets)."""
        tokenizer, out = self.tokenizer, []
        for text, ids in parsed:
            options: tuple[bool, ...] = (True, False)  # a text prompt: its special tokens (BOS) take no room
            if text is None:
                text, options = (tokenizer.decode(ids) if tokenizer is not None else ""), (False,)
            offsets = None
            if with_offsets and tokenizer is not None:
                for skip_special in options:
                    offsets = _token_offsets(tokenizer, ids, text, skip_special)
                    if offsets is not None:
                        break
            out.append((text, offsets))
        return out

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def _logprob_lists(self, token_ids, entries, top_n: int, as_ids: bool) -> tuple[list, list, list]:
        """tokens, token_logprobs, top_logprobs (the sampled token's entry, then up to top_n others)."""
        tokens, values, top = [], [], []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:  # the first prompt token: nothing before it predicts it
                tokens.append(f"token_id:{token_id}" if as_ids else self._decode_one(token_id))
                values.append(None)
                top.append(None)
                continue
            sampled = entry.get(token_id)
            tokens.append(_piece(sampled, token_id, as_ids))
            values.append(_finite(sampled.logprob) if sampled is not None else None)
            items = entry.items() if top_n < 0 else itertools.islice(entry.items(), top_n + 1)
            top.append({_piece(lp, tid, as_ids): _finite(lp.logprob) for tid, lp in items})
        return tokens, values, top

    def _completion_logprobs(self, job: _Job, token_ids, entries, offset: int,
                             offsets: list[int] | None = None, end: int = 0) -> tuple[dict, int]:
        """The completions format for these tokens; text_offset from `offsets` (then the next token
        starts at `end`) or counted on from `offset` by the length of each token's text."""
        tokens, values, top = self._logprob_lists(token_ids, entries, job.top_n, job.as_ids)
        if offsets is None:
            offsets = []
            for piece in tokens:
                offsets.append(offset)
                offset += len(piece)
        else:
            offsets, offset = list(offsets), end
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}, offset

    def _echo_logprobs(self, job: _Job, p: int, prompt_logprobs) -> tuple[dict, int]:
        """The echoed prompt's part of a choice's logprobs (its first token has none)."""
        text, offsets = job.echo[p]
        ids = job.prompt_ids[p]
        entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(ids)
        return self._completion_logprobs(job, ids, entries, 0, offsets, len(text))

    async def _stream_completion(self, job: _Job):
        head = (f'data: {{"id":"{job.rid}","object":"text_completion","created":{job.created},'
                f'"model":{self.model_json},"choices":[').encode()
        n, echo, prompt_lens = job.n, job.echo, job.prompt_lens
        states: dict[int, _Choice] = {}
        prompt_logprobs: dict[int, list] = {}
        cached: dict[int, int] = {}
        try:
            async for p, out in self._outputs(job.streams, job.arrival, prompt_lens):
                if out.prompt_logprobs is not None:  # with the request's first delta
                    prompt_logprobs[p] = out.prompt_logprobs
                if out.num_cached_tokens is not None:
                    cached[p] = out.num_cached_tokens
                for c in out.outputs:
                    index = p * n + c.index
                    state = states.get(index)
                    if state is None:
                        state = states[index] = _Choice()
                    # echo with max_tokens 0: the one token the engine generated is not returned
                    text, ids, entries = ("", (), ()) if job.echo_only else (c.text, c.token_ids, c.logprobs)
                    echo_now = echo is not None and not state.started
                    if not echo_now and not text and not ids and c.finish_reason is None:
                        continue
                    # (a chunk is sent for new tokens whose text is held back, with text "", as vLLM does)
                    logprobs = None
                    if job.want_logprobs:
                        if echo_now:
                            logprobs, state.offset = self._echo_logprobs(job, p, prompt_logprobs.get(p))
                        if ids:
                            part, state.offset = self._completion_logprobs(job, ids, entries, state.offset)
                            logprobs = _joined(logprobs, part)
                    if echo_now:
                        text = echo[p][0] + text
                    state.num_tokens += len(ids)
                    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    if job.token_ids:
                        if not state.started:
                            choice["prompt_token_ids"] = job.prompt_ids[p]
                        choice["token_ids"] = list(ids)
                    state.started = True
                    chunk = head + _dumps(choice).encode() + b"]"
                    if job.continuous:  # vLLM's: this prompt's tokens, this choice's tokens so far
                        chunk += b',"usage":' + _dumps(self._usage(prompt_lens[p], state.num_tokens)).encode()
                    yield chunk + b"}\n\n"
            if job.include_usage:
                completion_tokens = sum(s.num_tokens for s in states.values())
                usage = self._usage(sum(prompt_lens), completion_tokens, cached, len(prompt_lens))
                yield head + b'],"usage":' + _dumps(usage).encode() + b"}\n\n"
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
            yield self._error_event(exc)
        yield _DONE

    async def _full_completion(self, job: _Job) -> Response:
        n = job.n
        choices = {p * n + i: _Choice() for p in range(len(job.streams)) for i in range(n)}
        prompt_logprobs: dict[int, list] = {}
        cached: dict[int, int] = {}
        try:
            async for p, out in self._outputs(job.streams, job.arrival, job.prompt_lens):
                if out.prompt_logprobs is not None:
                    prompt_logprobs[p] = out.prompt_logprobs
                if out.num_cached_tokens is not None:
                    cached[p] = out.num_cached_tokens
                for c in out.outputs:
                    choice = choices[p * n + c.index]
                    if c.text:
                        choice.text.append(c.text)
                    choice.token_ids.extend(c.token_ids)
                    if c.logprobs:
                        choice.entries.extend(c.logprobs)
                    if c.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        except EngineDeadError:
            raise unavailable("the engine stopped while this request ran") from None
        except RequestFailedError as exc:
            raise request_failed(str(exc)) from None
        except ValueError as exc:
            raise APIError(str(exc), param=param_of(str(exc))) from None
        out_choices, completion_tokens = [], 0
        for index, choice in sorted(choices.items()):
            p = index // n
            text, ids, entries = "".join(choice.text), choice.token_ids, choice.entries
            if job.echo_only:  # the one token the engine generated is not returned
                text, ids, entries = "", [], []
            logprobs = None
            if job.want_logprobs:
                offset = 0
                if job.echo is not None:
                    logprobs, offset = self._echo_logprobs(job, p, prompt_logprobs.get(p))
                logprobs = _joined(logprobs, self._completion_logprobs(job, ids, entries, offset)[0])
            if job.echo is not None:
                text = job.echo[p][0] + text
            body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason}
            if job.prompt_logprobs:
                body["prompt_logprobs"] = _prompt_logprobs_json(prompt_logprobs.get(p))
            if job.token_ids:
                body["prompt_token_ids"] = job.prompt_ids[p]
                body["token_ids"] = ids
            completion_tokens += len(ids)
            out_choices.append(body)
        body = {
            "id": job.rid, "object": "text_completion", "created": job.created, "model": self.model_name,
            "choices": out_choices,
            "usage": self._usage(sum(job.prompt_lens), completion_tokens, cached, len(job.streams)),
        }
        return Response(_dumps(body), media_type="application/json")

    # ------------------------------------------------------------- /v1/chat/completions
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_ready()
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._check_model(req.model)
        conversation = req.conversation()
        truncate = req.truncation(self.max_model_len)
        size = sum(len(m["content"]) for m in conversation if isinstance(m.get("content"), str))
        text, ids = await _off_loop(size, _INLINE_CHARS, self._render_chat, req, conversation)
        if truncate is not None and len(ids) > truncate:
            text, ids = None, ids[-truncate:]
        max_tokens = req.requested_max_tokens()
        self._check_length(len(ids), max_tokens, "messages", req.max_tokens_param)
        params = req.sampling_params(max_tokens, self.vocab_size)
        renames = req.renames()
        await self._constrain(request, req, params, renames)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
        streams = [(rid, self._start(prompt, params, rid, renames, req.priority))]
        role = req.response_role
        last = conversation[-1]  # vLLM's echo: the last message, when the reply continues its role
        echo = last["content"] if req.echo and last["role"] == role else ""
        job = _Job(rid, int(time.time()), streams, arrival, [ids], params, req, echo)
        job.role = role
        job.prompt_logprobs = req.wants_prompt_logprobs is not None
        job.tool_mode, job.tool_name = req.tool_mode, req.named_function
        if req.stream:
            return _SSEResponse(self._stream_chat(job), media_type="text/event-stream", headers=_SSE_HEADERS)
        return await self._unless_client_leaves(request, self._full_chat(job))

    def _render_chat(self, req: ChatCompletionRequest, conversation: list[dict]) -> tuple[str, list[int]]:
        """The conversation through the chat template, tokenized as LLM.chat does."""
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; use /v1/completions", param="messages")
        kwargs = dict(req.chat_template_kwargs or {})
        tools = req.template_tools()
        if tools is not None:
            kwargs.setdefault("tools", tools)
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=bool(req.add_generation_prompt),
                                                 tokenize=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint (roles, order) is the message
            raise APIError(f"messages: the chat template failed: {exc}", param="messages") from None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own specials
        if not ids:
            raise APIError("messages: the conversation renders to an empty prompt", param="messages")
        return text, ids

    def _chat_logprobs(self, token_ids, entries, top_n: int, as_ids: bool) -> list[dict]:
        content = []
        for token_id, entry in zip(token_ids, entries):
            sampled = entry.get(token_id)
            piece = _piece(sampled, token_id, as_ids)
            top = sorted((lp.rank, tid, lp) for tid, lp in entry.items()
                         if lp.rank is not None and (top_n < 0 or lp.rank <= top_n))
            content.append({
                "token": piece,
                "logprob": _finite(sampled.logprob) if sampled is not None else -9999.0,
                "bytes": list(piece.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {"token": (t := _piece(lp, tid, as_ids)), "logprob": _finite(lp.logprob),
                     "bytes": list(t.encode("utf-8", errors="replace"))}
                    for _, tid, lp in top
                ],
            })
        return content

    def _chat_chunk(self, head: bytes, choice: dict, job: _Job, completion_tokens: int, first: bool = False) -> bytes:
        chunk = head + _dumps(choice).encode() + b"]"
        if first and job.token_ids:  # vLLM's: the prompt's ids ride on the first chunk of each choice
            chunk += b',"prompt_token_ids":' + _dumps(job.prompt_ids[0]).encode()
        if job.continuous:
            chunk += b',"usage":' + _dumps(self._usage(job.prompt_lens[0], completion_tokens)).encode()
        return chunk + b"}\n\n"

    async def _stream_chat(self, job: _Job):
        head = (f'data: {{"id":"{job.rid}","object":"chat.completion.chunk","created":{job.created},'
                f'"model":{self.model_json},"choices":[').encode()
        states = {i: _Choice() for i in range(job.n)}
        parsers = {i: job.tool_parser() for i in range(job.n)} if job.tool_mode else None
        first_content = None if job.tool_mode in ("required", "named") else ""  # a reply of calls has no content
        cached: dict[int, int] = {}
        try:
            for i in range(job.n):  # OpenAI's first chunk of a choice carries the role
                first = {"index": i, "delta": {"role": job.role, "content": first_content}, "logprobs": None,
                         "finish_reason": None}
                yield self._chat_chunk(head, first, job, 0, first=True)
            if job.echo:
                for i in range(job.n):
                    echoed = {"index": i, "delta": {"content": job.echo}, "logprobs": None, "finish_reason": None}
                    yield self._chat_chunk(head, echoed, job, 0)
            async for _, out in self._outputs(job.streams, job.arrival, job.prompt_lens):
                if out.num_cached_tokens is not None:
                    cached[0] = out.num_cached_tokens
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    state = states[c.index]
                    state.num_tokens += len(c.token_ids)
                    finish_reason = c.finish_reason
                    if parsers is None:
                        delta = {"content": c.text}
                    else:  # tools: content and tool calls parsed out of the text as it comes
                        parser = parsers[c.index]
                        content, calls = parser.feed(c.text)
                        if finish_reason is not None:
                            more, last = parser.finish()
                            content, calls = content + more, calls + last
                            finish_reason = job.finish_reason(finish_reason, parser.num_calls)
                        delta = {}
                        if content:
                            delta["content"] = content
                        if calls:
                            delta["tool_calls"] = calls
                        if not delta and finish_reason is None and not job.token_ids and not (
                                job.want_logprobs and c.token_ids):
                            continue  # text held back, nothing else to say
                    choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                    if job.want_logprobs and c.token_ids:
                        choice["logprobs"] = {"content": self._chat_logprobs(c.token_ids, c.logprobs, job.top_n,
                                                                             job.as_ids)}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    if job.token_ids:
                        choice["token_ids"] = list(c.token_ids)
                    yield self._chat_chunk(head, choice, job, state.num_tokens)
            if job.include_usage:
                usage = self._usage(job.prompt_lens[0], sum(s.num_tokens for s in states.values()), cached, 1)
                yield head + b'],"usage":' + _dumps(usage).encode() + b"}\n\n"
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
            yield self._error_event(exc)
        yield _DONE

    async def _full_chat(self, job: _Job) -> Response:
        choices = {i: _Choice() for i in range(job.n)}
        prompt_logprobs = None
        cached: dict[int, int] = {}
        try:
            async for _, out in self._outputs(job.streams, job.arrival, job.prompt_lens):
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
                if out.num_cached_tokens is not None:
                    cached[0] = out.num_cached_tokens
                for c in out.outputs:
                    choice = choices[c.index]
                    if c.text:
                        choice.text.append(c.text)
                    choice.token_ids.extend(c.token_ids)
                    if job.want_logprobs and c.token_ids:
                        choice.entries.extend(self._chat_logprobs(c.token_ids, c.logprobs, job.top_n, job.as_ids))
                    if c.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        except EngineDeadError:
            raise unavailable("the engine stopped while this request ran") from None
        except RequestFailedError as exc:
            raise request_failed(str(exc)) from None
        except ValueError as exc:
            raise APIError(str(exc), param=param_of(str(exc), {"prompt": "messages"})) from None
        out_choices = []
        for index, c in sorted(choices.items()):
            message = {"role": job.role, "content": job.echo + "".join(c.text)}
            finish_reason = c.finish_reason
            if job.tool_mode:  # the same parser the stream uses, fed the whole text
                parser = job.tool_parser()
                content, calls = tool_calls.parse_all(parser, "".join(c.text))
                message["content"] = (job.echo + content) or None
                if calls:
                    message["tool_calls"] = calls
                finish_reason = job.finish_reason(finish_reason, parser.num_calls)
            choice = {"index": index, "message": message,
                      "logprobs": {"content": c.entries} if job.want_logprobs else None,
                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}
            if job.token_ids:
                choice["token_ids"] = c.token_ids
            out_choices.append(choice)
        body = {
            "id": job.rid, "object": "chat.completion", "created": job.created, "model": self.model_name,
            "choices": out_choices,
            "usage": self._usage(job.prompt_lens[0], sum(len(c.token_ids) for c in choices.values()), cached, 1),
        }
        if job.prompt_logprobs:
            body["prompt_logprobs"] = _prompt_logprobs_json(prompt_logprobs)
        if job.token_ids:
            body["prompt_token_ids"] = job.prompt_ids[0]
        return Response(_dumps(body), media_type="application/json")

    # ------------------------------------------------------------- lifecycle
    async def drain(self, timeout: float) -> None:
        """Wait for the running requests (at most `timeout` s), then abort what is left. Constraints
        still compiling are stopped at once (their requests get 503): a compile can take its whole
        time budget, and nothing of it has been generated yet."""
        self.engine.inputs.close()
        deadline = time.monotonic() + timeout
        while self.metrics.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.metrics.active):
            try:
                await self.engine.abort(request_id)
            except EngineDeadError:
                break
        deadline = time.monotonic() + 5.0  # their last chunks (finish_reason "abort") go out
        while self.metrics.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _piece(lp, token_id: int, as_ids: bool = False) -> str:
    if not as_ids and lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"


def _joined(first: dict | None, second: dict) -> dict:
    """Two parts of one choice's completions logprobs, in order (`first`'s lists are extended)."""
    if first is None:
        return second
    for key, values in second.items():
        first[key].extend(values)
    return first


def _prompt_logprobs_json(entries) -> list | None:
    """vLLM's prompt_logprobs: per prompt token, null (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for tid, lp in e.items()}
            for e in entries]


def _token_offsets(tokenizer, ids: list[int], text: str, skip_special: bool) -> list[int] | None:
    """Where each token starts in `text`, if decoding the ids incrementally gives exactly `text`
    (else None). A token that adds no text of its own (a skipped special token, the first
    bytes of a character) starts where the next text does."""
    detok = Detokenizer(tokenizer.backend_tokenizer, [], skip_special, (), False)
    offsets = []
    for token_id in ids:
        offsets.append(len(detok.text))
        detok.add([token_id])
    detok.finish()
    return offsets if detok.text == text else None


def _too_large(limit: int, declared: int | None) -> APIError:
    size = f" ({declared} bytes)" if declared is not None else ""
    return APIError(f"the request body{size} is over this server's limit of {limit} bytes "
                    f"(--max-request-body-bytes)", status=413)


class _BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 before it is read (by its Content-Length), or
    as soon as the bytes read pass the limit (a chunked body). uvicorn then discards the rest as it
    arrives, so the client, still sending, gets the answer."""

    def __init__(self, app, limit: int, server: OpenAIServer):
        self.app, self.limit, self.server = app, limit, server

    async def __call__(self, scope, receive, send):
        limit = self.limit
        if scope["type"] != "http" or not limit:
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    await _error_response(_too_large(limit, int(value)), self.server)(scope, receive, send)
                    return
                break
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # raised in the handler reading the body: its APIError handler answers
                    raise _too_large(limit, None)
            return message

        await self.app(scope, counted, send)


def _error_response(err: APIError, server: OpenAIServer | None = None) -> JSONResponse:
    if server is not None:
        server.metrics.rejected.labels(str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status)


def build_app(engine: AsyncLLM, served_model_name: str, metrics_prefix: str | None = None, *,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> FastAPI:
    """The FastAPI app serving `engine` as `served_model_name`; `app.state.server` is its OpenAIServer.
    Bodies over `max_request_body_bytes` get 413 (0: no limit); /health is 503 once the core has not
    been heard for `heartbeat_timeout` seconds."""
    server = OpenAIServer(engine, served_model_name, metrics_prefix, heartbeat_timeout)
    app = FastAPI(title="graphdecode", docs_url=None, redoc_url=None)
    app.state.server = server
    if max_request_body_bytes:
        app.add_middleware(_BodyLimit, limit=max_request_body_bytes, server=server)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc, server)

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone):
        return Response(status_code=499)  # not sent: the connection is closed

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # unknown route, wrong method
        err = APIError(str(exc.detail), status=exc.status_code,
                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return _error_response(err, server)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        loc = [x for x in (errors[0]["loc"] if errors else ()) if x != "body"]
        param = str(loc[0]) if loc else None
        message = f"{param}: {errors[0]['msg']}" if errors and param else "invalid request"
        return _error_response(APIError(message, param=param), server)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models():
        config = engine.config
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": server.created, "owned_by": "graphdecode",
            "root": str(config.model), "max_model_len": config.max_model_len,
        }]}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        status, body = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        content, media_type = server.metrics.exposition()
        return Response(content, media_type=media_type)

    return app


# ------------------------------------------------------------------ running it
class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before uvicorn shuts down,
    and which shuts down by itself when the engine core dies.

    uvicorn's own handler would close the listening socket at once (new clients: connection
    refused) and re-raise the signal after shutdown (exit status -15); this one keeps
    answering, with 503, until the running requests are done, and exits normally.
    A dead core ends the server at the next tick with `exit_status` 1 (see the module docstring);
    a core that stops beating, and one that beats again, get a line each.
    """

    def __init__(self, config: uvicorn.Config, api: OpenAIServer, shutdown_timeout: float):
        super().__init__(config)
        self.api = api
        self.shutdown_timeout = shutdown_timeout
        self.exit_status = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._silent = False  # the core is past its heartbeat timeout (said once, and once when it is back)

    def check_core(self) -> None:
        """A dead core: one ERROR line with its cause (and the traceback it sent), exit status 1."""
        engine = self.api.engine
        if self.exit_status or not engine.is_dead:
            return
        self.exit_status = 1
        self.should_exit = True
        traceback = f"\nThe engine core's traceback:\n{engine.reported.rstrip()}" if engine.reported else ""
        print(f"ERROR: graphdecode: the engine core died ({engine.death_cause()}); the server exits with status 1 "
              f"so that a supervisor can restart it{traceback}", file=sys.stderr, flush=True)

    async def on_tick(self, counter: int) -> bool:
        self.check_core()
        silent = None if self.exit_status else self.api.unresponsive()
        if (silent is not None) != self._silent:
            self._silent = silent is not None
            print(f"WARNING: graphdecode: {silent}; /health answers 503" if silent else
                  "graphdecode: the engine core is heard from again", file=sys.stderr, flush=True)
        return await super().on_tick(counter)

    async def startup(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame):
        if self.api.draining or not self.started or self._loop is None:  # a second signal, or not serving yet
            self.should_exit = True
            self.force_exit = self.api.draining
            return
        self.api.draining = True
        print(f"graphdecode: signal {sig}: draining (at most {self.shutdown_timeout:g} s); new requests get 503",
              file=sys.stderr, flush=True)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self):
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self):
        try:
            await self.api.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True


def serve(args) -> int:
    """Run the server for parsed, checked `serve` arguments (server/args.py); returns the exit status."""
    model, options = engine_options(args)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                      else DEFAULT_MODEL_NAME)
    engine = AsyncLLM(model, **options)
    try:
        app = build_app(engine, name, args.metrics_prefix, max_request_body_bytes=args.max_request_body_bytes,
                        heartbeat_timeout=args.heartbeat_timeout)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                access_log=not args.no_access_log, timeout_graceful_shutdown=10,
                                timeout_keep_alive=30)
        server = DrainingServer(config, app.state.server, args.shutdown_timeout)
        freeze_startup_heap()  # full collections skip the start-up heap (a 190-220 ms stall of every stream each)
        print(f"graphdecode: serving {name!r} (max_model_len {engine.config.max_model_len}) on "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        server.run()
        server.check_core()  # a core that died while a SIGTERM drained the server: still not a clean exit
    finally:
        engine.shutdown()
    return server.exit_status


def serve_checked(args) -> int:
    """`serve` after every argument is checked (the engine's options by building an EngineConfig,
    before the model loads); a bad one, or a model directory that cannot be built, is one line and
    exit status 2."""
    try:
        check_serve_args(args)
        engine_options(args)
    except (ValueError, TypeError) as e:
        fail(e)
    try:
        return serve(args)
    except ValueError as e:  # the engine could not be built (a broken model directory, ...)
        fail(e)


def main(argv=None) -> int:
    """`python -m graphdecode.server.openai_api ARGS`: the same as `graphdecode serve ARGS`."""
    parser = argparse.ArgumentParser(prog="python -m graphdecode.server.openai_api", description=DESCRIPTION,
                                     formatter_class=HelpFormatter)
    add_serve_args(parser)
    return serve_checked(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
