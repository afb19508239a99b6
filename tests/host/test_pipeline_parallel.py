"""Pipeline parallelism on CPU (gloo): PP=2 and TP=2 x PP=2 give TP=1's tokens (greedy, seeded, n > 1, logprobs,
chunked prefill, prefix-cache hits, structured outputs, an MoE family, hybrids, the CPU graph twin, n-gram,
draft-model and EAGLE-3 speculation), each stage holds only its layers' weights and KV pages, a partition is
honoured, and what stages cannot run yet is refused by name."""

from __future__ import annotations

import json
import os
import signal

import pytest
from transformers import LlamaConfig

from graphdecode import LLM, SamplingParams
from graphdecode.default_model import save_random_model
from graphdecode.models.eagle3_checkpoint import random_eagle3_head
from graphdecode.models.pipeline import partition_layers
from graphdecode.structured import StructuredOutputsParams
from tests.helpers import (
    SMALL_ENGINE,
    assert_head_drafts_over_stages,
    assert_rank_loss_named,
    completions,
    random_prompts,
    token_prompts,
)

CASES = [
    SamplingParams(temperature=0, max_tokens=16),
    SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=5, max_tokens=12),
    SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[7, 99, 300], logprobs=3),
]


def outputs(llm, prompts, params) -> list:
    result = []
    for o in llm.generate(prompts, params):
        for c in o.outputs:
            logprobs = [sorted((t, p.logprob) for t, p in step.items()) for step in c.logprobs or []]
            result.append((c.token_ids, c.finish_reason, logprobs))
    return result


def same(got, want) -> bool:
    """Tokens, finish reasons and logprob ids exactly; logprob values to 1e-4, as test_tensor_parallel.py: a TP
    rank sums its half of a row's products before the all-reduce adds the halves, so a logprob may move in its
    last bits (2e-6 on an AVX-512 box) while every token stays the single rank's."""
    if isinstance(got, float) and isinstance(want, float):
        return abs(got - want) < 1e-4
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    return got == want


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory) -> str:
    """A tiny Llama of three layers: two stages split it unevenly."""
    path = str(tmp_path_factory.mktemp("pp") / "llama3l")
    save_random_model(path, LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                        initializer_range=0.1, bos_token_id=1, eos_token_id=2), seed=7)
    return path


