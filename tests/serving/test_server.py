"""The OpenAI-compatible server, live on a loopback port, driven by the real `openai` client.

One server (module scope) serves most tests; greedy and seeded outputs must equal an
in-process LLM's on the same model. A second, small server checks SIGTERM draining."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from graphdecode import LLM, SamplingParams
from graphdecode.server.launch import start_server, stop_server
from tests.helpers import SMALL_ENGINE, signalled_mid_stream, stream_events

MODEL = "test-model"
MAX_MODEL_LEN = 1024
ENGINE = dict(SMALL_ENGINE, max_model_len=MAX_MODEL_LEN, max_batch_size=128)
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
L = f"model_name={MODEL}"  # the label on every /metrics sample
M = f"{{{L}}}"


def _start_server(model: str, log_path, *extra: str) -> tuple[subprocess.Popen, str]:
    return start_server(["--model", model, "--served-model-name", MODEL, "--threads", "1", "--no-access-log",
                         "--log-level", "warning", *extra], str(log_path), timeout_s=180)


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, url = _start_server(text_model, log, "-k", str(ENGINE["num_decode_steps"]), "--max-model-len",
                              str(MAX_MODEL_LEN), "--max-batch-size", str(ENGINE["max_batch_size"]))
    yield url
    assert stop_server(proc, 40) == 0, open(log).read()


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name plus sorted labels."""
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_models_health_and_metrics_endpoints(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").status_code == 200
    m = metrics(server)
    for name in (f"graphdecode:num_requests_running{M}", f"graphdecode:num_requests_waiting{M}",
                 f"graphdecode:prompt_tokens_total{M}", f"graphdecode:generation_tokens_total{M}",
                 f"graphdecode:time_to_first_token_seconds_count{M}",
                 f"graphdecode:inter_token_latency_seconds_count{M}", f"graphdecode:num_preemptions_total{M}",
                 f"graphdecode:windows_total{M}", f"graphdecode:requests_aborted_total{M}",
                 f"graphdecode:request_success_total{{finished_reason=length,{L}}}"):
        assert name in m, name


def test_completions_equal_llm_generate(client, llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    want = llm.generate(PROMPTS, params)
    one = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert one.choices[0].text == want[0].outputs[0].text
    assert one.choices[0].finish_reason == want[0].outputs[0].finish_reason
    assert one.usage.prompt_tokens == len(want[0].prompt_token_ids)
    assert one.usage.completion_tokens == len(want[0].outputs[0].token_ids)
    # a list of prompts: one engine request each, choices in prompt order
    many = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in many.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in many.choices] == [o.outputs[0].text for o in want]
    assert many.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    # token ids in, streamed out
    ids = want[1].prompt_token_ids
    text, reasons = "", []
    for chunk in client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stream=True):
        (c,) = chunk.choices
        text += c.text
        reasons.append(c.finish_reason)
    assert text == want[1].outputs[0].text
    assert reasons[-1] == want[1].outputs[0].finish_reason and not any(reasons[:-1])
    # stop strings and vLLM's extras
    stop_want = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, stop=[" "], ignore_eos=True,
                                                         min_tokens=2))
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=" ",
                                    extra_body={"ignore_eos": True, "min_tokens": 2})
    assert got.choices[0].text == stop_want[0].outputs[0].text
    assert got.choices[0].finish_reason == stop_want[0].outputs[0].finish_reason


def test_chat_equals_llm_chat(client, llm):
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10))[0]
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_n3_streamed_with_seed_equals_unstreamed(server, client, llm):
    prompt = "Parallel sampling: the n completions of one prompt share its prefill"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.9, n=3, seed=11)
    before = metrics(server)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        (c,) = chunk.choices  # one choice per chunk, each with its index
        streamed[c.index] = streamed.get(c.index, "") + c.text
    after = metrics(server)
    assert sorted(streamed) == [0, 1, 2]
    whole = client.completions.create(**kwargs)
    assert [c.text for c in whole.choices] == [streamed[i] for i in range(3)]
    want = llm.generate(prompt, SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10))[0]
    assert [c.text for c in whole.choices] == [c.text for c in want.outputs]
    num_prompt = len(want.prompt_token_ids)
    assert after[f"graphdecode:prompt_tokens_total{M}"] - before[f"graphdecode:prompt_tokens_total{M}"] == num_prompt
    assert after[f"graphdecode:prefill_tokens_total{M}"] - before[f"graphdecode:prefill_tokens_total{M}"] <= num_prompt


