"""LoRA adapters over HTTP, as vLLM's server serves them: --enable-lora --lora-modules NAME=PATH, a request's
`model` choosing its adapter, /v1/models listing each adapter with its parent, and adapters loaded and unloaded
at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true). One live server for the module, the real openai client;
right answers from transformers + PEFT."""

from __future__ import annotations

import argparse
import os

import openai
import pytest

from graphdecode.server.args import add_serve_args, check_serve_args
from tests.helpers import live_server, peft_adapter, peft_greedy

MODEL = "lora-base"
PROMPT = [5, 71, 300, 12, 9, 44]


@pytest.fixture(scope="module")
def adapters(text_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_lora_adapters")
    return {"sql": peft_adapter(text_model, str(root / "sql"), seed=7),
            "late": peft_adapter(text_model, str(root / "late"), seed=8, r=4, targets=("q_proj", "v_proj"))}


@pytest.fixture(scope="module")
def server(text_model, adapters, tmp_path_factory):
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    with live_server(text_model, tmp_path_factory.mktemp("server_lora"), MODEL, "--max-model-len", "256",
                     "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
                     f"sql={adapters['sql']}", env=env) as url:
        yield url


def _completion(client, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.model == model  # the answer names the adapter (vLLM's)
    return out.choices[0].model_extra["token_ids"]


def test_the_model_field_chooses_the_adapter(client, adapters, text_model):
    assert _completion(client, "sql") == peft_greedy(text_model, adapters["sql"], [PROMPT], 10)[0]
    assert _completion(client, MODEL) == peft_greedy(text_model, None, [PROMPT], 10)[0]
    assert peft_greedy(text_model, adapters["sql"], [PROMPT], 10) != peft_greedy(text_model, None, [PROMPT], 10)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)


def test_a_streamed_chat_names_its_adapter(client):
    chunks = list(client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks and {c.model for c in chunks} == {"sql"}


def test_anthropic_messages_and_responses_run_the_adapter(server, client):
    """Every chat-shaped endpoint takes the adapter from its model field and names it in its answer."""
    import anthropic

    with anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=60) as claude:
        message = claude.messages.create(model="sql", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert message.model == "sql"
    assert client.responses.create(model="sql", input="hi", max_output_tokens=4).model == "sql"


def test_metrics_carry_vllms_lora_requests_info(http):
    text = http.get(str(http.base_url).rstrip("/").removesuffix("/v1") + "/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("graphdecode:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line


def test_models_lists_each_adapter_with_its_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"].model_extra["root"] == adapters["sql"]
    assert cards["sql"].model_extra["parent"] == MODEL


def test_adapters_load_and_unload_at_run_time(client, http, adapters, text_model):
    root = str(http.base_url).rstrip("/")
    bad = http.post(f"{root}/load_lora_adapter", json={"lora_name": "broken", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "is not a directory" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "lora_path"
    empty = http.post(f"{root}/load_lora_adapter", json={"lora_name": "", "lora_path": adapters["late"]})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "lora_name"
    typed = http.post(f"{root}/load_lora_adapter", json={"lora_name": 2**64 + 1, "lora_path": adapters["late"]})
    assert typed.status_code == 400 and typed.json()["error"]["param"] == "lora_name"
    taken = http.post(f"{root}/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapters["late"]})
    assert taken.status_code == 400 and "'sql' is already served" in taken.json()["error"]["message"]
    loaded = http.post(f"{root}/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
    assert loaded.status_code == 200, loaded.text
    assert _completion(client, "late") == peft_greedy(text_model, adapters["late"], [PROMPT], 10)[0]
    assert "late" in {m.id for m in client.models.list().data}
    gone = http.post(f"{root}/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    again = http.post(f"{root}/unload_lora_adapter", json={"lora_name": "late"})
    assert again.status_code == 404


def test_lora_modules_flag_forms(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x/a",
                              '{"name": "b", "path": "/x/b", "base_model_name": "base"}'])
    assert [(m.lora_name, m.lora_path, m.base_model_name) for m in args.lora_modules] == [
        ("a", "/x/a", None), ("b", "/x/b", "base")]
    args = parser.parse_args(["--lora-modules", "a=/x/a"])
    with pytest.raises(ValueError, match="--lora-modules: serving LoRA adapters needs --enable-lora"):
        check_serve_args(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-lora", "--lora-modules", "no-path"])
