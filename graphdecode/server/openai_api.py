"""The OpenAI-compatible HTTP server: FastAPI + uvicorn over AsyncLLM, its app and its lifecycle.

    graphdecode serve [--model DIR] [--host 127.0.0.1] [--port 8000] [engine options]
    python -m graphdecode.server.openai_api [same options]

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent
events or not), POST /v1/chat/completions/batch (vLLM's: N conversations, one choice each),
POST /v1/responses and GET /v1/responses/{id} (the Responses API), POST /v1/messages
(Anthropic's Messages API), POST /invocations (vLLM's SageMaker entry: a chat or a completion,
by its body), POST /tokenize and /detokenize (vLLM's), GET /load (vLLM's running-request count), GET
/v1/models, GET /health (and /ping, SageMaker's), GET /metrics (Prometheus), GET /version.

All HTTP, JSON and SSE work happens in this process; the engine core process only
steps (AsyncLLM). A request flows through these modules, top down:

* this one: the app (`build_app`: routes, error handlers, the body limit) and running it
  (`serve`, `run_server`, `DrainingServer`). A body over --max-request-body-bytes is refused with
  413 before it is read (by its Content-Length, or as soon as a chunked body passes the limit).
  With --api-server-count N > 1, api_servers.py runs N such processes over one core. With --api-key,
  auth.py's middleware guards every route but the probes; CORSMiddleware is outermost.
* serving.py: `OpenAIServer`, the steps both endpoints share. A request is parsed (a large
  body in a worker thread), validated, tokenized (long prompts and chat templates in a
  worker thread, so /health and other streams never wait) and handed to
  `AsyncLLM.generate` (the engine's own checks, then the core at once) before its response
  starts, so a bad one is a 400 naming the field and costs the engine nothing. A
  structured-output constraint or tool_choice is checked and compiled in a worker thread
  before the request is sent. A client that goes away has its engine requests aborted.
* completions.py, chat.py: the two endpoints, request -> engine requests -> response. One
  engine request per prompt: n > 1 is one request with SamplingParams(n=...), prefilled once.
* choices.py: what each choice accumulates, for the streamed and the whole responses alike;
  logprobs.py: the logprob formats; responses.py: JSON bodies and SSE streams; tools.py:
  tool calls; protocol.py: the request models; constraints.py: their structured-output fields;
  errors.py: the error bodies. docs/serving.md describes the API.

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
import json
import os
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine_args import HelpFormatter, engine_options, fail
from ..host.gc_heap import freeze_startup_heap
from .args import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_TOOL_CALL_PARSER,
    DESCRIPTION,
    add_serve_args,
    check_serve_args,
)
from .async_llm import AsyncLLM
from .auth import ApiKeyAuth, api_keys
from .chat import create_chat_completion
from .chat_batch import create_batch_chat_completion
from .chat_template import load_chat_template
from .completions import create_completion
from .errors import APIError
from .listen import bind_unix, remove_socket_file
from .lora_modules import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, runtime_updates_allowed
from .messages import anthropic_error, create_message
from .request_id import RequestIdHeaders
from .responses_api import create_response, get_response
from .responses_protocol import ResponseStore
from .serving import ClientGone, OpenAIServer
from .stat_logger import StatLogger
from .tokenize import detokenize, tokenize
from .weight_api import add_weight_routes

__all__ = ["DEFAULT_MODEL_NAME", "DrainingServer", "OpenAIServer", "build_app", "main", "serve", "serve_checked"]

DEFAULT_MODEL_NAME = "graphdecode-default"
MESSAGES_PATH = "/v1/messages"  # Anthropic's API: its own error shape


# ------------------------------------------------------------------ the app
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
                    await _error_response(_too_large(limit, int(value)), self.server, scope.get("path", ""))(
                        scope, receive, send)
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


def _error_response(err: APIError, server: OpenAIServer | None = None, path: str = "") -> JSONResponse:
    """The error in the shape of the API its path belongs to (Anthropic's for /v1/messages, else OpenAI's)."""
    if server is not None:
        server.metrics.rejected.labels(str(err.status)).inc()
    body = anthropic_error(err) if path.startswith(MESSAGES_PATH) else err.body()
    return JSONResponse(body, status_code=err.status)


def build_app(engine: AsyncLLM, served_model_name: str | list[str], metrics_prefix: str | None = None, *,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S, reasoning_parser: str | None = None,
              tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER, return_tokens_as_token_ids: bool = False,
              force_include_usage: bool = False, load_tracking: bool = False,
              api_keys: list[str] | None = None, cors: dict | None = None,
              chat_template: str | None = None, request_id_headers: bool = False, lora_modules=()) -> FastAPI:
    """The FastAPI app serving `engine` as `served_model_name` (or several names: requests may send any, answers
    carry the first); `app.state.server` is its OpenAIServer.
    Bodies over `max_request_body_bytes` get 413 (0: no limit); /health is 503 once the core has not
    been heard for `heartbeat_timeout` seconds; replies are read with `reasoning_parser` (reasoning.py)
    and `tool_call_parser` (tool_parsers.py); chats through `chat_template` (None: the tokenizer's). With
    `api_keys`, every route but the probes needs one (auth.py); `cors`: CORSMiddleware's options
    (allow_origins, ...), outermost, so that a 401 or 413 reaches a browser's script too. `lora_modules`: the
    LoRARequests of the adapters served by name (lora_modules.py)."""
    server = OpenAIServer(engine, served_model_name, metrics_prefix, heartbeat_timeout, reasoning_parser,
                          tool_call_parser, return_tokens_as_token_ids, force_include_usage, chat_template,
                          lora_modules)
    app = FastAPI(title="graphdecode", docs_url=None, redoc_url=None, openapi_url=None)  # (the routes take raw bodies)
    app.state.server = server
    if max_request_body_bytes:
        app.add_middleware(_BodyLimit, limit=max_request_body_bytes, server=server)
    if api_keys:  # added after the body limit: it runs first, so a client without a key learns nothing more
        app.add_middleware(ApiKeyAuth, keys=api_keys,
                           error_response=lambda err, path: _error_response(err, server, path))
    if request_id_headers:  # outside the key check: a 401 carries the id too
        app.add_middleware(RequestIdHeaders)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc, server, request.url.path)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # not sent: the connection is closed

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # unknown route, wrong method
        err = APIError(str(exc.detail), status=exc.status_code,
                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return _error_response(err, server, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        loc = [x for x in (errors[0]["loc"] if errors else ()) if x != "body"]
        param = str(loc[0]) if loc else None
        message = f"{param}: {errors[0]['msg']}" if errors and param else "invalid request"
        return _error_response(APIError(message, param=param), server, request.url.path)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(server, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(server, request)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(request: Request):
        return await create_batch_chat_completion(server, request)

    responses = ResponseStore()  # stored Responses (store: true), for previous_response_id

    @app.post("/v1/responses")
    async def create_responses(request: Request):
        return await create_response(server, responses, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return get_response(responses, response_id)

    @app.post("/invocations")
    async def invocations(request: Request):
        """vLLM's SageMaker entry point: a chat request (it has `messages`) or a completion (`prompt`)."""
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            body = None
        if isinstance(body, dict) and "messages" in body:
            return await create_chat_completion(server, request)
        if isinstance(body, dict) and "prompt" in body:
            return await create_completion(server, request)
        raise APIError("the request body must be a chat request (with messages) or a completion request (with "
                       "prompt)")

    @app.post(MESSAGES_PATH)
    async def messages(request: Request):
        return await create_message(server, request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize(server, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(server, request)

    @app.get("/v1/models")
    async def models():
        config = engine.config
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": server.created, "owned_by": "graphdecode",
            "root": str(config.model), "max_model_len": config.max_model_len,
        } for name in server.model_names] + server.loras.cards(server.created, config.max_model_len)}

    if runtime_updates_allowed():  # vLLM's: only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await server.parse(request, LoadLoRAAdapterRequest)
            server.loras.add(body.lora_name, body.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            body = await server.parse(request, UnloadLoRAAdapterRequest)
            server.loras.remove(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    add_weight_routes(app, server, engine)  # with VLLM_SERVER_DEV_MODE=1

    @app.get("/load")
    async def load():
        """vLLM's: the requests running now, with --enable-server-load-tracking (else 0)."""
        return {"server_load": len(server.metrics.active) if load_tracking else 0}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        status, body = server.health()
        return JSONResponse(body, status_code=status)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's health probe (vLLM's): /health's answer."""
        return await health()

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

    def __init__(self, config: uvicorn.Config, api: OpenAIServer, shutdown_timeout: float,
                 stats: StatLogger | None = None):
        super().__init__(config)
        self.api = api
        self.shutdown_timeout = shutdown_timeout
        self.stats = stats  # the periodic log line (stat_logger.py); None: --disable-log-stats
        self.exit_status = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

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
        if not self.exit_status:
            self.api.unresponsive()  # logs a core that stops beating even while no request asks
            if self.stats is not None:
                for line in self.stats.lines(time.monotonic()):
                    print(f"graphdecode: {line}", file=sys.stderr, flush=True)
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
    """Run the server for parsed, checked `serve` arguments (server/args.py); returns the exit status.
    With --api-server-count N > 1, N API server processes share the port (api_servers.py)."""
    if args.api_server_count > 1:
        from .api_servers import serve_many

        return serve_many(args, run_server)
    model, options = engine_options(args)
    if args.data_parallel_size > 1:
        from .data_parallel import DataParallelLLM

        return run_server(args, DataParallelLLM(model, args.data_parallel_size, **options))
    return run_server(args, AsyncLLM(model, **options))


def run_server(args, engine: AsyncLLM, sockets=None, label: str = "", log_stats: bool = True) -> int:
    """Serve `engine` (this process's client of the core) until SIGTERM or the core's death; shuts the
    client down and returns the exit status. `sockets`: already bound (one of several API servers);
    `log_stats`: this server logs what concerns the one core (its KV capacity at start-up, the periodic
    stats line): one of several API servers does."""
    names = args.served_model_name or [os.path.basename(os.path.normpath(args.model)) if args.model
                                       else DEFAULT_MODEL_NAME]
    name = names[0]
    own = None  # a --uds socket bound here (one of several API servers: the parent's)
    try:
        if args.uds and sockets is None:
            sockets = [own := bind_unix(args.uds)]
        keys = api_keys(args.api_key)
        app = build_app(engine, names, args.metrics_prefix, max_request_body_bytes=args.max_request_body_bytes,
                        heartbeat_timeout=args.heartbeat_timeout, reasoning_parser=args.reasoning_parser,
                        tool_call_parser=args.tool_call_parser,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        force_include_usage=args.enable_force_include_usage,
                        load_tracking=args.enable_server_load_tracking, api_keys=keys,
                        chat_template=load_chat_template(args.chat_template),
                        request_id_headers=args.enable_request_id_headers, lora_modules=args.lora_modules or (),
                        cors=dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                                  allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials))
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                access_log=not args.no_access_log, timeout_graceful_shutdown=10,
                                timeout_keep_alive=30, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
        stats = None if args.disable_log_stats or not log_stats else StatLogger(
            engine, args.log_stats_interval, time.monotonic())
        server = DrainingServer(config, app.state.server, args.shutdown_timeout, stats)
        freeze_startup_heap()  # full collections skip the start-up heap (a 190-220 ms stall of every stream each)
        guarded = f"; an API key is needed ({len(keys)} accepted)" if keys else ""
        scheme = "https" if args.ssl_certfile else "http"
        where = f"unix:{args.uds} ({scheme}://localhost/v1 through it)" if args.uds else \
            f"{scheme}://{args.host}:{args.port}/v1"
        print(f"graphdecode: {label}serving {name!r} (max_model_len {engine.config.max_model_len}) on "
              f"{where}{guarded}", file=sys.stderr, flush=True)
        if log_stats:
            print(f"graphdecode: {kv_capacity(engine.config)}", file=sys.stderr, flush=True)
        server.run(sockets=sockets)
        server.check_core()  # a core that died while a SIGTERM drained the server: still not a clean exit
    finally:
        engine.shutdown()
        if own is not None:
            own.close()
            remove_socket_file(args.uds)
    return server.exit_status


