"""Hybrid models on the GPU, inside the window's CUDA graphs (profiling/gpu_check's pytest_hybrid stage).

Tiny random Qwen3.5 (Gated DeltaNet + gated attention) and Nemotron-H (Mamba2 + rope-less attention + MLP)
checkpoints are built here from a seed (transformers' config classes, where the machine's transformers has them)
and run in float32 with CUDA graphs, k = 4 steps per launch, beside the same engine's eager float32 reference
(no graphs, no compile): the greedy tokens are equal, with chunked prefill crossing the recurrent layers' blocks,
with n-gram speculation (drafts accepted and rejected), with Qwen3.5's own MTP layer drafting (method "mtp"),
and after a prefix hit that restores a state snapshot.
A bf16 graph engine then runs the same prompts: its tokens agree with the float32 ones on most rows (random
tiny models have small logit margins; bf16 rounding moves some argmaxes).
"""

from __future__ import annotations

import pytest

from tests.helpers import add_mtp_layer
from tests.hf_parity_models import free_memory, random_prompts

BLOCKS = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"]
MODELS = {  # name -> (transformers config class, its fields)
    "qwen3_5": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=6, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)),
    "nemotron_h": ("NemotronHConfig", dict(
        layers_block_type=BLOCKS, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
        ssm_state_size=32, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=32)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid(request, tmp_path_factory):
    import transformers

    from graphdecode.default_model import save_random_model

    name = request.param
    cls_name, fields = MODELS[name]
    config_cls = getattr(transformers, cls_name, None)
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    path = str(tmp_path_factory.mktemp(name))
    save_random_model(path, config_cls(vocab_size=2048, hidden_size=256, max_position_embeddings=2048,
                                       initializer_range=0.05, bos_token_id=1, eos_token_id=2, **fields), seed=7)
    if name == "qwen3_5":  # an MTP layer beside the decoder, as Qwen3.5 checkpoints ship one (plain runs skip it)
        add_mtp_layer(path, 3)
    return path


@pytest.mark.gpu
@pytest.mark.extended
def test_gpu_hybrid_graphs_give_the_eager_float32_tokens(hybrid, record_testsuite_property):
    from graphdecode import LLM, SamplingParams

    base = random_prompts([12, 40, 90, 150], 2048, seed=5)
    prompts = [{"prompt_token_ids": p + p[:20]} for p in base]  # each repeats its start: n-gram drafts accept
    system = random_prompts([48], 2048, seed=6)[0]
    shared = [{"prompt_token_ids": system + q} for q in random_prompts([5, 9, 14], 2048, seed=8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_model_len=512, max_batch_size=8, num_decode_steps=4,
                  max_num_batched_tokens=64, compile=False, seed=0)

    def run(**engine):
        llm = LLM(hybrid, **common, **engine)
        if engine.get("speculative_config"):
            llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        hits = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in shared]
        stats = llm.stats()
        del llm
        free_memory()
        return tokens, hits, stats

    want, want_hits, _ = run(cuda_graphs=False)
    graphed, hits, stats = run(cuda_graphs=True)
    assert stats["graphs_captured"] > 0 and stats["prefix_cache_hits"] > 0
    assert graphed == want and hits == want_hits
    spec_tokens, _, spec = run(cuda_graphs=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert spec_tokens == want
    assert 0 < spec["spec_accepted_tokens"] < spec["spec_draft_tokens"]
    if "qwen3_5" in hybrid:  # the target's own MTP layer drafting inside the graphs
        mtp_tokens, _, mtp = run(cuda_graphs=True, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        assert mtp_tokens == want and mtp["spec_draft_tokens"] > 0
    common["dtype"] = "bfloat16"
    bf16, _, _ = run(cuda_graphs=True)
    agree = sum(a[:8] == b[:8] for a, b in zip(bf16, want))
    record_testsuite_property("hybrid_bf16_rows_agreeing_8_tokens", agree)
    assert agree >= 2
