"""Mixture-of-experts (issue 23): the MoE layer's implementations against each other and transformers'
routers, YaRN against transformers' tables, expert load counters, tensor parallelism, config and
checkpoint errors. Greedy parity and seeded sampling per family run in test_model_families.py (the
families `mixtral`, `qwen3_moe`, `gpt_oss`); MXFP4 checkpoints in unit/test_mxfp4.py; graphs on a GPU
in gpu/test_gpu_graphs.py."""

from __future__ import annotations

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.config import model_weight_bytes
from graphdecode.models.model_config import load_model_config, parse_model_config
from graphdecode.models.moe import IMPLEMENTATIONS, MoEConfig, moe_experts, route
from graphdecode.models.rope import inverse_frequencies
from tests.helpers import (
    copy_model,
    edit_tensors,
    generate_tokens,
    hf_greedy,
    random_prompts,
    remove_tensor,
    rewrite_config,
    token_prompts,
)

MOE_FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


# ------------------------------------------------------------------------------- the layer itself
def _experts(num_experts, hidden, inter, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.3
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.3
    b13 = torch.randn(num_experts, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=g) if bias else None
    return w13, w2, b13, b2


def _routings(tokens, num_experts, k, g):
    """Random routings, one where an expert gets no token, and one where one expert gets every token."""
    logits = torch.randn(tokens, num_experts, generator=g)
    yield "random", logits
    starved = logits.clone()
    starved[:, 0] = -1e4  # expert 0 receives nothing
    yield "expert 0 empty", starved
    crowded = logits.clone()
    crowded[:, 3] = 1e4  # every token picks expert 3
    yield "expert 3 takes all", crowded


@pytest.mark.parametrize("activation, bias", [("silu", False), ("gpt_oss", True)])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_grouped_and_dense_equal_the_reference_on_random_routings(activation, bias, k):
    num_experts, hidden, inter, tokens = 8, 32, 16, 13
    w13, w2, b13, b2 = _experts(num_experts, hidden, inter, bias, seed=k)
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(tokens, hidden, generator=g)
    routing = "topk_softmax" if activation == "gpt_oss" else "softmax_topk"
    cfg = MoEConfig(num_experts, k, inter, routing=routing)
    for case, logits in _routings(tokens, num_experts, k, g):
        weights, ids = route(logits, cfg)
        if case == "expert 0 empty":
            assert not (ids == 0).any()
        if case == "expert 3 takes all":
            assert (ids == 3).any(-1).all()
        want = IMPLEMENTATIONS["reference"](x, ids, weights, w13, w2, b13, b2, activation, 1.702, 7.0)
        assert torch.isfinite(want).all() and want.abs().sum() > 0
        for name in ("grouped", "dense"):
            got = moe_experts(x, ids, weights, w13, w2, b13, b2, activation, 1.702, 7.0, name)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name}, {case}")


def test_the_op_compiles_as_one_opaque_call_and_matches_in_bfloat16():
    """Compiled windows see [T, H] -> [T, H] whatever the routing: fullgraph, and no recompile when the
    routing changes; bf16 grouped stays within bf16 rounding of the fp32 reference."""
    num_experts, hidden, inter, tokens, k = 8, 32, 16, 9, 2
    w13, w2, _, _ = _experts(num_experts, hidden, inter, False, seed=3)
    cfg = MoEConfig(num_experts, k, inter)
    compiled = torch.compile(lambda x, ids, w: moe_experts(x, ids, w, w13, w2, None, None, "silu", 1.0, 1.0,
                                                           "grouped"), fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(tokens, hidden, generator=g)
        weights, ids = route(torch.randn(tokens, num_experts, generator=g), cfg)
        want = IMPLEMENTATIONS["reference"](x, ids, weights, w13, w2, None, None, "silu", 1.0, 1.0)
        torch.testing.assert_close(compiled(x, ids, weights), want, rtol=1e-5, atol=1e-5)
        half = moe_experts(x.bfloat16(), ids, weights, w13.bfloat16(), w2.bfloat16(), None, None, "silu", 1.0, 1.0,
                           "grouped")
        torch.testing.assert_close(half.float(), want, rtol=5e-2, atol=5e-2)


def test_routing_matches_transformers_routers():
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hidden, experts, k = 16, 8, 3
    g = torch.Generator().manual_seed(4)
    x = torch.randn(21, hidden, generator=g)
    cases = [
        (MixtralTopKRouter(MixtralConfig(hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=k)),
         MoEConfig(experts, k, 4, renormalize=True, weights_fp32=True)),
        (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=k,
                                           norm_topk_prob=False)), MoEConfig(experts, k, 4, renormalize=False)),
        (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=k,
                                           norm_topk_prob=True)), MoEConfig(experts, k, 4, renormalize=True)),
        (GptOssTopKRouter(GptOssConfig(hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=k)),
         MoEConfig(experts, k, 4, routing="topk_softmax", router_bias=True)),
    ]
    for router, cfg in cases:
        with torch.no_grad():
            router.weight.normal_(generator=g)
            if hasattr(router, "bias"):
                router.bias.normal_(generator=g)
            _, hf_weights, hf_ids = router(x)
            logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
        weights, ids = route(logits, cfg)
        order = hf_ids.sort(-1)
        assert torch.equal(ids, order.values), type(router).__name__
        assert weights.dtype == hf_weights.dtype
        torch.testing.assert_close(weights, hf_weights.gather(-1, order.indices), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ YaRN
@pytest.mark.parametrize("params", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 256},  # truncated range, default betas
    {"factor": 8.0, "original_max_position_embeddings": 512, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 2.0, "original_max_position_embeddings": 512, "attention_factor": 1.25},
    {"factor": 4.0},  # original_max_position_embeddings: max_position_embeddings, as transformers fills it
])
def test_yarn_frequencies_and_scale_equal_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    raw = dict(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
               num_attention_heads=2, max_position_embeddings=16384, rope_parameters=rope)
    ours = parse_model_config(raw).rope
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert torch.equal(inverse_frequencies(ours, 32), inv_freq)
    assert ours.attention_factor == pytest.approx(scale, rel=1e-12)


