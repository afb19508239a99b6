"""LoRA adapters (vLLM's enable_lora / LoRARequest) against transformers + PEFT, greedy, token for token: several
adapters and the base model in one batch, one device slot served to adapters in turn (graphs' CPU twin, bounds
checks, chunked prefill, preemption), prefix-cache pages kept per adapter, Phi-3's fused projections, bf16 rows
that do not depend on their batch; bad adapters and configurations are errors naming the field, before any work."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from graphdecode import LLM, LoRARequest, SamplingParams
from graphdecode.config import EngineConfig
from tests.helpers import SMALL_ENGINE, edit_tensors, peft_adapter, peft_greedy, random_prompts, token_prompts

MODEL = "llama_gqa_llama3"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts(4, [7, 19, 5, 33], seed=11)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Two adapters of the tiny Llama: every projection at rank 8; q and v only at rank 4 with rsLoRA and an
    alpha_pattern for v."""
    root, model = tmp_path_factory.mktemp("lora"), tiny_models[MODEL]
    every = peft_adapter(model, str(root / "every"), seed=1)
    qv = peft_adapter(model, str(root / "qv"), seed=2, r=4, targets=("q_proj", "v_proj"), use_rslora=True,
                      alpha_pattern={"v_proj": 3})
    return {"every": LoRARequest("every", 1, every), "qv": LoRARequest("qv", 2, qv)}


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models[MODEL], **SMALL_ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8)


def _tokens(llm, prompts, loras, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), params, lora_request=loras)]


def _oracle(model, loras, prompts, n=12):
    return [peft_greedy(model, lora.lora_path if lora else None, [p], n)[0] for lora, p in zip(loras, prompts)]


def test_adapters_and_the_base_model_in_one_batch_give_peft_tokens(llm, adapters, tiny_models):
    loras = [adapters["every"], adapters["qv"], None, adapters["every"]]
    got = _tokens(llm, PROMPTS, loras)
    want = _oracle(tiny_models[MODEL], loras, PROMPTS)
    assert got == want
    base = _oracle(tiny_models[MODEL], [None] * 4, PROMPTS)
    assert got[0] != base[0] and got[1] != base[1] and got[3] != base[3]  # each adapter changes its tokens
    assert llm.engine.runner.model.cpu_decode.max_loras == 2  # decode steps added them in the one C++ call


