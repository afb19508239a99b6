"""The engine core process: the step loop, fed and drained over two pipes.

AsyncLLM starts it (`python -m graphdecode.server.engine_core IN_FD OUT_FD`, a fresh
interpreter: nothing of the parent's __main__ is re-imported) so that nothing of the serving process
(HTTP parsing, JSON and SSE encoding, tokenisation of new prompts, asyncio) sits
between two window launches: this process does nothing but read requests, step, and
send each step's deltas (vLLM V1's EngineCore pattern, over multiprocessing pipes).

Messages in: first ("init", model, engine_args); then lists of tuples (what
the sender had queued, in order): ("add", request_id, prompt_text, prompt_token_ids,
params, priority, cache_salt), ("abort", request_id), ("stats",), ("shutdown",).
Messages out: ("ready", EngineConfig) or ("failed", message) once at start;
("outputs", [RequestOutput deltas], load) after every step that produced some, where
load is a small dict (running, waiting, preemptions, windows, tokens in / out, KV pages
in use, prefix-cache lookups, the histogram of tokens per step: see `_load`);
("rejected", request_id, message) for an add the engine refused (its checks: a bad request);
("error", request_id, message) for an add that failed otherwise (logged; the core goes on);
("stats", dict); ("failed", traceback) when the step loop itself raised: the engine's state
is then unknown, so the core reports it and exits (the server exits too, see openai_api.py);
("beat", step_seconds) every HEARTBEAT_INTERVAL_S from a thread of its own, idle or busy, with
how long the step in progress has run (0.0 between steps): the proof of life the server's
/health and metrics read (a stopped or frozen process stops beating; a step that does not
return does not, it shows in step_seconds). Both threads write under one lock.
A closed input pipe (the parent died) ends the loop too.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import traceback
from bisect import bisect_left
from multiprocessing.connection import Connection

from ..host.gc_heap import freeze_startup_heap
from ..host.output_builder import DeltaQueue
from .args import HEARTBEAT_INTERVAL_S

log = logging.getLogger(__name__)

# upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total buckets), +Inf after them
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _Outputs:
    """The output pipe, written by the step loop and the heartbeat thread: one message at a time."""

    __slots__ = ("_pipe", "_lock")

    def __init__(self, pipe: Connection):
        self._pipe = pipe
        self._lock = threading.Lock()

    def send(self, message) -> None:
        with self._lock:
            self._pipe.send(message)


class _Heartbeat(threading.Thread):
    """Sends ("beat", step_seconds) every `interval` s until stopped or the pipe breaks. The step loop
    sets `step_started` (time.monotonic()) while a step runs, None between steps."""

    def __init__(self, outputs: _Outputs, interval: float = HEARTBEAT_INTERVAL_S):
        super().__init__(name="graphdecode-heartbeat", daemon=True)
        self.outputs = outputs
        self.interval = interval
        self.step_started: float | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            started = self.step_started
            try:
                self.outputs.send(("beat", 0.0 if started is None else time.monotonic() - started))
            except (OSError, ValueError):  # the parent went away: the step loop ends on its closed pipe
                return


class StepTokens:
    """Histogram of the tokens of each engine step, vLLM's iteration_tokens_total: the whole prompt
    (prefix-cache hits included) of every sequence whose first token came out in the step, plus the
    tokens the step generated (that reached the host in it). Steps with neither are not counted.
    Cumulative, so a step whose load is never sent is not lost."""

    __slots__ = ("counts", "sum", "_seen")

    def __init__(self):
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # per bucket, not cumulative; the last: +Inf
        self.sum = 0
        self._seen = 0

    def after_step(self, engine) -> None:
        load = engine.load()
        total = load["first_token_prompt_tokens"] + load["generated_tokens"]
        tokens, self._seen = total - self._seen, total
        if tokens > 0:
            self.counts[bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
            self.sum += tokens


def _load(engine, step_tokens: StepTokens | None = None) -> dict:
    """What the serving side reports as gauges and counters: the engine's load, and this step's tokens."""
    load = engine.load()
    if step_tokens is not None:
        load["iteration_tokens"] = (tuple(step_tokens.counts), step_tokens.sum)
    return load


def _add(engine, message: tuple, outputs) -> None:
    """Admit one request: the boundary where a failure is that request's alone. A ValueError or
    TypeError (the engine's checks) rejects it; any other exception fails it, logged with its
    traceback, and whatever of it reached the engine is aborted, so the core keeps serving."""
    _, request_id, text, ids, params, priority, salt = message
    try:
        # AsyncLLM ran the engine's checks on these params before sending them: not again here
        engine.add_requests([engine.prepare(text, ids, params, request_id, priority, checked=True, cache_salt=salt)])
    except (ValueError, TypeError) as exc:
        outputs.send(("rejected", request_id, str(exc)))
    except Exception as exc:  # noqa: BLE001 - the request-failure boundary: this request fails, the core goes on
        log.exception("graphdecode: request %s failed in the engine core (the core goes on serving)", request_id)
        engine.abort_request(request_id)
        outputs.send(("error", request_id, f"{type(exc).__name__}: {exc}"))


def _handle(engine, message: tuple, outputs) -> bool:
    """Apply one message from the serving side; False for shutdown."""
    kind = message[0]
    if kind == "shutdown":
        return False
    if kind == "add":
        _add(engine, message, outputs)
    elif kind == "abort":
        engine.abort_request(message[1])
    elif kind == "stats":
        outputs.send(("stats", engine.stats()))
    return True


def run_engine_core(requests, outputs, model: str, engine_args: dict) -> None:
    """Process entry point. `requests`/`outputs`: the two ends of multiprocessing pipes. The engine
    sets its own torch threads (EngineConfig.cpu_threads)."""
    try:
        from ..config import EngineConfig
        from ..host.engine import Engine

        engine = Engine(EngineConfig(model=model, **engine_args))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        outputs.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    freeze_startup_heap()  # the model and engine stay out of full collections (a 160 ms stall each)
    outputs = _Outputs(outputs)
    outputs.send(("ready", engine.config))
    heartbeat = _Heartbeat(outputs)
    heartbeat.start()
    queue = DeltaQueue()
    step_tokens = StepTokens()
    try:
        while True:
            idle = not engine.has_unfinished()
            if requests.poll(None if idle else 0):
                while True:  # take everything that is waiting, then step
                    if not all(_handle(engine, message, outputs) for message in requests.recv()):
                        return  # shutdown
                    if not requests.poll(0):
                        break
            if engine.has_unfinished():
                heartbeat.step_started = time.monotonic()
                for seq in engine.step():
                    queue.push(seq)
                heartbeat.step_started = None
                step_tokens.after_step(engine)
                if queue:
                    outputs.send(("outputs", queue.take(), _load(engine, step_tokens)))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the parent went away
    except Exception:  # noqa: BLE001 - the parent must learn why its engine died
        outputs.send(("failed", traceback.format_exc()))
    finally:
        heartbeat.stopped.set()
        engine.close()  # tensor-parallel workers stop with the core


def main(argv=None) -> None:
    # The parent owns this process's lifetime ("shutdown", or its end of the pipe closing):
    # a Ctrl+C or SIGTERM sent to the whole process group must not end the core while
    # the parent is still draining its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    in_fd, out_fd = (int(x) for x in (argv or sys.argv[1:]))
    requests, outputs = Connection(in_fd, writable=False), Connection(out_fd, readable=False)
    try:
        kind, model, engine_args = requests.recv()
    except (EOFError, OSError):
        return
    assert kind == "init"
    run_engine_core(requests, outputs, model, engine_args)


if __name__ == "__main__":
    main()
