"""A tensor-parallel worker (ranks 1..N-1): builds its shard of the model runner, then
applies every plan the driver broadcasts, exactly as the driver's runner does.

It leaves its loop on a None plan (shutdown), and exits at once when the pipe from the
driver reads EOF (the driver died): a watcher thread, so no worker outlives its engine.
Its first act is a message on `started`: the driver waits for it (a worker that exits
during its bootstrap, before it gets here, is reported at once; see tensor_parallel.py).
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist


def _exit_when_driver_is_gone(watched) -> None:
    try:
        watched.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def run_worker(rank: int, world_size: int, port: int, config, watched, started) -> None:
    started.send(os.getpid())
    started.close()
    threading.Thread(target=_exit_when_driver_is_gone, args=(watched,), daemon=True).start()
    torch.set_num_threads(config.cpu_threads)  # before init: the runner sets it again on CPU
    from .runner import ModelRunner
    from .tp_rank import init_rank

    tp, plans = init_rank(rank, world_size, port, config.torch_device)
    with torch.inference_mode():
        runner = ModelRunner(config, tp)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=plans)
            message = box[0]
            if message is None:
                break
            if isinstance(message, str):  # a question from the driver
                dist.gather_object(_answer(runner, message), None, dst=0, group=plans)
                continue
            runner.execute(message)
    dist.destroy_process_group()


def _answer(runner, question: str):
    if question == "sizes":
        return runner.memory_sizes()
    raise ValueError(f"unknown question {question!r}")
