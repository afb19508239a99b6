"""DeepSeek's routing on the GPU, inside the window's CUDA graphs (profiling/gpu_check's pytest_families stage).

Tiny random GLM-4.5 (sigmoid group routing, a float32 router, shared experts, q/k norms, half-head rotary),
DeepSeek-V3 (multi-head latent attention over a latent cache, which the torch reference attends on the GPU)
and Nemotron 3 (relu-squared experts beside Mamba2) checkpoints, built here from a seed with random router
correction biases, run in float32 with CUDA graphs, k = 4 steps per launch, beside the same engine's eager
float32 reference (no graphs, no compile): the greedy tokens are equal, with chunked prefill and with the
model's own MTP layer drafting (GLM-4.5 and DeepSeek-V3, method "mtp"). A bf16 graph engine then runs the same
prompts: its router stays float32 and its tokens agree with the float32 ones on most rows.
"""

from __future__ import annotations

import pytest

from tests.helpers import add_nextn_layer, edit_tensors
from tests.hf_parity_models import free_memory, random_prompts

COMMON = dict(vocab_size=2048, hidden_size=256, max_position_embeddings=2048, initializer_range=0.05,
              bos_token_id=1, eos_token_id=2)
MOE = dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5)
MODELS = {  # name -> (transformers config class, its fields, whether an MTP layer is added)
    "glm4_moe": ("Glm4MoeConfig", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
        moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
        use_qk_norm=True, **MOE), True),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=512, moe_intermediate_size=128,
        n_shared_experts=1, first_k_dense_replace=1, **MOE), True),
    "nemotron3_moe": ("NemotronHConfig", dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=512, ssm_state_size=32, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=32, moe_intermediate_size=128,
        moe_shared_expert_intermediate_size=256, **MOE), False),
}


@pytest.fixture(scope="module", params=list(MODELS))
def family(request, tmp_path_factory):
    import torch
    import transformers

    from graphdecode.default_model import save_random_model

    name = request.param
    cls_name, fields, mtp = MODELS[name]
    config_cls = getattr(transformers, cls_name, None)
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    path = str(tmp_path_factory.mktemp(name))
    save_random_model(path, config_cls(**COMMON, **fields), seed=7)
    g = torch.Generator().manual_seed(3)
    edit_tensors(path, lambda t: t.update({k: torch.randn(t[k].shape, generator=g) * 0.1 for k in t
                                           if k.endswith("e_score_correction_bias")}))
    if mtp:
        add_nextn_layer(path, 3)
    return name, path, mtp


@pytest.mark.gpu
@pytest.mark.extended
def test_gpu_moe_family_graphs_give_the_eager_float32_tokens(family, record_testsuite_property):
    from graphdecode import LLM, SamplingParams

    name, path, mtp = family
    prompts = [{"prompt_token_ids": p} for p in random_prompts([12, 40, 90, 150], 2048, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_model_len=512, max_batch_size=8, num_decode_steps=4,
                  max_num_batched_tokens=64, compile=False, seed=0)

    def run(**engine):
        llm = LLM(path, **common, **engine)
        if engine.get("speculative_config"):
            llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
        routers = {str(p.dtype) for n, p in llm.engine.runner.model.named_parameters() if "gate.e_score" in n}
        del llm
        free_memory()
        return tokens, stats, routers

    want, _, _ = run(cuda_graphs=False)
    graphed, stats, routers = run(cuda_graphs=True)
    assert stats["graphs_captured"] > 0 and graphed == want and routers == {"torch.float32"}
    if mtp:
        mtp_tokens, spec, _ = run(cuda_graphs=True, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        assert mtp_tokens == want and spec["spec_draft_tokens"] > 0
    common["dtype"] = "bfloat16"
    bf16, _, routers = run(cuda_graphs=True)
    assert routers == {"torch.float32"}
    agree = sum(a[:8] == b[:8] for a, b in zip(bf16, want))
    record_testsuite_property(f"{name}_bf16_rows_agreeing_8_tokens", agree)
    assert agree >= 2
