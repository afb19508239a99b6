"""Two graphdecode servers behind the real vLLM router (`vllm-router`, PyPI): 200 requests through the router,
nothing lost, both replicas used; one replica killed mid-run, and every request still answered (the router
moves them to the live one)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from graphdecode.device.tp_rank import free_port
from graphdecode.server.launch import start_server, stop_server

ROUTER = shutil.which("vllm-router")
MODEL = "routed"
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is a test dependency (pyproject's [test])")


def _finished(text: str) -> float:
    """engine_requests_finished from a /metrics page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("graphdecode:engine_requests_finished_total"))


def test_two_replicas_behind_vllm_router_lose_nothing_when_one_dies(text_model, tmp_path):
    servers = [start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1", "-k", "2",
                             "--max-model-len", "256", "--no-access-log", "--log-level", "warning"],
                            str(tmp_path / f"server{i}.log"), timeout_s=180) for i in range(2)]
    port = free_port()
    router_log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen(
        [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[url for _, url in servers],
         "--policy", "round_robin", "--retry-max-retries", "5", "--retry-initial-backoff-ms", "50",
         "--health-check-interval-secs", "1", "--log-level", "warning"],
        stdout=router_log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # the router is up once it answers a completion
            try:
                r = httpx.post(f"{base}/v1/completions", timeout=30,
                               json={"model": MODEL, "prompt": "warm", "max_tokens": 1})
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and router.poll() is None, (tmp_path / "router.log").read_text()
            time.sleep(0.3)

        before_kill = []

        async def run() -> list[int]:
            done = 0

            async def one(client, i):
                nonlocal done
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": f"Request {i} asks",
                                                               "max_tokens": 4, "ignore_eos": True})
                done += 1
                if done == 80:  # mid-run: replica 1 dies with requests in flight
                    before_kill.append(_finished((await client.get(f"{servers[1][1]}/metrics")).text))
                    os.kill(servers[1][0].pid, signal.SIGKILL)
                return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else r.text

            limits = httpx.Limits(max_connections=16)
            async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(one(client, i) for i in range(200)))

        results = asyncio.run(run())
        assert [status for status, _ in results] == [200] * 200, [r for r in results if r[0] != 200][:3]
        assert all(tokens == 4 for _, tokens in results)
        assert servers[1][0].wait(10) == -signal.SIGKILL
        live = _finished(httpx.get(f"{servers[0][1]}/metrics", timeout=30).text)
        assert before_kill[0] >= 20 and live >= 120  # both replicas answered; the live one took the rest
    finally:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(router.pid, signal.SIGKILL)
        router_log.close()
        for proc, _ in servers:
            if proc.poll() is None:
                stop_server(proc)
