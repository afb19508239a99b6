"""A prompt sent with no SamplingParams runs with the model's recommended defaults (generation_config.json),
through generate, a list with None in it, stream, chat and AsyncLLM; a SamplingParams the caller built runs
exactly as built."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.server.async_llm import AsyncLLM
from tests.helpers import SMALL_ENGINE

PROMPTS = ["The capital of France is", "One, two, three,"]
RECOMMENDED = {"temperature": 0.0, "repetition_penalty": 0.1, "max_new_tokens": 5, "do_sample": False}


@pytest.fixture(scope="module")
def recommending_model(text_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(text_model, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **RECOMMENDED}))
    return str(path)


@pytest.fixture(scope="module")
def llm(recommending_model):
    with LLM(recommending_model, **SMALL_ENGINE, cpu_threads=1) as llm:
        yield llm


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_no_params_means_the_models_recommendation(llm):
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, repetition_penalty=0.1, max_tokens=5)
    recommended = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, repetition_penalty=0.1,
                                                               max_tokens=5)))
    plain_greedy = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5)))
    assert recommended != plain_greedy  # the penalty changes this model's tokens: the check below can fail
    assert _tokens(llm.generate(PROMPTS)) == recommended
    assert _tokens(llm.generate(PROMPTS, [None, SamplingParams(temperature=0.0, max_tokens=7)])) == [
        recommended[0], _tokens(llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=7)))[0]]
    streamed = {}
    for delta in llm.stream(PROMPTS):
        streamed.setdefault(delta.prompt, []).extend(delta.outputs[0].token_ids)
    assert [streamed[p] for p in PROMPTS] == recommended
    # a SamplingParams the caller built is not touched: SamplingParams' own max_tokens, 16, no penalty
    built = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0))[0].outputs[0]
    assert len(built.token_ids) == 16 and built.token_ids[:5] == plain_greedy[0]


def test_async_llm_with_no_params(llm, recommending_model):
    async def run():
        engine = AsyncLLM(recommending_model, **SMALL_ENGINE, cpu_threads=1)
        try:
            tokens = []
            async for delta in engine.generate(PROMPTS[0]):
                tokens.extend(delta.outputs[0].token_ids)
            return tokens
        finally:
            engine.shutdown()

    expected = _tokens(llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, repetition_penalty=0.1,
                                                               max_tokens=5)))[0]
    assert asyncio.run(run()) == expected