def test_the_one_call_and_the_eager_forward_give_the_same_bits(llm, adapters, tiny_models):
    """The CPU's one-call decode layers add each row's update in the order and with the kernels of the eager
    forward: the same logprobs to the bit."""
    loras = [adapters["every"], None, adapters["qv"]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    model = llm.engine.runner.model

    def run():
        outs = llm.generate(token_prompts(PROMPTS[:3]), params, lora_request=loras)
        return [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    one_call = run()
    driver, model.cpu_decode = model.cpu_decode, None
    try:
        eager = run()
    finally:
        model.cpu_decode = driver
    assert one_call == eager


def test_n_children_share_their_adapter(llm, adapters, tiny_models):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
    (out,) = llm.generate(token_prompts(PROMPTS[:1]), params, lora_request=adapters["qv"])
    want = _oracle(tiny_models[MODEL], [adapters["qv"]], PROMPTS[:1])[0]
    assert [c.token_ids for c in out.outputs] == [want, want]


def test_prefix_cache_pages_are_the_adapters_own(llm, adapters, tiny_models):
    prompt = random_prompts(1, [40], seed=5)
    every = adapters["every"]
    first, = llm.generate(token_prompts(prompt), GREEDY, lora_request=every)
    base, = llm.generate(token_prompts(prompt), GREEDY)  # the same tokens, another adapter: no hit
    again, = llm.generate(token_prompts(prompt), GREEDY, lora_request=every)
    assert base.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == _oracle(tiny_models[MODEL], [every], prompt)[0]
    assert base.outputs[0].token_ids == _oracle(tiny_models[MODEL], [None], prompt)[0]


def test_kv_events_name_the_adapter_that_computed_a_page(llm, adapters):
    """vLLM's BlockStored carries lora_id / lora_name: a prefix-aware router keeps adapters' pages apart."""
    pool = llm.engine.pool
    pool.events = []  # what kv_events_config turns on: the pool records what it stores
    try:
        llm.generate(token_prompts(random_prompts(2, [36], seed=21)), GREEDY, lora_request=[adapters["qv"], None])
        stored = [event for event in pool.take_events() if event[0] == "stored"]
    finally:
        pool.events = None
    assert {event[4] for event in stored} == {adapters["qv"], None}


def test_one_slot_serves_adapters_in_turn(adapters, tiny_models):
    """max_loras=1: requests for the other adapter wait for the slot; in graphs (the CPU twin), bounds-checked,
    prefill chunks of 8 tokens, a pool small enough to preempt."""
    llm = LLM(tiny_models[MODEL], **SMALL_ENGINE, enable_lora=True, max_loras=1, max_lora_rank=8, cuda_graphs=True,
              check_bounds=True, max_num_batched_tokens=8, num_pages=17)
    prompts = random_prompts(8, [21, 9, 30, 14], seed=3)
    every, qv = adapters["every"], adapters["qv"]
    loras = [every, every, None, every, None, qv, qv, every]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    assert _tokens(llm, prompts, loras, params) == _oracle(tiny_models[MODEL], loras, prompts, 80)
    stats = llm.stats()
    assert stats["graphs_captured"] > 0 and stats["preemptions"] > 0
    assert llm.engine.scheduler.loras.num_loads >= 3  # the slot changed adapters more than once


def test_the_load_names_running_and_waiting_adapters(adapters, tiny_models):
    """What vLLM's lora_requests_info reports: adapters held in the batch, adapters of requests not admitted yet
    (one slot: the second adapter's request waits), and an aborted waiting request leaves the count."""
    llm = LLM(tiny_models[MODEL], **SMALL_ENGINE, enable_lora=True, max_loras=1, max_lora_rank=8)
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, params, request_id="a", lora_request=adapters["every"])
    engine.add_request({"prompt_token_ids": PROMPTS[1]}, params, request_id="b", lora_request=adapters["qv"])
    assert (engine.load()["lora_running"], engine.load()["lora_waiting"]) == ([], ["every", "qv"])
    engine.step()
    load = engine.load()
    assert (load["lora_running"], load["lora_waiting"], load["max_lora"]) == (["every"], ["qv"], 1)
    engine.abort_request("b")
    engine.step()
    assert engine.load()["lora_waiting"] == []
    while engine.has_unfinished():
        engine.step()
    assert engine.load()["lora_running"] == []


def test_phi3_fused_projections(tiny_models, tmp_path):
    """Phi-3 stores qkv_proj and gate_up_proj fused, and PEFT adapts them as whole projections."""
    model = tiny_models["phi3_partial_swa"]
    adapter = peft_adapter(model, str(tmp_path / "phi3"), seed=4, targets=("qkv_proj", "o_proj", "gate_up_proj",
                                                                           "down_proj"))
    llm = LLM(model, **SMALL_ENGINE, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("phi3", 1, adapter)
    prompts = PROMPTS[:2]
    assert _tokens(llm, prompts, [lora, None]) == _oracle(model, [lora, None], prompts)


def test_bf16_rows_do_not_depend_on_their_batch(adapters, tiny_models):
    """In bf16 the LoRA matmuls run on the CPU's panels, like the projections: a row's tokens are the same alone
    and beside seven others with other adapters."""
    llm = LLM(tiny_models[MODEL], **SMALL_ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="bfloat16")
    prompts = random_prompts(8, [12, 25, 6, 17], seed=9)
    loras = [adapters["every"], adapters["qv"], None, adapters["every"]] * 2
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    together = _tokens(llm, prompts, loras, params)
    alone = [_tokens(llm, [p], [lora], params)[0] for p, lora in zip(prompts[:4], loras[:4])]
    assert together[:4] == alone


# ------------------------------------------------------------------------- errors, before any work
def _copy(adapter: LoRARequest, tmp_path, name: str) -> str:
    path = str(tmp_path / name)
    shutil.copytree(adapter.lora_path, path)
    return path


def _edit_config(path: str, **fields) -> None:
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def _adapter_tensors(path: str, edit) -> None:
    os.rename(os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "model.safetensors"))
    edit_tensors(path, edit)
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "adapter_model.safetensors"))


