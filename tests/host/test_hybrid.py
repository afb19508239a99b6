"""Hybrid models (Qwen3.5: Gated DeltaNet + gated attention) against transformers, and their state cache.

A tiny random Qwen3.5 text model (three linear-attention layers, one attention layer, then two more linear
ones) runs greedy beside transformers' generate (its torch fallbacks for the delta rule and the convolution
are the oracle) through the engine's paths: eager and graph-twin windows, k = 1 / 4 / 8, page sizes, chunked
prefill (prompts cut at arbitrary points, across the delta rule's 64-token blocks), a tiny pool that preempts,
n > 1 forks; the multimodal checkpoint's text part; the state slots' accounting; refusals by field.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphdecode import LLM, SamplingParams, StructuredOutputsParams
from graphdecode.models.gated_deltanet import chunked_delta_rule
from tests.helpers import (
    copy_model,
    edit_tensors,
    hf_greedy,
    random_prompts,
    rewrite_config,
    token_prompts,
    with_tokenizer,
)

LAYERS = 6  # tests/conftest.py's qwen3_5: linear x 3, attention, linear x 2


@pytest.fixture(scope="module")
def qwen35(tiny_models) -> str:
    return tiny_models["qwen3_5"]


PROMPTS = random_prompts(4, [5, 37, 70, 150], seed=71)  # 70 and 150 cross the delta rule's 64-token blocks
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)]


@pytest.mark.parametrize("engine", [
    dict(),
    dict(cuda_graphs=True, num_decode_steps=4, page_size=4, max_num_batched_tokens=16),
    dict(num_decode_steps=1, buckets=[1, 2, 4], max_num_batched_tokens=45),
    dict(num_pages=20, max_model_len=192, max_num_batched_tokens=256),  # admitted in 19 pages, grow to 23
], ids=["eager", "graphs-chunked", "k1-buckets", "preempting"])
def test_greedy_matches_transformers(qwen35, engine):
    expected = hf_greedy(qwen35, PROMPTS, 24)
    with LLM(qwen35, dtype="float32", cpu_threads=1, **engine) as llm:
        assert _tokens(llm, PROMPTS) == expected
        if "num_pages" in engine:
            assert llm.engine.stats()["preemptions"] > 0
        assert llm.engine.scheduler.num_free_state_slots == llm.config.max_batch_size  # every slot came back


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("engine", [dict(), dict(cuda_graphs=True, num_decode_steps=4, page_size=4,
                                                  max_num_batched_tokens=16)], ids=["eager", "graphs-chunked"])
def test_the_moe_hybrids_match_transformers(tiny_models, family, engine):
    """Qwen3-Next (grouped projections, shared expert, a dense layer) and Qwen3.5-MoE."""
    path = tiny_models[family]
    with LLM(path, dtype="float32", cpu_threads=1, **engine) as llm:
        assert _tokens(llm, PROMPTS) == hf_greedy(path, PROMPTS, 24)
        assert sum(map(sum, llm.stats()["moe_tokens_per_expert"])) > 0


NEMOTRON_ENGINES = [dict(), dict(cuda_graphs=True, num_decode_steps=4, page_size=4, max_num_batched_tokens=21),
                    dict(num_decode_steps=1, compile=True, max_model_len=256, buckets=[4])]  # one compile


@pytest.mark.parametrize("engine", NEMOTRON_ENGINES, ids=["eager", "graphs-chunked", "k1-compiled"])
def test_nemotron_h_matches_transformers(tiny_models, engine):
    """Mamba2 blocks (the SSD chunks of 16 crossed by the prompts and by 21-token prefill chunks), attention
    without rope, relu-squared MLPs; tokens up to and including EOS, as generate stops there."""
    path = tiny_models["nemotron_h"]
    params = SamplingParams(max_tokens=24, temperature=0)
    with LLM(path, dtype="float32", cpu_threads=1, **engine) as llm:
        assert _tokens(llm, PROMPTS, params) == hf_greedy(path, PROMPTS, 24)


@pytest.mark.parametrize("model", ["nemotron3_moe", "nemotron3_latent"])
@pytest.mark.parametrize("engine", NEMOTRON_ENGINES, ids=["eager", "graphs-chunked", "k1-compiled"])
def test_nemotron_3_moe_blocks_match_transformers(tiny_models, tmp_path, engine, model):
    """Nemotron 3's MoE blocks beside Mamba2, attention and MLP blocks: relu-squared experts routed by sigmoid
    scores with a (random) correction bias over expert groups, scaled, plus the ungated shared expert; Super's
    kind with the experts in a latent space between fc1_latent_proj and fc2_latent_proj."""
    path = copy_model(tiny_models, model, tmp_path)
    g = torch.Generator().manual_seed(3)
    edit_tensors(path, lambda t: t.update({k: torch.randn(t[k].shape, generator=g) * 0.1 for k in t
                                           if k.endswith("e_score_correction_bias")}))
    params = SamplingParams(max_tokens=24, temperature=0)
    with LLM(path, dtype="float32", cpu_threads=1, **engine) as llm:
        blocks = llm.engine.runner.model.model.layers
        assert [b.sparse for b in blocks] == [False, True, False, False, True]
        assert blocks[1].mixer.gate.e_score_correction_bias.abs().sum() > 0
        assert _tokens(llm, PROMPTS, params) == hf_greedy(path, PROMPTS, 24)
        assert all(sum(layer) > 0 for layer in llm.stats()["moe_tokens_per_expert"])
        assert blocks[1].mixer.experts.down_proj.shape[1] == (32 if model == "nemotron3_latent" else 64)


@pytest.mark.parametrize("engine", NEMOTRON_ENGINES[:2], ids=["eager", "graphs-chunked"])
def test_granite_4_h_moe_matches_transformers(tiny_models, engine):
    """Granite 4.0-H's MoE models: experts (stacked input_linear / output_linear, router.layer: top-k logits,
    softmax over them) beside every layer's shared MLP, under Granite's multipliers."""
    path = tiny_models["granite_hybrid_moe"]
    params = SamplingParams(max_tokens=24, temperature=0)
    with LLM(path, dtype="float32", cpu_threads=1, **engine) as llm:
        layers = llm.engine.runner.model.model.layers
        assert all(layer.sparse and layer.mlp.cfg.routing == "topk_softmax" for layer in layers)
        assert _tokens(llm, PROMPTS, params) == hf_greedy(path, PROMPTS, 24)
        assert all(sum(layer) > 0 for layer in llm.stats()["moe_tokens_per_expert"])


@pytest.mark.parametrize("engine", NEMOTRON_ENGINES[:2], ids=["eager", "graphs-chunked"])
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
def test_granite_4_h_matches_transformers(tiny_models, tmp_path, engine, rope):
    """Granite 4.0-H (dense): Mamba2 and attention layers with shared MLPs, Granite's four multipliers; with
    position_embedding_type "rope" and without any position encoding."""
    path = tiny_models["granite_hybrid"]
    if not rope:
        path = copy_model(tiny_models, "granite_hybrid", tmp_path, "granite_nope")
        rewrite_config(path, lambda raw: raw.update(position_embedding_type=None))
    params = SamplingParams(max_tokens=24, temperature=0)
    with LLM(path, dtype="float32", cpu_threads=1, **engine) as llm:
        assert llm.config.model_config.rope_enabled is rope
        assert _tokens(llm, PROMPTS, params) == hf_greedy(path, PROMPTS, 24)


def test_nemotron_h_speculation_and_prefix_hits(tiny_models):
    path = tiny_models["nemotron_h"]
    prompts = _echo_prompts(path)
    with LLM(path, dtype="float32", cpu_threads=1,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
        got = _tokens(llm, prompts, SamplingParams(max_tokens=30, temperature=0))
        assert llm.engine.stats()["spec_accepted_tokens"] > 0
        shared = [SYSTEM + q for q in QUESTIONS[:3]]
        hits = [_hit_tokens(llm, p, SamplingParams(max_tokens=12, temperature=0)) for p in shared]
        assert [h for _, h in hits] == [0, 0, 32]
    assert got == hf_greedy(path, prompts, 30)
    assert [t for t, _ in hits] == hf_greedy(path, shared, 12)


def test_ngram_speculation_on_qwen3_next(tiny_models):
    path = tiny_models["qwen3_next"]
    prompts = _echo_prompts(path)
    with LLM(path, dtype="float32", cpu_threads=1,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
        got = _tokens(llm, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        assert llm.engine.stats()["spec_accepted_tokens"] > 0
    assert got == hf_greedy(path, prompts, 40)


def test_children_fork_the_prompts_state_and_sampling_ignores_company(qwen35):
    expected = hf_greedy(qwen35, PROMPTS[1:3], 16)
    with LLM(qwen35, dtype="float32", cpu_threads=1, max_num_batched_tokens=24) as llm:
        outs = llm.generate(token_prompts(PROMPTS[1:3]), SamplingParams(n=3, temperature=0, max_tokens=16,
                                                                        ignore_eos=True), use_tqdm=False)
        for out, ref in zip(outs, expected):
            assert [list(c.token_ids) for c in out.outputs] == [ref] * 3
        seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
        alone = _tokens(llm, PROMPTS[2:3], seeded)[0]
        crowd = llm.generate(token_prompts(PROMPTS), [GREEDY, GREEDY, seeded, GREEDY], use_tqdm=False)
        assert list(crowd[2].outputs[0].token_ids) == alone
        children = llm.generate(token_prompts(PROMPTS[2:3]), SamplingParams(n=2, temperature=1.0, seed=11,
                                                                            max_tokens=16, ignore_eos=True),
                                use_tqdm=False)[0].outputs
        assert len({tuple(c.token_ids) for c in children}) == 2  # forked states, each child its own noise


def test_state_slots_come_back_after_aborts(qwen35):
    with LLM(qwen35, dtype="float32", cpu_threads=1, max_batch_size=8, max_model_len=128) as llm:
        engine = llm.engine
        prompts = random_prompts(60, [3, 9, 20, 40], seed=72)
        params = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True, n=2)
        ids = [engine.add_request({"prompt_token_ids": p}, params).request_id for p in prompts]
        steps = busy = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps % 3 == 0 and ids:
                engine.abort_request(ids.pop(0 if steps % 2 else -1))  # waiting, prefilling or running ones
            assert engine.scheduler.num_free_state_slots >= 0
            busy = max(busy, engine.load()["state_slots_in_use"])
        assert engine.scheduler.num_free_state_slots == 8
        stats = engine.stats()
        assert busy == 8 and (stats["state_slots_in_use"], stats["state_slots"]) == (0, 8)
        assert engine.load()["state_slots_in_use"] == 0
        assert engine.pool.num_free == llm.config.num_pages - 1


def test_structured_outputs_constrain_a_hybrid_in_the_window(qwen35, text_model, tmp_path):
    """The constraint lives in the sampler; the recurrent layers under it run as always (twin windows here)."""
    path = with_tokenizer(qwen35, text_model, tmp_path / "with_tokenizer")
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=24, structured_outputs=StructuredOutputsParams(
        regex=pattern)) for s in range(3)]
    with LLM(path, dtype="float32", cpu_threads=1, cuda_graphs=True, num_decode_steps=4) as llm:
        outs = llm.generate(["Code: ", "The code is ", "Write one: "], params, use_tqdm=False)
    for out in outs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("text_model_name,model_type", [("qwen3_5", "qwen3_5"), ("qwen3_5_moe", "qwen3_5_moe")])
def test_multimodal_checkpoint_runs_its_text_part(tiny_models, tmp_path, text_model_name, model_type):
    """Qwen3_5(Moe)ForConditionalGeneration's checkpoint: text_config, model.language_model.*, beside a vision
    tower and MTP layers that are skipped."""
    source = tiny_models[text_model_name]
    path = str(tmp_path / f"{model_type}_vl")
    os.makedirs(path)
    with open(os.path.join(source, "config.json")) as f:
        text = json.load(f)
    text.pop("architectures", None)
    config = {"model_type": model_type, "architectures": ["ForConditionalGeneration"],
              "tie_word_embeddings": False, "text_config": text, "vision_config": {"depth": 1}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(
        os.path.join(source, "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with LLM(path, dtype="float32", cpu_threads=1) as llm:
        assert _tokens(llm, PROMPTS[:2]) == hf_greedy(source, PROMPTS[:2], 24)


def _echo_prompts(path: str) -> list[list[int]]:
    """Prompts that repeat themselves after the model's own continuation: n-gram drafts get accepted."""
    base = random_prompts(4, [12, 20, 30, 9], seed=5)
    return [p + c + p for p, c in zip(base, hf_greedy(path, base, 40))]