def test_logprobs_in_each_endpoints_format(client, llm):
    want = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for value, token_id, entry in zip(lp.token_logprobs, want.token_ids, want.logprobs):
        assert value == pytest.approx(entry[token_id].logprob, abs=1e-5)
    assert lp.text_offset[0] == 0 and all(len(t) >= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=3, stream=True)
    content = [t for c in chat if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(content) == 5
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy: the sampled token is the top one
        assert t.bytes == list(t.token.encode())


def test_raw_sse_stream_is_well_formed(server, llm):
    """The byte stream itself: `data: <json>` events, each ended by a blank line; the finish,
    then the usage chunk (no choices), then `data: [DONE]`, and nothing after."""
    want = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))[0].outputs[0]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 9, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    raw = httpx.post(f"{server}/v1/completions", json=body, timeout=60).content
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    assert all(c["usage"] is None for c in chunks[:-1] if "usage" in c)
    content = [c["choices"][0] for c in chunks[:-1]]
    assert "".join(c["text"] for c in content) == want.text
    assert content[-1]["finish_reason"] == "length" and not any(c["finish_reason"] for c in content[:-1])


def test_128_concurrent_streaming_clients(server, llm):
    prompts = [f"Client {i} asks: what comes next?" for i in range(128)]
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def main():
        async with AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*[one(client, p) for p in prompts])

    got = asyncio.run(main())
    assert [g[0] for g in got] == [o.outputs[0].text for o in want]
    assert all(g[1] == 8 for g in got)


