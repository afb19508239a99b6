"""Every numeric request field, fuzzed with out-of-range integers, floats and wrong types, through
the live server (both endpoints) and through SamplingParams / LLM.generate.

Each value is either legitimately valid (200, or a result) or refused before any work with a 400
(ValueError / TypeError) naming the field; none may reach the engine and break it: after the whole
run the same server and LLM still answer a normal request exactly as before, and /health is 200.
"""

from __future__ import annotations

import math
import re

import httpx
import pytest

from graphdecode import LLM, SamplingParams
from tests.helpers import SMALL_ENGINE, live_server

pytestmark = pytest.mark.faults  # the fault-injection suite (pytest -m faults)

MODEL = "fuzz-model"
MAX_MODEL_LEN = 96
ENGINE = dict(SMALL_ENGINE, num_decode_steps=2, max_model_len=MAX_MODEL_LEN)
EOS = 2  # the text model's </s>

# label -> JSON text (NaN and Infinity are what Python's json writes; the server's parser reads them)
VALUES = {
    "2**31": str(2**31), "2**32+1": str(2**32 + 1), "2**63": str(2**63), "10**30": str(10**30), "-1": "-1", "-2**63": str(-(2**63)),
    "1.5": "1.5", '"x"': '"x"', "null": "null", "true": "true", "NaN": "NaN", "Infinity": "Infinity",
}
HUGE_FLOATS = {"2**31", "2**32+1", "2**63", "10**30"}  # as floats: finite, and within float32's range

# (field, how the value is placed, labels answered 200); every other label must be a 400 naming `param`.
# placement: "value" as is; "list" [value]; "key" {"<value>": 1} (logit_bias keys); "bias" {"5": value}
SHARED = [
    ("n", "value", {"null"}),
    ("temperature", "value", HUGE_FLOATS | {"1.5", "null"}),
    ("top_p", "value", {"null"}),
    ("min_p", "value", {"null"}),
    ("seed", "value", {"2**31", "2**32+1", "-1", "-2**63", "null"}),  # a 64-bit integer (vLLM's server bound)
    ("presence_penalty", "value", {"-1", "1.5", "null"}),
    ("frequency_penalty", "value", {"-1", "1.5", "null"}),
    ("repetition_penalty", "value", HUGE_FLOATS | {"1.5", "null"}),
    ("top_k", "value", {"-1", "null"}),
    ("min_tokens", "value", {"null"}),
    ("best_of", "value", {"null"}),
    ("prompt_logprobs", "value", {"null"}),
    ("truncate_prompt_tokens", "value", {"-1", "null"}),
    ("priority", "value", set()),  # an integer (vLLM's), and non-zero needs --scheduling-policy priority
    ("stop_token_ids", "list", set()),
    ("allowed_token_ids", "list", set()),
    ("logit_bias", "key", set()),
    ("logit_bias", "bias", {"-1", "1.5"}),
]
COMPLETIONS = SHARED + [("max_tokens", "value", {"null"}), ("logprobs", "value", {"null"}),
                       ("prompt", "list", {'"x"'})]  # ["x"]: a list of text prompts
CHAT = SHARED + [("max_tokens", "value", {"null"}), ("max_completion_tokens", "value", {"null"}),
                 ("top_logprobs", "value", {"null"})]
# each request: these fields (JSON text), with the fuzzed field set or replacing one of them
BASE = {"completions": {"prompt": '"Hi"', "max_tokens": "2"},
        "chat/completions": {"messages": '[{"role": "user", "content": "Hi"}]', "max_tokens": "2",
                             "logprobs": "true"}}


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    with live_server(text_model, tmp_path_factory.mktemp("fuzz"), MODEL, "-k", str(ENGINE["num_decode_steps"]),
                     "--max-model-len", str(MAX_MODEL_LEN), "--max-batch-size", str(ENGINE["max_batch_size"])) as url:
        yield url


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, **ENGINE)


def _body(endpoint: str, field: str, placement: str, text: str) -> str:
    placed = {"value": text, "list": f"[{text}]", "key": '{"%s": 1}' % text.strip('"'),
              "bias": '{"5": %s}' % text}[placement]
    fields = {"model": f'"{MODEL}"', **BASE[endpoint], field: placed}
    return "{" + ", ".join(f'"{name}": {value}' for name, value in fields.items()) + "}"


