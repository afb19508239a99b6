"""Weight updates on the GPU (profiling/gpu_check's pytest_extended stage): new weights written under CUDA graphs
captured before the update (the pointers stay: no capture again), against the CPU engine loaded from the new
checkpoint, which CI checks against transformers (tests/host/test_weight_updates.py)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.helpers import SMALL_ENGINE, random_prompts, token_prompts
from tests.host.test_weight_updates import _trained


@pytest.mark.gpu
@pytest.mark.extended
def test_gpu_updates_under_captured_graphs_give_the_cpu_tokens(tiny_models, tmp_path):
    from graphdecode import LLM, SamplingParams

    base = tiny_models["llama_gqa_llama3"]
    trained = _trained(base, tmp_path / "trained", seed=1)
    prompts = token_prompts(random_prompts(6, [9, 23, 14], seed=4))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    gpu = LLM(base, **SMALL_ENGINE, dtype="float32", device="cuda", attention_backend="torch", buckets=[1, 4, 8])
    before = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    captured = gpu.stats()["graphs_captured"]
    gpu.update_weights({k: v.cuda() for k, v in load_file(f"{trained}/model.safetensors").items()})
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    with LLM(trained, **SMALL_ENGINE, dtype="float32", device="cpu") as cpu:
        want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    assert captured > 0 and gpu.stats()["graphs_captured"] == captured
    assert got == want != before
    gpu.update_weights_from_disk(base)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == before
