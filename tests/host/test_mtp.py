"""The target's own MTP layer as the draft (`speculative_config={"method": "mtp"}`): Qwen3.5 (dense; its MoE and
multimodal checkpoints) and Qwen3-Next (an MoE layer), read from the target's checkpoint; always the tokens plain
decoding gives; EAGLE-3 heads on the same hybrid targets.

The tiny checkpoints get their MTP tensors from tests.helpers.add_mtp_layer: mtp.layers.0 is a copy of the
target's full-attention layer, so transformers' own decoder layer computes it in the state test's oracle. A
random fc accepts almost nothing at low temperature, so, as for EAGLE-3, the state test checks the head's
invariant directly: mid-generation, after chunked prefill, speculative rounds that accept part of their drafts
(a high temperature) and plain windows, each live row's MTP output at p - 1 (which reads its K/V at every
position before it) equals a from-scratch computation with transformers' modules.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphdecode import LLM, SamplingParams, StructuredOutputsParams
from graphdecode.models.eagle3_checkpoint import random_eagle3_head
from tests.helpers import (
    add_mtp_layer,
    assert_head_state_follows,
    assert_same_outputs,
    completions,
    random_prompts,
    token_prompts,
    with_tokenizer,
)

FULL_LAYER = 3  # the tiny Qwen3.5's and Qwen3-Next's full-attention layer (tests/conftest.py)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
ENGINE = dict(dtype="float32", cpu_threads=1, num_decode_steps=4, max_model_len=256, max_batch_size=8)


@pytest.fixture(scope="module")
def mtp_models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for name in ("qwen3_5", "qwen3_next"):
        path = str(root / name)
        shutil.copytree(tiny_models[name], path)
        out[name] = add_mtp_layer(path, FULL_LAYER, seed=len(out))
    return out


def prompts(count: int = 5, seed: int = 3) -> list[dict]:
    return token_prompts(random_prompts(count, [4, 30, 70], seed=seed))


def always(llm: LLM) -> LLM:
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
    return llm


def alternate(llm: LLM) -> LLM:
    turn = iter(range(1 << 30))
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): next(turn) % 2 == 0
    return llm


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_mtp_gives_the_plain_tokens(mtp_models, name):
    """Greedy, seeded sampling with n = 2 and top-k, stops with logprobs: a dense MTP layer (Qwen3.5) and an
    MoE one (Qwen3-Next), speculating in every window."""
    path = mtp_models[name]
    cases = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, top_k=20, seed=4, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[17, 300], logprobs=2),
    ]
    batch = prompts()
    plain = LLM(path, **ENGINE)
    spec = always(LLM(path, speculative_config=MTP, **ENGINE))
    assert spec.config.draft_model == path and spec.config.mtp_config.model.decoder_layers == 1
    for params in cases:
        assert_same_outputs(spec.generate(batch, params, use_tqdm=False), plain.generate(batch, params,
                                                                                         use_tqdm=False))
    stats = spec.stats()
    assert stats["spec_windows"] > 0 and stats["spec_draft_tokens"] > 0


def test_graph_twin_bounds_preemption_prefix_hits_and_chunks(mtp_models):
    """Captured windows in the CPU twin under the bounds-checked mode, a tight pool (preemption), the same
    prompts again (prefix-cache hits restoring state snapshots), chunks of 32, n = 2 forks: the plain tokens."""
    path = mtp_models["qwen3_5"]
    tight = dict(ENGINE, max_model_len=128, num_pages=30, page_size=8, max_num_batched_tokens=32)
    batch = prompts(8, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=5.0, seed=11, max_tokens=24, ignore_eos=True)
    with LLM(path, **tight) as plain:
        want = [completions(plain.generate(batch, p, use_tqdm=False)) for p in (greedy, greedy, forked)]
    with LLM(path, speculative_config=MTP, cuda_graphs=True, check_bounds=True, **tight) as spec:
        alternate(spec)
        got = [completions(spec.generate(batch, p, use_tqdm=False)) for p in (greedy, greedy, forked)]
        stats = spec.stats()
    assert got == want
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["spec_windows"] > 0
    assert stats["spec_accepted_tokens"] > 0  # the hot samples of the forks accept drafts


def _reference(path: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(The MTP layer's output at p - 1, the target's final hidden state there) for a row whose tokens at 0..p
    are `tokens`, with transformers' modules: the target's final hidden states at 0..p-1, the embeddings of
    the tokens at 1..p, its (1 + w) RMSNorms, mtp.fc, and its own decoder layer `FULL_LAYER` (whose weights
    mtp.layers.0 copies) over positions 0..p-1, then mtp.norm."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    target = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    w = load_file(os.path.join(path, "model.safetensors"))
    cfg = target.config
    p = len(tokens) - 1

    def norm(name):
        module = Qwen3_5RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        module.weight.data.copy_(w[f"mtp.{name}.weight"])
        return module

    with torch.no_grad():
        final = target.model(torch.tensor([tokens[:p]])).last_hidden_state  # [1, p, H], after the final norm
        embeds = target.model.embed_tokens(torch.tensor([tokens[1:]]))
        x = torch.cat([norm("pre_fc_norm_embedding")(embeds), norm("pre_fc_norm_hidden")(final)], dim=-1)
        x = x @ w["mtp.fc.weight"].T
        position_ids = torch.arange(p).view(1, 1, -1).expand(3, 1, -1)  # text: every rope section alike
        rope = target.model.rotary_emb(x, position_ids)
        out = target.model.layers[FULL_LAYER](x, position_embeddings=rope, attention_mask=None)  # causal (sdpa)
        out = norm("norm")(out)
    return out[0, -1], final[0, -1]


def test_the_mtp_output_follows_every_path(mtp_models):
    """Each live row's MTP output at p - 1 (or, after a plain window, the target's final hidden state there)
    equals transformers' computation, mid-generation: through prefill chunks, the sampled first token,
    speculative rounds that accept part of their drafts and plain windows (the layer's K/V only)."""
    path = mtp_models["qwen3_5"]
    spec = LLM(path, speculative_config=MTP, max_num_batched_tokens=24, **ENGINE)
    assert_head_state_follows(spec, lambda tokens: _reference(path, tokens))


def test_a_multimodal_checkpoints_mtp_layer(mtp_models, tmp_path):
    """Qwen3_5ForConditionalGeneration's layout: text_config, model.language_model.*, a vision tower, and the
    MTP layer at the top level (mtp.*)."""
    source = mtp_models["qwen3_5"]
    path = str(tmp_path / "vl")
    os.makedirs(path)
    with open(os.path.join(source, "config.json")) as f:
        text = json.load(f)
    text.pop("architectures", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                   "tie_word_embeddings": False, "text_config": text, "vision_config": {"depth": 1}}, f)
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(os.path.join(source, "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    batch = prompts(3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(source, **ENGINE) as plain:
        want = completions(plain.generate(batch, params, use_tqdm=False))
    with LLM(path, speculative_config=MTP, **ENGINE) as spec:
        assert completions(always(spec).generate(batch, params, use_tqdm=False)) == want
        assert spec.stats()["spec_draft_tokens"] > 0


def test_an_eagle3_head_drafts_for_a_hybrid(mtp_models, tmp_path):
    """EAGLE-3 on a hybrid target: the hidden states entering three of its layers (linear and attention ones)."""
    path = mtp_models["qwen3_5"]
    head = random_eagle3_head(str(tmp_path / "head"), path, draft_vocab_size=300, aux_layers=(0, 3, 5))
    batch = prompts()
    cases = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
             SamplingParams(n=2, temperature=0.9, seed=2, max_tokens=20, ignore_eos=True)]
    with LLM(path, **ENGINE) as plain:
        want = [completions(plain.generate(batch, p, use_tqdm=False)) for p in cases]
    spec_config = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    with LLM(path, speculative_config=spec_config, cuda_graphs=True, **ENGINE) as spec:
        assert [completions(alternate(spec).generate(batch, p, use_tqdm=False)) for p in cases] == want
        assert spec.stats()["spec_draft_tokens"] > 0


def test_structured_outputs_with_mtp_drafts(mtp_models, text_model, tmp_path):
    """A constrained row's drafts walk its automaton: the plain tokens, each matching the pattern."""
    path = with_tokenizer(mtp_models["qwen3_5"], text_model, tmp_path / "with_tokenizer")
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=24, structured_outputs=StructuredOutputsParams(
        regex=pattern)) for s in range(3)]
    batch = ["Code: ", "The code is ", "Write one: "]
    with LLM(path, **ENGINE) as plain:
        want = completions(plain.generate(batch, params, use_tqdm=False))
    with LLM(path, speculative_config=MTP, **ENGINE) as spec:
        got = always(spec).generate(batch, params, use_tqdm=False)
        assert spec.stats()["spec_draft_tokens"] > 0
    assert completions(got) == want
    for out in got:
        assert re.fullmatch(pattern, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


def test_mtp_configs_are_checked_before_any_weight_is_read(mtp_models, tiny_models, text_model, tmp_path):
    with pytest.raises(ValueError, match="speculative_config: method 'mtp' .*model_type 'llama' has none"):
        LLM(text_model, speculative_config=MTP)
    with pytest.raises(ValueError, match="speculative_config: method 'mtp': .* no mtp.layers"):
        LLM(tiny_models["qwen3_5"], speculative_config=MTP)  # a checkpoint without them
    with pytest.raises(ValueError, match="speculative_config.model must be the target"):
        LLM(mtp_models["qwen3_5"], speculative_config={**MTP, "model": str(tmp_path / "absent")})
    with pytest.raises(ValueError, match="unknown key 'prompt_lookup_max'"):
        LLM(mtp_models["qwen3_5"], speculative_config={**MTP, "prompt_lookup_max": 3})

    def edited(name, edit):
        path = str(tmp_path / name)
        shutil.copytree(mtp_models["qwen3_5"], path)
        tensors = load_file(os.path.join(path, "model.safetensors"))
        edit(tensors)
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return path

    second = edited("two", lambda t: t.update({"mtp.layers.1.input_layernorm.weight": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"2 MTP layers \(\[0, 1\]\)"):
        LLM(second, speculative_config=MTP)
    missing = edited("missing", lambda t: t.pop("mtp.fc.weight"))
    with pytest.raises(ValueError, match="speculative_config: method 'mtp': .*'mtp.fc.weight' is missing"):
        LLM(missing, speculative_config=MTP)
    wrong = edited("wrong", lambda t: t.update({"mtp.fc.weight": torch.zeros(64, 64)}))
    with pytest.raises(ValueError, match=r"'mtp.fc.weight' has shape \(64, 64\), expected \(64, 128\)"):
        LLM(wrong, speculative_config=MTP)
