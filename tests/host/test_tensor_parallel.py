"""Tensor parallelism on CPU (gloo, worker processes): TP=2 gives TP=1's tokens, each rank holds
only its share, a dead worker is reported within seconds, and no process is left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.models.eagle3_checkpoint import random_eagle3_head
from tests.helpers import SMALL_ENGINE, add_mtp_layer, assert_rank_loss_named, random_prompts, token_prompts


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def outputs(llm, prompts, params):
    return [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("model", ["llama_gqa_llama3", "qwen2_tied", "llama_head_dim"])
def test_tp2_gives_the_tp1_tokens(tiny_models, model):
    """GQA (4:2), one KV head for two ranks (replicated), MHA with head_dim != hidden / heads."""
    path = tiny_models[model]
    prompts = token_prompts(random_prompts(7, [1, 17, 40, 100]))
    cases = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=5, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[7, 99, 300], logprobs=3),
    ]
    single = LLM(path, **SMALL_ENGINE)
    want = [outputs(single, prompts, params) for params in cases]
    logprobs_one = single.generate(prompts[:2], cases[2])
    with LLM(path, tensor_parallel_size=2, **SMALL_ENGINE) as tp2:
        assert [outputs(tp2, prompts, params) for params in cases] == want
        logprobs_two = tp2.generate(prompts[:2], cases[2])
        pids = tp2.engine.executor.worker_pids
    for a, b in zip(logprobs_one, logprobs_two):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert not any(alive(pid) for pid in pids)


def test_tp2_preemption_and_stop_strings(tiny_models, text_model):
    path = tiny_models["llama_gqa_llama3"]
    prompts = token_prompts(random_prompts(10, [10, 30, 60]))
    tight = dict(num_decode_steps=8, max_model_len=256, max_batch_size=16, num_pages=24)
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=40)
    want = outputs(LLM(path, **tight), prompts, params)
    with LLM(path, tensor_parallel_size=2, **tight) as tp2:
        assert outputs(tp2, prompts, params) == want
        assert tp2.stats()["preemptions"] > 0
    texts = ["The capital of France is", "Once upon a time", "def main():"]
    stops = SamplingParams(temperature=0, max_tokens=40, stop=["e", "in"], include_stop_str_in_output=True)
    want = outputs(LLM(text_model, **SMALL_ENGINE), texts, stops)
    with LLM(text_model, tensor_parallel_size=2, **SMALL_ENGINE) as tp2:
        assert outputs(tp2, texts, stops) == want


def test_each_rank_holds_its_share(tiny_models):
    path = tiny_models["llama_gqa_llama3"]  # 4 query heads, 2 KV heads: an even split
    single = LLM(path, **SMALL_ENGINE).engine.runner.memory_sizes()
    with LLM(path, tensor_parallel_size=2, **SMALL_ENGINE) as tp2:
        driver = tp2.engine.runner.memory_sizes()
        _, worker = tp2.engine.executor.gather_from_workers("sizes")
    for rank in (driver, worker):
        assert rank["kv_cache_bytes"] == single["kv_cache_bytes"] // 2
        norms = 64 * 4 * (2 * 2 + 1)  # RMSNorm weights (fp32) are replicated on every rank
        assert rank["weight_bytes"] == (single["weight_bytes"] - norms) // 2 + norms


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_next", "nemotron_h", "nemotron3_moe", "nemotron3_latent",
                                   "granite_hybrid_moe"])
def test_tp2_hybrids_split_their_recurrent_heads(tiny_models, tmp_path, model):
    """Gated DeltaNet key heads (Qwen3.5; Qwen3-Next's grouped projections and shared experts) and Mamba2 heads
    and groups (Nemotron-H; Nemotron 3 with its relu-squared experts split too) split across two ranks: TP=1's
    tokens (greedy, seeded n > 1, a prefix hit restoring
    a state snapshot, speculation: Qwen3.5 by its MTP layer, replicated on each rank, the others by n-grams),
    each rank holding half of every state."""
    path = tiny_models[model]
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    if model == "qwen3_5":
        path = add_mtp_layer(shutil.copytree(path, str(tmp_path / "mtp")), 3)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    system = random_prompts(1, [40], seed=3)[0]
    prompts = token_prompts([system + p for p in random_prompts(4, [3, 17, 30, 60], seed=4)])
    cases = [SamplingParams(temperature=0, max_tokens=20),
             SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=12)]
    engine = dict(SMALL_ENGINE, speculative_config=spec)
    single = LLM(path, **engine)
    want = [outputs(single, prompts[:1], cases[0])] + [outputs(single, prompts, params) for params in cases]
    states = single.engine.runner.memory_sizes()["state_cache_bytes"]
    with LLM(path, tensor_parallel_size=2, **engine) as tp2:
        tp2.engine.spec_policy.speculate = lambda bucket, rows=(): True  # the driver's choice travels in the plan
        got = [outputs(tp2, prompts[:1], cases[0])] + [outputs(tp2, prompts, params) for params in cases]
        assert tp2.engine.stats()["prefix_cache_hits"] > 0 and tp2.engine.stats()["spec_draft_tokens"] > 0
        driver = tp2.engine.runner.memory_sizes()
        _, worker = tp2.engine.executor.gather_from_workers("sizes")
    assert got == want
    assert driver["state_cache_bytes"] == worker["state_cache_bytes"] == states // 2


def test_tp_validation(tiny_models):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_models["llama_gqa_llama3"], tensor_parallel_size=3)  # 4 heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide linear_num_key_heads \(2\)"):
        LLM(tiny_models["qwen3_5"], tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_models["llama_gqa_llama3"], tensor_parallel_size=0)


def test_a_killed_worker_raises_within_seconds(tiny_models):
    llm = LLM(tiny_models["llama_head_dim"], tensor_parallel_size=2, **SMALL_ENGINE)
    (pid,) = llm.engine.executor.worker_pids
    assert_rank_loss_named(llm, lambda: os.kill(pid, signal.SIGKILL), "worker 1")
    assert not alive(pid)


def test_workers_stop_at_interpreter_exit(tiny_models, tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(
        "import sys\n"
        "from graphdecode import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({tiny_models['llama_head_dim']!r}, tensor_parallel_size=2, max_model_len=64)\n"
        "    print(*llm.engine.executor.worker_pids, flush=True)\n"
        "    llm.generate({'prompt_token_ids': [3, 4]})\n"  # then exit without close()
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split()]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and not any(alive(p) for p in pids)


def test_tp3_on_smollm2():
    """SmolLM2-135M has 9 heads and 3 KV heads: TP=2 is refused by name, TP=3 gives TP=1's tokens."""
    from graphdecode.gguf_import import smollm2_dir

    path = smollm2_dir()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=2)
    prompts = ["The capital of France is", "Water boils at"]
    params = SamplingParams(temperature=0, max_tokens=8)
    want = outputs(LLM(path, **SMALL_ENGINE), prompts, params)
    with LLM(path, tensor_parallel_size=3, **SMALL_ENGINE) as tp3:
        assert outputs(tp3, prompts, params) == want


