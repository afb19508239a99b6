"""AsyncLLM: the engine for asyncio servers, with its core in its own process.

    engine = AsyncLLM(model, **engine_args)            # same arguments as LLM
    async for out in engine.generate(prompt, params, request_id="r1"):
        ...                                            # RequestOutput deltas, the last one finished
    await engine.abort("r1")
    engine.shutdown()

The engine core (server/engine_core.py) runs the step loop in a spawned process; this
side tokenizes and validates prompts (the core sent its EngineConfig, so the checks are
the engine's own, done before any work, raising ValueError/TypeError by name), sends
requests down one pipe, and a reader thread hands each step's deltas to the asyncio
queue of the request they belong to. Cancelling a consumer (task cancelled, client
gone, `aclose()`) aborts its request, which frees its row and pages in the core.
`load` holds the core's latest gauges (running, waiting, ...), for metrics.

The core beats every second, idle or busy (args.HEARTBEAT_INTERVAL_S); the reader
notes when it last heard anything: `heartbeat_age` is the seconds since, which a server
compares with its limit (a stopped or frozen core stops beating), and `step_seconds` how
long the core's step in progress had run at its latest beat. `is_dead` turns true once the
core reported a failure or its process exited; `death_cause()` says how it died.

A request goes to the core when `generate` is called inside a running event loop, not
when its stream is first read: a server answering a burst of requests hands each one to
the core as soon as it is validated, instead of after every other handler of the burst
has run (at 256 clients the first request reaches the core ~80 ms sooner: BENCHMARKS.md).
A sender thread writes
what is queued for the core as one message per wake-up, so a burst costs a few pickles
and pipe writes rather than one per request.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref

import torch

from ..config import EngineConfig
from ..engine_args import engine_kwargs
from ..host.engine import load_tokenizer
from ..host.inputs import InputProcessor
from ..host.scheduler import group_pages
from ..host.weight_updates import WeightUpdate, check_version
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .weight_sync import PAUSE_MODES

START_TIMEOUT_S = 600.0  # model load + graph capture on a cold machine


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine core failed this one request (not a bad request: an error inside the engine,
    logged by the core); the core goes on serving the others."""


def _send_requests(outbox: queue.SimpleQueue, pipe, engine_ref) -> None:
    """Sender thread: writes queued messages to the core's pipe, in order, until None (shutdown).

    Each write is the list of everything queued by then (the core takes them in order).
    It holds the AsyncLLM only weakly, so dropping the engine still shuts the core down.
    """
    while True:
        batch = [outbox.get()]
        while batch[-1] is not None:
            try:
                batch.append(outbox.get_nowait())
            except queue.Empty:
                break
        stop = batch[-1] is None
        if stop:
            batch.pop()
        try:
            if batch:
                pipe.send(batch)
        except (OSError, ValueError) as exc:  # the core closed its end: it died (the reader reports it too)
            engine = engine_ref()
            if engine is not None and not engine._closed:
                engine.dead = engine.dead or f"the engine core process exited ({exc})"
            return
        if stop:
            return


def _read_outputs(pipe, engine_ref) -> None:
    """Reader thread: notes when the core was last heard, and hands every message but a beat to the
    engine's event loop, until the core fails or its pipe closes. Runs from start-up, so beats are
    read while no request has bound a loop yet. It holds the AsyncLLM only while it handles a
    message, so dropping the engine still shuts the core down."""
    while True:
        try:
            message, heard = pipe.recv(), True
        except (EOFError, OSError):
            message, heard = ("failed", "the engine core process exited"), False
        engine = engine_ref()
        if engine is None or not engine._take(message, heard):
            return
        del engine


