"""The steps every request to the server takes, whichever endpoint it came to: OpenAIServer
(the served engine and the server's own state) and Job (one HTTP request's engine requests).

A request is refused early while the server drains, the core is dead or has not been heard
for --heartbeat-timeout seconds (`check_ready`); its body is parsed (in a worker thread when
large, see `off_loop`), its model name and context length checked, its structured-output
constraint compiled in a worker thread (`constrain`: stopped when the client leaves), and its
engine requests started (`start`: AsyncLLM.generate runs the engine's checks, a 400 naming the
field). `outputs` then merges the deltas of a job's engine requests, keeping the metrics, and
`outputs_error` turns what they raise into the API's errors. A non-streamed response is built
while the client is watched (`unless_client_leaves`): one that leaves cancels it, which aborts
its engine requests. `drain` is the SIGTERM path: running requests finish, then are aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ..sampling_params import SamplingParams
from ..structured.compile_worker import CompileCancelled
from .args import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_TOOL_CALL_PARSER
from .async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from .call_formats import format_for
from .choices import Choices
from .constraints import ConstraintSource, build_constraint, constraint_error
from .errors import (
    APIError,
    lone_surrogate_error,
    model_not_found,
    param_of,
    request_failed,
    unavailable,
    validation_error,
)
from .logprobs import LogprobFormat
from .lora_modules import LoRAModules
from .metrics import ServerMetrics
from .reasoning import check_reasoning_parser
from .tool_parsers import tool_parser

# Work done on the event loop only up to these sizes, a few ms at most on a slow core (a worker thread
# above them; its hop costs ~0.1 ms): JSON token-id lists parse at ~15 MB/s, text tokenizes at ~3 KB/ms,
# echo offsets take ~4 us per token.
INLINE_BODY = 64 << 10  # body bytes parsed inline
INLINE_CHARS = 4096  # prompt characters or ids (all prompts, or all message contents) tokenized inline
INLINE_TOKENS = 1024  # prompt tokens echoed (decoded, offsets found) inline
_log = logging.getLogger("uvicorn.error")  # uvicorn's own lines ("INFO: ..."), at --log-level


class ClientGone(Exception):
    """The client left before its request body was read in full: there is no one to answer."""


async def off_loop(work: int, limit: int, fn, *args):
    """fn(*args), in a worker thread when `work` exceeds `limit`, so the event loop keeps serving."""
    if work > limit:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def outputs_error(exc: Exception, renames: dict[str, str] | None = None) -> APIError:
    """The API error for what a running request's outputs raised: 503 (the core died), 500 (the
    core failed this request), 400 naming the field (a ValueError), else a 500 `server_error`."""
    if isinstance(exc, EngineDeadError):
        return unavailable("the engine stopped while this request ran")
    if isinstance(exc, RequestFailedError):
        return request_failed(str(exc))
    if isinstance(exc, ValueError):
        return APIError(str(exc), param=param_of(str(exc), renames))
    return APIError(f"{type(exc).__name__}: {exc}", status=500, type="server_error")


class Job:
    """One HTTP request's engine requests (one per prompt), and what its response needs besides
    their outputs. The endpoint sets the fields that only it has (echo_only, role, tools)."""

    __slots__ = ("rid", "created", "streams", "arrival", "prompt_ids", "prompt_lens", "n", "max_tokens", "logprobs",
                 "token_ids", "include_usage", "continuous", "echo", "echo_only", "prompt_logprobs", "role",
                 "tool_mode", "tool_name", "tool_parser", "functions", "reasoning", "reasoning_opened", "model",
                 "model_json")

    def __init__(self, rid: str, streams: list, arrival: float, prompt_ids: list[list[int]], params: SamplingParams,
                 req, echo, tokenizer, as_ids: bool = False, force_usage: bool = False):
        """as_ids, force_usage: the server's --return-tokens-as-token-ids and --enable-force-include-usage."""
        self.rid, self.created, self.streams, self.arrival = rid, int(time.time()), streams, arrival
        self.prompt_ids = prompt_ids
        self.prompt_lens = [len(ids) for ids in prompt_ids]
        self.n = params.n
        self.max_tokens = params.max_tokens  # None: up to the context's end
        # None: no logprobs asked for; tokens as "token_id:123" with return_tokens_as_token_ids (vLLM's)
        self.logprobs = (LogprobFormat(params.logprobs, bool(req.return_tokens_as_token_ids or as_ids), tokenizer)
                         if params.logprobs is not None else None)
        self.token_ids = bool(req.return_token_ids)
        self.include_usage = req.include_usage or (force_usage and bool(req.stream))
        self.continuous = req.continuous_usage
        self.echo = echo  # completions: per prompt (text, token offsets) or None; chat: the echoed content
        self.echo_only = False  # completions: echo with max_tokens 0
        self.prompt_logprobs = False  # the response carries prompt_logprobs
        self.role = "assistant"  # chat: the reply's role
        self.tool_mode = None  # chat: None, "auto", "required" or "named" (ChatCompletionRequest.tool_mode)
        self.tool_name = None  # chat, "named": the function called
        self.tool_parser = "hermes"  # chat, "auto": the format the answer's calls are read in (--tool-call-parser)
        self.functions = None  # chat: the request's checked tool definitions
        self.reasoning = None  # the reasoning parser's name (--reasoning-parser), or None
        self.reasoning_opened = False  # the prompt ends inside a reasoning block the template opened


