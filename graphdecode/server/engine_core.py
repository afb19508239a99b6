"""The engine core process: the step loop, fed and drained over two pipes.

AsyncLLM starts it (`python -m graphdecode.server.engine_core IN_FD OUT_FD`, a fresh
interpreter: nothing of the parent's __main__ is re-imported) so that nothing of the serving process
(HTTP parsing, JSON and SSE encoding, tokenisation of new prompts, asyncio) sits
between two window launches: this process does nothing but read requests, step, and
send each step's deltas (vLLM V1's EngineCore pattern, over multiprocessing pipes).

Messages in: first ("init", model, engine_args); then lists of tuples (what
the sender had queued, in order): ("add", request_id, prompt_text, prompt_token_ids,
params), ("abort", request_id), ("stats",), ("shutdown",).
Messages out: ("ready", EngineConfig) or ("failed", message) once at start;
("outputs", [RequestOutput deltas], load) after every step that produced some, where
load is a small dict (running, waiting, preemptions, windows, tokens in / out);
("rejected", request_id, message) for an add the engine refused; ("stats", dict).
A closed input pipe (the parent died) ends the loop too.
"""

from __future__ import annotations

import signal
import sys
import traceback
from multiprocessing.connection import Connection

from ..runtime.gc_heap import freeze_startup_heap
from ..runtime.output_builder import DeltaQueue


def _load(engine) -> dict:
    """What the serving side reports as gauges and counters (cheap: no walk over requests)."""
    s, sched = engine._stats, engine.scheduler
    return {
        "running": len(sched.running),
        "waiting": len(sched.waiting) + len(sched.prefilling),
        "preemptions": sched.num_preemptions,
        "windows": s.windows,
        "prefill_tokens": s.prefill_tokens,
        "generated_tokens": s.generated_tokens,
        "requests_finished": s.requests_finished,
    }


def _handle(engine, message: tuple, outputs) -> bool:
    """Apply one message from the serving side; False for shutdown."""
    kind = message[0]
    if kind == "shutdown":
        return False
    if kind == "add":
        _, request_id, text, ids, params = message
        try:
            engine.add_prepared(engine.prepare(text, ids, params, request_id))
        except ValueError as exc:
            outputs.send(("rejected", request_id, str(exc)))
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
        from ..runtime.engine import Engine

        engine = Engine(EngineConfig(model=model, **engine_args))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        outputs.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    freeze_startup_heap()  # the model and engine stay out of full collections (a 160 ms stall each)
    outputs.send(("ready", engine.config))
    queue = DeltaQueue()
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
                for seq in engine.step():
                    queue.push(seq)
                if queue:
                    outputs.send(("outputs", queue.take(), _load(engine)))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the parent went away
    except Exception:  # noqa: BLE001 - the parent must learn why its engine died
        outputs.send(("failed", traceback.format_exc()))
    finally:
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
