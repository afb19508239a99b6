"""Shared fixtures: tiny HuggingFace checkpoints saved with save_pretrained, and
transformers' own greedy output for them (the oracle)."""

from __future__ import annotations

import contextlib
import json
import os

import httpx
import pytest
import torch

torch.set_num_threads(1)  # 2 cores and a busy neighbour: more threads make small matmuls far slower
# engines built without cpu_threads (LLM, AsyncLLM's core, servers: they inherit it) take one thread too,
# not EngineConfig's default of every usable core
os.environ.setdefault("GRAPHDECODE_CPU_THREADS", "1")
if not torch.cuda.is_available():
    # the CPU suite runs every engine (servers' too: they inherit it) in the bounds-checked mode
    # (graphdecode/device/bounds.py): an index a kernel would follow out of range fails the test
    os.environ.setdefault("GRAPHDECODE_CHECK_BOUNDS", "1")

_HF_CACHE: dict = {}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "extended: GPU cases outside profiling/gpu_check's must-pass core (its pytest_extended stage)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the mark, not the keyword: tests/gpu/ names every item in it
            item.add_marker(skip)


def _save(path: str, cls_name: str, **config_kwargs) -> str:
    import transformers

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from graphdecode.default_model import save_random_model

    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    save_random_model(path, config_cls(**config_kwargs), seed=1234)
    return path


COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

MODEL_SPECS = {
    # GQA (4 query heads per KV head... 4:2) with llama3 rope scaling that bites inside 512 positions
    "llama_gqa_llama3": (
        "LlamaForCausalLM",
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # Qwen2: q/k/v biases, tied embeddings, 4:1 GQA
    "qwen2_tied": (
        "Qwen2ForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    # explicit head_dim (32) different from hidden / heads (16), MHA
    "llama_head_dim": (
        "LlamaForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=4, head_dim=32),
    ),
    # Qwen3: q/k RMSNorm, explicit head_dim (32, not hidden / heads), untied
    "qwen3_untied": (
        "Qwen3ForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
    # Qwen3, tied, use_sliding_window: layer 0 full (max_window_layers=1), layer 1 a 24-token window
    "qwen3_tied_swa": (
        "Qwen3ForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
             use_sliding_window=True, sliding_window=24, max_window_layers=1),
    ),
    # Mistral with a 20-token window on every layer
    "mistral_swa": (
        "MistralForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=20),
    ),
    # Phi-3: fused qkv_proj / gate_up_proj, half the head rotates, a 40-token window
    "phi3_partial_swa": (
        "Phi3ForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=40,
             pad_token_id=0),
    ),
    # Phi-4-mini-like: longrope past 64 positions (factor 16 -> attention factor 1.29), 3/4 of the head rotates
    "phi3_longrope": (
        "Phi3ForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, original_max_position_embeddings=64,
             pad_token_id=0, rope_parameters={
                 "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                 "short_factor": [1.0, 1.05, 1.2, 1.4, 1.7, 2.0], "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 14.0]}),
    ),
    # Gemma 3 text: (1 + w) norms, GeGLU, sandwich norms, query_pre_attn_scalar, both soft-caps,
    # local (16-token window, rope 1e4) / global (rope 1e6) layers
    "gemma3_text": (
        "Gemma3TextForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
             sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             query_pre_attn_scalar=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pad_token_id=0),
    ),
    # Mixtral: 8 experts, top-2 (softmax, renormalised), a 32-token window on every layer
    "mixtral": (
        "MixtralForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_local_experts=8,
             num_experts_per_tok=2, sliding_window=32),
    ),
    # Qwen3-MoE: q/k norms, 8 experts, top-3 (norm_topk_prob), layer 1 dense (mlp_only_layers)
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
             num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    # gpt-oss: sinks, biased clamped-SwiGLU experts (4, top-2), layers alternating a 16-token window and
    # full attention, YaRN over an original 64 positions
    "gpt_oss": (
        "GptOssForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
             num_local_experts=4, num_experts_per_tok=2, sliding_window=16, rope_parameters={
                 "rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 64}),
    ),
}


# What the GPU machine's kit (../shared/gpu-kit) prebuilds: bf16 at head_dim 64 and 128. Under
# profiling/gpu_check (GRAPHDECODE_REQUIRE_FLASHINFER=1) these must run, so a broken kit fails.
KIT_KERNELS = frozenset({(64, torch.bfloat16), (128, torch.bfloat16)})