def test_cli_tensor_parallel(text_model, capsys):
    from graphdecode.cli import main

    args = ["generate", "--model", text_model, "--max-tokens", "6", "--json", "Hello"]
    assert main(args) == 0
    single = capsys.readouterr().out
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == single


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_tp2_speculation_gives_the_tp1_tokens(tiny_models, text_model, tmp_path, method):
    """The speculate-or-plain choice travels in the plan, so every rank replays the same window; a
    draft model or an EAGLE-3 head is replicated on every rank (each drafts the same tokens from the same
    inputs: the target's hidden states are whole on every rank)."""
    path = text_model if method == "eagle3" else tiny_models["llama_gqa_llama3"]
    bases = random_prompts(4, [3, 5, 8], seed=2)
    prompts = [{"prompt_token_ids": (b * 12)[:30]} for b in bases]  # repetitive: drafts get accepted
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = outputs(LLM(path, **SMALL_ENGINE), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    if method == "draft_model":
        spec = {"method": "draft_model", "model": tiny_models["qwen2_tied"], "num_speculative_tokens": 3}
    if method == "eagle3":
        head = random_eagle3_head(str(tmp_path / "head"), text_model, draft_vocab_size=300, aux_layers=(0, 2, 3))
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, **SMALL_ENGINE) as tp2:
        assert outputs(tp2, prompts, params) == want
        assert tp2.stats()["spec_windows"] > 0
