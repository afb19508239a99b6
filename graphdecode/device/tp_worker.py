"""A tensor-parallel worker (every rank but 0): joins the ranks, takes the driver's engine config, builds
its shard of the model runner, then applies every plan the driver broadcasts, exactly as the driver's
runner does.

It leaves its loop on a None plan (shutdown). A worker spawned on the driver's machine exits at once when
the pipe from the driver reads EOF (the driver died): a watcher thread, so no worker outlives its engine;
its first act is a message on `started`, which the driver waits for (a worker that exits during its
bootstrap, before it gets here, is reported at once; see tensor_parallel.py). A worker on another node
(tp_headless.py) or under torchrun (launched.py) learns that the driver is gone from its connection: the
wait for the next plan raises, and `serve_rank` says so in one line and exits non-zero.

Every rank runs the driver's config (its KV pool, buckets and options must be the driver's to the page),
with its own machine's thread count: the config crosses once, over the plans group, after the rendezvous.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .tp_rank import Placement, init_rank, parallel_groups


def _exit_when_driver_is_gone(watched) -> None:
    try:
        watched.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def run_worker(rank: int, place: Placement, config, watched, started, environ: dict) -> None:
    """A rank spawned by a driver or a headless node (its parent holds the other end of `watched`), in the
    parent's environment `environ` (a forkserver's child starts in the server's)."""
    os.environ.clear()
    os.environ.update(environ)
    started.send(os.getpid())
    started.close()
    threading.Thread(target=_exit_when_driver_is_gone, args=(watched,), daemon=True).start()
    serve_rank(rank, place, config.cpu_threads, config.torch_device)


def share_config(plans, config) -> None:
    """The driver's half of the config exchange (after init_rank)."""
    dist.broadcast_object_list([config], src=0, group=plans)


def serve_rank(rank: int, place: Placement, cpu_threads: int, device: torch.device) -> None:
    """Join the ranks as `rank`, take the driver's config (with this machine's cpu_threads), and apply its plans
    until it shuts down. A driver that goes away mid-run: one line on stderr, exit status 1."""
    torch.set_num_threads(cpu_threads)  # before init: the runner sets it again on CPU
    from .runner import ModelRunner

    plans = init_rank(rank, place, device, driver=False)
    box = [None]
    dist.broadcast_object_list(box, src=0, group=plans)
    config = copy.copy(box[0])
    object.__setattr__(config, "cpu_threads", cpu_threads)
    tp = parallel_groups(rank, config)
    try:
        with torch.inference_mode():
            runner = ModelRunner(config, tp)
            while True:
                box = [None]
                dist.broadcast_object_list(box, src=0, group=plans)
                message = box[0]
                if message is None:
                    dist.barrier(group=plans)  # the driver's goodbye: each rank tears down once all are here
                    break
                if isinstance(message, str):  # a question from the driver
                    dist.gather_object(_answer(runner, message), None, dst=0, group=plans)
                    continue
                if isinstance(message, NewWeights):  # the driver checked them: this rank writes its part
                    dist.gather_object(_write_weights(runner, message), None, dst=0, group=plans)
                    continue
                runner.execute(message)
    except (RuntimeError, OSError) as exc:  # the driver (or another rank) went away mid-collective
        print(f"graphdecode: tensor-parallel rank {rank}: the engine's ranks lost each other, leaving: "
              f"{' '.join(str(exc).split())[:500]}", file=sys.stderr, flush=True)
        os._exit(1)
    dist.destroy_process_group()


@dataclass(frozen=True)
class NewWeights:
    """The driver's weight update (Engine.update_weights): (name, tensor) pairs, every rank writes its part."""

    weights: list


def _write_weights(runner, message: NewWeights):
    """(names written, names skipped), or the refusal's text (the driver checked first: not expected)."""
    try:
        return runner.update_weights(message.weights)
    except (ValueError, TypeError) as exc:
        return f"tensor-parallel rank {dist.get_rank()}: {exc}"


def _answer(runner, question: str):
    if question == "sizes":
        return runner.memory_sizes()
    raise ValueError(f"unknown question {question!r}")