def test_a_dropped_client_is_aborted_and_frees_its_row(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "A very long story", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = 0
            while seen < 2:
                seen += next(lines).startswith("data: ")
        # the response is closed mid-stream: the connection goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(server)
        if (m[f"graphdecode:requests_aborted_total{M}"] > before[f"graphdecode:requests_aborted_total{M}"]
                and m[f"graphdecode:num_requests_running{M}"] == 0
                and m[f"graphdecode:num_requests_unfinished{M}"] == 0):
            break
        time.sleep(0.05)
    assert m[f"graphdecode:requests_aborted_total{M}"] == before[f"graphdecode:requests_aborted_total{M}"] + 1
    assert m[f"graphdecode:num_requests_running{M}"] == 0
    generated = (m[f"graphdecode:engine_generated_tokens_total{M}"]
                 - before[f"graphdecode:engine_generated_tokens_total{M}"])
    assert generated < 1000  # it did not run to its end


BAD = [
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ("completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": "x", "stop": 5}, "stop"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": [5] * (MAX_MODEL_LEN + 10)}, "prompt"),
    ("completions", {"prompt": [5] * (MAX_MODEL_LEN - 8), "max_tokens": 100}, "max_tokens"),
    ("completions", {"prompt": [99999]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": 5, "content": "hi"}]}, "messages[0].role"),  # any str role is fine
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "n": 0, "stream": True}, "n"),
]


def test_bad_requests_are_400s_naming_the_field_and_disturb_nobody(server, client, llm):
    want = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    result = {}

    def good():
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        result["text"] = "".join(c.choices[0].text for c in stream)

    thread = threading.Thread(target=good)
    thread.start()
    with httpx.Client(base_url=f"{server}/v1", timeout=30) as http:
        for endpoint, body, param in BAD:
            r = http.post(f"/{endpoint}", json={"model": MODEL, **body})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (body, error)
            assert error["type"] == "invalid_request_error" and error["message"]
        r = http.post("/completions", json={"model": "gpt-9", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = http.post("/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"]
        # unknown fields are ignored, as OpenAI and vLLM do
        r = http.post("/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "frobnicate": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    thread.join(60)
    assert result["text"] == want.outputs[0].text
    m = metrics(server)
    assert m[f"graphdecode:requests_rejected_total{{{L},status=400}}"] >= len(BAD)


def test_metrics_parse_and_move(server, client):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="Count: one", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(server)
    moved = {name: after[name] - before.get(name, 0) for name in after}
    assert moved[f"graphdecode:generation_tokens_total{M}"] == 5
    assert moved[f"graphdecode:prompt_tokens_total{M}"] > 0
    assert moved[f"graphdecode:request_success_total{{finished_reason=length,{L}}}"] == 1
    assert moved[f"graphdecode:time_to_first_token_seconds_count{M}"] == 1
    assert moved[f"graphdecode:e2e_request_latency_seconds_count{M}"] == 1
    assert moved[f"graphdecode:windows_total{M}"] >= 1 and moved[f"graphdecode:engine_generated_tokens_total{M}"] == 5
    assert after[f"graphdecode:engine_alive{M}"] == 1


def test_sigterm_drains_running_requests_then_exits_0(text_model, tmp_path):
    log = tmp_path / "server.log"
    proc, url = _start_server(text_model, log, "-k", "1", "--max-model-len", "1024", "--max-batch-size", "4",
                              "--shutdown-timeout", "30")
    try:
        body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 600, "stream": True, "ignore_eos": True}
        texts, finish, refused, health = [], [], [], []
        with signalled_mid_stream(url, body, proc, signal.SIGTERM) as lines:
            start = time.monotonic()
            with httpx.Client(timeout=10) as other:  # a new client while draining
                while not refused and time.monotonic() - start < 10:
                    r = other.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
                    if r.status_code == 503:
                        refused.append(r.json()["error"]["message"])
                        health.append(other.get(f"{url}/health").status_code)
            for line in lines:
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    texts.append(choice["text"])
                    finish.append(choice["finish_reason"])
        assert refused and health == [503]
        assert finish[-1] == "length"  # the running request ran to its end
        assert proc.wait(40) == 0
        assert time.monotonic() - start < 35
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "draining" in open(log).read()


def test_unknown_route_is_an_openai_error(server):
    r = httpx.get(f"{server}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(f"{server}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


# Faults injected into the engine of a server (and of its core process) through a sitecustomize
# module on PYTHONPATH: Engine.prepare fails a request whose prompt holds FAULT:request (one
# request, inside the core), Engine.step raises once a request holding FAULT:core is in the engine.
FAULTS = """
from graphdecode.host import engine as _engine

_prepare, _step = _engine.Engine.prepare, _engine.Engine.step


def prepare(self, prompt_text, *args, **kwargs):
    if prompt_text and "FAULT:request" in prompt_text:
        raise RuntimeError("injected fault for one request")
    return _prepare(self, prompt_text, *args, **kwargs)


def step(self):
    if any(r.prompt and "FAULT:core" in r.prompt for r in self.requests.values()):
        raise RuntimeError("injected fault in the step loop")
    return _step(self)


_engine.Engine.prepare, _engine.Engine.step = prepare, step
"""


def _long_stream(url: str, result: dict) -> None:
    """A streamed completion that outlives the faults; `result`: its text, finish reasons and error events."""
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 150, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stream_events(url, body, result)


def test_a_request_that_fails_in_the_core_fails_alone_and_a_dead_core_ends_the_server(text_model, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAULTS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    log = tmp_path / "server.log"
    proc, url = start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1",
                              "--no-access-log", "--log-level", "warning", "-k", "2", "--max-model-len", "256",
                              "--max-batch-size", "8"], str(log), timeout_s=180, env=env)
    try:
        with httpx.Client(base_url=f"{url}/v1", timeout=60) as http:
            # 1. a request the core fails: a 500 for it (an error event when streamed); the others go on
            other: dict = {}
            thread = threading.Thread(target=_long_stream, args=(url, other))
            thread.start()
            r = http.post("/completions", json={"model": MODEL, "prompt": "FAULT:request", "max_tokens": 4})
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["type"] == "server_error" and "injected fault for one request" in error["message"]
            streamed = http.post("/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "FAULT:request"}], "stream": True})
            assert streamed.status_code == 200
            events = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
            assert [e["error"]["type"] for e in events if "error" in e] == ["server_error"]
            thread.join(120)
            assert other["finish"][-1] == "length" and not other["errors"]
            assert httpx.get(f"{url}/health").status_code == 200
            r = http.post("/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            # 2. the step loop raises: every running request ends with an error, and the server exits 1
            other = {}
            thread = threading.Thread(target=_long_stream, args=(url, other))
            thread.start()
            deadline = time.monotonic() + 60
            while not other.get("text") and time.monotonic() < deadline:
                time.sleep(0.05)
            r = http.post("/completions", json={"model": MODEL, "prompt": "FAULT:core", "max_tokens": 4})
            assert r.status_code == 503, r.text
            thread.join(60)
            assert [e["type"] for e in other["errors"]] == ["service_unavailable_error"]
            assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = open(log).read()
    assert "failed in the engine core" in text and "injected fault for one request" in text  # logged by the core
    assert "the engine core died" in text and "injected fault in the step loop" in text