class RequestStream:
    """The deltas of one request, as an async iterator (what `AsyncLLM.generate` returns).

    Cancelling the task that reads it, `aclose()`, or dropping it unfinished aborts the
    request. The last delta has finished=True; after it the iteration stops.
    """

    __slots__ = ("request_id", "_engine", "_queue", "_message", "_state", "__weakref__")

    def __init__(self, engine: AsyncLLM, request_id: str, message: tuple):
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue | None = None
        self._message = message
        self._state = "new"  # new -> running -> done

    def _start(self) -> None:
        engine = self._engine
        engine._start_reader()
        if self.request_id in engine._queues:
            raise ValueError(f"request_id: {self.request_id!r} is already in use")
        self._queue = asyncio.Queue()
        engine._queues[self.request_id] = self._queue
        self._state = "running"
        engine._send(self._message)

    def _end(self, abort: bool) -> None:
        was_running, self._state = self._state == "running", "done"
        if not was_running:
            return
        engine = self._engine
        engine._queues.pop(self.request_id, None)
        if abort and engine.dead is None and not engine._closed:
            engine._send(("abort", self.request_id))

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._state == "new":
            self._start()
        if self._state == "done":
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self._end(abort=True)
            raise
        if isinstance(item, Exception):
            self._end(abort=True)
            raise item
        if item.finished:
            self._end(abort=False)
        return item

    def cancel(self) -> None:
        """Abort the request if it is unfinished; the iteration stops."""
        self._end(abort=True)

    async def aclose(self) -> None:
        """Stop reading; an unfinished request is aborted."""
        self._end(abort=True)

    def __del__(self):
        if getattr(self, "_state", "done") == "running":
            self._end(abort=True)


def start_engine_core(model: str, engine_args: dict, clients: int, env: dict | None = None):
    """Start the engine core process for `clients` API servers and send it "init": (its Popen, [per
    client (requests, outputs): the client's ends of its two pipes]). Each client waits for "ready".
    env: the process's environment (None: this one's)."""
    ends, fds = [], []
    for _ in range(clients):
        core_requests, requests = multiprocessing.Pipe(duplex=False)
        outputs, core_outputs = multiprocessing.Pipe(duplex=False)
        ends.append((requests, outputs, core_requests, core_outputs))
        fds += [core_requests.fileno(), core_outputs.fileno()]
    process = subprocess.Popen([sys.executable, "-m", "graphdecode.server.engine_core", *map(str, fds)],
                               pass_fds=fds, env=env)
    for _, _, core_requests, core_outputs in ends:
        core_requests.close()
        core_outputs.close()
    ends[0][0].send(("init", model, engine_args))
    return process, [(requests, outputs) for requests, outputs, _, _ in ends]


