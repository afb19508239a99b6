"""Data-parallel replicas behind one API server: `graphdecode serve --data-parallel-size N`.

N engine cores, each a whole engine in its own process (AsyncLLM's core, server/engine_core.py) with its own
KV pool and batch; on a CPU each gets its share of the cores (cpu_threads: the usable cores / N / its ranks,
unless given), on CUDA its own block of GPUs (CUDA_VISIBLE_DEVICES). This API server tokenizes and checks a
request once, then hands it to the replica with the fewest unfinished requests of this server (its queue
length; ties go round robin), and streams that replica's deltas back; an abort goes to the replica that holds
the request. Metrics carry an `engine` label (the replica's index, as vLLM's do); /health is the worst of the
replicas': a replica whose core dies is named (`replica 1: ...`) and, as with one engine, the server exits 1
so that its supervisor restarts it, and the requests it held end with an error.

`DataParallelLLM` offers the part of AsyncLLM's interface the server uses (config, tokenizer, inputs, generate,
abort, stats, the weight updates, is_dead, heartbeat_age, death_cause, reported, shutdown), so the app is the same either way.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

from ..config import CPU_THREADS_ENV, usable_cores
from .async_llm import AsyncLLM, EngineDeadError, start_engine_core


class DataParallelLLM:
    def __init__(self, model: str, size: int, **engine_args):
        if size < 2:
            raise ValueError(f"data_parallel_size must be >= 2 for replicas, got {size}")
        ranks = engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
        if size * ranks > max(usable_cores(), _gpu_count()):  # before any replica starts
            raise ValueError(f"data_parallel_size ({size}): {size} replicas of {ranks} rank(s) each need more than "
                             f"this machine's {usable_cores()} usable cores and {_gpu_count()} GPUs")
        if engine_args.get("cpu_threads") is None and not os.environ.get(CPU_THREADS_ENV, "").strip():
            engine_args = dict(engine_args, cpu_threads=max(1, usable_cores() // (size * ranks)))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else None

        def start(index: int):  # replica `index` tags its KV events with it (and offsets their ports by it)
            env = None if engine_args.get("device") == "cpu" else _replica_devices(index, ranks, devices)
            return start_engine_core(model, dict(engine_args, data_parallel_rank=index), 1, env=env)

        with ThreadPoolExecutor(size) as pool:  # the cores load their models at once
            started = list(pool.map(start, range(size)))
        self.replicas: list[AsyncLLM] = []
        try:
            for process, [(requests, outputs)] in started:
                self.replicas.append(AsyncLLM.over(process, requests, outputs))
        except BaseException:
            for replica in self.replicas:
                replica.shutdown(timeout=2.0)
            for process, _ in started[len(self.replicas):]:
                process.kill()
            raise
        first = self.replicas[0]
        self.config, self.tokenizer, self.inputs = first.config, first.tokenizer, first.inputs
        self._turn = itertools.count()

    # ------------------------------------------------------------- requests
    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompt, sampling_params=None, request_id: str | None = None, priority: int = 0,
                 lora_request=None):
        """The request on the replica with the fewest unfinished requests (AsyncLLM.generate's checks and stream)."""
        request_id = str(request_id) if request_id is not None else uuid.uuid4().hex
        if any(request_id in replica._queues for replica in self.replicas):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        dead = self._dead_replica()
        if dead is not None:
            raise EngineDeadError(self.death_cause(0))
        turn, count = next(self._turn), len(self.replicas)
        chosen = min(range(count), key=lambda i: (self.replicas[i].num_unfinished, (i - turn) % count))
        return self.replicas[chosen].generate(prompt, sampling_params, request_id, priority, lora_request)

    async def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            if str(request_id) in replica._queues:
                await replica.abort(request_id)

    async def stats(self) -> dict:
        """Each replica's stats() under "replicas", and their sums for the numeric counters."""
        each = [await replica.stats() for replica in self.replicas]
        total = {key: sum(s[key] for s in each) for key, value in each[0].items()
                 if isinstance(value, (int, float)) and not isinstance(value, bool)}
        return {**total, "replicas": each}

    async def update_weights(self, weights, weight_version: str | None = None, abort_all_requests: bool = False):
        """Every replica's weights (AsyncLLM.update_weights), at once; the first replica's WeightUpdate."""
        weights = list(weights.items() if isinstance(weights, dict) else weights)
        return (await asyncio.gather(*[replica.update_weights(weights, weight_version, abort_all_requests)
                                       for replica in self.replicas]))[0]

    async def update_weights_from_disk(self, model_path, weight_version: str | None = None,
                                       abort_all_requests: bool = False):
        return (await asyncio.gather(*[replica.update_weights_from_disk(model_path, weight_version,
                                                                        abort_all_requests)
                                       for replica in self.replicas]))[0]

    async def get_weight_version(self) -> str:
        return await self.replicas[0].get_weight_version()

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await asyncio.gather(*[replica.pause_generation(mode, clear_cache) for replica in self.replicas])

    async def resume_generation(self) -> None:
        await asyncio.gather(*[replica.resume_generation() for replica in self.replicas])

    async def is_paused(self) -> bool:
        return any([await replica.is_paused() for replica in self.replicas])

    @property
    def num_unfinished(self) -> int:
        return sum(replica.num_unfinished for replica in self.replicas)

    @property
    def loads(self) -> list[dict]:
        """Each replica's latest gauges (metrics label them by engine index)."""
        return [replica.load for replica in self.replicas]

    # ---------------------------------------------------------------- health
    def _dead_replica(self) -> int | None:
        return next((i for i, replica in enumerate(self.replicas) if replica.is_dead), None)

    @property
    def is_dead(self) -> bool:
        return self._dead_replica() is not None

    @property
    def heartbeat_age(self) -> float:
        return max(replica.heartbeat_age for replica in self.replicas)

    @property
    def reported(self) -> str | None:
        dead = self._dead_replica()
        return self.replicas[dead].reported if dead is not None else None

    def death_cause(self, wait_s: float = 1.0) -> str:
        dead = self._dead_replica()
        if dead is None:
            return "no replica has died"
        return f"replica {dead} of {len(self.replicas)}: {self.replicas[dead].death_cause(wait_s)}"

    # ---------------------------------------------------------------- lifecycle
    def shutdown(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _replica_devices(index: int, ranks: int, devices: list[str] | None) -> dict | None:
    """The environment of replica `index`'s core on CUDA: its block of `ranks` GPUs; None without CUDA."""
    import torch

    if devices is None:
        if not torch.cuda.is_available():
            return None
        devices = [str(i) for i in range(torch.cuda.device_count())]
    block = devices[index * ranks:(index + 1) * ranks]
    if len(block) < ranks:
        raise ValueError(f"data_parallel_size: replica {index} needs {ranks} GPU(s), only {len(devices)} are "
                         f"visible for every replica's {ranks}")
    return dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(block))
