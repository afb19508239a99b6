"""The engine core process: the step loop, fed and drained over pipes, one pair per API server.

AsyncLLM starts it (`python -m graphdecode.server.engine_core IN_FD OUT_FD [IN_FD OUT_FD ...]`, a
fresh interpreter: nothing of the parent's __main__ is re-imported) so that nothing of the serving process
(HTTP parsing, JSON and SSE encoding, tokenisation of new prompts, asyncio) sits
between two window launches: this process does nothing but read requests, step, and
send each step's deltas (vLLM V1's EngineCore pattern, over multiprocessing pipes).

Messages in: first ("init", model, engine_args); then lists of tuples (what
the sender had queued, in order): ("add", request_id, prompt_text, prompt_token_ids,
params, priority, cache_salt, lora_request), ("abort", request_id), ("stats",), ("shutdown",).
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
return does not, it shows in step_seconds). Both threads write under one lock per pipe.

Several clients (`--api-server-count`: one pipe pair per API server process): "init" comes from
the first; "ready", beats, loads and "failed" go to every client; a request's deltas, its
rejection or error go to the client that added it (the core keeps who owns each running request);
"stats" answers its asker. A client's "shutdown" or closed pipe (its process died) aborts its
requests; the loop ends once no client is left.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import traceback
from bisect import bisect_left
from multiprocessing.connection import Connection, wait

from ..host.gc_heap import freeze_startup_heap
from ..host.output_builder import DeltaQueue
from .args import HEARTBEAT_INTERVAL_S
from .weight_sync import WeightSync

log = logging.getLogger(__name__)

# upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total buckets), +Inf after them
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _Outputs:
    """A client's output pipe, written by the step loop and the heartbeat thread: one message at a
    time. A client that went away loses what is sent to it (its closed request pipe ends it)."""

    __slots__ = ("_pipe", "_lock")

    def __init__(self, pipe: Connection):
        self._pipe = pipe
        self._lock = threading.Lock()

    def send(self, message) -> None:
        with self._lock:
            try:
                self._pipe.send(message)
            except (OSError, ValueError):
                pass


def _broadcast(clients: list[_Outputs], message) -> None:
    for outputs in clients:
        outputs.send(message)


class _Heartbeat(threading.Thread):
    """Sends ("beat", step_seconds) to every client every `interval` s until stopped. The step loop
    sets `step_started` (time.monotonic()) while a step runs, None between steps."""

    def __init__(self, outputs: list[_Outputs], interval: float = HEARTBEAT_INTERVAL_S):
        super().__init__(name="graphdecode-heartbeat", daemon=True)
        self.outputs = outputs
        self.interval = interval
        self.step_started: float | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            started = self.step_started
            _broadcast(self.outputs, ("beat", 0.0 if started is None else time.monotonic() - started))


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


class _Clients:
    """The API servers the core serves: each one's pipes, and which of them owns each running request."""

    def __init__(self, pipes: list[tuple[Connection, Connection]]):
        self.requests = [requests for requests, _ in pipes]
        self.outputs = [_Outputs(outputs) for _, outputs in pipes]
        self.live = set(range(len(pipes)))  # clients not shut down or gone
        self.owner: dict[str, int] = {}  # running request id -> its client
        self.weights = WeightSync()  # weight updates waiting for the running requests to finish

    def waiting(self, timeout: float | None) -> list[int]:
        """The live clients with messages (or a closed pipe) waiting, after up to `timeout` s."""
        ready = wait([self.requests[i] for i in self.live], timeout)
        return [i for i in sorted(self.live) if self.requests[i] in ready]

    def leave(self, engine, client: int) -> None:
        """A client shut down or went away: its requests are aborted."""
        self.live.discard(client)
        for request_id in [r for r, c in self.owner.items() if c == client]:
            del self.owner[request_id]
            engine.abort_request(request_id)

    def send_outputs(self, outputs: list, load: dict) -> None:
        """Each client's deltas, with the load (every client gets the load, deltas or not)."""
        per_client: dict[int, list] = {i: [] for i in self.live}
        for out in outputs:
            client = self.owner.get(out.request_id)
            if client is None:
                continue  # its client left
            if out.finished:
                del self.owner[out.request_id]
            if client in per_client:
                per_client[client].append(out)
        for client, mine in per_client.items():
            self.outputs[client].send(("outputs", mine, load))


