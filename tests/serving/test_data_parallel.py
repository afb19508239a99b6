"""`--data-parallel-size 2`: two engine cores behind one API server. Concurrent clients (the real `openai`
client) all get their answers, the same greedy text as one engine gives; both replicas take requests (metrics
labelled by engine); a replica whose core is killed is named and the server exits 1; misplaced flags are refused."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import openai
import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.server.launch import start_server, stop_server
from tests.helpers import one_line_cli_error
from tests.serving.test_api_servers import _alive, _children

MODEL = "replicas"
ENGINE = ["--threads", "1", "-k", "2", "--max-model-len", "256", "--max-batch-size", "8"]


def _start(text_model, log, *extra):
    return start_server(["--model", text_model, "--served-model-name", MODEL, "--no-access-log", "--log-level",
                         "warning", "--data-parallel-size", "2", *ENGINE, *extra], str(log), timeout_s=180)


def _samples(url: str, name: str) -> dict[str, float]:
    """engine label -> value of metric `name`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line)
            found[engine.group(1) if engine else ""] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_two_replicas_answer_every_client_as_one_engine_would(text_model, tmp_path):
    prompts = [f"Request {i} is about" for i in range(24)]
    reference = LLM(text_model, num_decode_steps=2, max_model_len=256, max_batch_size=8, cpu_threads=1)
    want = [o.outputs[0].text for o in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=6))]
    proc, url = _start(text_model, tmp_path / "server.log")
    try:
        cores = [pid for pid, cmd in _children(proc.pid).items() if "graphdecode.server.engine_core" in cmd]
        assert len(cores) == 2

        async def ask_all():
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            async with client:
                return await asyncio.gather(*(client.completions.create(
                    model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts))

        answers = asyncio.run(ask_all())
        assert [a.choices[0].text for a in answers] == want
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
        finished = _samples(url, "graphdecode:engine_requests_finished_total")
        assert set(finished) == {"0", "1"} and all(v > 0 for v in finished.values()), finished
        assert sum(finished.values()) == len(prompts)
        assert set(_samples(url, "graphdecode:num_requests_waiting")) == {"0", "1"}
        assert set(_samples(url, "graphdecode:kv_cache_usage_perc")) == {"0", "1"}
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200

        os.kill(cores[1], signal.SIGKILL)  # one replica's core dies: named, and the server exits 1
        assert proc.wait(60) == 1
        log = (tmp_path / "server.log").read_text()
        assert re.search(r"replica [01] of 2: killed by SIGKILL", log), log[-3000:]
        for pid in cores:
            assert not _alive(pid)
    finally:
        if proc.poll() is None:
            stop_server(proc)


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-size", "2", "--api-server-count", "2"], "--data-parallel-size 2: one API server"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["--data-parallel-size", str(2**63)], "usable cores"),  # refused before any replica starts
])
def test_misplaced_replica_flags_are_refused(text_model, capsys, flags, message):
    assert message in one_line_cli_error(capsys, ["serve", "--model", text_model, *flags])
