"""Faults injected into a live server's engine core: stopped (SIGSTOP) and resumed, then killed (SIGKILL).

One server, with a 2 s heartbeat timeout, serves the module; the kill comes last, and a test that
finds the server gone starts another. The core is the server process's child running
`graphdecode.server.engine_core`, found through /proc."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from graphdecode.server.args import HEARTBEAT_INTERVAL_S
from graphdecode.server.launch import start_server, stop_server
from graphdecode.server.metrics import ServerMetrics
from tests.helpers import engine_config_stub, stream_events

pytestmark = pytest.mark.faults

MODEL = "fault-model"
HEARTBEAT_TIMEOUT = 2.0
P = "graphdecode:"


def _core_pid(server_pid: int) -> int:
    """The engine core: the server's child process running graphdecode.server.engine_core."""
    children = [int(pid) for path in glob.glob(f"/proc/{server_pid}/task/*/children")
                for pid in open(path).read().split()]
    cores = [pid for pid in children if b"graphdecode.server.engine_core" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(cores) == 1, children
    return cores[0]


def _gauges(url: str) -> dict[str, float]:
    """The /metrics samples whose only label is model_name, by name."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels == {"model_name": MODEL}}


def _until(predicate, timeout: float, step: float = 0.05) -> float:
    """Seconds until predicate() is true; fails after `timeout`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"not within {timeout} s"
        time.sleep(step)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def _servers():
    live: dict = {}
    yield live
    server = live.get("server")
    if server is not None and server.proc.poll() is None:
        assert stop_server(server.proc, 40) == 0, open(server.log).read()


@pytest.fixture
def server(_servers, text_model, tmp_path_factory):
    """The module's server (a fresh one if a test before ended it)."""
    server = _servers.get("server")
    if server is None or server.proc.poll() is not None:
        log = str(tmp_path_factory.mktemp("faults") / "server.log")
        proc, url = start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1",
                                  "--no-access-log", "--log-level", "warning", "-k", "2", "--max-model-len", "256",
                                  "--max-batch-size", "4", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)],
                                 log, timeout_s=180)
        server = _servers["server"] = SimpleNamespace(proc=proc, url=url, log=log)
    return server


def _complete(url: str, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens},
                      timeout=30)


def test_a_stopped_core_turns_health_503_within_the_heartbeat_timeout_and_200_once_it_runs(server):
    url, core = server.url, _core_pid(server.proc.pid)
    time.sleep(HEARTBEAT_TIMEOUT + 0.5)  # idle past the timeout: only its beats are heard
    gauges = _gauges(url)
    assert gauges[f"{P}engine_heartbeat_age_seconds"] < HEARTBEAT_TIMEOUT
    assert gauges[f"{P}engine_alive"] == 1 and gauges[f"{P}engine_step_seconds"] == 0
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}

    os.kill(core, signal.SIGSTOP)
    try:
        waited = _until(lambda: httpx.get(f"{url}/health").status_code == 503, HEARTBEAT_TIMEOUT + 2)
        assert waited <= HEARTBEAT_TIMEOUT + 1  # its last beat came at most an interval before the stop
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "unresponsive" and "--heartbeat-timeout" in health["reason"]
        r = _complete(url)  # not served while the core is stopped
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable_error"
        assert "has not answered" in r.json()["error"]["message"]
        gauges = _gauges(url)
        assert gauges[f"{P}engine_heartbeat_age_seconds"] > HEARTBEAT_TIMEOUT  # stale, and says so
        assert gauges[f"{P}engine_alive"] == 1
    finally:
        os.kill(core, signal.SIGCONT)

    _until(lambda: httpx.get(f"{url}/health").status_code == 200, HEARTBEAT_INTERVAL_S + 2)
    r = _complete(url)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert _gauges(url)[f"{P}engine_heartbeat_age_seconds"] < HEARTBEAT_TIMEOUT
    text = open(server.log).read()
    assert "has not answered" in text and "heard from again" in text


