"""The OpenAI server's vLLM semantics, live on a loopback port (one server for the module):
echo with logprobs (lm-evaluation-harness's loglikelihood request), prompt_logprobs,
chat echo and custom roles, return_token_ids, truncate_prompt_tokens,
return_tokens_as_token_ids, continuous usage stats, cached prompt tokens, logit_bias
errors, /version, a huge prompt that must not stall the server, and the body limit (413).

Right answers come from an in-process LLM on the same model, and transformers for the
prompt logprobs."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import threading
import time

import httpx
import pytest

import graphdecode
from graphdecode import LLM, SamplingParams
from tests.helpers import SMALL_ENGINE, hf_prompt_logprobs, live_server

MODEL = "vllm-model"
MAX_MODEL_LEN = 1024
PAGE_SIZE = 16
BODY_LIMIT = 8 << 20
ENGINE = dict(SMALL_ENGINE, max_model_len=MAX_MODEL_LEN, max_batch_size=32, page_size=PAGE_SIZE)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    with live_server(text_model, tmp_path_factory.mktemp("server_vllm"), MODEL, "-k", "4", "--max-model-len",
                     str(MAX_MODEL_LEN), "--max-batch-size", "32", "--page-size", str(PAGE_SIZE),
                     "--max-request-body-bytes", str(BODY_LIMIT)) as url:
        yield url


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, **ENGINE)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def _sse(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = response.content.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    return [json.loads(e[len(b"data: "):]) for e in events[:-2]]


def _hf_prompt_logprobs(model_dir: str, ids: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token given the ones before it (fp32)."""
    rows = hf_prompt_logprobs(model_dir, ids)
    return [rows[j - 1, ids[j]].item() for j in range(1, len(ids))]


