"""DeepSeek-V3's family (`deepseek_v3`, models/deepseek_v3.py and models/mla.py): multi-head latent attention,
absorbed over a cache of latents, against transformers' expanded computation; its MoE (sigmoid group routing,
shared experts, dense first layers); its MTP layer drafting through `speculative_config={"method": "mtp"}`.

Two tiny checkpoints: one with q_lora_rank and interleaved rope pairs (DeepSeek-V3's defaults), one with
q_proj straight from the hidden state, plain rope pairs and YaRN with mscale_all_dim (the softmax scale's
factor). Router correction biases and norms are random (transformers initialises them to 0 and 1)."""

from __future__ import annotations

import shutil

import pytest

from graphdecode import LLM, SamplingParams
from tests.helpers import (
    add_nextn_layer,
    assert_graph_twin_gives_plain_tokens,
    assert_head_state_follows,
    assert_hf_tokens_on_every_path,
    assert_same_outputs,
    generate_tokens,
    hf_greedy,
    nextn_reference,
    random_prompts,
    save_routed_model,
    token_prompts,
)

LAYERS = 3  # layer 0 dense (first_k_dense_replace), 1 and 2 sparse; the MTP layer is stored as layer 3
ENGINE = dict(dtype="float32", cpu_threads=1, num_decode_steps=4, max_model_len=256, max_batch_size=8)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
VARIANTS = {
    "lora_interleaved": dict(q_lora_rank=32, rope_interleave=True),
    "q_proj_yarn": dict(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def _tiny_deepseek(path: str, **variant) -> str:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
                              n_shared_experts=1, moe_intermediate_size=32, n_group=4, topk_group=2,
                              first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=1024,
                              bos_token_id=1, eos_token_id=2, **variant)
    return save_routed_model(path, DeepseekV3ForCausalLM, config, seed=11)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    out = {name: _tiny_deepseek(str(root / name), **variant) for name, variant in VARIANTS.items()}
    shutil.copytree(out["lora_interleaved"], str(root / "mtp"))
    out["mtp"] = add_nextn_layer(str(root / "mtp"), LAYERS)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_parity_with_transformers_on_every_path(deepseek, variant):
    """transformers' greedy tokens through plain windows (k = 1), chunked prefill with prefix-cache hits (k = 4)
    and n-gram speculation; the first token's logprobs equal transformers' (the absorbed attention computes the
    expanded one's scores and outputs in another order of the sums)."""
    path = deepseek[variant]
    batch = random_prompts(6, [3, 17, 50, 100], seed=21)
    llm = assert_hf_tokens_on_every_path(path, batch, GREEDY, hf_greedy(path, batch, 24))
    cfg = llm.config.model_config
    assert cfg.num_kv_heads == 1 and cfg.head_dim == 32 + 16 and cfg.rope_head_dim == 16


def test_malformed_latent_fields_name_the_field(deepseek):
    """config.json's MLA and YaRN fields are checked before any weight is read: a ValueError naming the field."""
    from graphdecode.models.model_config import load_model_config
    from tests.helpers import rewrite_config

    for field, value in (("kv_lora_rank", -1), ("qk_rope_head_dim", 2**63), ("q_lora_rank", "x")):
        path = shutil.copytree(deepseek["q_proj_yarn"], f"{deepseek['q_proj_yarn']}_{field}")
        rewrite_config(path, lambda raw: raw.update({field: value}))
        with pytest.raises(ValueError, match=field):
            load_model_config(path)
    path = shutil.copytree(deepseek["q_proj_yarn"], f"{deepseek['q_proj_yarn']}_mscale")
    rewrite_config(path, lambda raw: raw["rope_parameters"].update(mscale_all_dim=float("nan")))
    with pytest.raises(ValueError, match="mscale_all_dim"):
        load_model_config(path)


def test_the_latent_cache_and_batch_invariance(deepseek):
    """The paged cache holds one latent head per token (a 48-wide row, not four 32-wide keys and 16-wide
    values); a row's tokens do not depend on its batch (each head's absorbed products as panel weights), in
    float32 and bf16."""
    path = deepseek["lora_interleaved"]
    batch = random_prompts(6, [5, 40, 90], seed=4)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dtype, cpu_threads=1, max_model_len=256, max_batch_size=8)
        kv = llm.engine.runner.kv_caches[0]
        assert kv.shape[-2:] == (1, 48)
        attention = llm.engine.runner.model.model.layers[0].self_attn
        assert attention.uk_panels is not None and not hasattr(attention, "kv_b_proj")
        together = generate_tokens(llm, batch, GREEDY)
        assert [generate_tokens(llm, [p], GREEDY)[0] for p in batch] == together


def test_tp2_gives_the_tp1_tokens(deepseek):
    """Heads split across two ranks (q_b_proj and kv_b_proj by rows, o_proj by columns), the latent cache and the
    float32 router replicated; the MTP head drafts on both ranks."""
    path = deepseek["mtp"]
    batch = random_prompts(4, [17, 50, 100, 5], seed=8)
    engine = dict(num_decode_steps=4, max_model_len=256, max_batch_size=4)
    single = generate_tokens(LLM(path, **engine), batch, GREEDY)
    assert single == hf_greedy(deepseek["lora_interleaved"], batch, 24)
    with LLM(path, tensor_parallel_size=2, speculative_config=MTP, **engine) as tp2:
        tp2.engine.spec_policy.speculate = lambda bucket, rows=(): True
        assert generate_tokens(tp2, batch, GREEDY) == single
        assert tp2.stats()["spec_draft_tokens"] > 0


def test_mtp_gives_the_plain_tokens_and_follows_every_path(deepseek):
    """The MTP layer (DeepSeek-V3's layout, an MLA decoder layer) drafting: plain decoding's tokens, greedy and
    seeded n = 2; mid-generation its state equals transformers' computation."""
    path = deepseek["mtp"]
    batch = token_prompts(random_prompts(5, [4, 30, 70], seed=3))
    plain = LLM(path, **ENGINE)
    spec = LLM(path, speculative_config=MTP, **ENGINE)
    spec.engine.spec_policy.speculate = lambda bucket, rows=(): True
    for params in (GREEDY, SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=20, ignore_eos=True)):
        assert_same_outputs(spec.generate(batch, params, use_tqdm=False), plain.generate(batch, params,
                                                                                         use_tqdm=False))
    assert spec.stats()["spec_accepted_tokens"] > 0
    state = LLM(path, speculative_config=MTP, max_num_batched_tokens=24, **ENGINE)
    assert_head_state_follows(state, lambda tokens: nextn_reference(path, tokens, LAYERS))


def test_graph_twin_bounds_and_mtp_give_the_plain_tokens(deepseek):
    """The family's layers and its MTP layer in captured windows (the CPU graph twin, bounds-checked), chunked
    prefill, speculative and plain windows alternating: plain decoding's tokens."""
    assert_graph_twin_gives_plain_tokens(deepseek["mtp"], MTP, token_prompts(random_prompts(5, [4, 30, 70], seed=9)))