def _add(engine, message: tuple, outputs) -> None:
    """Admit one request: the boundary where a failure is that request's alone. A ValueError or
    TypeError (the engine's checks) rejects it; any other exception fails it, logged with its
    traceback, and whatever of it reached the engine is aborted, so the core keeps serving."""
    _, request_id, text, ids, params, priority, salt, lora = message
    try:
        # AsyncLLM ran the engine's checks on these params before sending them: not again here
        engine.add_requests([engine.prepare(text, ids, params, request_id, priority, checked=True, cache_salt=salt,
                                            lora_request=lora)])
    except (ValueError, TypeError) as exc:
        outputs.send(("rejected", request_id, str(exc)))
    except Exception as exc:  # noqa: BLE001 - the request-failure boundary: this request fails, the core goes on
        log.exception("graphdecode: request %s failed in the engine core (the core goes on serving)", request_id)
        engine.abort_request(request_id)
        outputs.send(("error", request_id, f"{type(exc).__name__}: {exc}"))


def _handle(engine, message: tuple, clients: _Clients, client: int) -> bool:
    """Apply one message from a client; False for its shutdown."""
    kind = message[0]
    outputs = clients.outputs[client]
    if kind == "shutdown":
        return False
    if clients.weights.holds(client, message):  # a weight update waits for the running requests: so do new ones
        return True
    if kind in ("update_weights", "pause"):
        clients.weights.ask(engine, client, message)
    elif kind == "resume":
        for held_client, held in clients.weights.resume(client, message, clients.outputs):
            if held_client in clients.live and not _handle(engine, held, clients, held_client):
                clients.leave(engine, held_client)
    elif kind == "add":
        request_id = message[1]
        if request_id in clients.owner:  # another API server's request of the same id is running
            outputs.send(("rejected", request_id, f"request_id: {request_id!r} is already in use"))
            return True
        clients.owner[request_id] = client
        _add(engine, message, outputs)
        if request_id not in engine.requests:
            clients.owner.pop(request_id, None)  # refused or failed at admission
    elif kind == "abort":  # its final delta (finish_reason "abort") comes out of the next step
        if clients.owner.get(message[1]) == client:
            engine.abort_request(message[1])
    elif kind == "stats":
        outputs.send(("stats", {**engine.stats(), "paused": clients.weights.paused}))
    return True


def _read(engine, clients: _Clients, timeout: float | None) -> None:
    """Take everything the clients have sent by now (after up to `timeout` s), in order per client."""
    for client in clients.waiting(timeout):
        requests = clients.requests[client]
        try:
            while client in clients.live and requests.poll(0):
                for message in requests.recv():
                    if not _handle(engine, message, clients, client):
                        clients.leave(engine, client)
                        break
        except (EOFError, OSError):  # that API server's process is gone
            clients.leave(engine, client)


def run_engine_core(pipes: list[tuple[Connection, Connection]], model: str, engine_args: dict) -> None:
    """Process entry point. `pipes`: per client, the (requests, outputs) ends of two multiprocessing
    pipes. The engine sets its own torch threads (EngineConfig.cpu_threads)."""
    clients = _Clients(pipes)
    try:
        from ..config import EngineConfig
        from ..host.engine import Engine

        engine = Engine(EngineConfig(model=model, **engine_args))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        _broadcast(clients.outputs, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    freeze_startup_heap()  # the model and engine stay out of full collections (a 160 ms stall each)
    _broadcast(clients.outputs, ("ready", engine.config))
    heartbeat = _Heartbeat(clients.outputs)
    heartbeat.start()
    queue = DeltaQueue()
    step_tokens = StepTokens()
    try:
        while clients.live:
            for client, message in clients.weights.apply_ready(engine, clients.outputs):
                if client in clients.live and not _handle(engine, message, clients, client):
                    clients.leave(engine, client)
            _read(engine, clients, None if not engine.has_unfinished() else 0)
            if engine.has_unfinished():
                heartbeat.step_started = time.monotonic()
                for seq in engine.step():
                    queue.push(seq)
                heartbeat.step_started = None
                step_tokens.after_step(engine)
                if queue:
                    clients.send_outputs(queue.take(), _load(engine, step_tokens))
    except KeyboardInterrupt:
        return
    except Exception:  # noqa: BLE001 - the parent must learn why its engine died
        _broadcast(clients.outputs, ("failed", traceback.format_exc()))
    finally:
        heartbeat.stopped.set()
        engine.close()  # tensor-parallel workers stop with the core


def main(argv=None) -> None:
    # The parent owns this process's lifetime ("shutdown", or its end of the pipe closing):
    # a Ctrl+C or SIGTERM sent to the whole process group must not end the core while
    # the parent is still draining its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fds = [int(x) for x in (argv or sys.argv[1:])]
    pipes = [(Connection(fds[i], writable=False), Connection(fds[i + 1], readable=False))
             for i in range(0, len(fds), 2)]
    try:
        kind, model, engine_args = pipes[0][0].recv()
    except (EOFError, OSError):
        return
    assert kind == "init"
    run_engine_core(pipes, model, engine_args)


if __name__ == "__main__":
    main()