def test_a_killed_core_is_logged_by_its_signal_and_the_server_exits_1_within_5_s(server):
    url, core = server.url, _core_pid(server.proc.pid)
    stream: dict = {"finish": [], "errors": []}
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    reader = threading.Thread(target=stream_events, args=(url, body, stream, 30))
    reader.start()
    _until(lambda: len(stream["finish"]) > 0, 30)
    os.kill(core, signal.SIGKILL)
    start = time.monotonic()
    code = server.proc.wait(10)
    elapsed = time.monotonic() - start
    reader.join(10)
    text = open(server.log).read()
    assert code == 1 and elapsed < 5, (code, elapsed, text)
    died = [line for line in text.splitlines() if line.startswith("ERROR:") and "engine core died" in line]
    assert len(died) == 1 and "killed by SIGKILL" in died[0], text
    assert [e["type"] for e in stream["errors"]] == ["service_unavailable_error"]  # the stream ended, not hung


def test_the_engine_gauges_read_0_once_the_core_died():
    """The running and waiting gauges and KV usage are the core's figures while it lives, 0 after;
    counters keep their values, and the heartbeat age goes on."""
    load = {"num_running_seqs": 3, "num_waiting_seqs": 2, "kv_pages_in_use": 5, "kv_pages": 10, "windows": 7,
            "state_slots_in_use": 2, "state_slots": 8, "state_snapshots_cached": 4}
    engine = SimpleNamespace(config=engine_config_stub(), load=load, dead=None, is_dead=False,
                             heartbeat_age=0.4, step_seconds=0.25)

    def gauges():
        text = ServerMetrics(engine, MODEL, P).exposition()[0].decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    alive = gauges()
    assert (alive[f"{P}num_requests_running"], alive[f"{P}num_requests_waiting"]) == (3, 2)
    assert alive[f"{P}kv_cache_usage_perc"] == 0.5 and alive[f"{P}engine_alive"] == 1
    assert alive[f"{P}engine_heartbeat_age_seconds"] == 0.4 and alive[f"{P}engine_step_seconds"] == 0.25
    assert (alive[f"{P}state_slots_in_use"], alive[f"{P}state_slots"], alive[f"{P}state_snapshots_cached"]) == (2, 8, 4)
    engine.is_dead, engine.dead, engine.heartbeat_age = True, "the engine core process exited", 12.0
    dead = gauges()
    assert (dead[f"{P}num_requests_running"], dead[f"{P}num_requests_waiting"]) == (0, 0)
    assert dead[f"{P}kv_cache_usage_perc"] == 0 and dead[f"{P}engine_alive"] == 0
    assert dead[f"{P}state_slots_in_use"] == 0
    assert dead[f"{P}engine_heartbeat_age_seconds"] == 12.0 and dead[f"{P}windows_total"] == 7


@pytest.mark.parametrize("value", ["1", "0", "-3", "nan"])
def test_a_heartbeat_timeout_not_above_the_interval_is_refused_by_name(value, capsys):
    from graphdecode.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--heartbeat-timeout", value])
    assert exit_.value.code == 2
    assert "--heartbeat-timeout" in capsys.readouterr().err


def test_the_smallest_pool_preempts_and_changes_no_output(text_model, tmp_path):
    """A KV pool of one sequence's pages plus one (`--num-gpu-blocks-override`) under 12 concurrent
    streams: requests are preempted and recomputed, every output equals the same request run
    alone, and every page is free afterwards."""
    log = str(tmp_path / "server.log")
    max_len = 64  # 4 pages of 16: the pool holds one full sequence and a spare page
    proc, url = start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1",
                              "--no-access-log", "--log-level", "warning", "-k", "2", "--max-model-len",
                              str(max_len), "--max-batch-size", "8", "--num-gpu-blocks-override", "6"],
                             log, timeout_s=180)
    try:
        prompts = [f"Story {i}: once upon a time" for i in range(12)]

        def body(prompt: str) -> dict:
            return {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}

        results: dict[str, str] = {}

        def run(prompt: str) -> None:
            response = httpx.post(f"{url}/v1/completions", json=body(prompt), timeout=120)
            assert response.status_code == 200, response.text
            results[prompt] = response.json()["choices"][0]["text"]

        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert len(results) == len(prompts)
        gauges = _gauges(url)
        assert gauges[f"{P}num_preemptions_total"] > 0
        for prompt in prompts:  # alone, one at a time: nothing to preempt
            alone = httpx.post(f"{url}/v1/completions", json=body(prompt), timeout=120).json()["choices"][0]["text"]
            assert results[prompt] == alone, prompt
        _until(lambda: _gauges(url)[f"{P}kv_cache_usage_perc"] == 0, 5)
    finally:
        assert stop_server(proc, 40) == 0, open(log).read()
