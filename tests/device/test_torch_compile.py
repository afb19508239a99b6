"""The compiled decode forward: one compile for all buckets >= 2 (and one for bucket 1),
whatever the KV width; compile time reported apart from capture; cache under the
graphdecode cache root. Uses the aot_eager backend so CI does not wait for inductor."""

from __future__ import annotations

import os

import torch
import torch._dynamo

from graphdecode import LLM, SamplingParams
from graphdecode.device import torch_compile
from graphdecode.device.torch_compile import CompiledForward
from tests.helpers import first_tokens, random_prompts, token_prompts


def test_one_compile_serves_every_bucket_and_width(tiny_models):
    torch._dynamo.reset()
    path = tiny_models["llama_gqa_llama3"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = token_prompts(random_prompts(11, [3, 20, 70]))
    eager = LLM(path, num_decode_steps=4, max_model_len=256, max_batch_size=16)
    want = first_tokens(eager.generate(prompts, params))

    llm = LLM(path, num_decode_steps=4, max_model_len=256, max_batch_size=16)
    windows = llm.engine.runner.windows
    compiled = CompiledForward(llm.engine.runner.model.decode_logits, backend="aot_eager")
    windows.logits_fn = compiled
    with torch.inference_mode():  # as the runner does
        windows.warm_up()  # bucket 1 and bucket 2: the two entries
    assert compiled.compiles == 2 and compiled.compile_seconds > 0
    got = []
    for i, j in ((0, 4), (4, 6), (6, 11)):  # buckets 4, 2, 8; KV widths 2, 4 and 8 pages
        got += first_tokens(llm.generate(prompts[i:j], params))
    got += first_tokens(llm.generate(prompts[:1], params))
    assert got[: len(prompts)] == want and got[-1] == want[0]
    buckets = llm.stats()["windows_per_bucket"]
    assert set(buckets) == {1, 2, 4, 8}
    assert compiled.compiles == 2, "a bucket or a KV width recompiled the forward"
    assert llm.stats()["compile_seconds"] == compiled.compile_seconds


def test_inductor_cache_lives_under_the_graphdecode_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path))
    assert torch_compile.inductor_cache_dir() == os.path.join(str(tmp_path), "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(str(tmp_path), "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")  # a user's choice wins
    assert torch_compile.inductor_cache_dir() == "/somewhere/else"
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torch._dynamo writes
    assert torch_compile.inductor_cache_dir() == os.path.join(str(tmp_path), "inductor")