def test_bad_adapters_are_errors_naming_the_field(llm, adapters, tmp_path):
    every = adapters["every"]
    dora = _copy(every, tmp_path, "dora")
    _edit_config(dora, use_dora=True)
    head = _copy(every, tmp_path, "head")
    _adapter_tensors(head, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}))
    shape = _copy(every, tmp_path, "shape")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _adapter_tensors(shape, lambda t: t.update({key: torch.zeros(32, 8)}))
    half = _copy(every, tmp_path, "half")
    _adapter_tensors(half, lambda t: t.pop("base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"))
    wide = peft_adapter(llm.config.model, str(tmp_path / "wide"), seed=3, r=16, targets=("q_proj",))
    cases = [
        (LoRARequest("none", 5, str(tmp_path / "missing")), "is not a directory"),
        (LoRARequest("dora", 6, dora), "use_dora=True is not supported"),
        (LoRARequest("head", 7, head), "lm_head.lora_A.weight' is not a LoRA weight of an attention or MLP"),
        (LoRARequest("shape", 8, shape), "has shape [32, 8], expected [64, 8]"),
        (LoRARequest("half", 9, half), "layers.1.mlp.up_proj has no lora_A.weight"),
        (LoRARequest("wide", 10, wide), "rank 16, above max_lora_rank (8)"),
    ]
    for lora, message in cases:
        with pytest.raises(ValueError) as info:
            llm.generate(token_prompts(PROMPTS[:2]), GREEDY, lora_request=[None, lora])
        assert str(info.value).startswith(f"prompts[1]: lora_request ({lora.lora_name!r}): ")
        assert message in str(info.value)
    assert not llm.engine.has_unfinished()  # nothing of those calls was added
    with pytest.raises(TypeError, match="lora_request must be a graphdecode.LoRARequest"):
        llm.generate(token_prompts(PROMPTS[:1]), GREEDY, lora_request="every")
    with pytest.raises(ValueError, match="lora_request: 1 given for 2 prompts"):
        llm.generate(token_prompts(PROMPTS[:2]), GREEDY, lora_request=[every])
    for bad in (0, -1, 2**63, 2**64 + 1, float("nan"), True):
        with pytest.raises(ValueError, match=r"lora_request.lora_int_id must be an integer in \[1, 2\*\*63\)"):
            LoRARequest("x", bad, every.lora_path)


def test_an_engine_without_lora_refuses_an_adapter(tiny_models, adapters):
    llm = LLM(tiny_models[MODEL], **SMALL_ENGINE)
    with pytest.raises(ValueError, match="started without enable_lora=True"):
        llm.generate(token_prompts(PROMPTS[:1]), GREEDY, lora_request=adapters["every"])


@pytest.mark.parametrize("fields, message", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "with speculative_config yet"),
    ({"compile": True}, "with compile=True"),
    ({"max_loras": 0}, "max_loras must be an integer >= 1"),
    ({"max_lora_rank": 1024}, "max_lora_rank must be <= 512"),
    ({"max_cpu_loras": 1, "max_loras": 2}, "max_cpu_loras must be an integer >= max_loras (2)"),
    ({"max_loras": 2**32 + 1}, "max_loras (4294967297) and max_lora_rank (16): "),
    ({"max_loras": -1}, "max_loras must be an integer >= 1"),
    ({"max_lora_rank": float("nan")}, "max_lora_rank must be an integer >= 1"),
])
def test_lora_configurations_refused_by_name(tiny_models, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model=tiny_models[MODEL], enable_lora=True, **fields)


def test_families_lora_does_not_run_are_refused(tiny_models):
    moe = next(name for name in tiny_models if "moe" in name or "mixtral" in name)
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters do not run with"):
        EngineConfig(model=tiny_models[moe], enable_lora=True)


def test_the_pool_sizing_counts_the_adapter_slots(llm):
    """EngineConfig sizes the KV pool after the weights and the LoRA buffers: its count is the runner's."""
    from graphdecode.lora.config import lora_buffer_bytes

    config, lora = llm.config, llm.engine.runner.lora
    dense = sum(m.dense.numel() * m.dense.element_size() for linear in lora.linears.values()
                for m in (linear.a, linear.b))
    assert dense == lora_buffer_bytes(config.model_config, config.torch_dtype, config.max_loras, config.max_lora_rank)
    assert llm.engine.runner.memory_sizes()["weight_bytes"] >= dense
