"""CompileWorkers: constraints compiled in worker processes, under a time and a memory budget.

A compile that runs away (a big counted repetition over a large vocabulary: gigabytes; a
regex whose DFA blows up exponentially: minutes) must cost its request a clear error, not
the server its memory or its shutdown. A thread cannot be stopped or limited; a process
can. Each worker is a small Python process (`python -m graphdecode.structured.compile_worker`:
numpy and outlines-core, no torch) whose address space is limited (RLIMIT_AS) to its
baseline plus `budget.memory_bytes`; the caller waits at most `budget.seconds` and kills
the worker when the time is up, when its request is cancelled (`cancelled`, a
threading.Event: the client left) or when the owner closes (engine close, server
shutdown). A killed or crashed worker (outlines-core aborts when an allocation fails) is
replaced at the next compile.

Workers start on the first compile and keep the vocabularies they were sent (about 1 MB
and 0.2 s per tokenizer, once per worker); at most `max_workers` compile at a time, the
other callers wait their turn (their own deadline still counts).

Messages are length-prefixed pickles over the worker's stdin / stdout: ("vocab",
TokenizerVocab), ("compile", fingerprint, StructuredOutputsParams, CompileBudget) ->
("ok", TokenAutomaton) or ("error", message).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from .budget import CompileBudget

_HEADER = struct.Struct("<Q")
_POLL_SECONDS = 0.05


class CompileCancelled(Exception):
    """The request that asked for this compile went away, or the workers were closed; the
    worker was stopped."""


def _write(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Worker:
    def __init__(self, memory_bytes: int):
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "graphdecode.structured.compile_worker", str(int(memory_bytes))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
        )
        self.vocabs: set[str] = set()  # fingerprints this worker holds

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def reply(self, deadline: float, cancelled: threading.Event | None):
        """The next message, or: "timeout", "cancelled", "died" (strings)."""
        fd = self.process.stdout.fileno()
        while True:
            if cancelled is not None and cancelled.is_set():
                return "cancelled"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], min(left, _POLL_SECONDS))
            if ready:
                header = _read_exactly(fd, _HEADER.size)
                body = _read_exactly(fd, _HEADER.unpack(header)[0]) if header is not None else None
                return "died" if body is None else pickle.loads(body)


class CompileWorkers:
    def __init__(self, budget: CompileBudget, max_workers: int = 2):
        self.budget = budget
        self._idle: list[_Worker] = []
        self._slots = threading.Semaphore(max_workers)
        self._lock = threading.Lock()
        self._busy: set[_Worker] = set()
        self._closed = False
        self.killed = 0  # workers stopped for time, memory or cancellation

    def compile(self, params, vocab, field: str, cancelled: threading.Event | None = None):
        """params (StructuredOutputsParams) over vocab (TokenizerVocab) -> TokenAutomaton.
        Raises ValueError naming structured_outputs.<field> for a bad or over-budget constraint,
        CompileCancelled if `cancelled` was set first."""
        deadline = time.monotonic() + self.budget.seconds
        while not self._slots.acquire(timeout=_POLL_SECONDS):
            if cancelled is not None and cancelled.is_set():
                raise CompileCancelled()
            if time.monotonic() >= deadline:
                raise self._over_time(field)
        worker = None
        try:
            worker = self._take()
            try:
                if vocab.fingerprint not in worker.vocabs:
                    _write(worker.process.stdin, ("vocab", vocab))
                    worker.vocabs.add(vocab.fingerprint)
                _write(worker.process.stdin, ("compile", vocab.fingerprint, params, self.budget))
            except (BrokenPipeError, OSError):
                reply = "died"
            else:
                reply = worker.reply(deadline, cancelled)
            if isinstance(reply, str):
                worker.kill()
                worker, self.killed = None, self.killed + 1
                if reply == "cancelled" or self._closed:
                    raise CompileCancelled()
                if reply == "timeout":
                    raise self._over_time(field)
                raise ValueError(
                    f"structured_outputs.{field}: compiling the constraint took more than its memory budget of "
                    f"{self.budget.memory_bytes >> 20} MiB (structured_compile_memory_bytes); lower its "
                    "repetition counts (maxLength, maxItems, {m,n}) or its number of choices")
            kind, value = reply
            if kind == "error":
                raise ValueError(value)
            return value
        finally:
            with self._lock:
                if worker is not None:
                    self._busy.discard(worker)
                    if self._closed:
                        worker.kill()
                    else:
                        self._idle.append(worker)
            self._slots.release()

    def _over_time(self, field: str) -> ValueError:
        return ValueError(
            f"structured_outputs.{field}: compiling the constraint took more than its time budget of "
            f"{self.budget.seconds:g} s (structured_compile_timeout); simplify it (fewer alternatives or "
            "repetitions)")

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise CompileCancelled()
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    break
                worker.kill()
            else:
                worker = _Worker(self.budget.memory_bytes)
            self._busy.add(worker)
            return worker

    def close(self) -> None:
        """Stop every worker now: a compile in flight reads its worker's end of file and raises
        CompileCancelled. A busy worker's process is only killed here; its pipes are closed by the
        thread reading them (closing an fd under another thread's read races with the fd's reuse)."""
        with self._lock:
            self._closed = True
            idle, busy = self._idle, list(self._busy)
            self._idle = []
        for worker in idle:
            worker.kill()
        for worker in busy:
            worker.process.kill()


# ------------------------------------------------------------------ the worker process
def _limit_memory(budget: int) -> None:
    """Address space: what this process maps now plus `budget` bytes."""
    import resource

    try:
        with open("/proc/self/status") as status:
            vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + budget
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _serve(budget: int) -> None:
    import outlines_core  # noqa: F401

    from . import compiler  # numpy and outlines-core: what a compile needs, loaded before the limit

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner stops it (a terminal's ^C reaches the group)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the message stream
    fd = sys.stdin.fileno()
    _limit_memory(budget)
    vocabs = {}
    while True:
        header = _read_exactly(fd, _HEADER.size)
        if header is None:
            return
        message = pickle.loads(_read_exactly(fd, _HEADER.unpack(header)[0]))
        if message[0] == "vocab":
            vocabs[message[1].fingerprint] = message[1]
            continue
        _, fingerprint, params, budget = message
        try:
            automaton = compiler.compile_automaton(params, vocabs[fingerprint], budget)
            reply = ("ok", automaton)
        except ValueError as exc:
            reply = ("error", str(exc))
        except MemoryError:
            reply = ("error", f"structured_outputs.{params.kind}: compiling the constraint took more than its "
                              "memory budget (structured_compile_memory_bytes)")
        _write(out, reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
