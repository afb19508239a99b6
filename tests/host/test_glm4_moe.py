"""GLM-4.5's family (`glm4_moe`, models/glm4_moe.py): DeepSeek-V3's routing (sigmoid scores, a correction bias,
groups, scaling), ungated shared experts, dense first layers, biased q/k/v with q/k norms and half-head rotary,
against transformers; and its MTP layer in DeepSeek-V3's layout (`model.layers.{num_hidden_layers}.*`) drafting
through `speculative_config={"method": "mtp"}`.

The tiny model's biases, norms and router correction bias are random (transformers initialises them to 0 and
1), so every part of the routing and the attention shows. Its MTP layer copies the target's last (sparse)
layer, so transformers' own decoder layer is the oracle of the head's state."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphdecode import LLM, SamplingParams
from graphdecode.models.moe import MoEConfig, route
from tests.helpers import (
    add_nextn_layer,
    assert_graph_twin_gives_plain_tokens,
    assert_head_drafts_over_stages,
    assert_head_state_follows,
    assert_hf_tokens_on_every_path,
    assert_same_outputs,
    completions,
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


def _tiny_glm(path: str) -> str:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                           n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2,
                           first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                           max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    return save_routed_model(path, Glm4MoeForCausalLM, config, seed=7)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4_moe")
    plain = _tiny_glm(str(root / "plain"))
    with_mtp = str(root / "mtp")
    shutil.copytree(plain, with_mtp)
    return {"plain": plain, "mtp": add_nextn_layer(with_mtp, LAYERS)}


def prompts(count: int = 5, seed: int = 3) -> list[list[int]]:
    return random_prompts(count, [4, 30, 70], seed=seed)


def always(llm: LLM) -> LLM:
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
    return llm


def test_routing_is_transformers_router(glm):
    """route("sigmoid_groups") picks transformers' experts with its weights: the correction bias in the choice
    only, the best two groups of four by their two best scores, renormalised, times routed_scaling_factor."""
    from transformers import AutoConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = AutoConfig.from_pretrained(glm["plain"])
    router = Glm4MoeTopkRouter(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 64, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    x = torch.randn(200, 64, generator=g)
    _, want_weights, want_ids = router(x)
    cfg = MoEConfig(8, 3, 32, routing="sigmoid_groups", weights_fp32=True, num_groups=4, topk_groups=2,
                    routed_scaling=2.5)
    weights, ids = route(x @ router.weight.T, cfg, router.e_score_correction_bias)
    order = want_ids.sort(dim=-1)
    assert torch.equal(ids, order.values)
    torch.testing.assert_close(weights, want_weights.gather(1, order.indices), rtol=1e-6, atol=1e-7)
    assert weights.dtype == torch.float32
    for bad, match in ((dict(num_groups=3), "n_group .3. must divide"), (dict(num_groups=8), "fewer than 2 experts"),
                       (dict(num_groups=4, topk_groups=5), "topk_group .5.")):
        with pytest.raises(ValueError, match=match):
            MoEConfig(8, 3, 32, routing="sigmoid_groups", **bad)


def test_greedy_parity_with_transformers_on_every_path(glm):
    """transformers' greedy tokens, plain (k = 1), chunked prefill with prefix-cache hits (k = 4, 4 rows), and
    n-gram speculation (the verify's queries through the MoE); the first token's logprobs equal transformers'."""
    path = glm["plain"]
    batch = prompts(6, seed=21)
    llm = assert_hf_tokens_on_every_path(path, batch, GREEDY, hf_greedy(path, batch, 24))
    assert [layer.sparse for layer in llm.engine.runner.model.model.layers] == [False, True, True]


def test_the_router_stays_float32_in_bf16(glm):
    """A bf16 engine keeps the router's weight and correction bias float32 (transformers'
    _keep_in_fp32_modules_strict), and a row's tokens do not depend on its batch."""
    llm = LLM(glm["plain"], dtype="bfloat16", cpu_threads=1, max_model_len=256, max_batch_size=8)
    gates = [layer.mlp.gate for layer in llm.engine.runner.model.model.layers if layer.sparse]
    assert gates and all(g.weight.dtype == g.e_score_correction_bias.dtype == torch.float32 for g in gates)
    assert all(layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
               for layer in llm.engine.runner.model.model.layers if layer.sparse)
    batch = prompts(6, seed=4)
    together = generate_tokens(llm, batch, GREEDY)
    assert [generate_tokens(llm, [p], GREEDY)[0] for p in batch] == together


def test_mtp_gives_the_plain_tokens(glm):
    """The nextn layer drafting in every window: greedy, seeded n = 2, and stops with logprobs; the target's own
    load skips the MTP layer's tensors."""
    path = glm["mtp"]
    cases = [GREEDY, SamplingParams(n=2, temperature=0.8, top_k=20, seed=4, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[17, 300], logprobs=2)]
    batch = token_prompts(prompts())
    plain = LLM(path, **ENGINE)
    assert len(plain.engine.runner.model.model.layers) == LAYERS
    spec = always(LLM(path, speculative_config=MTP, **ENGINE))
    assert spec.config.mtp_config.first_layer == LAYERS
    for params in cases:
        assert_same_outputs(spec.generate(batch, params, use_tqdm=False), plain.generate(batch, params,
                                                                                         use_tqdm=False))
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0


def test_the_mtp_output_follows_every_path(glm):
    """Mid-generation, after chunked prefill, speculative rounds accepting part of their drafts and plain windows,
    each live row's MTP output at p - 1 (or, after a plain window, the target's final hidden state) equals
    transformers' computation."""
    path = glm["mtp"]
    spec = LLM(path, speculative_config=MTP, max_num_batched_tokens=24, **ENGINE)
    assert_head_state_follows(spec, lambda tokens: nextn_reference(path, tokens, LAYERS))


def test_nextn_configs_are_checked_before_any_weight_is_read(glm, tmp_path):
    def edited(name, edit=None, config=None):
        path = str(tmp_path / name)
        shutil.copytree(glm["mtp"], path)
        if edit:
            tensors = load_file(os.path.join(path, "model.safetensors"))
            edit(tensors)
            save_file(tensors, os.path.join(path, "model.safetensors"))
        if config:
            with open(os.path.join(path, "config.json")) as f:
                raw = json.load(f)
            raw.update(config)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(raw, f)
        return path

    at = f"model.layers.{LAYERS}."
    with pytest.raises(ValueError, match=rf"method 'mtp': .* no model.layers.{LAYERS}.\* tensors"):
        LLM(glm["plain"], speculative_config=MTP)
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0"):
        LLM(edited("none", config={"num_nextn_predict_layers": 0}), speculative_config=MTP)
    two = edited("two", lambda t: t.update({f"model.layers.{LAYERS + 1}.enorm.weight": torch.ones(64)}),
                 {"num_nextn_predict_layers": 2})
    with pytest.raises(ValueError, match=rf"2 MTP layers \(\[{LAYERS}, {LAYERS + 1}\]\)"):
        LLM(two, speculative_config=MTP)
    missing = edited("missing", lambda t: t.pop(at + "eh_proj.weight"))
    with pytest.raises(ValueError, match=rf"speculative_config: method 'mtp': .*'{at}eh_proj.weight' is missing"):
        LLM(missing, speculative_config=MTP)
    wrong = edited("wrong", lambda t: t.update({at + "eh_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(ValueError, match=rf"'{at}eh_proj.weight' has shape \(64, 64\), expected \(64, 128\)"):
        LLM(wrong, speculative_config=MTP)
    assert completions(LLM(two, **ENGINE).generate(token_prompts(prompts(1)), GREEDY, use_tqdm=False))


def test_tp2_splits_glm_like_tp1_and_its_mtp_layer_drafts_there(glm):
    """Tensor parallelism: every expert's and the shared experts' intermediate size split, the float32 router
    replicated; the MTP head, replicated on both ranks, drafts and the tokens stay plain decoding's."""
    path = glm["mtp"]
    batch = prompts(4, seed=8)
    engine = dict(num_decode_steps=4, max_model_len=256, max_batch_size=4)
    single = generate_tokens(LLM(path, **engine), batch, GREEDY)
    assert single == hf_greedy(glm["plain"], batch, 24)
    with LLM(path, tensor_parallel_size=2, speculative_config=MTP, **engine) as tp2:
        always(tp2)
        assert generate_tokens(tp2, batch, GREEDY) == single
        assert tp2.stats()["spec_draft_tokens"] > 0


def test_graph_twin_bounds_and_mtp_give_the_plain_tokens(glm):
    """The family's layers and its MTP layer in captured windows (the CPU graph twin, bounds-checked), chunked
    prefill, speculative and plain windows alternating: plain decoding's tokens."""
    assert_graph_twin_gives_plain_tokens(glm["mtp"], MTP, token_prompts(random_prompts(5, [4, 30, 70], seed=9)))


def test_mtp_drafts_over_pipeline_stages(glm):
    """The MTP layer over two stages (it reads the last stage's final hidden states, shared with every rank, and
    embeds with the target's embedding, which every stage then holds): one rank's drafts and acceptance, and
    plain decoding's tokens."""
    batch = token_prompts(prompts(4, seed=9))
    hot = SamplingParams(temperature=1.5, seed=5, max_tokens=16, ignore_eos=True)
    got = assert_head_drafts_over_stages(glm["mtp"], MTP, batch, [GREEDY, hot], **ENGINE)
    assert got == [completions(LLM(glm["plain"], **ENGINE).generate(batch, params)) for params in (GREEDY, hot)]
