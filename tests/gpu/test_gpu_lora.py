"""LoRA adapters on the GPU (profiling/gpu_check's pytest_extended stage): windows of rows with two adapters and
none, in CUDA graphs captured once, the adapters loaded into their slots between replays (one slot for two
adapters: the second rewrites the first's buffers under captured graphs), against the CPU engine, which CI checks
against transformers + PEFT (tests/host/test_lora.py). The adapters are written here in PEFT's format (peft is not
on the GPU machine)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import SMALL_ENGINE, random_prompts, token_prompts

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(model_dir: str, out: str, seed: int, rank: int) -> str:
    """adapter_config.json and adapter_model.safetensors as peft's save_pretrained writes them, random A and B."""
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for parent, names in TARGETS.items():
            for name in names:
                k, n = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=g) * 0.3
                tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=g) * 0.3
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [n for names in TARGETS.values() for n in names]}, f)
    return out


@pytest.mark.gpu
@pytest.mark.extended
def test_gpu_lora_windows_in_graphs_give_the_cpu_tokens(tiny_models, tmp_path):
    from graphdecode import LLM, LoRARequest, SamplingParams

    model = tiny_models["llama_gqa_llama3"]
    first = LoRARequest("first", 1, write_adapter(model, str(tmp_path / "first"), 1, 8))
    second = LoRARequest("second", 2, write_adapter(model, str(tmp_path / "second"), 2, 4))
    prompts = random_prompts(6, [9, 23, 14], seed=4)
    loras = [first, None, second, first, second, None]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32")
    gpu = LLM(model, **SMALL_ENGINE, **lora, device="cuda", attention_backend="torch", buckets=[1, 4, 8])
    cpu = LLM(model, **SMALL_ENGINE, **lora, device="cpu")
    got = [o.outputs[0].token_ids for o in gpu.generate(token_prompts(prompts), params, lora_request=loras)]
    want = [o.outputs[0].token_ids for o in cpu.generate(token_prompts(prompts), params, lora_request=loras)]
    assert gpu.stats()["graphs_captured"] > 0
    assert gpu.engine.scheduler.loras.num_loads >= 2  # the one slot changed adapters under the captured graphs
    assert got == want
