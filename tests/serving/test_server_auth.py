"""--api-key (vLLM's): every route but the probes needs a key, sent as the OpenAI clients send it (Bearer) or
as the Anthropic clients do (x-api-key); CORS (--allowed-origins ...) answers browsers' preflights and reaches
their scripts with the errors too. One live server for the module, the real openai and anthropic clients."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from graphdecode.server.auth import api_keys
from tests.helpers import live_server, one_line_cli_error

MODEL = "guarded-model"
KEYS = ("first-key", "second-key")
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    with live_server(text_model, tmp_path_factory.mktemp("server_auth"), MODEL, "--max-model-len", "256",
                     "--api-key", *KEYS, "--allowed-origins", f'["{ORIGIN}"]') as url:
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
