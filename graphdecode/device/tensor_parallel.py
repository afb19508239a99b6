"""Tensor-parallel ranks: rank 0 (the driver, in the engine's process) and its workers.

`TPExecutor` starts the ranks of its machine (1..L-1, L = N on one machine, or N / nnodes:
the other nodes' ranks are started there by `graphdecode serve --headless`, tp_headless.py; under
torchrun none, launched.py) as worker processes (`SpawnedRanks`: forkserver on CPU, spawn on GPUs),
sets up torch.distributed (NCCL on GPUs, gloo on CPUs; a gloo group for plans; tp_rank.py), sends
every rank its engine config, and then, once per engine step, broadcasts the step's plan (the runner's part of it: rows,
chunks, window, never the host's sequences) to every worker, whose runner applies it
exactly as the driver's does. Every rank samples from the same gathered logits with
the same position-keyed noise, so all hold the same tokens without a broadcast.

Lifecycle: workers start with the engine and stop with it (`shutdown`, the LLM's
`close()` / context manager, and at interpreter exit). A worker watches a pipe from
the driver and exits when the driver is gone, so none is orphaned. A worker that
dies is noticed before each step (its exit code) and when a collective fails (gloo
reports the closed connection at once): the driver raises TPWorkerError naming it (a rank
on another node by its rank and node), it never waits forever: no collective of the driver
waits longer than tp_rank's collective timeout.

Scripts must build a tensor-parallel LLM under `if __name__ == "__main__":`. Workers are
started with spawn's preparation (forkserver on CPU, spawn on GPUs), so each one imports the script again as its
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
import os
import sys
import time
import weakref
from multiprocessing.connection import wait as wait_for_any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .tp_rank import INIT_TIMEOUT_S, Placement, TPWorkerError, init_rank, parallel_groups, placement_for
from .tp_worker import run_worker, share_config

EXIT_UNGUARDED_MAIN = 64  # a worker's exit status: it found the main module building an LLM (sysexits EX_USAGE)
GUARD_ADVICE = ('put the code that builds the LLM under `if __name__ == "__main__":` (tensor-parallel workers '
                "are new processes: each imports the script again as its main module before it starts)")


def _in_spawn_bootstrap() -> bool:
    """This process is a spawned child still importing its parent's main module (multiprocessing's
    own test before it refuses to start a process, see multiprocessing.spawn)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _rank_context(device: torch.device):
    """How ranks start. On CPU, multiprocessing's forkserver, its server preloaded with the worker's modules
    (torch, graphdecode): a rank forks from it in a fraction of a second instead of importing them again
    (~4 s per rank, and its exit is quicker too), after spawn's preparation all the same (the main module
    imported again as `__mp_main__`, so an unguarded script is still caught); run_worker takes the driver's
    environment of the moment, not the server's. On GPUs, spawn: a process that forks after CUDA was
    initialised (a preloaded import may query it) hands its children a CUDA they cannot use."""
    if device.type == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["graphdecode.device.runner", "graphdecode.device.tp_worker"])  # once it starts
    return ctx


