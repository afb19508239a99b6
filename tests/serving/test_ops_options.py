"""Operations that fit the machine (issue 40, items 5 and 6): the KV pool sized by vLLM's options
(num_pages / --num-gpu-blocks-override, kv_cache_memory_bytes, gpu_memory_utilization,
VLLM_CPU_KVCACHE_SPACE), torch threads defaulting to the usable cores, `graphdecode serve MODEL`,
a lone surrogate named in the 400, and a client that hangs up mid-body logged as one INFO line."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

import graphdecode.config as config_module
from graphdecode.attention.kv_cache import kv_bytes_per_page
from graphdecode.cli import main
from graphdecode.config import ACTIVATION_RESERVE_BYTES, EngineConfig, model_weight_bytes
from graphdecode.engine_args import byte_size
from graphdecode.server.launch import start_server, stop_server
from tests.helpers import one_line_cli_error

GIB = 1 << 30


@pytest.fixture
def model(tiny_models):
    return tiny_models["llama_head_dim"]


def _per_page(config: EngineConfig) -> int:
    cfg = config.model_config
    return kv_bytes_per_page(cfg.num_layers, config.page_size, cfg.num_kv_heads, cfg.head_dim, config.torch_dtype)


@pytest.fixture
def per_page(model):
    return _per_page(EngineConfig(model=model, device="cpu", max_model_len=64))


# ------------------------------------------------------------------ the KV pool
def test_kv_cache_memory_bytes_sizes_the_pool_exactly(model, per_page, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config = EngineConfig(model=model, device="cpu", max_model_len=64, kv_cache_memory_bytes=100 * per_page + 7)
    assert config.num_pages == 100
    # more than max_batch_size sequences fill: the bytes asked for are the pool (prefix-cache room)
    config = EngineConfig(model=model, device="cpu", max_model_len=64, max_batch_size=2,
                          kv_cache_memory_bytes=50 * per_page)
    assert config.num_pages == 50
    assert EngineConfig(model=model, device="cpu", max_model_len=64, num_pages=33).num_pages == 33


def test_vllm_cpu_kvcache_space_is_the_cpu_default(model, per_page, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.01")  # GiB, as vLLM-CPU reads it
    config = EngineConfig(model=model, device="cpu", max_model_len=64)
    assert config.num_pages == int(0.01 * GIB) // per_page
    # an explicit size wins over the environment
    assert EngineConfig(model=model, device="cpu", max_model_len=64, num_pages=20).num_pages == 20
    assert EngineConfig(model=model, device="cpu", max_model_len=64,
                        kv_cache_memory_bytes=30 * per_page).num_pages == 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    default = EngineConfig(model=model, device="cpu", max_model_len=64).num_pages
    assert default != int(0.01 * GIB) // per_page
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM's "auto": the built-in default
    assert EngineConfig(model=model, device="cpu", max_model_len=64).num_pages == default
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
            EngineConfig(model=model, device="cpu", max_model_len=64)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.00001")  # 10 KiB: not one sequence
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE .* must hold one sequence of max_model_len"):
        EngineConfig(model=model, device="cpu", max_model_len=64)


def test_gpu_memory_utilization_on_cpu_reads_the_hosts_ram(model, per_page, monkeypatch):
    """On CPU: fraction x RAM, less what others use now, the weights (counted twice) and the activation
    reserve; never more than max_batch_size sequences fill."""
    probe = EngineConfig(model=model, device="cpu", max_model_len=64)
    weights = model_weight_bytes(probe.model_config, probe.torch_dtype)
    total = 16 * GIB
    available = 2 * weights + ACTIVATION_RESERVE_BYTES + 100 * per_page + 5
    monkeypatch.setattr(config_module, "_host_memory", lambda: (available, total))
    config = EngineConfig(model=model, device="cpu", max_model_len=64, gpu_memory_utilization=1.0)
    assert config.num_pages == 100
    capped = EngineConfig(model=model, device="cpu", max_model_len=64, max_batch_size=2, gpu_memory_utilization=1.0)
    assert capped.num_pages == 2 * 4 + 1  # two sequences of 4 pages and the scratch page
    with pytest.raises(ValueError, match=r"gpu_memory_utilization \(0\.5: .*must hold one sequence"):
        EngineConfig(model=model, device="cpu", max_model_len=64, gpu_memory_utilization=0.5)


BAD_KV = [
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes must be a positive integer"),
    (dict(kv_cache_memory_bytes=1.5), "kv_cache_memory_bytes must be a positive integer"),
    (dict(kv_cache_memory_bytes=1000), r"kv_cache_memory_bytes \(1000\), 0 pages .* must hold one sequence"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be a fraction in"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction in"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization must be a fraction in"),
    (dict(gpu_memory_utilization=True), "gpu_memory_utilization must be a fraction in"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a fraction in"),
    (dict(num_pages=100, kv_cache_memory_bytes=1 << 30), "num_pages and kv_cache_memory_bytes both size"),
    (dict(kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.5),
     "kv_cache_memory_bytes and gpu_memory_utilization both size"),
    (dict(num_pages=3), r"num_pages \(3\) must hold one sequence"),
]


@pytest.mark.parametrize("kwargs,message", BAD_KV)
def test_kv_options_are_checked_by_name(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=model, device="cpu", max_model_len=64, **kwargs)


# ------------------------------------------------------------------ threads
def test_cpu_threads_default_to_the_usable_cores(model, monkeypatch):
    monkeypatch.delenv("GRAPHDECODE_CPU_THREADS", raising=False)
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: {0, 2, 3, 5, 6, 7}, raising=False)
    assert EngineConfig(model=model, device="cpu").cpu_threads == 6
    assert EngineConfig(model=model, device="cpu", tensor_parallel_size=2).cpu_threads == 3  # shared by the ranks
    assert EngineConfig(model=model, device="cpu", cpu_threads=2).cpu_threads == 2  # an explicit count wins
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: {4}, raising=False)
    assert EngineConfig(model=model, device="cpu", tensor_parallel_size=2).cpu_threads == 1


def test_graphdecode_cpu_threads_overrides_the_default(model, monkeypatch):
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("GRAPHDECODE_CPU_THREADS", "3")
    assert EngineConfig(model=model, device="cpu").cpu_threads == 3
    assert EngineConfig(model=model, device="cpu", cpu_threads=5).cpu_threads == 5
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv("GRAPHDECODE_CPU_THREADS", bad)
        with pytest.raises(ValueError, match="cpu_threads: GRAPHDECODE_CPU_THREADS must be a positive integer"):
            EngineConfig(model=model, device="cpu")


def test_the_engine_runs_on_the_resolved_thread_count(model, monkeypatch):
    import torch

    from graphdecode import LLM

    monkeypatch.delenv("GRAPHDECODE_CPU_THREADS", raising=False)
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        llm = LLM(model, max_model_len=64, max_batch_size=2)
        assert llm.config.cpu_threads == 2 and llm.stats()["cpu_threads"] == 2
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ the command line
def test_byte_sizes_as_vllm_writes_them():
    assert [byte_size(t) for t in ("4096", "4K", "4KiB", "4k", "1.5G", "2GiB", "3g")] == [
        4096, 4096, 4096, 4000, 3 << 29, 2 << 30, 3 * 10**9]
    for bad in ("0", "-1G", "4kiB", "G", "lots", "nan", "inf"):
        with pytest.raises(Exception, match="expected a size in bytes"):
            byte_size(bad)


def test_kv_options_reach_the_engine(llm_options, text_model):
    seen, Built = llm_options
    for flags in (["--num-gpu-blocks-override", "300"], ["--num-pages", "301"], ["--kv-cache-memory-bytes", "64M"],
                  ["--gpu-memory-utilization", "0.9"], []):
        with pytest.raises(Built):
            main(["generate", "--model", text_model, "--device", "cpu", *flags, "Hi"])
    keys = ("num_pages", "kv_cache_memory_bytes", "gpu_memory_utilization")
    assert [{k: o[k] for k in keys if k in o} for o in seen] == [
        {"num_pages": 300}, {"num_pages": 301}, {"kv_cache_memory_bytes": 64 << 20},
        {"gpu_memory_utilization": 0.9}, {}]


def test_serve_takes_the_model_as_a_positional_argument(monkeypatch, text_model, tmp_path, capsys):
    import graphdecode.server.openai_api as openai_api

    served = []
    monkeypatch.setattr(openai_api, "serve", lambda args: served.append(args) or 0)
    assert main(["serve", text_model, "--port", "0"]) == 0
    assert served[-1].model == text_model
    assert main(["serve", "--port", "0", text_model, "--num-gpu-blocks-override", "200"]) == 0  # anywhere
    assert served[-1].model == text_model and served[-1].num_pages == 200
    assert main(["serve", "--model", text_model]) == 0  # --model stays
    assert served[-1].model == text_model
    assert main(["serve", text_model, "--model", text_model + "/"]) == 0  # the same directory twice
    line = one_line_cli_error(capsys, ["serve", text_model, "--model", str(tmp_path)])
    assert "MODEL" in line and "--model" in line and text_model in line and str(tmp_path) in line
    # the pool options are checked before the server starts
    line = one_line_cli_error(capsys, ["serve", text_model, "--max-model-len", "128", "--num-gpu-blocks-override", "8"])
    assert "num_pages (8) must hold one sequence of max_model_len (128 tokens = 8 pages)" in line
    line = one_line_cli_error(capsys, ["serve", text_model, "--num-pages", "100", "--kv-cache-memory-bytes", "1G"])
    assert "num_pages and kv_cache_memory_bytes both size the KV pool" in line
    assert "gpu_memory_utilization" in one_line_cli_error(
        capsys, ["serve", text_model, "--gpu-memory-utilization", "2"])
    assert len(served) == 4


# ------------------------------------------------------------------ a live server
@pytest.fixture(scope="module")
def positional_server(text_model, tmp_path_factory):
    """`graphdecode serve DIR` with a small pool, at --log-level info (threads from GRAPHDECODE_CPU_THREADS)."""
    log = tmp_path_factory.mktemp("ops_server") / "server.log"
    proc, url = start_server([text_model, "--served-model-name", "m", "--no-access-log", "--log-level", "info",
                              "--max-model-len", "128", "--num-gpu-blocks-override", "20", "-k", "2"],
                             str(log), timeout_s=180)
    yield url, log
    assert stop_server(proc, 40) == 0, log.read_text()


def test_the_positional_server_serves(positional_server, text_model):
    url, _ = positional_server
    with httpx.Client(base_url=f"{url}/v1", timeout=60) as http:
        assert http.get("/models").json()["data"][0]["root"] == text_model
        answer = http.post("/completions", json={"model": "m", "prompt": ["Hello", "World", "Hi"], "max_tokens": 40,
                                                 "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert [c["finish_reason"] for c in answer.json()["choices"]] == ["length"] * 3


SURROGATES = [
    ("/completions", rb'{"model": "m", "prompt": "ab\ud800cd", "max_tokens": 2}', "prompt",
     r"prompt: the text is not valid Unicode: lone surrogate '\ud800' at character 2"),
    ("/completions", rb'{"model": "m", "prompt": ["fine", "x\udc00"], "max_tokens": 2}', "prompt",
     r"prompt[1]: the text is not valid Unicode: lone surrogate '\udc00' at character 1"),
    ("/completions", rb'{"model": "m", "prompt": "ok", "stop": ["\ud800\u0041"], "max_tokens": 2}', "stop",
     r"stop[0]: the text is not valid Unicode: lone surrogate '\ud800' at character 0"),
    ("/chat/completions", rb'{"model": "m", "messages": [{"role": "user", "content": "hi\ud800"}]}',
     "messages[0].content", r"messages[0].content: the text is not valid Unicode: lone surrogate '\ud800' at "
                            r"character 2"),
]


@pytest.mark.parametrize("path,body,param,message", SURROGATES)
def test_a_lone_surrogate_is_named(positional_server, path, body, param, message):
    url, _ = positional_server
    answer = httpx.post(f"{url}/v1{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["message"] == message and error["param"] == param
    assert "hex escape" not in error["message"]


def test_a_surrogate_pair_and_broken_json_keep_their_answers(positional_server):
    url, _ = positional_server
    headers = {"Content-Type": "application/json"}
    pair = httpx.post(f"{url}/v1/completions", content=rb'{"model": "m", "prompt": "ab\ud83d\ude00", "max_tokens": 2}',
                      headers=headers, timeout=60)
    assert pair.status_code == 200, pair.text
    broken = httpx.post(f"{url}/v1/completions", content=rb'{"model": "m", "prompt": "ab\ud800', headers=headers,
                        timeout=60)
    assert broken.status_code == 400 and "lone surrogate" not in broken.json()["error"]["message"]
    assert "JSON" in broken.json()["error"]["message"]


def test_a_client_hanging_up_mid_body_is_one_info_line(positional_server):
    url, log = positional_server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"model": "m", "prompt": "ab')
        time.sleep(0.5)  # the handler is waiting for the rest of the body
    deadline = time.monotonic() + 20
    while "hung up while sending" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    text = log.read_text()
    lines = [line for line in text.splitlines() if "hung up while sending" in line]
    assert len(lines) == 1 and lines[0].startswith("INFO:"), text
    assert "POST /v1/completions body; nothing answered" in lines[0]
    assert "Traceback" not in text and "ClientDisconnect" not in text and "ERROR" not in text, text