def kv_capacity(config) -> str:
    """What the KV pool holds, as vLLM says it at start-up: tokens, and sequences of max_model_len at once."""
    tokens = (config.num_pages - 1) * config.page_size  # page 0 is the scratch page
    return (f"KV cache: {tokens:,} tokens ({config.num_pages - 1:,} pages of {config.page_size}); maximum "
            f"concurrency for {config.max_model_len:,} tokens per request: {tokens / config.max_model_len:.2f}x "
            f"(rows: {config.max_batch_size})")


def serve_checked(args) -> int:
    """`serve` after every argument is checked (the engine's options by building an EngineConfig,
    before the model loads); a bad one, or a model directory that cannot be built, is one line and
    exit status 2."""
    try:
        check_serve_args(args)
        model, given = engine_options(args)
        if args.data_parallel_size > 1 and (args.api_server_count > 1 or args.headless):
            raise ValueError(f"--data-parallel-size {args.data_parallel_size}: one API server in front of the "
                             f"replicas (not with --api-server-count > 1 or --headless); or run each replica as a "
                             f"server of its own behind a router")
        if given.get("node_rank", 0) and not args.headless:
            raise ValueError(f"--node-rank {given['node_rank']}: the server runs on node 0; the other nodes run "
                             f"`graphdecode serve MODEL --headless`")
    except (ValueError, TypeError) as e:
        fail(e)
    try:
        if args.headless:  # this node's tensor-parallel ranks only: no server, no engine
            from ..config import EngineConfig
            from ..device.tp_headless import run_headless

            return run_headless(EngineConfig(model=model, **given))
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
