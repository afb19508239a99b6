"""Simulated streaming users for the serving benchmark (profiling/bench_serve.py).

Each user is its own client object with its own kept-alive connection, as N separate
users would be, and streams one completion, recording when it started, when the
response headers came, when each content chunk came, and when it ended. Clients run in
this process's event loop, or spread over worker processes (`ClientPool(procs=P)`) so
that issuing and parsing requests is not bound to one Python process on a machine with
cores to spare. Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux), comparable
across the processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import time

MODEL_NAME = "bench"  # the name the benchmark's server is started with


async def one_openai(client, prompt, max_tokens: int) -> dict:
    start = time.perf_counter()
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    headers = time.perf_counter()
    times, tokens = [], 0
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:  # a content chunk: new tokens (their text may be held back) or the finish
            times.append(now)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"start": start, "headers": headers, "end": time.perf_counter(), "times": times, "tokens": tokens}


async def one_raw(client, prompt, max_tokens: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        headers = time.perf_counter()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                times.append(now)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"start": start, "headers": headers, "end": time.perf_counter(), "times": times, "tokens": tokens}


def make_client(url: str, kind: str):
    """One client per simulated user, as N separate users would be: each with its own connection,
    opened by the warm-up and kept alive, so no level pays for client construction or TCP set-up.
    (One client shared by all would measure httpcore's connection pool, whose every request scans
    all pooled connections: quadratic in N.)"""
    if kind == "raw":
        import httpx

        return httpx.AsyncClient(base_url=url, timeout=600)
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)


async def run_clients(clients: list, prompts: list, max_tokens: int, kind: str) -> list[dict]:
    one = one_raw if kind == "raw" else one_openai
    return await asyncio.gather(*[one(client, p, max_tokens) for client, p in zip(clients, prompts)])


class ClientPool:
    """`count` users against `url`, in this process (procs=1) or spread round-robin over
    `procs` worker processes that start each run together."""

    def __init__(self, url: str, kind: str, count: int, procs: int = 1):
        if procs < 1:
            raise ValueError(f"procs: must be at least 1, got {procs}")
        self.url, self.kind, self.count, self.procs = url, kind, count, procs
        self._stack = contextlib.AsyncExitStack()
        self._clients: list = []
        self._workers: list = []  # (process, connection)

    @property
    def pids(self) -> list[int]:
        """The worker processes (their CPU time is the client's too)."""
        return [proc.pid for proc, _ in self._workers]

    async def __aenter__(self):
        if self.procs == 1:
            self._clients = [await self._stack.enter_async_context(make_client(self.url, self.kind))
                             for _ in range(self.count)]
            return self
        context = multiprocessing.get_context("spawn")
        for i in range(self.procs):
            mine, theirs = context.Pipe()
            share = len(range(i, self.count, self.procs))
            proc = context.Process(target=_worker, args=(theirs, self.url, self.kind, share), daemon=True)
            proc.start()
            theirs.close()
            self._workers.append((proc, mine))
        return self

    async def __aexit__(self, *exc):
        for proc, conn in self._workers:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc, conn in self._workers:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
            conn.close()
        await self._stack.aclose()

    async def run(self, prompts: list, max_tokens: int) -> list[dict]:
        """One completion per prompt, prompt i by user i; the records of all of them."""
        if self.procs == 1:
            return await run_clients(self._clients, prompts, max_tokens, self.kind)
        start_at = time.perf_counter() + 0.1  # every worker starts its share at the same moment
        busy = []
        for i, (_, conn) in enumerate(self._workers):
            share = prompts[i :: self.procs]
            if share:
                conn.send(("run", share, max_tokens, start_at))
                busy.append(conn)
        loop = asyncio.get_running_loop()
        replies = await asyncio.gather(*[loop.run_in_executor(None, conn.recv) for conn in busy])
        for reply in replies:
            if isinstance(reply, str):
                raise RuntimeError(f"a client worker failed:\n{reply}")
        return [record for reply in replies for record in reply]


def _worker(conn, url: str, kind: str, count: int) -> None:
    asyncio.run(_worker_loop(conn, url, kind, count))


async def _worker_loop(conn, url: str, kind: str, count: int) -> None:
    import traceback

    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(make_client(url, kind)) for _ in range(count)]
        while True:
            message = await loop.run_in_executor(None, conn.recv)
            if message is None:
                return
            _, prompts, max_tokens, start_at = message
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            try:
                conn.send(await run_clients(clients, prompts, max_tokens, kind))
            except Exception:  # noqa: BLE001 - reported to the parent, which raises it
                conn.send(traceback.format_exc())