class AsyncLLM:
    def __init__(self, model: str | None = None, **engine_args):
        engine_args = engine_kwargs("AsyncLLM", engine_args)
        if model is None:
            from ..default_model import default_model_dir

            model = default_model_dir()
        process, [(self._requests, self._outputs)] = start_engine_core(str(model), engine_args, 1)
        self._attach(process)

    @classmethod
    def attached(cls, requests, outputs) -> AsyncLLM:
        """An AsyncLLM over a core that another process started with several clients (one API server
        of --api-server-count): `requests` / `outputs`, its ends of this client's two pipes."""
        return cls.over(None, requests, outputs)

    @classmethod
    def over(cls, process: subprocess.Popen | None, requests, outputs) -> AsyncLLM:
        """An AsyncLLM over a core already started (start_engine_core): its process (None: another process's),
        and this client's ends of its two pipes. Waits for its "ready"."""
        self = cls.__new__(cls)
        self._requests, self._outputs = requests, outputs
        self._attach(process)
        return self

    def _attach(self, process: subprocess.Popen | None) -> None:
        """Wait for the core's "ready" (its EngineConfig), then start this client's threads."""
        self._process = process
        # transformers' tokenizer classes load while the core builds the engine (on another core), not after
        from transformers import AutoTokenizer  # noqa: F401

        ready = self._outputs.poll(START_TIMEOUT_S)
        try:
            kind, payload = self._outputs.recv() if ready else ("failed", f"no answer in {START_TIMEOUT_S:.0f} s")
        except EOFError:
            status = f" with status {process.wait(5)}" if process is not None else ""
            kind, payload = "failed", f"the engine core process exited{status}"
        if kind != "ready":
            self._kill()
            raise ValueError(f"the engine could not be built: {payload}")
        self.config: EngineConfig = payload
        self.tokenizer = load_tokenizer(str(self.config.model), self.config.tokenizer)
        self.inputs = InputProcessor(
            self.config, self.tokenizer,
            functools.partial(group_pages, page_size=self.config.page_size,
                              window_tokens=self.config.window_tokens),
        )
        self.load: dict = {}
        self.dead: str | None = None  # why the core died, once it has
        self.reported: str | None = None  # the traceback the core sent before it died, if it sent one
        self.last_heard = time.monotonic()  # when the reader last got a message (a beat at least every second)
        self.step_seconds = 0.0  # how long the core's step in progress had run at its latest beat
        # Requests go down the pipe from a sender thread: a pipe write blocks once the pipe is
        # full, and the core reads only between two steps, so a burst of requests written from
        # the event loop would stall every stream for up to a window.
        self._closed = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=_send_requests, args=(self._outbox, self._requests, weakref.ref(self)),
                                        name="graphdecode-requests", daemon=True)
        self._sender.start()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats_waiters: list[asyncio.Future] = []
        self._replies: dict[str, asyncio.Future] = {}  # weight updates and pauses by token, answered by the core
        self._reader = threading.Thread(target=_read_outputs, args=(self._outputs, weakref.ref(self)),
                                        name="graphdecode-outputs", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------- requests
    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, priority: int = 0, lora_request=None) -> RequestStream:
        """Validate now (ValueError / TypeError naming the field) and send the request to the core.

        Returns an async iterator of deltas; the last has finished=True. Stopping the
        iteration early (cancel, aclose, dropping the iterator) aborts the request.
        Called with no event loop running, the request starts when first read.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if sampling_params is None:  # the model's recommended defaults (generation_defaults.py)
            sampling_params = SamplingParams(**self.config.sampling_defaults)
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        (text, ids), = self.inputs.tokenize_all([prompt])
        salt = self.inputs.cache_salt(prompt)
        request_id = str(request_id) if request_id is not None else uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        # the engine's own checks, on its own copy of the params: that copy is what the core gets, so a
        # change the caller makes to theirs afterwards never reaches the request
        params = sampling_params.submitted()
        ids = self.inputs.truncated(ids, params)  # truncate_prompt_tokens, before the length is checked
        params, _ = self.inputs.check(ids, params, priority, verified=True)
        if lora_request is not None:  # the adapter's files against the model, before the request goes anywhere
            self.inputs.loras.check(lora_request)
        stream = RequestStream(self, request_id, ("add", request_id, text, ids, params, priority, salt, lora_request))
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return stream  # no loop yet: it starts when first read
        stream._start()
        return stream

    async def abort(self, request_id: str) -> None:
        self._send(("abort", str(request_id)))

    async def stats(self) -> dict:
        """The engine's full stats() (asks the core; answered between two steps)."""
        self._start_reader()
        future = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(future)
        self._send(("stats",))
        return await future

    async def update_weights(self, weights, weight_version: str | None = None,
                             abort_all_requests: bool = False) -> WeightUpdate:
        """New weights for the core's model (reinforcement learning between rollouts; docs/weight_updates.md):
        (name, tensor) pairs or a mapping, sent down the pipe. The core waits for the running requests to finish
        (or aborts them: `abort_all_requests`), holding new ones until the weights are in, so every request's
        tokens come from one version. ValueError / TypeError: refused before anything was written."""
        pairs = []
        for item in weights.items() if isinstance(weights, dict) else weights:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"weights: each item must be a (name, torch.Tensor) pair, got {item!r:.80}")
            pairs.append((item[0], item[1].detach().cpu()))
        # pickled here, by value: the pipe's pickler would hand tensors over as shared-memory handles, which only a
        # multiprocessing child (not the core, a process of its own) may open
        return await self._update(("pickled", pickle.dumps(pairs, protocol=pickle.HIGHEST_PROTOCOL)), weight_version,
                                  abort_all_requests)

    async def update_weights_from_disk(self, model_path, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> WeightUpdate:
        """update_weights with every tensor of a checkpoint directory, read by the core (its machine's path)."""
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError(f"model_path: must be a path, got {type(model_path).__name__}")
        return await self._update(("disk", os.fspath(model_path)), weight_version, abort_all_requests)

    async def get_weight_version(self) -> str:
        """The version of the weights the core runs (asked of it)."""
        return (await self.stats())["weight_version"]

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's: stop running requests, for weight updates in several parts. mode "abort" ends the running
        requests (finish_reason "abort"), "wait" lets them finish; either way new requests wait until
        resume_generation. Returns once nothing runs; clear_cache: the prefix cache is forgotten then. vLLM's
        "keep" (running requests frozen across an update) is refused: their K/V would mix two weights."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if not isinstance(clear_cache, bool):
            raise TypeError(f"clear_cache: must be a bool, got {type(clear_cache).__name__}")
        await self._ask(lambda token: ("pause", token, mode, clear_cache))

    async def resume_generation(self) -> None:
        """New requests run again (and those held by the pause start)."""
        await self._ask(lambda token: ("resume", token))

    async def is_paused(self) -> bool:
        return (await self.stats())["paused"]

    async def _update(self, source: tuple, weight_version, abort_all_requests: bool) -> WeightUpdate:
        version = check_version(weight_version)
        if not isinstance(abort_all_requests, bool):
            raise TypeError(f"abort_all_requests: must be a bool, got {type(abort_all_requests).__name__}")
        result = await self._ask(lambda token: ("update_weights", token, source, version, abort_all_requests))
        return WeightUpdate(result["weight_version"], result["updated"], tuple(result["skipped"]))

    async def _ask(self, message):
        """Send message(token) to the core and wait for its ("reply", token, result, error)."""
        self._start_reader()
        token = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._replies[token] = future
        try:
            self._send(message(token))
            return await future
        finally:
            self._replies.pop(token, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    @property
    def is_dead(self) -> bool:
        """The core is gone (it reported a failure, or its process exited), and not by shutdown()."""
        exited = self._process is not None and self._process.poll() is not None
        return not self._closed and (self.dead is not None or exited)

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the core was last heard (it beats every second while it runs)."""
        return time.monotonic() - self.last_heard

    def death_cause(self, wait_s: float = 1.0) -> str:
        """How the core died, in a few words: the signal that killed it (SIGKILL, ...) or its exit
        status, after the exception line of the traceback it sent, if it sent one (the whole
        traceback is `reported`). Waits up to `wait_s` for the process to be reaped."""
        if self._process is None:  # another process started it (--api-server-count): only its pipe closed
            code = None
        else:
            try:
                code = self._process.wait(wait_s)
            except subprocess.TimeoutExpired:
                code = None
        if self._process is None:
            how = "its pipe to this API server closed"
        elif code is None:
            how = "its process has not exited yet"
        elif code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"its process exited with status {code}"
        if self.reported:
            last = self.reported.strip().splitlines()[-1]
            return f"its step loop raised {last}; {how}"
        return how

    # ---------------------------------------------------------------- plumbing
    def _send(self, message) -> None:
        """Queue a message for the core (never blocks the event loop); in order, by the sender thread."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._outbox.put(message)

    def _start_reader(self) -> None:
        """Bind the reader to the running event loop (a new one once the previous one closed)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError("AsyncLLM is in use by another running event loop")
            self._loop = loop

    def _take(self, message, heard: bool) -> bool:
        """On the reader thread: one message from the core (`heard`: it came from the core, not from
        its pipe closing). False once the core failed: nothing more comes."""
        if heard:
            self.last_heard = time.monotonic()
        kind = message[0]
        if kind == "beat":
            self.step_seconds = message[1]
            return True
        if kind == "failed" and not self._closed:
            self.dead = message[1]  # seen by new calls even if no loop dispatches it
            if heard:
                self.reported = message[1]
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._dispatch, message)
            except RuntimeError:  # that loop closed: its consumers are gone, the next loop rebinds
                pass
        return kind != "failed"

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, self.load = message
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
        elif kind in ("rejected", "error"):
            _, request_id, text = message
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(ValueError(text) if kind == "rejected" else RequestFailedError(text))
        elif kind == "stats":
            waiters, self._stats_waiters = self._stats_waiters, []
            for future in waiters:
                if not future.done():
                    future.set_result(message[1])
        elif kind == "reply":
            _, token, result, error = message
            future = self._replies.get(token)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(ValueError(error))
        elif kind == "failed":
            if self._closed:
                return
            self.dead = message[1]
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(self.dead))
            for future in [*self._stats_waiters, *self._replies.values()]:
                if not future.done():
                    future.set_exception(EngineDeadError(self.dead))

    # ---------------------------------------------------------------- lifecycle
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process (requests still running end without outputs)."""
        if self._closed:
            return
        self._closed = True
        self.inputs.close()  # compiles in flight stop
        self._outbox.put(("shutdown",))  # after whatever is still queued
        self._outbox.put(None)
        self._sender.join(timeout)
        if self._process is not None:  # one started by another process ends when all its clients did
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        self._requests.close()

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.shutdown(timeout=2.0)
