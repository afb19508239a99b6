"""Greedy token ids identical to transformers generate, across buckets, k, page sizes,
arrival patterns and preemption."""

from __future__ import annotations

import pytest

from graphdecode import LLM, SamplingParams
from tests.helpers import (
    SMALL_ENGINE,
    copy_model,
    generate_tokens,
    hf_greedy,
    random_prompts,
    rewrite_config,
    token_prompts,
)

LENGTHS = [1, 7, 16, 17, 33, 64, 100, 129, 150, 200, 3, 48]
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _run_staggered(llm: LLM, prompts, waves: int, steps_between: int):
    """Add prompts in waves while earlier ones decode; returns output token ids in prompt order."""
    engine = llm.engine
    requests = []
    per_wave = -(-len(prompts) // waves)
    for w in range(waves):
        for p in prompts[w * per_wave : (w + 1) * per_wave]:
            requests.append(engine.add_request({"prompt_token_ids": p}, GREEDY))
        for _ in range(steps_between):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return [r.seqs[0].output_token_ids for r in requests]


@pytest.mark.parametrize("model", ["llama_gqa_llama3", "qwen2_tied", "llama_head_dim"])
def test_greedy_parity_with_transformers(tiny_models, model):
    path = tiny_models[model]
    prompts = random_prompts(12, LENGTHS)
    expected = hf_greedy(path, prompts, MAX_NEW)
    buckets_used = set()

    # all at once: k=1, page size 16
    llm = LLM(path, num_decode_steps=1, page_size=16, max_model_len=256, max_batch_size=16)
    got = generate_tokens(llm, prompts, GREEDY)
    assert got == expected
    buckets_used |= set(llm.stats()["windows_per_bucket"])

    # arrivals while others decode: k=4, page size 32, at most 8 rows
    llm = LLM(path, num_decode_steps=4, page_size=32, max_model_len=256, max_batch_size=8)
    assert _run_staggered(llm, prompts, waves=4, steps_between=2) == expected
    buckets_used |= set(llm.stats()["windows_per_bucket"])

    # a KV pool so small that sequences get preempted and recomputed: k=8, page size 16
    llm = LLM(path, num_decode_steps=8, page_size=16, max_model_len=256, max_batch_size=16, num_pages=24)
    got = generate_tokens(llm, prompts, GREEDY)
    assert got == expected
    assert llm.stats()["preemptions"] > 0
    buckets_used |= set(llm.stats()["windows_per_bucket"])

    assert len(buckets_used) >= 3, buckets_used


def test_parity_k4_page16_and_k8_page32(tiny_models):
    path = tiny_models["llama_gqa_llama3"]
    prompts = random_prompts(12, LENGTHS, seed=3)
    expected = hf_greedy(path, prompts, MAX_NEW)
    for k, page in [(4, 16), (8, 32)]:
        llm = LLM(path, num_decode_steps=k, page_size=page, max_model_len=256, max_batch_size=4)
        assert generate_tokens(llm, prompts, GREEDY) == expected


def test_transformers_4x_config_layout_and_shards(tiny_models, tmp_path):
    """A 4.x-style config.json (rope_theta/rope_scaling/torch_dtype) and sharded safetensors load the same model."""
    import shutil

    from transformers import AutoModelForCausalLM

    src = tiny_models["llama_gqa_llama3"]
    dst = str(tmp_path / "v4_sharded")
    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(dst, max_shard_size="60KB")
    shutil.copy(f"{src}/generation_config.json", dst)

    def to_v4(raw):
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = rope
        raw["torch_dtype"] = raw.pop("dtype")

    rewrite_config(dst, to_v4)
    import os

    assert os.path.exists(f"{dst}/model.safetensors.index.json")
    prompts = random_prompts(4, [5, 40, 90, 130], seed=5)
    expected = hf_greedy(src, prompts, MAX_NEW)
    llm = LLM(dst, num_decode_steps=4, max_model_len=256, max_batch_size=4)
    assert generate_tokens(llm, prompts, GREEDY) == expected


def test_mistral_model_type_without_sliding_window(tiny_models, tmp_path):
    dst = copy_model(tiny_models, "llama_head_dim", tmp_path, "mistral")

    def to_mistral(raw):
        raw["model_type"] = "mistral"
        raw["architectures"] = ["MistralForCausalLM"]
        raw["sliding_window"] = None

    rewrite_config(dst, to_mistral)
    prompts = random_prompts(3, [4, 20, 60], seed=9)
    expected = hf_greedy(dst, prompts, MAX_NEW)
    llm = LLM(dst, max_model_len=256, max_batch_size=4)
    assert generate_tokens(llm, prompts, GREEDY) == expected


@pytest.mark.parametrize("model", ["llama_gqa_llama3", "qwen2_tied"])
def test_greedy_parity_through_stream(tiny_models, model):
    path = tiny_models[model]
    prompts = random_prompts(12, LENGTHS, seed=7)
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(path, num_decode_steps=8, page_size=16, max_model_len=256, max_batch_size=8)
    got: dict[str, list[int]] = {}
    for delta in llm.stream(token_prompts(prompts), GREEDY):
        (c,) = delta.outputs
        got.setdefault(delta.request_id, []).extend(c.token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernel", "gathering_reference"])
def test_parity_with_and_without_the_cpu_kernel(tiny_models, kernels):
    """Both CPU decode paths (pages read in place by the kernel; the gathering reference a
    machine without a C++ compiler runs) give transformers' tokens, with chunked prefill
    (SDPA after earlier chunks) and a compiled window."""
    path = tiny_models["qwen2_tied"]
    prompts = random_prompts(8, LENGTHS, seed=11)
    expected = hf_greedy(path, prompts, MAX_NEW)
    for extra in ({"max_num_batched_tokens": 48}, {"compile": True, "buckets": [8]}):  # compiled: one bucket
        llm = LLM(path, **SMALL_ENGINE, **extra)
        backend = llm.engine.runner.backend
        if not kernels:
            backend.kernels = None  # as cpu_kernels() leaves it where nothing can build the kernel
        assert backend.reads_pages_in_place == (kernels and backend.kernels is not None)
        assert generate_tokens(llm, prompts, GREEDY) == expected
        assert llm.stats()["cpu_attention_kernels"] == backend.reads_pages_in_place
