"""Two graphdecode servers behind the real vLLM router (`vllm-router`, PyPI): 200 requests through the router,
nothing lost, both replicas used; one replica killed mid-run, and every request still answered (the router
moves them to the live one). And the router's kv_aware policy, fed our KV events, sends a prompt's extensions
to the replica that holds its pages."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from graphdecode.device.tp_rank import free_port
from graphdecode.server.launch import start_server, stop_server

# on PATH, or beside this interpreter (a venv run by its python without being activated)
ROUTER = shutil.which("vllm-router") or shutil.which("vllm-router", path=os.path.dirname(sys.executable))
MODEL = "routed"
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is a test dependency (pyproject's [test])")


@contextlib.contextmanager
def routed(servers: list, tmp_path, *policy: str):
    """vllm-router in front of `servers` ((process, url) each) with `policy` flags; yields its URL once it answers a
    completion, and stops it and the servers afterwards."""
    port = free_port()
    log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                               *[url for _, url in servers], *policy, "--log-level", "warning"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.post(f"{base}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": [5, 6], "max_tokens": 1}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and router.poll() is None, (tmp_path / "router.log").read_text()
            time.sleep(0.3)
        yield base
    finally:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(router.pid, signal.SIGKILL)
        log.close()
        for proc, _ in servers:
            if proc.poll() is None:
                stop_server(proc)


FINISHED, HITS = "graphdecode:engine_requests_finished_total", "graphdecode:prefix_cache_hits_total"


def _counters(text: str) -> dict[str, float]:
    """The requests finished and prefix-cache hits on a /metrics page."""
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
            for name in (FINISHED, HITS)}


def test_two_replicas_behind_vllm_router_lose_nothing_when_one_dies(text_model, tmp_path):
    servers = [start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1", "-k", "2",
                             "--max-model-len", "256", "--no-access-log", "--log-level", "warning"],
                            str(tmp_path / f"server{i}.log"), timeout_s=180) for i in range(2)]
    with routed(servers, tmp_path, "--policy", "round_robin", "--retry-max-retries", "5",
                "--retry-initial-backoff-ms", "50", "--health-check-interval-secs", "1") as base:
        before_kill = []

        async def run() -> list[int]:
            done = 0

            async def one(client, i):
                nonlocal done
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": f"Request {i} asks",
                                                               "max_tokens": 4, "ignore_eos": True})
                done += 1
                if done == 80:  # mid-run: replica 1 dies with requests in flight
                    before_kill.append(_counters((await client.get(f"{servers[1][1]}/metrics")).text)[FINISHED])
                    os.kill(servers[1][0].pid, signal.SIGKILL)
                return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else r.text

            limits = httpx.Limits(max_connections=16)
            async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(one(client, i) for i in range(200)))

        results = asyncio.run(run())
        assert [status for status, _ in results] == [200] * 200, [r for r in results if r[0] != 200][:3]
        assert all(tokens == 4 for _, tokens in results)
        assert servers[1][0].wait(10) == -signal.SIGKILL
        live = _counters(httpx.get(f"{servers[0][1]}/metrics", timeout=30).text)[FINISHED]
        assert before_kill[0] >= 20 and live >= 120  # both replicas answered; the live one took the rest


def test_vllm_router_routes_by_our_kv_events(text_model, tmp_path):
    """vllm-router's kv_aware policy, fed each replica's KV events (kv_events_config): a prompt prefilled on one
    replica (sent to it directly) draws every later request that extends it through the router to that replica."""
    events = [free_port(), free_port()]
    servers = [start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1", "-k", "2",
                             "--max-model-len", "512", "--no-access-log", "--log-level", "warning",
                             "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
                             f'"endpoint": "tcp://*:{port}"}}'], str(tmp_path / f"server{i}.log"), timeout_s=180)
               for i, port in enumerate(events)]
    policy = ["--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", text_model]
    for (_, url), event_port in zip(servers, events):
        policy += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{event_port}"]
    with routed(servers, tmp_path, *policy) as base:
        for trial, holder in enumerate([1, 0, 1]):
            prompt = [(37 * trial + 11 * i) % 400 + 10 for i in range(160)]  # ten pages, token ids as the API takes
            httpx.post(f"{servers[holder][1]}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            time.sleep(1.0)  # the stored pages' events reach the router
            before = [_counters(httpx.get(f"{url}/metrics", timeout=30).text) for _, url in servers]
            for j in range(4):
                r = httpx.post(f"{base}/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": prompt + [500 + j, 501 + j], "max_tokens": 2})
                assert r.status_code == 200, r.text
            after = [_counters(httpx.get(f"{url}/metrics", timeout=30).text) for _, url in servers]
            gained = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
            assert gained[holder][FINISHED] == 4, gained
            assert gained[holder][HITS] >= 4 * 160, gained
            assert gained[1 - holder][FINISHED] == 0, gained