def require_flashinfer(head_dim: int, dtype: torch.dtype) -> None:
    """Skip a GPU test that picks FlashInfer for (head_dim, dtype) unless it can run here.

    The decision is the engine's own (`flashinfer_unavailable_reason`, the probe behind
    `attention_backend` auto and the refusal of an explicit "flashinfer"), so a test
    skips exactly where the engine would refuse, with the probe's reason. Under
    gpu_check a combination the kit promises fails instead of skipping."""
    from graphdecode.attention.flashinfer_probe import flashinfer_unavailable_reason

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    reason = flashinfer_unavailable_reason(head_dim, dtype)
    if reason is None:
        return
    if os.environ.get("GRAPHDECODE_REQUIRE_FLASHINFER") == "1" and (head_dim, dtype) in KIT_KERNELS:
        pytest.fail(f"the gpu-kit promises FlashInfer for head_dim {head_dim} {dtype}, but: {reason}")
    pytest.skip(f"FlashInfer cannot run head_dim {head_dim} {dtype} here: {reason}")


def assert_padded_ctas_masked(wrapper, rows: int) -> None:
    """flashinfer issue #4002: a CUDA-graph plan launches a padded grid (padded_batch_size CTAs
    per KV head, more than the scheduled blocks) and, before the fix, padded CTAs read stale
    schedule entries when split-KV was off. 0.7.2.post1's plan allocates `block_valid_mask`
    for every CUDA-graph plan and its run binds it (docs/gpu.md); check that this plan has it
    and that it marks exactly a prefix of scheduled blocks, at least one per row.
    PrefillPlanInfo fields: [0] padded_batch_size, [12] block_valid_mask_offset,
    [13] enable_cuda_graph, [14] split_kv."""
    info = [int(x) for x in wrapper._plan_info]
    padded, offset, cuda_graph, split_kv = info[0], info[12], info[13], info[14]
    assert cuda_graph == 1 and split_kv == 0, info
    assert offset != 0, f"no block_valid_mask in a CUDA-graph plan: {info}"
    mask = wrapper._pin_memory_int_workspace_buffer[offset:offset + padded].view(torch.bool)
    scheduled = int(mask.sum())
    assert rows <= scheduled <= padded and bool(mask[:scheduled].all()), (scheduled, padded)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_models(model_root):
    return {name: _save(str(model_root / name), cls, **kw) for name, (cls, kw) in MODEL_SPECS.items()}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate, greedy, fp32, CPU, one prompt at a time (cached per model)."""
    from transformers import AutoModelForCausalLM

    key = (model_dir, tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            outs.append(gen[0, len(p) :].tolist())
        _HF_CACHE[key] = outs
    return _HF_CACHE[key]


def random_prompts(count: int, lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]


def rewrite_config(model_dir: str, edit) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    edit(raw)
    with open(path, "w") as f:
        json.dump(raw, f, indent=2)


@pytest.fixture(scope="session")
def text_model(model_root):
    """A tiny Llama with a real byte-level BPE tokenizer (the built-in default model's recipe)."""
    from graphdecode.default_model import build_default_model

    path = str(model_root / "text_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_default_model(path)
    return path


@contextlib.contextmanager
def live_server(model: str, log_dir, served_name: str, *extra: str, env: dict | None = None):
    """`graphdecode serve` on a free loopback port with the tests' common flags (one thread, quiet);
    yields its URL, and checks it drained and exited 0 afterwards."""
    from graphdecode.server.launch import start_server, stop_server

    log = os.path.join(str(log_dir), "server.log")
    proc, url = start_server(["--model", model, "--served-model-name", served_name, "--threads", "1",
                              "--no-access-log", "--log-level", "warning", *extra], log, timeout_s=180, env=env)
    try:
        yield url
    finally:
        code = stop_server(proc, 40)
    assert code == 0, open(log).read()


@pytest.fixture(scope="module")
def clients(server):
    """(the real openai client, an httpx client) on the module's `server` fixture's /v1."""
    from openai import OpenAI

    with OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60) as client, \
            httpx.Client(base_url=f"{server}/v1", timeout=60) as http:
        yield client, http


@pytest.fixture(scope="module")
def client(clients):
    return clients[0]


@pytest.fixture(scope="module")
def http(clients):
    return clients[1]


@pytest.fixture
def llm_options(monkeypatch):
    """The options the CLI passes to LLM: each call records them and raises Built (no engine)."""
    import graphdecode

    class Built(Exception):
        pass

    seen: list[dict] = []

    def fake_llm(model, **options):
        seen.append(options)
        raise Built

    monkeypatch.setattr(graphdecode, "LLM", fake_llm)
    return seen, Built


def stream_events(url: str, body: dict, result: dict, timeout: float = 60) -> None:
    """Stream a completion into `result`: "text", "finish" (each chunk's finish_reason) and "errors"
    (error events), as the chunks arrive (so another thread can watch them)."""
    result.update(text="", finish=[], errors=[])
    with httpx.Client(timeout=timeout) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    result["errors"].append(event["error"])
                    continue
                result["text"] += event["choices"][0]["text"]
                result["finish"].append(event["choices"][0]["finish_reason"])
