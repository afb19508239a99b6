"""Weight updates over HTTP for RL loops (VLLM_SERVER_DEV_MODE=1; SGLang's /update_weights_from_disk and
/get_weight_version): answers after an update are the new checkpoint's (transformers greedy, token for token);
a request running when the update arrives finishes on the old weights and one arriving while it waits runs on the
new ones (every request's tokens from one version), or the running one is aborted (abort_all_requests); a bad
checkpoint is a 400 naming what was refused, and the server serves on."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from graphdecode.server.weight_api import DEV_MODE_ENV, add_weight_routes
from tests.helpers import hf_greedy, live_server, stream_events
from tests.host.test_weight_updates import _trained

PROMPT = [5, 71, 300, 12, 9, 44]


@pytest.fixture(scope="module")
def trained(text_model, tmp_path_factory):
    return _trained(text_model, tmp_path_factory.mktemp("server_weights") / "trained", seed=3)


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    with live_server(text_model, tmp_path_factory.mktemp("server_weights_log"), "policy", "--max-model-len", "512",
                     env={**os.environ, DEV_MODE_ENV: "1"}) as url:
        yield url


def _tokens(url: str, max_tokens: int = 8) -> list[int]:
    out = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "policy", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}).json()
    return out["choices"][0]["token_ids"]


def _update(url: str, path: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/update_weights_from_disk", json={"model_path": path, **extra}, timeout=120)


def _running(url: str) -> float:
    line = next(line for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith("graphdecode:num_requests_running"))
    return float(line.rsplit(" ", 1)[1])


def _when_running(url: str) -> None:
    deadline = time.monotonic() + 60
    while _running(url) < 1:
        assert time.monotonic() < deadline, "the long request never ran"
        time.sleep(0.05)


def test_an_update_serves_the_new_checkpoint(server, text_model, trained):
    assert _tokens(server) == hf_greedy(text_model, [PROMPT], 8)[0]
    answer = _update(server, trained, weight_version="step-1")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["success"] and body["weight_version"] == "step-1" and body["updated"] > 0
    assert httpx.get(f"{server}/get_weight_version").json() == {"weight_version": "step-1"}
    assert _tokens(server) == hf_greedy(trained, [PROMPT], 8)[0] != hf_greedy(text_model, [PROMPT], 8)[0]
    assert _update(server, text_model, weight_version="step-0").status_code == 200


def test_running_requests_finish_on_the_old_weights_and_new_ones_wait(server, text_model, trained):
    long, late, updated = {}, {}, {}
    runner = threading.Thread(target=lambda: long.update(tokens=_tokens(server, 400)))
    runner.start()
    _when_running(server)
    updater = threading.Thread(target=lambda: updated.update(answer=_update(server, trained)))
    updater.start()
    time.sleep(0.5)  # the update is in the core, waiting for the long request
    arrival = threading.Thread(target=lambda: late.update(tokens=_tokens(server)))
    arrival.start()
    for thread in (runner, updater, arrival):
        thread.join(120)
    assert updated["answer"].status_code == 200
    assert long["tokens"] == hf_greedy(text_model, [PROMPT], 400)[0]  # all on the old weights
    assert late["tokens"] == hf_greedy(trained, [PROMPT], 8)[0]  # held, then run on the new ones
    assert _update(server, text_model).status_code == 200


def test_abort_all_requests_ends_the_running_ones(server, trained, text_model):
    result = {}
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    runner = threading.Thread(target=stream_events, args=(server, body, result))
    runner.start()
    _when_running(server)
    answer = _update(server, trained, abort_all_requests=True)
    runner.join(60)
    assert answer.status_code == 200 and result["finish"][-1] == "abort" and not result["errors"]
    assert _tokens(server) == hf_greedy(trained, [PROMPT], 8)[0]
    assert _update(server, text_model).status_code == 200


def test_a_bad_checkpoint_is_refused_by_name_and_the_server_serves_on(server, text_model, tiny_models):
    missing = _update(server, str(text_model) + "-missing")
    assert missing.status_code == 400 and "model_path" in missing.json()["message"]
    other = _update(server, tiny_models["llama_gqa_llama3"])  # another architecture: shapes differ
    assert other.status_code == 400 and not other.json()["success"] and "has shape" in other.json()["message"]
    assert _tokens(server) == hf_greedy(text_model, [PROMPT], 8)[0]


def test_the_routes_need_dev_mode(monkeypatch):
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    app = FastAPI()
    add_weight_routes(app, None, None)
    assert not {"/update_weights_from_disk", "/get_weight_version"} & {route.path for route in app.routes}
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    add_weight_routes(app, None, None)
    assert {"/update_weights_from_disk", "/get_weight_version"} <= {route.path for route in app.routes}


def test_pause_resume_and_is_paused(server, text_model, trained):
    """vLLM's routes: /pause (abort by default) ends the running request, a request sent while paused waits
    through the update, /resume lets it run on the new weights; mode=keep is a 400 naming mode."""
    result, late = {}, {}
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    runner = threading.Thread(target=stream_events, args=(server, body, result))
    runner.start()
    _when_running(server)
    assert httpx.post(f"{server}/pause", timeout=60).json() == {"is_paused": True}
    runner.join(60)
    assert result["finish"][-1] == "abort"
    assert httpx.get(f"{server}/is_paused").json() == {"is_paused": True}
    arrival = threading.Thread(target=lambda: late.update(tokens=_tokens(server)))
    arrival.start()
    assert _update(server, trained).status_code == 200
    time.sleep(0.3)
    assert arrival.is_alive()  # still held after the update: the server is paused
    assert httpx.post(f"{server}/resume").json() == {"is_paused": False}
    arrival.join(60)
    assert late["tokens"] == hf_greedy(trained, [PROMPT], 8)[0]
    keep = httpx.post(f"{server}/pause", params={"mode": "keep"})
    assert keep.status_code == 400 and keep.json()["error"]["param"] == "mode"
    assert httpx.get(f"{server}/is_paused").json() == {"is_paused": False}
    assert _update(server, text_model).status_code == 200
