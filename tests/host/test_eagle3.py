"""EAGLE-3 heads (`method: eagle3`): drafts from a one-layer head over the target's hidden states, inside
the window; always the tokens plain decoding gives.

A random head accepts almost nothing at low temperature, so the outputs tests alone would pass with a head
whose K/V were wrong. The state test checks the head's invariant directly instead: mid-generation, after
prefill chunks, speculative rounds with partial acceptance (a high temperature: coupled Gumbel noise
dominates both distributions, so drafts are often the target's token) and plain windows between them, the
head's K/V at every position before a row's next input, and its output at the last one, equal a from-scratch
computation by hand from transformers' hidden states of the target and the head's tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphdecode import LLM, SamplingParams
from graphdecode.models.eagle3_checkpoint import random_eagle3_head
from graphdecode.structured.params import StructuredOutputsParams
from tests.helpers import (
    assert_same_outputs,
    completions,
    device_tokens,
    hot_mid_generation,
    random_prompts,
    token_prompts,
)

AUX = (0, 2, 3)  # the 4-layer target's layers the head reads (the default needs 6+ layers)
D = 3
ENGINE = dict(num_decode_steps=4, max_model_len=256, max_batch_size=8)


def spec_config(head: str, d: int = D) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": d}


@pytest.fixture(scope="module")
def heads(text_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {
        "reduced": random_eagle3_head(str(root / "reduced"), text_model, draft_vocab_size=200, aux_layers=AUX),
        "own_embedding": random_eagle3_head(str(root / "own"), text_model, draft_vocab_size=512, aux_layers=AUX,
                                            own_embedding=True, seed=1),
    }


@pytest.fixture(scope="module")
def plain(text_model):
    return LLM(text_model, **ENGINE)


def prompts(count: int = 6, seed: int = 3) -> list[dict]:
    return token_prompts(random_prompts(count, [4, 30, 60], seed=seed))


def alternate(llm: LLM) -> None:
    """Speculate in every other window, whatever the policy would choose: both kinds of window run."""
    turn = iter(range(1 << 30))
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): next(turn) % 2 == 0


def test_eagle3_gives_the_plain_tokens(text_model, heads, plain):
    """Greedy, seeded sampling with n = 2 and top-k, stops with logprobs; a reduced draft vocabulary with the
    target's embedding, and a full one with its own; speculating every window and every other one."""
    cases = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, top_k=20, seed=4, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[17, 300], logprobs=2),
    ]
    batch = prompts()
    for name, head in heads.items():
        spec = LLM(text_model, speculative_config=spec_config(head), **ENGINE)
        if name == "reduced":
            spec.engine.spec_policy.speculate = lambda bucket, rows=(): True
        else:
            alternate(spec)
        for params in cases:
            assert_same_outputs(spec.generate(batch, params), plain.generate(batch, params))
        stats = spec.stats()
        assert stats["spec_windows"] > 0 and stats["spec_draft_tokens"] > 0
        # greedy drafts skip the vocabulary-wide logits: the same argmax, ties (a zero row) broken alike
        model = spec.engine.runner.head.head
        x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        x[0] = 0
        x = x.to(model.norm.weight.dtype)
        assert torch.equal(model.greedy(x), model.logits(x).argmax(-1))


def test_graph_twin_bounds_preemption_prefix_hits_and_chunks(text_model, heads):
    """The CPU twin of CUDA graphs (captured EAGLE-3 windows, the first replay refusing host copies), the
    bounds-checked mode, a tight pool (preemption), the same prompts again (prefix-cache hits), prompts in
    chunks of 32 and n = 2 forks: the plain tokens."""
    tight = dict(ENGINE, max_batch_size=8, num_pages=20, max_num_batched_tokens=32)
    batch = prompts(8, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=5.0, seed=11, max_tokens=24, ignore_eos=True)
    want = [completions(LLM(text_model, **tight).generate(batch, p)) for p in (greedy, greedy, forked)]
    spec = LLM(text_model, speculative_config=spec_config(heads["reduced"]), cuda_graphs=True, check_bounds=True,
               **tight)
    alternate(spec)
    got = [completions(spec.generate(batch, p)) for p in (greedy, greedy, forked)]
    assert got == want
    stats = spec.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["spec_windows"] > 0
    assert stats["spec_accepted_tokens"] > 0  # the hot samples of the forks accept drafts