def test_echo_with_logprobs_is_the_loglikelihood_request(http, llm, tokenizer, text_model):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens=1, prompt as ids."""
    ids = tokenizer(PROMPT)["input_ids"]
    hf = _hf_prompt_logprobs(text_model, ids)
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=1))[0]
    generated = want.outputs[0]
    for prompt in (ids, PROMPT):
        body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        r = http.post("/completions", json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        echoed = PROMPT if isinstance(prompt, str) else tokenizer.decode(ids)
        assert choice["text"] == echoed + generated.text
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:len(ids)] == [tokenizer.decode([t]) for t in ids]
        for got, ref in zip(lp["token_logprobs"][1:len(ids)], hf):
            assert got == pytest.approx(ref, abs=1e-4)
        for entry, value in zip(lp["top_logprobs"][1:len(ids)], lp["token_logprobs"][1:]):
            assert len(entry) <= 2 and max(entry.values()) >= value  # the token's own, and the top one
        token_id = generated.token_ids[0]
        assert lp["token_logprobs"][-1] == pytest.approx(generated.logprobs[0][token_id].logprob, abs=1e-5)
        # text_offset: where each token starts in the returned text; BOS takes no room in a text prompt
        offsets, text = lp["text_offset"], choice["text"]
        assert offsets == sorted(offsets) and offsets[len(ids)] == len(echoed)
        for token, at in zip(lp["tokens"], offsets):
            if token != tokenizer.bos_token or not isinstance(prompt, str):
                assert text[at:at + len(token)] == token
        assert r.json()["usage"]["completion_tokens"] == 1
        # max_tokens 0 (vLLM's): the prompt alone, with the same logprobs
        r0 = http.post("/completions", json={**body, "max_tokens": 0})
        assert r0.status_code == 200, r0.text
        (only,) = r0.json()["choices"]
        assert only["text"] == echoed
        assert only["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]
        assert only["logprobs"]["text_offset"] == offsets[:len(ids)]
        assert r0.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                                      # prompt logprobs are computed over the whole prompt: no cache hit
                                      "prompt_tokens_details": {"cached_tokens": 0}}
        streamed0 = _sse(http.post("/completions", json={**body, "max_tokens": 0, "stream": True}))
        assert "".join(c["choices"][0]["text"] for c in streamed0) == echoed
        assert streamed0[-1]["choices"][0]["finish_reason"] == "length"
        # streamed: the same text and logprobs, concatenated
        chunks = _sse(http.post("/completions", json={**body, "max_tokens": 3, "stream": True}))
        whole = http.post("/completions", json={**body, "max_tokens": 3}).json()["choices"][0]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
        streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert [x for part in streamed for x in part[key]] == whole["logprobs"][key]
    without = http.post("/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert without.status_code == 400 and without.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_on_both_endpoints(http, llm, tokenizer):
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0].prompt_logprobs
    r = http.post("/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert r.json()["choices"][0]["logprobs"] is None
    assert len(got) == len(want) == r.json()["usage"]["prompt_tokens"] and got[0] is None
    for entry, ref in zip(got[1:], want[1:]):
        assert set(entry) == {str(t) for t in ref}
        for tid, lp in ref.items():
            assert entry[str(tid)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entry[str(tid)]["rank"] == lp.rank and entry[str(tid)]["decoded_token"] == lp.decoded_token
    messages = [{"role": "user", "content": "Say hi."}]
    chat = http.post("/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                "prompt_logprobs": 0}).json()
    plp = chat["prompt_logprobs"]
    assert len(plp) == chat["usage"]["prompt_tokens"] and plp[0] is None and all(len(e) == 1 for e in plp[1:])
    for endpoint, body in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": messages})):
        r = http.post(f"/{endpoint}", json={"model": MODEL, "stream": True, "prompt_logprobs": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_chat_echo_and_custom_roles(http, tokenizer):
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "ipython", "content": "42"},
                {"role": "tool", "content": "ok"}, {"role": "wizard", "content": "Say hi."}]
    r = http.post("/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                             "return_token_ids": True})
    assert r.status_code == 200, r.text
    as_is = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"]
    assert r.json()["prompt_token_ids"] == as_is  # every role reached the template unchanged
    mapped = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    assert tokenizer(tokenizer.apply_chat_template(mapped, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"] != as_is
    # echo: the last message's content comes first when the reply continues its role (vLLM's rule)
    start = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once upon"}]
    body = {"model": MODEL, "messages": start, "max_tokens": 6, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True, "ignore_eos": True}
    plain = http.post("/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = http.post("/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "Once upon" + plain["content"]} and plain["content"]
    chunks = _sse(http.post("/chat/completions", json={**body, "echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == echoed["content"]
    # a user message last, a generation prompt after it: nothing of it is echoed
    user_last = {"model": MODEL, "messages": start[:1], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert (http.post("/chat/completions", json={**user_last, "echo": True}).json()["choices"][0]["message"]
            == http.post("/chat/completions", json=user_last).json()["choices"][0]["message"])
    r = http.post("/chat/completions", json={"model": MODEL, "messages": [{"role": 5, "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"


def test_token_ids_truncation_and_token_id_strings(http, llm, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = llm.generate(PROMPT, params)[0].outputs[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    (choice,) = http.post("/completions", json=body).json()["choices"]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want.token_ids
    chunks = _sse(http.post("/completions", json={**body, "stream": True}))
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids
    messages = [{"role": "user", "content": "Say hi."}]
    chat_want = llm.chat(messages, params)[0]
    chat = http.post("/chat/completions", json={**body, "messages": messages, "prompt": None}).json()
    assert chat["prompt_token_ids"] == chat_want.prompt_token_ids
    assert chat["choices"][0]["token_ids"] == chat_want.outputs[0].token_ids
    chunks = _sse(http.post("/chat/completions", json={**body, "messages": messages, "stream": True}))
    assert chunks[0]["prompt_token_ids"] == chat_want.prompt_token_ids
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == chat_want.outputs[0].token_ids
    # truncate_prompt_tokens: the last N prompt tokens (-1: max_model_len)
    cut = llm.generate({"prompt_token_ids": ids[-3:]}, params)[0].outputs[0]
    r = http.post("/completions", json={**body, "truncate_prompt_tokens": 3}).json()
    assert r["usage"]["prompt_tokens"] == 3 and r["choices"][0]["prompt_token_ids"] == ids[-3:]
    assert r["choices"][0]["text"] == cut.text
    r = http.post("/completions", json={**body, "truncate_prompt_tokens": -1}).json()
    assert r["choices"][0]["prompt_token_ids"] == ids and r["choices"][0]["text"] == want.text
    # truncation_side "right": the first N instead
    first = llm.generate({"prompt_token_ids": ids[:3]}, params)[0].outputs[0]
    r = http.post("/completions", json={**body, "truncate_prompt_tokens": 3, "truncation_side": "right"}).json()
    assert r["choices"][0]["prompt_token_ids"] == ids[:3] and r["choices"][0]["text"] == first.text
    r = http.post("/completions", json={**body, "truncate_prompt_tokens": 3, "truncation_side": "middle"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"
    chat_cut = http.post("/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                    "truncate_prompt_tokens": 4}).json()
    assert chat_cut["usage"]["prompt_tokens"] == 4
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        r = http.post("/completions", json={**body, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    # return_tokens_as_token_ids: every token in logprobs is "token_id:N"
    lp = http.post("/completions", json={**body, "logprobs": 2, "return_tokens_as_token_ids": True}).json()
    lp = lp["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    assert all(key.startswith("token_id:") for entry in lp["top_logprobs"] for key in entry)
    chat_lp = http.post("/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3,
                                                   "temperature": 0, "logprobs": True, "top_logprobs": 2,
                                                   "return_tokens_as_token_ids": True, "ignore_eos": True}).json()
    content = chat_lp["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == [f"token_id:{t}" for t in chat_want.outputs[0].token_ids[:3]]
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)


def test_continuous_usage_stats(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 9, "ignore_eos": True, "stream": True, "n": 2,
            "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse(http.post("/completions", json=body))
    final, chunks = chunks[-1], chunks[:-1]
    prompt_tokens = final["usage"]["prompt_tokens"]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 18
    seen = {0: 0, 1: 0}
    for chunk in chunks:  # every chunk: the prompt's tokens and its choice's tokens so far
        (choice,) = chunk["choices"]
        seen[choice["index"]] += len(choice["token_ids"])
        assert chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": seen[choice["index"]],
                                  "total_tokens": prompt_tokens + seen[choice["index"]]}
    assert seen == {0: 9, 1: 9}
    chat = _sse(http.post("/chat/completions", json={**body, "prompt": None, "n": 1,
                                                     "messages": [{"role": "user", "content": "Hi"}]}))
    assert all(c["usage"]["prompt_tokens"] == chat[-1]["usage"]["prompt_tokens"] for c in chat)
    assert chat[0]["usage"]["completion_tokens"] == 0
    assert [c["usage"]["completion_tokens"] for c in chat[1:-1]][-1] == chat[-1]["usage"]["completion_tokens"] == 9
    # vLLM's rule: without include_usage there is no usage at all
    quiet = _sse(http.post("/completions", json={**body, "stream_options": {"continuous_usage_stats": True}}))
    assert all("usage" not in c for c in quiet)


def test_cached_prompt_tokens_in_usage(http):
    from graphdecode.host.sequence import Request

    if "num_cached_tokens" not in getattr(Request, "__slots__", ()):
        pytest.skip("the scheduler does not record a request's prefix-cache hit yet (Request.num_cached_tokens)")
    prompt = " ".join(f"word{i}" for i in range(120))  # a long prompt nobody sent before
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    first = http.post("/completions", json=body).json()["usage"]
    n = first["prompt_tokens"]
    assert n > 4 * PAGE_SIZE and first["prompt_tokens_details"]["cached_tokens"] < PAGE_SIZE
    again = http.post("/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (n - 1) // PAGE_SIZE * PAGE_SIZE <= again < n  # every full page of it (never the last token)
    chunks = _sse(http.post("/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == again


def test_logit_bias_error_names_every_bad_key(http):
    bias = {"a": 1.0, "-3": 2.0, "99999": 1.0, "5": 1.0}
    for endpoint, body in (("completions", {"prompt": "x"}), ("chat/completions",
                                                             {"messages": [{"role": "user", "content": "x"}]})):
        r = http.post(f"/{endpoint}", json={"model": MODEL, "logit_bias": bias, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logit_bias"
        for key in ("'a'", "'-3'", "'99999'"):
            assert key in error["message"], error["message"]
        assert "'5'" not in error["message"]


def test_one_rule_for_the_api_and_the_server(http, llm):
    """stop=[""] and a priority without the priority policy are refused by the server exactly as by the
    Python API, naming the same field; max_tokens past the context is refused by the server only (vLLM's
    split: its engine stops the request at max_model_len with "length")."""
    r = http.post("/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert r.json()["error"]["message"].startswith("max_tokens is too large: 5000.")
    res = llm.generate("Hello", SamplingParams(max_tokens=5000, ignore_eos=True))[0]
    out = res.outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_MODEL_LEN - len(res.prompt_token_ids)
    cases = [({"stop": [""]}, "stop", dict(stop=[""])),
             ({"priority": 3}, "priority", None)]
    for extra, field, api_kwargs in cases:
        r = http.post("/completions", json={"model": MODEL, "prompt": "Hello", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        if api_kwargs is not None:
            with pytest.raises(ValueError, match=field) as info:
                llm.generate("Hello", SamplingParams(**api_kwargs))
            assert r.json()["error"]["message"] == str(info.value).removeprefix("prompts[0]: ")
        else:
            with pytest.raises(ValueError, match="priority"):
                llm.generate("Hello", SamplingParams(), priority=[3])
    r = http.post("/completions", json={"model": MODEL, "prompt": "Hello", "stop": [], "max_tokens": 2})
    assert r.status_code == 200  # [] is no stop, as before


def test_allowed_token_ids_field(http, llm):
    tokenizer = llm.get_tokenizer()
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": allowed, "return_token_ids": True}
    r = http.post("/completions", json=body)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["token_ids"]
    want = llm.generate("Answer:", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert tokens == want and set(tokens) <= set(allowed)
    r = http.post("/completions", json={**body, "allowed_token_ids": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_version(server):
    r = httpx.get(f"{server}/version")
    assert r.status_code == 200
    assert r.json() == {"version": graphdecode.__version__} == {"version": importlib.metadata.version("graphdecode")}


def test_a_huge_prompt_stalls_nobody_and_is_refused_by_name(server, client, llm):
    want = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    huge = "Once upon a time there was an engine that kept every stream busy. " * 38000  # ~2.5 MB, seconds to tokenize
    result = {}

    def send():
        start = time.monotonic()
        result["response"] = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": huge}, timeout=120)
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=send)
    thread.start()
    polls, other = [], None
    with httpx.Client(timeout=10) as poller:
        while thread.is_alive():
            start = time.monotonic()
            assert poller.get(f"{server}/health").status_code == 200
            polls.append(time.monotonic() - start)
            if other is None and len(polls) == 5:  # another request meanwhile: answered as usual
                other = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True}).choices[0].text
            time.sleep(0.02)
    thread.join()
    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert str(MAX_MODEL_LEN) in r.json()["error"]["message"]  # the limit it is over
    assert result["seconds"] > 1.0 and len(polls) >= 10  # the polls ran while it was being tokenized
    assert max(polls) < 0.5, sorted(polls)[-5:]
    assert other == want


def test_bodies_over_the_limit_get_413(server, http):
    over = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'
    for content in (over, (over[i:i + (1 << 20)] for i in range(0, len(over), 1 << 20))):  # Content-Length, chunked
        r = http.post("/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert str(BODY_LIMIT) in error["message"] and error["type"] == "invalid_request_error"
    r = http.post("/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_negative_body_limit_is_a_cli_error(text_model, capsys):
    from graphdecode.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", text_model, "--max-request-body-bytes", "-1"])
    assert exc.value.code == 2 and "--max-request-body-bytes" in capsys.readouterr().err


def test_optional_vllm_fields_are_null_when_not_asked_for(client):
    """vLLM's whole responses carry prompt_logprobs / prompt_token_ids / token_ids as null when not asked for;
    clients written for vLLM read them as attributes."""
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    choice = completion.choices[0]
    assert (choice.prompt_logprobs, choice.prompt_token_ids, choice.token_ids) == (None, None, None)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert (chat.prompt_logprobs, chat.prompt_token_ids, chat.choices[0].token_ids) == (None, None, None)
    asked = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           extra_body={"return_token_ids": True})
    assert asked.prompt_token_ids and len(asked.choices[0].token_ids) == 2


def test_server_wide_token_ids_and_usage_flags(text_model, tmp_path_factory):
    """--return-tokens-as-token-ids: every logprob token as "token_id:N"; --enable-force-include-usage: every
    stream ends with its usage; --enable-server-load-tracking: GET /load counts the running requests;
    "logprobs": "true" read as true (vLLM's lax models); a seed past int64 a 400."""
    with live_server(text_model, tmp_path_factory.mktemp("server_flags"), MODEL, "--max-model-len", "1024",
                     "--return-tokens-as-token-ids", "--enable-force-include-usage",
                     "--enable-server-load-tracking") as url, \
            httpx.Client(base_url=f"{url}/v1", timeout=60) as http:
        assert httpx.get(f"{url}/load").json() == {"server_load": 0}
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}
        running = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",), kwargs={"json": body,
                                                                                             "timeout": 60})
        running.start()
        seen, deadline = set(), time.monotonic() + 30
        while running.is_alive() and time.monotonic() < deadline:  # polled while its 1,000 tokens run
            seen.add(httpx.get(f"{url}/load").json()["server_load"])
        running.join()
        assert 1 in seen and httpx.get(f"{url}/load").json() == {"server_load": 0}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        r = http.post("/chat/completions", json={**chat, "logprobs": "true", "top_logprobs": 1})
        assert r.status_code == 200, r.text
        entries = r.json()["choices"][0]["logprobs"]["content"]
        assert len(entries) == 3 and all(e["token"].startswith("token_id:") for e in entries)
        events = _sse(http.post("/chat/completions", json={**chat, "stream": True}))
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        r = http.post("/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "seed": 2**63})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_invocations_dispatches_by_the_body(http):
    """vLLM's /invocations: a body with messages is a chat completion, one with prompt a completion."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    root = str(http.base_url).removesuffix("/v1/").removesuffix("/v1")
    for body, kind in ((chat, "chat.completion"), (completion, "text_completion")):
        r = httpx.post(f"{root}/invocations", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["object"] == kind, r.text
        direct = http.post("/chat/completions" if "messages" in body else "/completions", json=body).json()
        assert r.json()["choices"][0].get("text") == direct["choices"][0].get("text")
        assert r.json()["choices"][0].get("message") == direct["choices"][0].get("message")
    r = httpx.post(f"{root}/invocations", json={"model": MODEL}, timeout=60)
    assert r.status_code == 400


def test_cache_salt_field(http):
    """vLLM's cache_salt on the server: the usage's cached tokens come only from requests with the same salt;
    an empty salt is a 400 naming it."""
    body = {"model": MODEL, "prompt": "The salted prompt " * 12, "max_tokens": 1}

    def cached(**salt) -> int:
        r = http.post("/completions", json={**body, **salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="s1") == 0 and cached(cache_salt="s1") > 0
    assert cached(cache_salt="s2") == 0
    r = http.post("/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                             "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_grouped_stop_token_ids_on_the_server(http, llm):
    """stop_token_ids=[[a, b], c] in a request body: the group ends the output, stop_reason "[a, b]"."""
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    ids = greedy.token_ids
    j = next(j for j in range(4, len(ids)) if all(ids[i - 1 : i + 1] != ids[j - 1 : j + 1] for i in range(1, j)))
    group = ids[j - 1 : j + 1]
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[group]))[0].outputs[0]
    assert want.stop_reason == str(group)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": stream,
                "stop_token_ids": [group, next(t for t in range(3, 500) if t not in ids)]}
        r = http.post("/completions", json=body)
        chunks = _sse(r) if stream else [r.json()]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        assert "".join(c["text"] for c in choices) == want.text
        assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == ("stop", str(group))
    r = http.post("/completions", json={"model": MODEL, "prompt": PROMPT, "stop_token_ids": [[1, "x"]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


def _metric(http, name: str) -> float:
    root = str(http.base_url).removesuffix("/v1/").removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"graphdecode:{name}"))


def test_chat_completions_batch(http):
    """vLLM's /v1/chat/completions/batch: choice i answers conversation i exactly as /v1/chat/completions would,
    usage summed; its limits and a conversation's bad field are 400s naming the field."""
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Name a colour."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]]
    shared = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stop_token_ids": [[1, 2]]}
    r = http.post("/chat/completions/batch", json={**shared, "messages": conversations})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1, 2]
    singles = [http.post("/chat/completions", json={**shared, "messages": m}).json() for m in conversations]
    for choice, single in zip(body["choices"], singles):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["finish_reason"] == single["choices"][0]["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(s["usage"][key] for s in singles)
    bad = [({"stream": True}, "stream"), ({"n": 2}, "n"), ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {}}}]}, "tools"), ({"temperature": -1}, "temperature")]
    for extra, param in bad:
        r = http.post("/chat/completions/batch", json={**shared, **extra, "messages": conversations})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    for messages, param in (([], "messages"), ([[]], "messages[0]"), ([conversations[0], [{"content": "x"}]],
                                                                    "messages[1][0].role")):
        r = http.post("/chat/completions/batch", json={**shared, "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (messages, r.text)


def test_chat_completions_batch_aborts_what_it_started_when_a_later_conversation_is_refused(http):
    finished, generated = _metric(http, "engine_requests_finished"), _metric(http, "engine_generated_tokens")
    long = [{"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}]
    body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True,
            "messages": [[{"role": "user", "content": "Hi"}], long]}
    r = http.post("/chat/completions/batch", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1]", r.text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _metric(http, "engine_requests_finished") == finished:
        time.sleep(0.05)
    assert _metric(http, "engine_requests_finished") == finished + 1  # conversation 0, aborted
    assert _metric(http, "num_requests_running") == 0
    assert _metric(http, "engine_generated_tokens") - generated < 400


def test_the_models_recommended_sampling_defaults(text_model, tmp_path_factory, llm):
    """generation_config.json's sampling fields (vLLM's --generation-config auto) fill what a request leaves out,
    on every endpoint; its max_new_tokens caps what a request asks for; a field the request gives wins."""
    model = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(text_model, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0,
                                                               "max_new_tokens": 4}))
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids
    with live_server(str(model), tmp_path_factory.mktemp("server_recommended"), MODEL, "--max-model-len", "1024",
                     "--override-generation-config", '{"top_p": 0.9}') as url, \
            httpx.Client(base_url=f"{url}/v1", timeout=60) as http:
        body = {"model": MODEL, "prompt": PROMPT, "return_token_ids": True}
        for asked, tokens in ((None, 4), (2, 2), (50, 4)):  # the recommendation's 4 where it is the smaller
            r = http.post("/completions", json=body if asked is None else {**body, "max_tokens": asked})
            choice = r.json()["choices"][0]
            assert r.status_code == 200 and choice["token_ids"] == greedy[:tokens], r.text
            assert choice["finish_reason"] == "length"
        # n = 3 with no temperature: the recommended greedy makes three equal choices; a request's own
        # temperature 1 samples (three greedy choices of 4 tokens from 512 near-uniform ones: never)
        r = http.post("/completions", json={**body, "n": 3}).json()
        assert [c["token_ids"] for c in r["choices"]] == [greedy] * 3
        r = http.post("/completions", json={**body, "n": 3, "temperature": 1.0, "seed": 5}).json()
        assert [c["token_ids"] for c in r["choices"]] != [greedy] * 3
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2}
        r = http.post("/chat/completions", json={**chat, "max_completion_tokens": 50}).json()
        assert [c["finish_reason"] for c in r["choices"]] == ["length"] * 2 and r["usage"]["completion_tokens"] == 8
        assert r["choices"][0]["message"] == r["choices"][1]["message"]
        r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 50, "messages": chat["messages"]})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 4 and \
            r.json()["stop_reason"] == "max_tokens", r.text
        # a chat 2 tokens short of the context, no max_tokens asked: the recommended 4 is no reason to refuse it
        # (vLLM's rule: only the request's own max_tokens must fit); it ends at max_model_len
        def rendered(words):
            body = {"messages": [{"role": "user", "content": "a " * words}]}
            return httpx.post(f"{url}/tokenize", json=body).json()["count"]

        words = 900 + (MAX_MODEL_LEN - 2) - rendered(900)
        assert rendered(words) == MAX_MODEL_LEN - 2
        long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "a " * words}]}
        r = http.post("/chat/completions", json=long_chat)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert http.post("/chat/completions", json={**long_chat, "max_tokens": 4}).status_code == 400


def test_tokenize_and_detokenize(http, server, tokenizer):
    """vLLM's /tokenize (a prompt, or a chat rendered as /v1/chat/completions renders it) and /detokenize."""
    r = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    ids = tokenizer(PROMPT)["input_ids"]
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                                                 "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    r = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
    assert r.json()["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"] != ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = http.post("/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                "return_token_ids": True}).json()
    r = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200 and r.json()["tokens"] == chat["prompt_token_ids"]
    r = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}
    for path, body, param in (("/tokenize", {"prompt": PROMPT, "messages": messages}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens")):
        r = httpx.post(f"{server}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert httpx.post(f"{server}/tokenize", json={"model": "other", "prompt": "Hi"}).status_code == 404
    assert httpx.get(f"{server}/ping").json() == {"status": "ok"}