# ----------------------------------------------------------------------------- counters and stats
def test_each_live_token_is_counted_once_per_layer_and_slot(tiny_models):
    """Rows finishing mid-window (k=4, different max_tokens), padded bucket rows and a prefix-cache hit:
    each MoE layer counts top_k times the tokens it computed for live rows, no more."""
    path = tiny_models["qwen3_moe"]
    prompts = random_prompts(5, [3, 17, 40, 70, 9], seed=3)
    llm = LLM(path, num_decode_steps=4, page_size=16, max_model_len=256, max_batch_size=8)
    lengths = [5, 11, 2, 7, 13]
    outs = llm.generate(token_prompts(prompts), [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                        for n in lengths])
    stats = llm.stats()
    counts = stats["moe_tokens_per_expert"]
    assert len(counts) == 2 and all(len(layer) == 8 for layer in counts)  # layer 1 is dense
    computed = sum(map(len, prompts)) + sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert [sum(layer) for layer in counts] == [3 * computed] * 2
    assert stats["moe_max_over_mean_load"] >= 1.0
    llm.generate(token_prompts([prompts[3]]), SamplingParams(temperature=0, max_tokens=1))  # 64 of 70 tokens cached
    again = llm.stats()["moe_tokens_per_expert"]
    assert sum(again[0]) - sum(counts[0]) == 3 * (70 - 64)
    dense = LLM(tiny_models["qwen3_untied"], max_model_len=64, max_batch_size=2)
    assert "moe_tokens_per_expert" not in dense.stats()


def test_cpu_defaults_and_weight_bytes(tiny_models):
    # batch_invariant=False: the dense fp32 parameters stay (the invariant path moves them into panels)
    llm = LLM(tiny_models["gpt_oss"], max_model_len=64, max_batch_size=2, batch_invariant=False)
    model = llm.engine.runner.model
    expected = "grouped" if hasattr(torch, "_grouped_mm") else "reference"
    assert all(layer.experts.implementation == expected for layer in model.moe_layers)
    specs = model.attention_specs
    assert [s.sliding_window for s in specs] == [16, None]
    assert all(s.sinks is not None and s.sinks.shape == (4,) and s.sinks.abs().sum() > 0 for s in specs)
    cfg = llm.config.model_config
    counted = sum(p.numel() for p in model.parameters())
    assert model_weight_bytes(cfg, torch.float32) == pytest.approx(4 * counted, rel=0.02)  # all experts; no norms


# -------------------------------------------------------------------------------- tensor parallel
@pytest.mark.parametrize("model", MOE_FAMILIES)
def test_tp2_splits_every_expert_like_tp1(tiny_models, model):
    """Each rank holds half of every expert's intermediate size; the router is replicated; one all-reduce
    after the MoE (gpt-oss's down bias added once)."""
    path = tiny_models[model]
    prompts = random_prompts(4, [17, 50, 100, 5], seed=8)
    engine = dict(num_decode_steps=4, max_model_len=256, max_batch_size=4)
    single = generate_tokens(LLM(path, **engine), prompts, GREEDY)
    assert single == hf_greedy(path, prompts, 16)
    with LLM(path, tensor_parallel_size=2, **engine) as tp2:
        assert generate_tokens(tp2, prompts, GREEDY) == single
        counts = tp2.stats()["moe_tokens_per_expert"]
    computed = sum(map(len, prompts)) + sum(len(t) - 1 for t in single)
    assert sum(counts[0]) == load_model_config(path).moe.top_k * computed


