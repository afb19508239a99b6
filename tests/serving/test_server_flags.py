"""Server-wide flags of vLLM's command lines. --api-key: every route but the probes needs a key, sent as the
OpenAI clients send it (Bearer) or as the Anthropic clients do (x-api-key); CORS (--allowed-origins ...)
answers browsers' preflights and reaches their scripts with the errors too; --chat-template replaces the
tokenizer's on every chat-shaped endpoint; --seed, --max-num-seqs, --enforce-eager reach the engine. One live
server for the module, the real openai and anthropic clients."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import ssl
import subprocess
import time

import anthropic
import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from graphdecode import LLM, SamplingParams
from graphdecode.config import EngineConfig
from graphdecode.engine_args import engine_kwargs, engine_options, token_count
from graphdecode.server.args import add_serve_args, check_serve_args
from graphdecode.server.auth import api_keys
from graphdecode.server.launch import start_server, stop_server
from graphdecode.server.stat_logger import StatLogger
from tests.helpers import live_server, one_line_cli_error

MODEL = "guarded-model"
KEYS = ("first-key", "second-key")
ORIGIN = "https://app.example"
ALIAS = "guarded-alias"


TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" \
           "{% if add_generation_prompt %}[assistant] {% endif %}"


LOG = {}  # the module server's log file


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    where = tmp_path_factory.mktemp("server_flags")
    (where / "template.jinja").write_text(TEMPLATE)
    LOG["path"] = where / "server.log"
    with live_server(text_model, where, MODEL, "--max-model-len", "256", "--api-key", *KEYS,
                     "--allowed-origins", f'["{ORIGIN}"]', "--chat-template", str(where / "template.jinja"),
                     "--log-stats-interval", "0.3", "--served-model-name", MODEL, ALIAS,
                     "--enable-request-id-headers") as url:
        yield url


def test_keys_from_the_flag_or_the_environment(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(None) == [] and api_keys(["a", "b"]) == ["a", "b"]
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys(None) == ["from-env"] and api_keys(["a"]) == ["a"]  # the flag wins
    monkeypatch.setenv("VLLM_API_KEY", " ")
    with pytest.raises(ValueError, match="VLLM_API_KEY: an API key must not be empty"):
        api_keys(None)
    monkeypatch.delenv("VLLM_API_KEY")
    assert "--api-key: an API key must not be empty" in one_line_cli_error(capsys, ["serve", "--api-key", ""])


def test_openai_clients_need_a_key(server):
    for key in KEYS:
        with openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0) as client:
            out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
            assert out.choices[0].finish_reason == "length"
    with openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert info.value.status_code == 401
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # guarded by default: every route but the probes, an unknown one too (a 401 before a 404)
    for path in ("/v1/models", "/v1/no-such-route", "/invocations", "/v1/responses/resp_1"):
        assert httpx.get(f"{server}{path}").status_code == 401, path
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"bearer {KEYS[0]}"}).status_code == 200
    for path in ("/health", "/metrics", "/version", "/load"):
        assert httpx.get(f"{server}{path}").status_code == 200, path


def test_anthropic_clients_send_x_api_key(server):
    hi = [{"role": "user", "content": "Hi"}]
    with anthropic.Anthropic(base_url=server, api_key=KEYS[1], max_retries=0) as claude:
        message = claude.messages.create(model=MODEL, max_tokens=2, messages=hi)
        assert message.stop_reason == "max_tokens"
    with anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0) as claude:
        with pytest.raises(anthropic.AuthenticationError) as info:
            claude.messages.create(model=MODEL, max_tokens=2, messages=hi)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_cors_preflights_and_errors_reach_the_allowed_origin(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = httpx.options(f"{server}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN  # no key on a preflight
    r = httpx.options(f"{server}/v1/chat/completions", headers={"Origin": "https://other.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{server}/v1/completions", headers={"Origin": ORIGIN}, json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_the_servers_chat_template(server, text_model):
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    expected = tokenizer("[system] Be brief.\n[user] Hi\n[assistant] ", add_special_tokens=False)["input_ids"]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True) != "[user] Hi\n[assistant] "
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=60, json={
        "model": MODEL, "messages": conversation, "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == expected, r.text
    with anthropic.Anthropic(base_url=server, api_key=KEYS[0], max_retries=0) as claude:  # Messages too
        message = claude.messages.create(model=MODEL, max_tokens=1, system="Be brief.",
                                         messages=[{"role": "user", "content": "Hi"}])
    assert message.usage.input_tokens == len(expected)


@pytest.mark.parametrize("value, fragment", [
    ("no-such-file.jinja", "is not a file, nor a Jinja template"),
    ("{% for m in messages %}{{ m.content }}", "the template does not compile"),
])
def test_a_bad_chat_template_stops_start_up(capsys, value, fragment):
    assert fragment in one_line_cli_error(capsys, ["serve", "--chat-template", value], clean=True)


def test_vllm_engine_flags_reach_the_engine(text_model):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args([text_model, "--seed", "7", "--max-num-seqs", "4", "--enforce-eager",
                              "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests",
                              "--dtype", "auto", "--max-model-len", "0.2k", "--no-enable-prefix-caching",
                              "--disable-fastapi-docs", "--disable-uvicorn-access-log"])
    assert args.no_access_log
    check_serve_args(args)
    _, given = engine_options(args)
    assert given == {"seed": 7, "max_batch_size": 4, "cuda_graphs": False, "dtype": "auto", "max_model_len": 200,
                     "enable_prefix_caching": False}
    assert [token_count(t) for t in ("4096", "32k", "32K", "25.6k", "auto", "-1")] == [
        4096, 32000, 32768, 25600, None, None]
    for bad in ("0", "1.5", "2.5K", "1.0001k", "infk", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            token_count(bad)
    for name, dtype in (("auto", torch.float32), ("float", torch.float32), ("half", torch.float16)):
        assert EngineConfig(model=text_model, dtype=name).torch_dtype == dtype  # on this CPU


def test_vllm_engine_arguments_in_python(text_model):
    """LLM(model, max_num_seqs=..., ...) as written for vLLM: its names translated, its always-on ones taken."""
    assert engine_kwargs("LLM", {"max_num_seqs": 4, "block_size": 32, "num_gpu_blocks_override": 64,
                                 "enforce_eager": True, "trust_remote_code": True, "enable_chunked_prefill": True,
                                 "disable_log_stats": False}) == {
        "max_batch_size": 4, "page_size": 32, "num_pages": 64, "cuda_graphs": False}
    assert engine_kwargs("LLM", {"enforce_eager": False}) == {}
    with pytest.raises(TypeError, match="both 'max_num_seqs'"):
        engine_kwargs("LLM", {"max_num_seqs": 4, "max_batch_size": 8})
    with pytest.raises(ValueError, match="enable_chunked_prefill=False: graphdecode cannot do that"):
        engine_kwargs("LLM", {"enable_chunked_prefill": False})
    with pytest.raises(TypeError, match="unexpected keyword argument 'swap_space'"):
        LLM(text_model, swap_space=4)
    with LLM(text_model, max_num_seqs=4, block_size=32, enforce_eager=True, trust_remote_code=True,
             max_model_len=128) as llm:
        assert (llm.config.max_batch_size, llm.config.page_size, llm.config.cuda_graphs) == (4, 32, False)
        assert len(llm.generate("Hi", SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3


def test_the_periodic_stats_line(server):
    """vLLM's log line, every --log-stats-interval seconds while the engine works, then one idle line."""
    def stats_lines():
        return [line for line in LOG["path"].read_text().splitlines() if "Avg generation throughput" in line]

    # and at start-up, what the KV pool holds (vLLM's "maximum concurrency" line)
    assert re.search(r"graphdecode: KV cache: [0-9,]+ tokens \([0-9,]+ pages of 16\); maximum concurrency for 256 "
                     r"tokens per request: [0-9.]+x", LOG["path"].read_text())

    before, quiet_since = len(stats_lines()), time.monotonic()  # until the earlier tests' lines (idle one too) end
    while time.monotonic() - quiet_since < 1.0 and time.monotonic() < quiet_since + 10:
        time.sleep(0.1)
        if len(stats_lines()) != before:
            before, quiet_since = len(stats_lines()), time.monotonic()
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEYS[0], max_retries=0) as client:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, temperature=0, extra_body={
            "ignore_eos": True})
    idle = re.compile(r"graphdecode: engine 0: Avg prompt throughput: 0\.0 tokens/s, Avg generation throughput: "
                      r"0\.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0\.0%, Prefix cache hit "
                      r"rate: 0\.0%")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(idle.fullmatch(line) for line in stats_lines()[before:]):
        time.sleep(0.2)
    lines = stats_lines()[before:]
    assert any(re.search(r"Avg generation throughput: [1-9][0-9.]* tokens/s", line) for line in lines), lines
    assert idle.fullmatch(lines[-1]), lines
    time.sleep(1)  # idle: no more lines
    assert len(stats_lines()) == before + len(lines)