class SpawnedRanks:
    """Ranks started as processes of this one (`_rank_context`), each with a lifeline pipe: the driver's ranks
    1..L-1 on its machine, or every rank of a headless node. `started` waits until each has reported in from
    run_worker (one that exits first is a TPWorkerError naming it: the unguarded script of the module docstring)."""

    def __init__(self, ranks, place: Placement, config):
        ctx = _rank_context(config.torch_device)
        self.ranks = list(ranks)
        self.procs: list = []
        self._lifelines = []  # our ends of one pipe per rank: EOF there tells it its parent is gone
        started = []  # our ends of one pipe per rank: a message once its bootstrap is over
        try:
            for rank in self.ranks:
                watched, kept = ctx.Pipe(duplex=False)
                heard, says = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=run_worker, args=(rank, place, config, watched, says, dict(os.environ)),
                                   name=f"graphdecode-tp{rank}", daemon=True)
                proc.start()
                watched.close()
                says.close()
                self.procs.append(proc)
                self._lifelines.append(kept)
                started.append(heard)
            self._wait_until_started(started)
        except BaseException:
            self.stop(timeout=1.0)
            raise
        finally:
            for end in started:
                end.close()

    def _wait_until_started(self, started: list) -> None:
        pending = dict(zip(started, range(len(self.ranks))))  # pipe -> index
        deadline = time.monotonic() + INIT_TIMEOUT_S
        while pending:
            exits = {self.procs[i].sentinel: i for i in pending.values()}
            ready = wait_for_any([*pending, *exits], timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise TPWorkerError(f"tensor-parallel workers {sorted(self.ranks[i] for i in pending.values())} "
                                    f"did not start in {INIT_TIMEOUT_S} s")
            for end in [r for r in ready if r in pending]:  # messages first: one may start, then exit
                try:
                    end.recv()
                except (EOFError, OSError):  # closed unsent: it exited before run_worker
                    raise self._exited_before_starting(pending[end]) from None
                del pending[end]
            for sentinel in ready:
                if exits.get(sentinel) in pending.values():
                    raise self._exited_before_starting(exits[sentinel])

    def _exited_before_starting(self, index: int) -> TPWorkerError:
        proc = self.procs[index]
        proc.join(5)
        what = (f"tensor-parallel worker {self.ranks[index]} (pid {proc.pid}) exited with code {proc.exitcode} "
                f"before it started")
        if proc.exitcode == EXIT_UNGUARDED_MAIN:
            return TPWorkerError(f"{what}: the script builds the LLM when it is imported, and every worker "
                                 f"imports it again; {GUARD_ADVICE}")
        return TPWorkerError(f"{what} (its error is on stderr). If the script builds the LLM at its top level, "
                             f"that is the usual cause: {GUARD_ADVICE}")

    def check(self) -> None:
        """TPWorkerError naming the first rank that exited."""
        for rank, proc in zip(self.ranks, self.procs):
            if proc.exitcode is not None:
                raise TPWorkerError(f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` for each to leave (after the driver's None plan), then kill it."""
        for proc in self.procs:
            proc.join(timeout)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
        for end in self._lifelines:
            end.close()


class TPExecutor:
    def __init__(self, config):
        if _in_spawn_bootstrap():  # a worker re-importing an unguarded script: say so, and exit
            print("graphdecode: this process (a tensor-parallel worker) is importing the main module, which "
                  f"builds an LLM with tensor_parallel_size > 1 at import: {GUARD_ADVICE}", file=sys.stderr,
                  flush=True)
            os._exit(EXIT_UNGUARDED_MAIN)  # not SystemExit: a forkserver's child would exit 1 whatever its code
        self.place = placement_for(config)
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: torch.distributed is already initialised in this process")
        self.world_size = config.world_size
        self.closed = False
        self.failed = False  # a rank was lost: no goodbye broadcast at shutdown
        self._local = None
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        try:
            if self.place.ray:
                from .ray_ranks import RayRanks

                self._local = RayRanks(range(1, self.world_size), self.place, config)
            elif not self.place.launched:
                self._local = SpawnedRanks(self.place.local_ranks[1:], self.place, config)
            self._plans = self._join(config.torch_device)
            share_config(self._plans, config)
            self.tp = parallel_groups(0, config)
        except BaseException:
            self.shutdown(timeout=1.0)
            raise

    def _join(self, device):
        """Rank 0's rendezvous; the other nodes' ranks not joining in INIT_TIMEOUT_S is a TPWorkerError naming
        them and where they were awaited."""
        try:
            return init_rank(0, self.place, device, driver=True)
        except (RuntimeError, OSError) as exc:
            self.check_workers()
            remote = self.place.remote_ranks
            if not remote:
                raise
            raise TPWorkerError(f"{self.place.describe(remote)} did not join at {self.place.init_method} within "
                                f"{INIT_TIMEOUT_S} s ({' '.join(str(exc).split())[:300]}); on each other node run "
                                f"`graphdecode serve MODEL --headless` with this engine's --tensor-parallel-size, "
                                f"--nnodes, --master-addr and --master-port, and its own --node-rank") from exc

    # ------------------------------------------------------------------ steps
    def broadcast_plan(self, plan) -> None:
        """Send the step's plan to the workers (its readout stays here: workers only launch)."""
        self.check_workers()
        self._broadcast(dataclasses.replace(plan, readout=[]))

    def check_workers(self) -> None:
        if self._local is not None:
            self._local.check()

    def collective_failed(self, exc: BaseException) -> TPWorkerError | None:
        """If a collective failed because a rank died, the error to raise instead: a worker of this machine that
        exited, by name; else, where ranks run elsewhere, the lost connection to them."""
        if not isinstance(exc, (RuntimeError, OSError)):
            return None
        for _ in range(20):  # the dead process may take a moment to be reaped
            try:
                self.check_workers()
            except TPWorkerError as dead:
                self.failed = True
                return dead
            time.sleep(0.05)
        remote = self.place.remote_ranks
        text = " ".join(str(exc).split())
        if remote and any(word in text.lower() for word in ("gloo", "connection", "timed out", "timeout", "nccl",
                                                              "peer")):
            self.failed = True
            return TPWorkerError(f"the engine lost its connection to {self.place.describe(remote)}: {text[:300]}")
        return None

    def gather_from_workers(self, request) -> list:
        """Ask every rank something ("sizes"), or have each do something (tp_worker.NewWeights), and gather their
        answers; rank order, the driver answers for itself as None."""
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
        """The pids of the ranks this process spawned (none under a launcher)."""
        return [p.pid for p in self._local.procs] if self._local is not None else []

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        if dist.is_initialized() and not self.failed:
            try:
                self.check_workers()
                self._broadcast(None)  # workers leave their loop
                dist.barrier(group=self._plans)  # ... and every rank tears down with no collective in flight
            except Exception:  # noqa: BLE001 - best effort: dead workers are killed below
                pass
        if self._local is not None:
            self._local.stop(timeout)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - a group with a dead peer may fail to tear down cleanly
                print(f"graphdecode: tearing down torch.distributed: {' '.join(str(exc).split())[:300]}",
                      file=sys.stderr, flush=True)


def _shutdown_at_exit(ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown(timeout=5.0)