# --------------------------------------------------------------------------------- config, errors
def test_configs_read_as_transformers_does(tiny_models):
    qwen = load_model_config(tiny_models["qwen3_moe"])
    assert qwen.moe.sparse_layers == (True, False, True) and qwen.moe.top_k == 3 and qwen.moe.renormalize
    assert qwen.qk_norm and qwen.head_dim == 16 and qwen.moe.intermediate_size == 32
    mixtral = load_model_config(tiny_models["mixtral"])
    assert mixtral.moe.num_experts == 8 and mixtral.moe.weights_fp32 and mixtral.layer_window(1) == 32
    oss = load_model_config(tiny_models["gpt_oss"])
    assert oss.attn_sinks and oss.qkv_bias and oss.o_proj_bias and oss.rope.rope_type == "yarn"
    assert [oss.layer_window(i) for i in range(2)] == [16, None] and oss.moe.routing == "topk_softmax"
    base = dict(model_type="qwen3_moe", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
                num_attention_heads=2, num_experts=4, num_experts_per_tok=2)
    assert parse_model_config(dict(base, decoder_sparse_step=2)).moe.sparse_layers == (False, True, False, True)
    assert parse_model_config(dict(base, mlp_only_layers=[0, 3])).moe.sparse_layers == (False, True, True, False)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        parse_model_config(dict(base, num_experts_per_tok=5))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        parse_model_config(dict(base, mlp_only_layers=[4]))
    with pytest.raises(ValueError, match="quantization_config"):
        parse_model_config(dict(base, quantization_config={"quant_method": "fp8"}))
    gpt = dict(base, model_type="gpt_oss", num_local_experts=4)
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        parse_model_config(dict(gpt, quantization_config={"quant_method": "awq"}))
    assert parse_model_config(dict(gpt, quantization_config={"quant_method": "mxfp4"})).quantization == "mxfp4"


def test_checkpoint_errors_name_the_expert_tensor(tiny_models, tmp_path):
    missing = copy_model(tiny_models, "mixtral", tmp_path, "missing")
    edit_tensors(missing, remove_tensor("model.layers.1.block_sparse_moe.experts.5.w2.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.5\.w2\.weight' is missing"):
        LLM(missing, max_model_len=64)
    extra = copy_model(tiny_models, "qwen3_moe", tmp_path, "extra")
    rewrite_config(extra, lambda raw: raw.update(num_experts=7))  # the checkpoint has 8
    with pytest.raises(ValueError, match=r"experts\.7\.(gate|up|down)_proj\.weight' has no place"):
        LLM(extra, max_model_len=64)
    shape = copy_model(tiny_models, "gpt_oss", tmp_path, "shape")
    edit_tensors(shape, lambda t: t.update({"model.layers.0.mlp.experts.down_proj": torch.zeros(4, 64, 63)}))
    with pytest.raises(ValueError, match=r"experts\.down_proj' has shape \(4, 64, 63\), expected \(4, 64, 64\)"):
        LLM(shape, max_model_len=64)
    router = copy_model(tiny_models, "gpt_oss", tmp_path, "router")
    edit_tensors(router, remove_tensor("model.layers.0.mlp.router.bias"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.router\.bias' is missing"):
        LLM(router, max_model_len=64)


def test_a_compiled_window_runs_the_experts_op(tiny_models):
    """torch.compile traces the decode window with the experts as one opaque op (fullgraph): the
    tokens are transformers'."""
    path = tiny_models["gpt_oss"]
    prompts = random_prompts(3, [50, 9, 20], seed=6)
    llm = LLM(path, num_decode_steps=4, page_size=16, max_model_len=256, max_batch_size=4, buckets=[4],
              compile=True)
    assert generate_tokens(llm, prompts, GREEDY) == hf_greedy(path, prompts, 16)
    assert llm.stats()["compile_seconds"] > 0


def test_an_expert_tensor_in_two_forms_is_refused(tiny_models, tmp_path):
    both = copy_model(tiny_models, "qwen3_moe", tmp_path, "both")
    stacked = torch.zeros(8, 64, 32)
    edit_tensors(both, lambda t: t.update({"model.layers.0.mlp.experts.down_proj": stacked}))
    with pytest.raises(ValueError, match=r"both hold model\.layers\.0\.mlp\.experts\.down_proj"):
        LLM(both, max_model_len=64)


def test_quantization_config_must_match_the_expert_tensors(tiny_models, tmp_path):
    liar = copy_model(tiny_models, "gpt_oss", tmp_path, "liar")
    rewrite_config(liar, lambda raw: raw.update(quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj' is float, but config\.json says "
                                         r"quantization_config mxfp4"):
        LLM(liar, max_model_len=64)
