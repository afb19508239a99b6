"""logprobs computed on the device inside the window agree with transformers' log_softmax."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from graphdecode import LLM, SamplingParams
from tests.helpers import random_prompts, token_prompts


def test_logprobs_match_transformers(tiny_models):
    path = tiny_models["qwen2_tied"]
    prompts = random_prompts(3, [5, 40, 90], seed=41)
    llm = LLM(path, num_decode_steps=4, max_model_len=256, max_batch_size=4)
    params = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12),  # no logprobs asked: none returned
    ]
    outs = llm.generate(token_prompts(prompts), params)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, out, p in zip(prompts, outs, params):
        c = out.outputs[0]
        if p.logprobs is None:
            assert c.logprobs is None
            continue
        assert len(c.logprobs) == len(c.token_ids) == 12
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)  # [T, V]
        total = 0.0
        for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
            assert entry[tok].rank == int((row > row[tok]).sum()) + 1
            top = row.topk(p.logprobs)
            for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert tid in entry and abs(entry[tid].logprob - value) < 1e-4
                if tid != tok:
                    assert entry[tid].rank == rank
            assert len(entry) <= p.logprobs + 1
            total += entry[tok].logprob
        assert abs(c.cumulative_logprob - total) < 1e-3