class OpenAIServer:
    """The served engine and the server's state (draining, metrics, the model's name and limits),
    with the request steps both endpoints share. Independent of the web framework's routing
    (openai_api.build_app); the endpoints are completions.py and chat.py."""

    def __init__(self, engine: AsyncLLM, served_model_name: str | list[str], metrics_prefix: str | None = None,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S, reasoning_parser: str | None = None,
                 tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER, return_tokens_as_token_ids: bool = False,
                 force_include_usage: bool = False, chat_template: str | None = None, lora_modules=()):
        self.engine = engine
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # every logprob token as "token_id:N"
        self.force_include_usage = force_include_usage  # every stream ends with its usage
        self.reasoning_parser = check_reasoning_parser(reasoning_parser)  # None: no reasoning separated
        self.tool_call_parser = tool_call_parser  # how tool_choice "auto" reads calls out of the answer
        calls = tool_parser(tool_call_parser, None)  # (checks the name)
        self.tool_markers_special = calls.special_markers
        self.heartbeat_timeout = heartbeat_timeout  # seconds without a beat from the core: unresponsive
        self._silent = False  # the core was last seen past its heartbeat timeout (logged at each change)
        # every name a request may send (vLLM's --served-model-name A B ...); the first is the one answers carry
        self.model_names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
        self.model_name = self.model_names[0]
        self.model_json = json.dumps(self.model_name)  # as it goes into each streamed chunk
        self.metrics = ServerMetrics(engine, self.model_name, metrics_prefix)
        self.draining = False
        self.created = int(time.time())
        self.tokenizer = engine.get_tokenizer()
        self.chat_template = chat_template  # --chat-template's text (chat_template.py); None: the tokenizer's
        # the format "auto" calls are constrained in (call_formats.py)
        self.tool_calls_constrained = format_for(getattr(calls, "constrained", None), self.tokenizer)
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.config.model_config.vocab_size
        # what a request's missing sampling fields become (generation_defaults.py): the model's recommendations
        self.sampling_defaults = engine.config.sampling_defaults
        self.prefix_caching = bool(engine.config.enable_prefix_caching)  # usage reports prompt_tokens_details
        # LoRA adapters served by name (--lora-modules; lora_modules.py), each checked against the model now
        self.loras = LoRAModules(engine, list(lora_modules), self.model_names)

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
        """Why the core counts as unresponsive (no beat for longer than the heartbeat timeout), or None.
        A change either way gets one line on stderr, so the log says it before any answer that depends on it."""
        age = self.engine.heartbeat_age
        silent = None if age <= self.heartbeat_timeout else (
            f"the engine core has not answered for {age:.1f} s (--heartbeat-timeout "
            f"{self.heartbeat_timeout:g} s): it is stopped, frozen or starved")
        if (silent is not None) != self._silent:  # whoever sees the change first logs it, before answering
            self._silent = silent is not None
            print(f"WARNING: graphdecode: {silent}; /health answers 503" if silent else
                  "graphdecode: the engine core is heard from again", file=sys.stderr, flush=True)
        return silent

    def check_ready(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.engine.is_dead:
            raise unavailable("the engine is not running")
        silent = self.unresponsive()
        if silent is not None:
            raise unavailable(silent)

    def check_model(self, name: str | None):
        """The LoRARequest of an adapter's name, None for the base model's (or no name); 404 for another."""
        if name is None or name in self.model_names:
            return None
        lora = self.loras.by_name.get(name)
        if lora is None:
            raise model_not_found(name)
        return lora

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
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

    # ------------------------------------------------------------- the request, into the engine
    @staticmethod
    async def parse(request: Request, model):
        """The request's body as `model` (a pydantic request class); a 400 naming the field."""
        try:
            body = await request.body()
        except ClientDisconnect:  # hung up while sending its body: one line, nothing to answer
            client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
            _log.info("%s hung up while sending its %s %s body; nothing answered", client, request.method,
                      request.url.path)
            raise ClientGone from None
        try:
            return await off_loop(len(body), INLINE_BODY, model.model_validate_json, body)
        except ValidationError as exc:
            surrogate = await off_loop(len(body), INLINE_BODY, lone_surrogate_error, exc, body)
            raise (surrogate or validation_error(exc)) from None

    async def constrain(self, request: Request, req, params: SamplingParams, renames: dict) -> None:
        """The request's structured-output constraint (response_format, structured_outputs, guided_*,
        tool_choice) checked and compiled for this model in a worker thread (0.1-3 s the first time;
        the event loop keeps serving), then set on `params`; AsyncLLM.generate finds it compiled in the
        engine's cache. A bad one is a 400 naming the field the client sent."""
        if getattr(req, "builds_regex", False):  # schemas turned into a regex here: a worker thread's work
            source = await asyncio.to_thread(req.constraint_source)
        else:
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

    def start(self, prompt: dict, params: SamplingParams, request_id: str, renames: dict, priority: int = 0,
              lora_request=None):
        """AsyncLLM.generate: validates (a 400 by name) and sends the request to the core now."""
        try:
            return self.engine.generate(prompt, params, request_id=request_id, priority=priority,
                                        lora_request=lora_request)
        except EngineDeadError:
            raise unavailable("the engine is not running") from None
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc), param=param_of(str(exc), renames)) from None

    def job(self, rid: str, streams: list, arrival: float, prompt_ids: list[list[int]], params: SamplingParams,
            req, echo, lora=None) -> Job:
        """The Job of a request this server started (its own defaults applied); its answers name `lora`'s adapter
        (vLLM's) or the served model."""
        job = Job(rid, streams, arrival, prompt_ids, params, req, echo, self.tokenizer,
                  self.return_tokens_as_token_ids, self.force_include_usage)
        if lora is not None:
            job.model, job.model_json = lora.lora_name, json.dumps(lora.lora_name)
        else:
            job.model, job.model_json = self.model_name, self.model_json
        return job

    # ------------------------------------------------------------- its outputs
    async def outputs(self, job: Job) -> AsyncIterator:
        """(prompt index, RequestOutput delta) of every engine request of `job`, metrics kept on the way.

        Closing this iterator (or cancelling its consumer) closes the engine iterators,
        which aborts their unfinished requests.
        """
        streams = job.streams
        trackers = [self.metrics.track(rid, n, job.arrival, job.n, (self.max_model_len - n) if job.max_tokens is None
                                       else job.max_tokens) for (rid, _), n in zip(streams, job.prompt_lens)]
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

    async def collect(self, job: Job, renames: dict[str, str] | None = None) -> Choices:
        """Every output of `job` folded into its choices, kept whole (a non-streamed response); what the
        outputs raise becomes the API's error (outputs_error)."""
        choices = Choices(job, self.prefix_caching, keep=True)
        try:
            async for p, out in self.outputs(job):
                choices.fold(p, out)
        except (EngineDeadError, RequestFailedError, ValueError) as exc:
            raise outputs_error(exc, renames) from None
        return choices

    # ------------------------------------------------------------- the client
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

    async def unless_client_leaves(self, request: Request, work) -> Response:
        """Run a non-streamed request; if the client disconnects first, cancel it (aborting its requests)."""
        task = asyncio.ensure_future(work)
        await self._until_done_or_gone(request, task, task.cancel)
        if task.cancelled():
            return Response(status_code=499)  # nobody is listening
        return task.result()

    # ------------------------------------------------------------- shutting down
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