def _reference(text_model: str, head: str, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """The head's K and V [p, kv_heads, head_dim] at positions 0..p-1, its output at p - 1 (before its
    final norm) and its fused hidden state there, by hand, for a row whose tokens at 0..p are `tokens`."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    target = transformers.AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    cfg = json.load(open(os.path.join(head, "config.json")))
    w = load_file(os.path.join(head, "model.safetensors"))
    p = len(tokens) - 1
    with torch.no_grad():
        states = target(torch.tensor([tokens[:p]]), output_hidden_states=True).hidden_states  # inputs of each layer
        aux = torch.cat([states[i][0] for i in AUX], dim=-1)  # [p, 3H]
        embed = w.get("embed_tokens.weight", target.model.embed_tokens.weight)
        eps = cfg["rms_norm_eps"]

        def rms(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

        hidden = aux @ w["fc.weight"].T
        x = torch.cat([rms(embed[torch.tensor(tokens[1:])], w["midlayer.input_layernorm.weight"]),
                       rms(hidden, w["midlayer.hidden_norm.weight"])], dim=-1)
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        dim = cfg["hidden_size"] // heads
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(p, heads, dim).transpose(0, 1)[None]
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(p, kv_heads, dim).transpose(0, 1)[None]
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(p, kv_heads, dim)
        rotary = LlamaRotaryEmbedding(transformers.LlamaConfig(**cfg))
        cos, sin = rotary(v, torch.arange(p)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys = k[0].transpose(0, 1)  # [p, kv_heads, dim]
        last = q[0, :, -1]  # [heads, dim]: the query at p - 1 sees every position
        group = heads // kv_heads
        scores = torch.einsum("hd,phd->hp", last, keys.repeat_interleave(group, dim=1)) / dim**0.5
        attn = torch.einsum("hp,phd->hd", scores.softmax(-1), v.repeat_interleave(group, dim=1)).reshape(-1)
        residual = hidden[-1] + attn @ w["midlayer.self_attn.o_proj.weight"].T
        normed = rms(residual, w["midlayer.post_attention_layernorm.weight"])
        gate, up = normed @ w["midlayer.mlp.gate_proj.weight"].T, normed @ w["midlayer.mlp.up_proj.weight"].T
        out = residual + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return keys, v, out, hidden[-1]


def test_the_heads_kv_and_output_follow_every_path(text_model, heads):
    """Mid-generation, each live row's head K/V at positions 0..p-1 and its output at p - 1 (after a plain
    window: the fused hidden state there, from which the next speculative window makes that output) equal
    the by-hand computation: through prefill chunks (a chunk's last position reads the next chunk's first
    token), the sampled first token, speculative rounds that accept part of their drafts, plain windows (the
    head's K/V only), and the first speculative step after them."""
    head = heads["reduced"]
    spec = LLM(text_model, speculative_config=spec_config(head), max_num_batched_tokens=24, **ENGINE)
    alternate(spec)
    runner = spec.engine.runner
    state, eagle = runner.state, runner.head
    assert state.speculation.history is None  # a head drafts from hidden states: no token history on the device
    driver = eagle.head.cpu_decode  # the head's layer in one C++ call (models/cpu_decode.py), where it runs
    calls = []
    if driver is not None:
        real = driver.run
        driver.run = lambda hidden, positions, ctx, **kw: (calls.append("decode" if ctx.verify is None else "verify"),
                                                           real(hidden, positions, ctx, **kw))[1]
    kinds = hot_mid_generation(spec)
    stats = spec.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # rounds accepting part of their drafts
    assert 0 < stats["spec_window_share"] < 1
    live = (~state.done).nonzero()[:, 0].tolist()
    assert len(live) == 3
    cache = eagle.kv_caches[0]
    page_size = cache.shape[2]
    for row in live:
        p = int(state.positions[row])
        tokens = device_tokens(spec.engine, row)
        assert p > 40
        keys, values, out, fused = _reference(text_model, head, tokens)
        pages = state.block_table[row, torch.arange(p) // page_size].long()
        offsets = torch.arange(p) % page_size
        torch.testing.assert_close(cache[pages, 0, offsets], keys, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(cache[pages, 1, offsets], values, atol=2e-4, rtol=1e-4)
        if eagle.stale[row]:
            torch.testing.assert_close(eagle.pending[row], fused, atol=2e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(eagle.prenorm[row], out, atol=2e-4, rtol=1e-4)
    assert kinds == {True, False}  # windows ended plain (stale rows) and speculative
    from graphdecode.kernels.cpu import cpu_kernels

    if cpu_kernels() is not None:  # with the kernels, the head's steps took the one call: drafts and verifies
        assert driver is not None and set(calls) == {"decode", "verify"}



def test_structured_outputs_with_an_eagle3_head(text_model, heads, plain):
    """A constrained row's drafts walk its automaton: the plain tokens, valid JSON."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=120, structured_outputs=StructuredOutputsParams(
        json=schema))
    batch = ["Describe a pet:", "Once upon a time", "JSON please"]
    spec = LLM(text_model, speculative_config=spec_config(heads["reduced"]), **ENGINE)
    spec.engine.spec_policy.speculate = lambda bucket, rows=(): True
    got = spec.generate(batch, params)
    assert completions(got) == completions(plain.generate(batch, params))
    finished = [out.outputs[0] for out in got if out.outputs[0].finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(o.text)["name"], str) for o in finished)


def test_eagle3_config_is_validated_before_any_weight_is_read(text_model, heads, tmp_path):
    good = heads["reduced"]
    config = json.load(open(os.path.join(good, "config.json")))
    tensors = load_file(os.path.join(good, "model.safetensors"))

    def variant(name: str, changes: dict | None = None, drop: str | None = None, d2t=None) -> str:
        path = tmp_path / name
        path.mkdir()
        json.dump({**config, **(changes or {})}, open(path / "config.json", "w"))
        kept = {k: v for k, v in tensors.items() if k != drop}
        if d2t is not None:
            kept["d2t"] = d2t
        save_file(kept, str(path / "model.safetensors"))
        return str(path)

    aux = "eagle_config.eagle_aux_hidden_state_layer_ids"
    cases = [
        (variant("arch", {"architectures": ["LlamaForCausalLM"]}), "architectures must name an EAGLE-3 head"),
        (variant("layers", {"num_hidden_layers": 2}), "num_hidden_layers must be 1"),
        (variant("vocab", {"vocab_size": 256, "draft_vocab_size": 100}), r"vocab_size \(256\) differs"),
        (variant("hidden", {"target_hidden_size": 128}), r"target_hidden_size \(128\) differs"),
        (variant("aux", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 3]}}), aux),
        (variant("default_aux", {"eagle_config": {}}), r"default aux layers .* 4-layer target"),
        (variant("no_d2t", drop="d2t"), "'d2t' is missing"),
        (variant("short_d2t", d2t=torch.zeros(5, dtype=torch.int64)), "'d2t' must be"),
        (variant("no_fc", drop="fc.weight"), "'fc.weight' is missing"),
        (variant("bad_map", d2t=torch.full((200,), 400, dtype=torch.int64)), "'d2t' maps draft ids"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(text_model, max_model_len=256, speculative_config=spec_config(path))


def test_a_compiled_forward_in_the_graph_twin(text_model, heads, plain):
    """torch.compile'd windows (the forward that returns the hidden states too) captured in the CPU twin of
    CUDA graphs, whose first replay runs under the host-copy check: the plain tokens."""
    spec = LLM(text_model, speculative_config=spec_config(heads["reduced"]), compile=True, cuda_graphs=True,
               **dict(ENGINE, buckets=[4]))  # one bucket: the 4 rows' windows, plain and speculative
    alternate(spec)
    batch = prompts(4, seed=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert completions(spec.generate(batch, params)) == completions(plain.generate(batch, params))
    assert spec.stats()["spec_windows"] > 0