def test_stat_logger_lines():
    """Throughput over the interval, the latest gauges, hit rate over the interval's lookups; idle: one line."""
    class Engine:
        load = {}

    engine = Engine()
    logger = StatLogger(engine, 10.0, now=0.0)
    assert logger.lines(5.0) == [] and logger.lines(10.0) == []  # not due; then due but idle from the start
    engine.load = {"prefill_tokens": 100, "generated_tokens": 50, "num_running_seqs": 2, "num_waiting_seqs": 1,
                   "kv_pages_in_use": 3, "kv_pages": 12, "prefix_cache_queries": 40, "prefix_cache_hits": 10}
    assert logger.lines(20.0) == ["engine 0: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: "
                                  "5.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix "
                                  "cache hit rate: 25.0%"]
    engine.load = dict(engine.load, num_running_seqs=0, num_waiting_seqs=0, kv_pages_in_use=0)
    assert logger.lines(30.0) == ["engine 0: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                                  "0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix "
                                  "cache hit rate: 0.0%"]
    assert logger.lines(40.0) == []  # idle again: quiet


def test_several_served_model_names(server):
    """--served-model-name A B (vLLM's): a request may name either; answers carry the first; both are listed."""
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEYS[0], max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
        out = client.completions.create(model=ALIAS, prompt="Hi", max_tokens=1)
        assert out.model == MODEL
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="Hi", max_tokens=1)