def test_partition_layers_like_vllm():
    assert partition_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert partition_layers(3, 2) == [range(0, 2), range(2, 3)]  # the remainder before the last stage
    assert partition_layers(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert partition_layers(5, 2, (1, 4)) == [range(0, 1), range(1, 5)]


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_stages_give_the_single_rank_tokens(three_layers, tp, pp):
    prompts = token_prompts(random_prompts(6, [1, 17, 40, 90]))
    single = LLM(three_layers, **SMALL_ENGINE)
    want = [outputs(single, prompts, params) for params in CASES]
    chunked = dict(SMALL_ENGINE, max_num_batched_tokens=32)  # the 90-token prompts in three chunks
    with LLM(three_layers, tensor_parallel_size=tp, pipeline_parallel_size=pp, **chunked) as llm:
        assert same([outputs(llm, prompts, params) for params in CASES], want)
        # prefix-cache hits: the same prompts again, and longer ones that share their pages
        longer = [{"prompt_token_ids": p["prompt_token_ids"] + [11, 12, 13]} for p in prompts]
        assert same(outputs(llm, prompts, CASES[0]), want[0])
        assert same(outputs(llm, longer, CASES[0]), outputs(single, longer, CASES[0]))
        assert llm.stats()["prefix_cache_hits"] > 0
        sizes = [llm.engine.runner.memory_sizes(), *llm.engine.executor.gather_from_workers("sizes")[1:]]
    assert len(sizes) == tp * pp
    full = single.engine.runner.memory_sizes()
    assert all(s["weight_bytes"] < full["weight_bytes"] and s["kv_cache_bytes"] < full["kv_cache_bytes"]
               for s in sizes)


@pytest.mark.parametrize("micro", [1, 3])
def test_micro_batches_in_flight_give_the_same_tokens(three_layers, micro, monkeypatch):
    """The default (2 micro-batches over 2 stages) runs in every test here; one (the bubble) and three (more than
    the stages) give the same tokens, under the CPU graph twin and its bounds checks too."""
    import graphdecode.device.graphs as graphs

    windows = []
    real = graphs.pipelined_window
    monkeypatch.setattr(graphs, "pipelined_window", lambda *a, **k: windows.append(a[4]) or real(*a, **k))
    prompts = token_prompts(random_prompts(7, [1, 17, 40]))
    want = [outputs(LLM(three_layers, **SMALL_ENGINE), prompts, params) for params in CASES]
    with LLM(three_layers, pipeline_parallel_size=2, pp_micro_batches=micro, cuda_graphs=True, check_bounds=True,
             **SMALL_ENGINE) as llm:
        assert same([outputs(llm, prompts, params) for params in CASES], want)
    # rank 0's windows: buckets of 4 and 8 rows in flight as micro-batches; none with one micro-batch
    assert (set(windows) >= {4, 8}) if micro > 1 else not windows


def test_each_stage_holds_its_layers(three_layers):
    single = LLM(three_layers, num_pages=40, **SMALL_ENGINE).engine.runner.memory_sizes()
    with LLM(three_layers, pipeline_parallel_size=2, num_pages=40, **SMALL_ENGINE) as llm:
        first = llm.engine.runner.memory_sizes()
        _, last = llm.engine.executor.gather_from_workers("sizes")
    # two layers' pages on the first stage, one on the last; together the single rank's
    assert first["kv_cache_bytes"] == 2 * last["kv_cache_bytes"]
    assert first["kv_cache_bytes"] + last["kv_cache_bytes"] == single["kv_cache_bytes"]
    # the weights split: the embedding on the first stage, the head on the last, each layer on one (the final
    # norm, 64 floats, on both)
    assert first["weight_bytes"] + last["weight_bytes"] == single["weight_bytes"] + 64 * 4
    with LLM(three_layers, pipeline_parallel_size=2, pp_layer_partition="1,2", num_pages=40, **SMALL_ENGINE) as llm:
        first = llm.engine.runner.memory_sizes()
        _, last = llm.engine.executor.gather_from_workers("sizes")
        assert 2 * first["kv_cache_bytes"] == last["kv_cache_bytes"]
        prompts = token_prompts(random_prompts(3, [5, 30]))
        assert same(outputs(llm, prompts, CASES[1]), outputs(LLM(three_layers, **SMALL_ENGINE), prompts, CASES[1]))


def test_an_moe_family_and_the_graph_twin_over_stages(tiny_models):
    """Qwen3-MoE (two layers, one a stage) under the CPU graph twin with bounds checks."""
    path = tiny_models["qwen3_moe"]
    prompts = token_prompts(random_prompts(4, [3, 30]))
    want = [outputs(LLM(path, **SMALL_ENGINE), prompts, params) for params in CASES[:2]]
    with LLM(path, pipeline_parallel_size=2, cuda_graphs=True, check_bounds=True, **SMALL_ENGINE) as llm:
        assert same([outputs(llm, prompts, params) for params in CASES[:2]], want)


def test_structured_outputs_over_stages(text_model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["Describe a pet:", "JSON please"]
    want = [o.outputs[0].text for o in LLM(text_model, **SMALL_ENGINE).generate(prompts, params)]
    with LLM(text_model, pipeline_parallel_size=2, **SMALL_ENGINE) as llm:
        got = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert got == want
    for text in got:
        assert set(json.loads(text)) == {"name", "age"}


@pytest.mark.parametrize("name, partition", [("qwen3_5", None), ("nemotron_h", "4,2")])
def test_hybrids_over_stages(tiny_models, tmp_path, name, partition):
    """A hybrid's recurrent states split with its layers (each stage's StateCache holds its own recurrent layers,
    its KV cache its own attention layers): Qwen3.5's three Gated DeltaNet layers on the first stage and its
    attention layer on the second; Nemotron-H's last stage a Mamba2 and an MLP block, no attention. Chunked
    prefills, prefix-cache hits (the states' snapshots) and n > 1 give the single rank's tokens; an EAGLE-3 head
    over layers of both stages, the single rank's drafts and acceptance (verifies that hold and commit the
    states)."""
    path = tiny_models[name]
    prompts = token_prompts(random_prompts(5, [1, 17, 40, 70]))
    engine = dict(SMALL_ENGINE, dtype="float32", max_num_batched_tokens=32)
    single = LLM(path, **engine)
    want = [outputs(single, prompts, params) for params in CASES[:2]]
    with LLM(path, pipeline_parallel_size=2, pp_layer_partition=partition, **engine) as llm:
        assert same([outputs(llm, prompts, params) for params in CASES[:2]], want)
        longer = [{"prompt_token_ids": p["prompt_token_ids"] + [11, 12, 13]} for p in prompts]
        assert same(outputs(llm, longer, CASES[0]), outputs(single, longer, CASES[0]))
        assert llm.stats()["prefix_cache_hits"] > 0
        sizes = [llm.engine.runner.memory_sizes(), *llm.engine.executor.gather_from_workers("sizes")[1:]]
    states = [s["state_cache_bytes"] for s in sizes]  # each stage's recurrent layers' slots, no other's
    assert min(states) > 0 and sum(states) == single.engine.runner.memory_sizes()["state_cache_bytes"]
    head = random_eagle3_head(str(tmp_path / "head"), path, draft_vocab_size=200, aux_layers=(0, 2, 4))
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    hot = SamplingParams(n=2, temperature=1.5, seed=5, max_tokens=16, ignore_eos=True)
    assert_head_drafts_over_stages(path, spec, prompts[:3], [hot], partition, **engine)


def test_ngram_speculation_over_stages(three_layers):
    """Drafts verified over the stages (every rank verifies the same logits): plain decoding's tokens."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": [11, 12, 13] * 9},
               {"prompt_token_ids": list(range(20, 60))}]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    want = [outputs(LLM(three_layers, **SMALL_ENGINE), prompts, params) for params in CASES[:2]]
    with LLM(three_layers, pipeline_parallel_size=2, speculative_config=spec, **SMALL_ENGINE) as llm:
        assert same([outputs(llm, prompts, params) for params in CASES[:2]], want)
        assert llm.stats()["spec_draft_tokens"] > 0


def test_draft_model_speculation_over_stages(three_layers):
    """A draft model replicated on every stage (each rank drafts the same tokens from the same shared logits), its
    target verified over the stages: single-rank plain decoding's tokens, greedy and seeded; a self-draft's greedy
    drafts all accepted."""
    prompts = token_prompts(random_prompts(6, [1, 17, 40, 90]))
    spec = {"method": "draft_model", "model": three_layers, "num_speculative_tokens": 2}
    want = [outputs(LLM(three_layers, **SMALL_ENGINE), prompts, params) for params in CASES[:2]]
    with LLM(three_layers, pipeline_parallel_size=2, speculative_config=spec, **SMALL_ENGINE) as llm:
        greedy = outputs(llm, prompts, CASES[0])
        stats = llm.stats()
        assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
        assert same([greedy, outputs(llm, prompts, CASES[1])], want)


def test_eagle3_head_over_stages(three_layers, tmp_path):
    """An EAGLE-3 head reading a layer of each stage (layers 0 and 1 on the first, 2 on the second), through
    chunked prefills and the CPU graph twin: one rank's drafts, acceptance and tokens, which are plain
    decoding's."""
    head = random_eagle3_head(str(tmp_path / "head"), three_layers, draft_vocab_size=200, aux_layers=(0, 1, 2))
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    prompts = token_prompts(random_prompts(6, [1, 17, 40, 90]))
    hot = SamplingParams(n=2, temperature=1.5, seed=5, max_tokens=16, ignore_eos=True)
    engine = dict(SMALL_ENGINE, max_num_batched_tokens=32)
    # the CPU graph twin: windows captured lazily with live rows, the head's broadcast inside them
    got = assert_head_drafts_over_stages(three_layers, spec, prompts, [CASES[0], hot], cuda_graphs=True, **engine)
    assert got == [completions(LLM(three_layers, **engine).generate(prompts, params)) for params in (CASES[0], hot)]


def test_a_dead_stage_is_named(three_layers):
    llm = LLM(three_layers, pipeline_parallel_size=2, **SMALL_ENGINE)
    (pid,) = llm.engine.executor.worker_pids
    assert_rank_loss_named(llm, lambda: os.kill(pid, signal.SIGKILL), "worker 1")


def test_what_stages_cannot_run_is_refused_by_name(three_layers, tiny_models):
    cases = [
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
        (dict(pipeline_parallel_size=4), r"pipeline_parallel_size \(4\) exceeds the model's 3 decoder layers"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="2,2"), "pp_layer_partition"),
        (dict(pipeline_parallel_size=2, pp_layer_partition=[3]), "pp_layer_partition"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="0,3"), "pp_layer_partition"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="a,b"), "pp_layer_partition"),
        (dict(pipeline_parallel_size=2, nnodes=4), "nnodes"),
        (dict(pipeline_parallel_size=3, pp_micro_batches=2), "pp_micro_batches"),
        (dict(pipeline_parallel_size=2, pp_micro_batches=0), "pp_micro_batches"),
        (dict(pipeline_parallel_size=2, compile=True), "compile=True does not run over pipeline stages"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM(three_layers, **kwargs)
    with pytest.raises(ValueError, match="layer loop of its own"):  # Phi-3's longrope switch
        LLM(tiny_models["phi3_longrope"], pipeline_parallel_size=2, **SMALL_ENGINE)