def _greedy_completion(http: httpx.Client) -> str:
    r = http.post("/completions", json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                                        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("endpoint,fields", [("completions", COMPLETIONS), ("chat/completions", CHAT)])
def test_every_numeric_field_is_valid_or_a_400_naming_it(server, llm, endpoint, fields):
    want = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8,
                                                                    ignore_eos=True))[0].outputs[0].text
    wrong = []
    with httpx.Client(base_url=f"{server}/v1", timeout=60) as http:
        assert _greedy_completion(http) == want
        for field, placement, valid in fields:
            for label, text in VALUES.items():
                body = _body(endpoint, field, placement, text)
                r = http.post(f"/{endpoint}", content=body, headers={"content-type": "application/json"})
                if label in valid:
                    if r.status_code != 200:
                        wrong.append(f"{field}={label} ({placement}): {r.status_code} {r.text[:200]}")
                    continue
                error = r.json().get("error", {}) if r.headers["content-type"] == "application/json" else {}
                if r.status_code != 400 or error.get("param") != field or not error.get("message"):
                    wrong.append(f"{field}={label} ({placement}): {r.status_code} {r.text[:200]}")
            assert httpx.get(f"{server}/health").status_code == 200, (field, wrong)
        assert _greedy_completion(http) == want  # the engine is untouched
    assert not wrong, "\n".join(wrong)


def test_min_tokens_beyond_the_context_runs_to_the_end(server, llm):
    """min_tokens past the end of the sequence (no max_tokens: up to max_model_len) means "never stop
    early", even against an EOS the model is pushed to: the int32 min_len on the device cannot wrap."""
    with httpx.Client(base_url=f"{server}/v1", timeout=60) as http:
        r = http.post("/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
            "min_tokens": 2**31 - 1, "logit_bias": {str(EOS): 100}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == MAX_MODEL_LEN
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
        temperature=0, max_tokens=None, min_tokens=2**31 - 1, logit_bias={EOS: 100}))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_MODEL_LEN - 3
    assert EOS not in out.token_ids


# SamplingParams / LLM.generate: each field with each value; valid ones generate
PY_VALUES = {"2**31": 2**31, "2**32+1": 2**32 + 1, "2**63": 2**63, "10**30": 10**30, "-1": -1, "-2**63": -(2**63), "1.5": 1.5,
             '"x"': "x", "None": None, "True": True, "nan": math.nan, "inf": math.inf, "10**400": 10**400}
# field -> labels that are valid (for fields whose None is their default or "off", None is valid)
PY_FIELDS = {
    "n": set(),
    "temperature": HUGE_FLOATS | {"1.5"},
    "top_p": set(),
    "top_k": {"-1"},
    "min_p": set(),
    "seed": {"2**31", "2**32+1", "2**63", "10**30", "-1", "-2**63", "None", "10**400"},
    "max_tokens": {"None"},
    "min_tokens": set(),
    "logprobs": {"None"},
    "prompt_logprobs": {"None"},
    "repetition_penalty": HUGE_FLOATS | {"1.5"},
    "presence_penalty": {"-1", "1.5"},
    "frequency_penalty": {"-1", "1.5"},
    "stop_token_ids": {"None"},
    "allowed_token_ids": {"None"},
    "logit_bias": {"None"},
}
LIST_FIELDS = {"stop_token_ids", "allowed_token_ids"}


def _py_value(field: str, value):
    if value is None:
        return None
    if field in LIST_FIELDS:
        return [value]
    if field == "logit_bias":
        return {value: 1.0}
    return value


@pytest.mark.parametrize("field", sorted(PY_FIELDS))
def test_sampling_params_fields_fuzzed_through_llm(llm, field):
    want = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))[0]
    for label, value in PY_VALUES.items():
        kwargs = {"max_tokens": 4, field: _py_value(field, value)}
        if label in PY_FIELDS[field]:
            out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(**kwargs))[0].outputs[0]
            assert out.finish_reason in ("length", "stop") and out.token_ids, (field, label)
            continue
        with pytest.raises((ValueError, TypeError)) as info:
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(**kwargs))
        message = str(info.value).removeprefix("prompts[0]: ")
        assert re.match(rf"{field}\b", message), (field, label, message)
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))[0] \
        .outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-6])
def test_tiny_temperatures_sample_greedily(llm, temperature):
    """logits / temperature would overflow float32 (inf, then garbage tokens): below 1e-5 it is greedy."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    tiny = llm.generate(prompt, SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, n=2))[0]
    assert [c.token_ids for c in tiny.outputs] == [greedy.token_ids] * 2