@pytest.mark.parametrize("engine", [dict(), dict(cuda_graphs=True, num_decode_steps=4)], ids=["eager", "graphs"])
def test_ngram_speculation_keeps_only_the_accepted_positions_in_the_states(qwen35, engine):
    prompts = _echo_prompts(qwen35)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(qwen35, dtype="float32", cpu_threads=1, speculative_config=spec, **engine) as llm:
        llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
        assert _tokens(llm, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) == \
            hf_greedy(qwen35, prompts, 40)
        stats = llm.engine.stats()
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # some drafts kept, some rejected
        seeded = [SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]
        speculated = _tokens(llm, prompts, seeded)
    with LLM(qwen35, dtype="float32", cpu_threads=1, **engine) as plain:
        assert _tokens(plain, prompts, seeded) == speculated  # speculation changes speed, never output


def test_a_dense_draft_model_drafts_for_a_hybrid(qwen35, tiny_models):
    prompts = _echo_prompts(qwen35)
    spec = {"method": "draft_model", "model": tiny_models["llama_gqa_llama3"], "num_speculative_tokens": 2}
    with LLM(qwen35, dtype="float32", cpu_threads=1, speculative_config=spec) as llm:
        llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
        got = _tokens(llm, prompts[:2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert llm.engine.stats()["spec_draft_tokens"] > 0
    assert got == hf_greedy(qwen35, prompts[:2], 24)


def test_refusals_name_the_field(qwen35, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model: a hybrid draft"):
        LLM(qwen35, speculative_config={"method": "draft_model", "model": qwen35, "num_speculative_tokens": 2})
    path = str(tmp_path / "bad")
    os.makedirs(path)
    with open(os.path.join(qwen35, "config.json")) as f:
        config = json.load(f)
    for edit, field in [({"layer_types": ["linear_attention"] * LAYERS}, "layer_types"),
                        ({"layer_types": ["sliding_attention"] * LAYERS}, "layer_types"),
                        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
                        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim")]:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**config, **edit}, f)
        with pytest.raises(ValueError, match=field):  # from config.json alone: no weights in this directory
            LLM(path)


def test_the_budget_holds_the_live_states_and_the_snapshots_first(qwen35):
    from graphdecode.config import EngineConfig, state_cache_bytes

    per_state = 5 * (128 * 3 * 4 + 4 * 16 * 16 * 4)  # 5 linear layers: conv window + float32 matrix
    per_page = 1 * 2 * 16 * 2 * 16 * 4  # one attention layer: K and V, 16 tokens, 2 heads of 16
    for caching, snapshots in ((True, 8), (False, 0)):
        config = EngineConfig(qwen35, dtype="float32", kv_cache_memory_bytes=1 << 22, max_batch_size=8,
                              enable_prefix_caching=caching)
        assert config.num_state_snapshots == snapshots
        states = state_cache_bytes(config.model_config, torch.float32, 8 + snapshots)
        assert states == (9 + snapshots) * per_state
        assert config.num_pages == ((1 << 22) - states) // per_page
    for bad in (-1, float("nan"), True, "3"):
        with pytest.raises(ValueError, match="num_state_snapshots must be an integer >= 0"):
            EngineConfig(qwen35, num_state_snapshots=bad)
    for absurd in (2**32 + 1, 2**63):  # refused by size before anything is allocated, naming the field
        with pytest.raises(ValueError, match=r"num_state_snapshots \(\d+\).*exceed the device"):
            LLM(qwen35, num_state_snapshots=absurd)


SYSTEM = random_prompts(1, [40], seed=81)[0]  # 2 full pages of 16 and 8 tokens
QUESTIONS = random_prompts(4, [9, 30, 17, 3], seed=82)


def _hit_tokens(llm, prompt, params=GREEDY) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens the prefix cache supplied)."""
    before = llm.engine.stats()["prefix_cache_hits"]
    tokens = _tokens(llm, [prompt], params)[0]
    return tokens, llm.engine.stats()["prefix_cache_hits"] - before


@pytest.mark.parametrize("engine", [dict(), dict(page_size=4, cuda_graphs=True, num_decode_steps=4)],
                         ids=["pages16", "pages4-graphs"])
def test_a_shared_system_prompt_hits_from_its_third_request_with_the_state_restored(qwen35, engine):
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = hf_greedy(qwen35, prompts + [prompts[0]], 24)
    size = engine.get("page_size", 16)
    with LLM(qwen35, dtype="float32", cpu_threads=1, **engine) as llm:
        first, hit1 = _hit_tokens(llm, prompts[0])
        second, hit2 = _hit_tokens(llm, prompts[1])  # finds the system prompt's K/V but no state there: snapshots it
        third, hit3 = _hit_tokens(llm, prompts[2])
        again, hit4 = _hit_tokens(llm, prompts[0])  # the same prompt: its last full page's snapshot
        assert [first, second, third, again] == [expected[0], expected[1], expected[2], expected[4]]
        assert (hit1, hit2, hit3) == (0, 0, 40 // size * size)
        assert hit4 == (len(prompts[0]) - 1) // size * size
        # a batch sharing the prefix, admitted in one step: each restores the snapshot and goes on alone
        batch = [SYSTEM + q for q in random_prompts(3, [5, 12, 20], seed=83)]
        assert _tokens(llm, batch) == hf_greedy(qwen35, batch, 24)
        assert llm.engine.scheduler.num_free_state_slots == llm.config.max_batch_size


def test_snapshots_are_evicted_least_recently_used_and_hits_stay_exact(qwen35):
    systems = [random_prompts(1, [36], seed=90 + i)[0] for i in range(3)]
    prompts = [system + q for system in systems for q in QUESTIONS[:3]]
    expected = hf_greedy(qwen35, prompts, 12)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(qwen35, dtype="float32", cpu_threads=1, num_state_snapshots=2) as llm:
        got = [_tokens(llm, [p], params)[0] for p in prompts]
        states = llm.engine.scheduler.states
        assert states.num_cached_snapshots == 2 and states.num_snapshots_taken > 2  # some were evicted
        assert llm.engine.stats()["state_snapshots_cached"] == 2
        assert llm.engine.stats()["prefix_cache_hits"] > 0
    assert got == expected


@pytest.mark.parametrize("cut", [1, 17, 64, 100])
def test_chunked_delta_rule_equals_the_recurrence_and_continues_across_cuts(cut):
    torch.manual_seed(0)
    length, heads, dk, dv = 130, 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk), dim=-1)
    v = torch.randn(length, heads, dv)
    decay = -torch.rand(length, heads)
    beta = torch.rand(length, heads)
    state0 = torch.randn(heads, dk, dv)
    state, expected = state0.clone(), []
    for t in range(length):  # the recurrent form, token by token
        state = state * decay[t].exp()[:, None, None]
        delta = (v[t] - (state * k[t][..., None]).sum(-2)) * beta[t][:, None]
        state = state + k[t][..., None] * delta[:, None, :]
        expected.append((state * q[t][..., None]).sum(-2))
    expected = torch.stack(expected)
    whole, final = chunked_delta_rule(q, k, v, decay, beta, state0)
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, state, rtol=1e-4, atol=1e-4)
    head, mid = chunked_delta_rule(q[:cut], k[:cut], v[:cut], decay[:cut], beta[:cut], state0)
    tail, end = chunked_delta_rule(q[cut:], k[cut:], v[cut:], decay[cut:], beta[cut:], mid)
    torch.testing.assert_close(torch.cat([head, tail]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(end, state, rtol=1e-4, atol=1e-4)
