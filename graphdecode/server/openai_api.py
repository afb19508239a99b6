"""The OpenAI-compatible HTTP server: FastAPI + uvicorn over AsyncLLM.

    graphdecode serve [--model DIR] [--host 127.0.0.1] [--port 8000] [engine options]
    python -m graphdecode.server.openai_api [same options]

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent
events or not), GET /v1/models, GET /health, GET /metrics (Prometheus).

All HTTP, JSON and SSE work happens in this process; the engine core process only
steps (AsyncLLM). A request is parsed, validated, tokenized and handed to
`AsyncLLM.generate` (which runs the engine's own checks, then sends it to the core at
once) before its response starts, so a bad one is a 400 naming the field and costs the
engine nothing. One engine request per prompt: n > 1 is one request with
SamplingParams(n=...), prefilled once. SSE chunks are plain dicts through json.dumps.
A client that goes away mid-stream has its engine iterator closed, which aborts its
request and frees its pages.

SIGTERM (or Ctrl+C): new requests get 503 and /health turns 503, running requests
finish (at most --shutdown-timeout seconds, then they are aborted), uvicorn closes,
the core process is shut down, exit status 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
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
from starlette.responses import StreamingResponse

from ..runtime.gc_heap import freeze_startup_heap
from ..sampling_params import SamplingParams
from .async_llm import AsyncLLM, EngineDeadError
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    model_not_found,
    param_of,
    unavailable,
    validation_error,
)

DEFAULT_MODEL_NAME = "graphdecode-default"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
    """What a non-streamed choice accumulates."""

    __slots__ = ("text", "num_tokens", "logprobs", "finish_reason", "stop_reason")

    def __init__(self, text: str = ""):
        self.text = [text] if text else []
        self.num_tokens = 0
        self.logprobs: list | None = None
        self.finish_reason = None
        self.stop_reason = None


class OpenAIServer:
    """Request handling, independent of the web framework's routing (see build_app)."""

    def __init__(self, engine: AsyncLLM, served_model_name: str):
        self.engine = engine
        self.model_name = served_model_name
        self.model_json = json.dumps(served_model_name)
        self.metrics = ServerMetrics(engine)
        self.draining = False
        self.created = int(time.time())
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.config.max_model_len

    # ------------------------------------------------------------- checks
    def health(self) -> tuple[int, str]:
        if self.engine.dead is not None or self.engine._process.poll() is not None:
            return 503, "dead"
        if self.draining:
            return 503, "draining"
        return 200, "ok"

    def _check_ready(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.engine.dead is not None:
            raise unavailable("the engine is not running")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name)

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                      max_tokens_param: str) -> None:
        """vLLM's rule: the prompt, and the prompt plus max_tokens when given, fit in max_model_len."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room to generate.", param=prompt_param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the length of the prompt or {max_tokens_param}.", param=max_tokens_param)

    def _start(self, prompt: dict, params: SamplingParams, request_id: str, renames: dict):
        """AsyncLLM.generate: validates (a 400 by name) and sends the request to the core now."""
        try:
            return self.engine.generate(prompt, params, request_id=request_id)
        except EngineDeadError:
            raise unavailable("the engine is not running") from None
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc), param=param_of(str(exc), renames)) from None

    @staticmethod
    async def _parse(request: Request, model):
        body = await request.body()
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from None

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
        elif isinstance(exc, ValueError):
            err = APIError(str(exc), param=param_of(str(exc)))
        else:
            err = APIError(f"{type(exc).__name__}: {exc}", status=500, type="server_error")
        return b"data: " + _dumps(err.body()).encode() + b"\n\n"

    @staticmethod
    async def _until_disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _unless_client_leaves(self, request: Request, work) -> Response:
        """Run a non-streamed request; if the client disconnects first, cancel it (aborting its requests)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(self._until_disconnected(request))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        if task.cancelled():
            return Response(status_code=499)  # nobody is listening
        return task.result()

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    # ------------------------------------------------------------- /v1/completions
    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_ready()
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        self._check_model(req.model)
        params = req.sampling_params()
        try:
            parsed = self.engine.inputs.tokenize_all(req.prompts())
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc), param="prompt") from None
        for text, ids in parsed:
            self._check_length(len(ids), params.max_tokens, "prompt", "max_tokens")
        rid = f"cmpl-{uuid.uuid4().hex}"
        renames = {"max_tokens": "max_tokens", "logprobs": "logprobs"}
        streams = []
        try:
            for i, (text, ids) in enumerate(parsed):
                prompt = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
                streams.append((f"{rid}-{i}", self._start(prompt, params, f"{rid}-{i}", renames)))
        except BaseException:
            for _, stream in streams:  # the prompts before the bad one were sent to the core already
                stream.cancel()
            raise
        prompt_lens = [len(ids) for _, ids in parsed]
        echo = None
        if req.echo:
            echo = [text if text is not None else self.tokenizer.decode(ids) for text, ids in parsed]
        created = int(time.time())
        if req.stream:
            body = self._stream_completion(rid, created, streams, arrival, prompt_lens, params, echo,
                                           req.include_usage)
            return _SSEResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)
        return await self._unless_client_leaves(
            request, self._full_completion(rid, created, streams, arrival, prompt_lens, params, echo))

    def _completion_logprobs(self, c, offset: int) -> tuple[dict, int]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(c.token_ids, c.logprobs):
            sampled = entry.get(token_id)
            piece = _piece(sampled, token_id)
            tokens.append(piece)
            token_logprobs.append(_finite(sampled.logprob) if sampled is not None else None)
            top.append({_piece(lp, tid): _finite(lp.logprob) for tid, lp in entry.items()})
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset

    async def _stream_completion(self, rid, created, streams, arrival, prompt_lens, params, echo, include_usage):
        head = (f'data: {{"id":"{rid}","object":"text_completion","created":{created},'
                f'"model":{self.model_json},"choices":[').encode()
        n = params.n
        want_logprobs = params.logprobs is not None
        completion_tokens = 0
        offsets: dict[int, int] = {}
        echoed: set[int] = set()
        try:
            async for p, out in self._outputs(streams, arrival, prompt_lens):
                for c in out.outputs:
                    index = p * n + c.index
                    completion_tokens += len(c.token_ids)
                    text = c.text
                    if echo is not None and index not in echoed:
                        echoed.add(index)
                        text = echo[p] + text
                    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    # (a chunk is sent for new tokens whose text is held back, with text "", as vLLM does)
                    if want_logprobs and c.token_ids:
                        choice["logprobs"], offsets[index] = self._completion_logprobs(c, offsets.get(index, 0))
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield head + _dumps(choice).encode() + b"]}\n\n"
            if include_usage:
                usage = self._usage(sum(prompt_lens), completion_tokens)
                yield head + b'],"usage":' + _dumps(usage).encode() + b"}\n\n"
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
            yield self._error_event(exc)
        yield _DONE

    async def _full_completion(self, rid, created, streams, arrival, prompt_lens, params, echo) -> Response:
        n = params.n
        choices = {}
        offsets: dict[int, int] = {}
        for p in range(len(streams)):
            for i in range(n):
                choices[p * n + i] = _Choice(echo[p] if echo is not None else "")
        want_logprobs = params.logprobs is not None
        try:
            async for p, out in self._outputs(streams, arrival, prompt_lens):
                for c in out.outputs:
                    index = p * n + c.index
                    choice = choices[index]
                    if c.text:
                        choice.text.append(c.text)
                    choice.num_tokens += len(c.token_ids)
                    if want_logprobs and c.token_ids:
                        part, offsets[index] = self._completion_logprobs(c, offsets.get(index, 0))
                        if choice.logprobs is None:
                            choice.logprobs = part
                        else:
                            for key, values in part.items():
                                choice.logprobs[key].extend(values)
                    if c.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        except EngineDeadError:
            raise unavailable("the engine stopped while this request ran") from None
        except ValueError as exc:
            raise APIError(str(exc), param=param_of(str(exc))) from None
        body = {
            "id": rid, "object": "text_completion", "created": created, "model": self.model_name,
            "choices": [
                {"index": index, "text": "".join(c.text),
                 "logprobs": (c.logprobs or _EMPTY_COMPLETION_LOGPROBS) if want_logprobs else None,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for index, c in sorted(choices.items())
            ],
            "usage": self._usage(sum(prompt_lens), sum(c.num_tokens for c in choices.values())),
        }
        return Response(_dumps(body), media_type="application/json")

    # ------------------------------------------------------------- /v1/chat/completions
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_ready()
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._check_model(req.model)
        conversation = req.conversation()
        text, ids = self._render_chat(req, conversation)
        max_tokens = req.requested_max_tokens()
        self._check_length(len(ids), max_tokens, "messages", req.max_tokens_param)
        params = req.sampling_params(max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        renames = {"max_tokens": req.max_tokens_param, "logprobs": "top_logprobs", "prompt": "messages"}
        streams = [(rid, self._start({"prompt": text, "prompt_token_ids": ids}, params, rid, renames))]
        created = int(time.time())
        if req.stream:
            body = self._stream_chat(rid, created, streams, arrival, len(ids), params, req.include_usage)
            return _SSEResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)
        return await self._unless_client_leaves(
            request, self._full_chat(rid, created, streams, arrival, len(ids), params))

    def _render_chat(self, req: ChatCompletionRequest, conversation: list[dict]) -> tuple[str, list[int]]:
        """The conversation through the chat template, tokenized as LLM.chat does."""
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; use /v1/completions", param="messages")
        kwargs = dict(req.chat_template_kwargs or {})
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

    def _chat_logprobs(self, c, top_n: int) -> list[dict]:
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs):
            sampled = entry.get(token_id)
            piece = _piece(sampled, token_id)
            top = sorted((lp.rank, tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top_n)
            content.append({
                "token": piece,
                "logprob": _finite(sampled.logprob) if sampled is not None else -9999.0,
                "bytes": list(piece.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {"token": (t := _piece(lp, tid)), "logprob": _finite(lp.logprob),
                     "bytes": list(t.encode("utf-8", errors="replace"))}
                    for _, tid, lp in top
                ],
            })
        return content

    async def _stream_chat(self, rid, created, streams, arrival, num_prompt_tokens, params, include_usage):
        head = (f'data: {{"id":"{rid}","object":"chat.completion.chunk","created":{created},'
                f'"model":{self.model_json},"choices":[').encode()
        want_logprobs = params.logprobs is not None
        completion_tokens = 0
        try:
            for i in range(params.n):  # OpenAI's first chunk of a choice carries the role
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield head + _dumps(first).encode() + b"]}\n\n"
            async for _, out in self._outputs(streams, arrival, [num_prompt_tokens]):
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    choice = {"index": c.index, "delta": {"content": c.text}, "logprobs": None,
                              "finish_reason": c.finish_reason}
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    if want_logprobs and c.token_ids:
                        choice["logprobs"] = {"content": self._chat_logprobs(c, params.logprobs)}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield head + _dumps(choice).encode() + b"]}\n\n"
            if include_usage:
                usage = self._usage(num_prompt_tokens, completion_tokens)
                yield head + b'],"usage":' + _dumps(usage).encode() + b"}\n\n"
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
            yield self._error_event(exc)
        yield _DONE

    async def _full_chat(self, rid, created, streams, arrival, num_prompt_tokens, params) -> Response:
        choices = {i: _Choice() for i in range(params.n)}
        want_logprobs = params.logprobs is not None
        try:
            async for _, out in self._outputs(streams, arrival, [num_prompt_tokens]):
                for c in out.outputs:
                    choice = choices[c.index]
                    if c.text:
                        choice.text.append(c.text)
                    choice.num_tokens += len(c.token_ids)
                    if want_logprobs and c.token_ids:
                        choice.logprobs = (choice.logprobs or []) + self._chat_logprobs(c, params.logprobs)
                    if c.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        except EngineDeadError:
            raise unavailable("the engine stopped while this request ran") from None
        except ValueError as exc:
            raise APIError(str(exc), param=param_of(str(exc), {"prompt": "messages"})) from None
        body = {
            "id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
            "choices": [
                {"index": index, "message": {"role": "assistant", "content": "".join(c.text)},
                 "logprobs": {"content": c.logprobs or []} if want_logprobs else None,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for index, c in sorted(choices.items())
            ],
            "usage": self._usage(num_prompt_tokens, sum(c.num_tokens for c in choices.values())),
        }
        return Response(_dumps(body), media_type="application/json")

    # ------------------------------------------------------------- lifecycle
    async def drain(self, timeout: float) -> None:
        """Wait for the running requests (at most `timeout` s), then abort what is left."""
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


_EMPTY_COMPLETION_LOGPROBS = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _piece(lp, token_id: int) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"


def _error_response(err: APIError, server: OpenAIServer | None = None) -> JSONResponse:
    if server is not None:
        server.metrics.rejected.labels(str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status)


def build_app(engine: AsyncLLM, served_model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` as `served_model_name`; `app.state.server` is its OpenAIServer."""
    server = OpenAIServer(engine, served_model_name)
    app = FastAPI(title="graphdecode", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc, server)

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

    @app.get("/health")
    async def health():
        status, text = server.health()
        return JSONResponse({"status": text}, status_code=status)

    @app.get("/metrics")
    async def metrics():
        content, media_type = server.metrics.exposition()
        return Response(content, media_type=media_type)

    return app


# ------------------------------------------------------------------ running it
class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before uvicorn shuts down.

    uvicorn's own handler would close the listening socket at once (new clients: connection
    refused) and re-raise the signal after shutdown (exit status -15); this one keeps
    answering, with 503, until the running requests are done, and exits normally.
    """

    def __init__(self, config: uvicorn.Config, api: OpenAIServer, shutdown_timeout: float):
        super().__init__(config)
        self.api = api
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

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
    """Run the server for parsed `graphdecode serve` arguments (see cli.py); returns the exit status."""
    from ..cli import _engine_options

    model, options = _engine_options(args)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                      else DEFAULT_MODEL_NAME)
    engine = AsyncLLM(model, **options)
    try:
        app = build_app(engine, name)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                access_log=not args.no_access_log, timeout_graceful_shutdown=10,
                                timeout_keep_alive=30)
        server = DrainingServer(config, app.state.server, args.shutdown_timeout)
        freeze_startup_heap()  # full collections skip the start-up heap (a 190-220 ms stall of every stream each)
        print(f"graphdecode: serving {name!r} (max_model_len {engine.config.max_model_len}) on "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        server.run()
    finally:
        engine.shutdown()
    return 0


def main(argv=None) -> int:
    from ..cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