def test_request_id_headers(server):
    """--enable-request-id-headers: the request's X-Request-Id comes back (a 401's too), else a fresh one."""
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    r = httpx.post(f"{server}/v1/completions", json=body, headers={**auth, "X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True},
                      headers={**auth, "X-Request-Id": "trace-43"}) as streamed:
        assert streamed.headers["x-request-id"] == "trace-43" and "[DONE]" in streamed.read().decode()
    first, second = (httpx.get(f"{server}/health").headers["x-request-id"] for _ in range(2))
    assert re.fullmatch("[0-9a-f]{32}", first) and first != second
    r = httpx.get(f"{server}/v1/models", headers={"X-Request-Id": "trace-44"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "trace-44"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command makes the test certificate")
def test_https(text_model, tmp_path):
    """--ssl-keyfile / --ssl-certfile: HTTPS that the openai client verifies against the certificate."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    proc, url = start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1",
                              "--max-model-len", "256", "--log-level", "warning", "--ssl-keyfile", str(key),
                              "--ssl-certfile", str(cert)], str(tmp_path / "server.log"), timeout_s=180,
                             verify=ssl.create_default_context(cafile=str(cert)))
    try:
        assert url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as http, openai.OpenAI(base_url=f"{url}/v1", api_key="x",
                                                                   http_client=http, max_retries=0) as client:
            out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert out.choices[0].finish_reason == "length"
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is refused
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
    finally:
        assert stop_server(proc, 40) == 0


@pytest.mark.parametrize("args, fragment", [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile: give both"),
    (["--ssl-keyfile", "nope.pem", "--ssl-certfile", "nope.pem"], "--ssl-keyfile: 'nope.pem' is not a file"),
])
def test_bad_tls_flags_stop_start_up(capsys, args, fragment):
    assert fragment in one_line_cli_error(capsys, ["serve", *args], clean=True)


def test_a_tokenizer_from_another_directory(text_model, tmp_path, capsys):
    """vLLM's tokenizer= / --tokenizer: weights without a tokenizer take one from elsewhere; a directory without
    one is refused by name before anything loads."""
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in os.listdir(text_model):
        if not name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(os.path.join(text_model, name), weights / name)
    params = SamplingParams(temperature=0, max_tokens=4)
    with LLM(text_model, max_model_len=128) as llm:
        expected = llm.generate("The capital of France is", params)[0]
    with LLM(str(weights), max_model_len=128, tokenizer=text_model) as llm:
        got = llm.generate("The capital of France is", params)[0]
    assert got.prompt_token_ids == expected.prompt_token_ids and got.outputs[0].text == expected.outputs[0].text
    with pytest.raises(ValueError, match="tokenizer must be a directory holding a HuggingFace tokenizer"):
        LLM(text_model, tokenizer=str(weights))
    assert "tokenizer must be a directory" in one_line_cli_error(
        capsys, ["serve", str(weights), "--tokenizer", str(tmp_path)], clean=True)
