"""Tensor-parallel ranks: rank 0 (the driver, in the engine's process) and its workers.

`TPExecutor` starts ranks 1..N-1 as worker processes (torch.multiprocessing, spawn),
sets up torch.distributed (NCCL on GPUs, gloo on CPUs; a gloo group for plans), and
then, once per engine step, broadcasts the step's plan (the runner's part of it: rows,
chunks, window, never the host's sequences) to every worker, whose runner applies it
exactly as the driver's does. Every rank samples from the same gathered logits with
the same position-keyed noise, so all hold the same tokens without a broadcast.

Lifecycle: workers start with the engine and stop with it (`shutdown`, the LLM's
`close()` / context manager, and at interpreter exit). A worker watches a pipe from
the driver and exits when the driver is gone, so none is orphaned. A worker that
dies is noticed before each step (its exit code) and when a collective fails (gloo
reports the closed connection at once): the driver raises TPWorkerError naming it,
it never waits forever.

Scripts must build a tensor-parallel LLM under `if __name__ == "__main__":`. Workers are
started with multiprocessing's spawn method, so each one imports the script again as its
main module before it runs; a script that builds `LLM(..., tensor_parallel_size=N)` at its
top level would build it again inside every worker. That cannot work: the driver waits for
each worker to report that it started (its bootstrap is over), and a worker that exits
first, as one re-importing an unguarded script does, is a TPWorkerError in the driver within
seconds, naming the guard (the worker itself exits with EXIT_UNGUARDED_MAIN and a line on
stderr saying why), instead of a rendezvous that never completes.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import sys
import time
import weakref
from multiprocessing.connection import wait as wait_for_any

import torch.distributed as dist
import torch.multiprocessing as mp

from .tp_rank import INIT_TIMEOUT_S, free_port, init_rank
from .tp_worker import run_worker

EXIT_UNGUARDED_MAIN = 64  # a worker's exit status: it found the main module building an LLM (sysexits EX_USAGE)
GUARD_ADVICE = ('put the code that builds the LLM under `if __name__ == "__main__":` (tensor-parallel workers '
                "are spawned processes: each imports the script again as its main module before it starts)")


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker died; the engine cannot go on."""


def _in_spawn_bootstrap() -> bool:
    """This process is a spawned child still importing its parent's main module (multiprocessing's
    own test before it refuses to start a process, see multiprocessing.spawn)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


class TPExecutor:
    def __init__(self, config):
        if _in_spawn_bootstrap():  # a worker re-importing an unguarded script: say so, and exit
            print("graphdecode: this process (a tensor-parallel worker) is importing the main module, which "
                  f"builds an LLM with tensor_parallel_size > 1 at import: {GUARD_ADVICE}", file=sys.stderr,
                  flush=True)
            raise SystemExit(EXIT_UNGUARDED_MAIN)
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: torch.distributed is already initialised in this process")
        self.world_size = config.tensor_parallel_size
        port = free_port()
        ctx = mp.get_context("spawn")
        self._workers = []
        self._lifelines = []  # the driver's ends of one pipe per worker: EOF there tells it the driver is gone
        self.closed = False
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        started = []  # the driver's ends of one pipe per worker: a message once its bootstrap is over
        try:
            for rank in range(1, self.world_size):
                watched, kept = ctx.Pipe(duplex=False)
                heard, says = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=run_worker, args=(rank, self.world_size, port, config, watched, says),
                                   name=f"graphdecode-tp{rank}", daemon=True)
                proc.start()
                watched.close()
                says.close()
                self._workers.append(proc)
                self._lifelines.append(kept)
                started.append(heard)
            self._wait_until_started(started)
            self.tp, self._plans = init_rank(0, self.world_size, port, config.torch_device)
        except BaseException:
            self.shutdown(timeout=1.0)
            raise
        finally:
            for end in started:
                end.close()

    def _wait_until_started(self, started: list) -> None:
        """Until every worker has reported in from run_worker; a worker that exits first (during
        its bootstrap: the unguarded script of the module docstring) is a TPWorkerError now,
        rather than a rendezvous that waits INIT_TIMEOUT_S for it."""
        pending = {end: rank for rank, end in enumerate(started, start=1)}
        deadline = time.monotonic() + INIT_TIMEOUT_S
        while pending:
            exits = {self._workers[rank - 1].sentinel: rank for rank in pending.values()}
            ready = wait_for_any([*pending, *exits], timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise TPWorkerError(f"tensor-parallel workers {sorted(pending.values())} did not start in "
                                    f"{INIT_TIMEOUT_S} s")
            for end in [r for r in ready if r in pending]:  # messages first: one may start, then exit
                try:
                    end.recv()
                except (EOFError, OSError):  # closed unsent: it exited before run_worker
                    raise self._exited_before_starting(pending[end]) from None
                del pending[end]
            for sentinel in ready:
                if exits.get(sentinel) in pending.values():
                    raise self._exited_before_starting(exits[sentinel])

    def _exited_before_starting(self, rank: int) -> TPWorkerError:
        proc = self._workers[rank - 1]
        proc.join(5)
        what = f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code {proc.exitcode} before it started"
        if proc.exitcode == EXIT_UNGUARDED_MAIN:
            return TPWorkerError(f"{what}: the script builds the LLM when it is imported, and every worker "
                                 f"imports it again; {GUARD_ADVICE}")
        return TPWorkerError(f"{what} (its error is on stderr). If the script builds the LLM at its top level, "
                             f"that is the usual cause: {GUARD_ADVICE}")

    # ------------------------------------------------------------------ steps
    def broadcast_plan(self, plan) -> None:
        """Send the step's plan to the workers (its readout stays here: workers only launch)."""
        self.check_workers()
        self._broadcast(dataclasses.replace(plan, readout=[]))

    def check_workers(self) -> None:
        for rank, proc in enumerate(self._workers, start=1):
            if proc.exitcode is not None:
                raise TPWorkerError(
                    f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                )

    def collective_failed(self, exc: BaseException) -> TPWorkerError | None:
        """If a collective failed because a worker died, the error to raise instead."""
        for _ in range(20):  # the dead process may take a moment to be reaped
            try:
                self.check_workers()
            except TPWorkerError as dead:
                return dead
            if not isinstance(exc, (RuntimeError, OSError)):
                return None
            time.sleep(0.05)
        return None

    def gather_from_workers(self, request: str) -> list:
        """Ask every rank something (e.g. "sizes"); rank order, the driver answers for itself as None."""
        self.check_workers()
        self._broadcast(request)
        answers = [None] * self.world_size
        dist.gather_object(None, answers, dst=0, group=self._plans)
        return answers

    def _broadcast(self, message) -> None:
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self._plans)

    # --------------------------------------------------------------- lifecycle
    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers]

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        if dist.is_initialized():
            try:
                if all(p.exitcode is None for p in self._workers):
                    self._broadcast(None)  # workers leave their loop
            except Exception:  # noqa: BLE001 - best effort: dead workers are killed below
                pass
        for proc in self._workers:
            proc.join(timeout)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
        for end in self._lifelines:
            end.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group with a dead peer may fail to tear down cleanly
                pass


def _shutdown_at_exit(ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown(timeout=5.0)

