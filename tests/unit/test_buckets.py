"""An explicit bucket list: exactly these padded batch sizes are planned and run, and
the list is validated by name before anything is built."""

from __future__ import annotations

import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.cli import main
from graphdecode.config import EngineConfig
from tests.helpers import random_prompts, token_prompts


def test_default_buckets_are_powers_of_two_up_to_max_batch_size(tiny_models):
    path = tiny_models["llama_head_dim"]
    assert EngineConfig(path).buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    cfg = EngineConfig(path, max_batch_size=24)
    assert cfg.buckets == (1, 2, 4, 8, 16, 24) and cfg.max_batch_size == 24


def test_explicit_buckets_set_max_batch_size(tiny_models):
    path = tiny_models["llama_head_dim"]
    cfg = EngineConfig(path, buckets=[1, 16, 128])
    assert cfg.buckets == (1, 16, 128) and cfg.max_batch_size == 128
    cfg = EngineConfig(path, buckets=(2, 8), max_batch_size=64)
    assert cfg.buckets == (2, 8) and cfg.max_batch_size == 8  # never more rows than the largest graph


@pytest.mark.parametrize(
    "buckets",
    [[], [4, 2], [1, 1, 2], [0, 4], [-1], [1.5, 4], ["1", "2"], "1,2", [1, 2048], [True, 2]],
)
def test_bad_bucket_lists_name_the_field(tiny_models, buckets):
    with pytest.raises(ValueError, match="buckets"):
        LLM(tiny_models["llama_head_dim"], buckets=buckets)


def test_largest_bucket_above_max_batch_size_is_refused(tiny_models):
    with pytest.raises(ValueError, match="buckets"):
        LLM(tiny_models["llama_head_dim"], buckets=[1, 16], max_batch_size=8)


def test_only_the_listed_buckets_run(tiny_models):
    llm = LLM(tiny_models["llama_gqa_llama3"], buckets=[3, 12], num_decode_steps=2, max_model_len=128)
    assert llm.engine.runner.windows.buckets == (3, 12)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = token_prompts(random_prompts(12, [5, 9]))
    outs = llm.generate(prompts[:1], params) + llm.generate(prompts[:5], params) + llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert set(llm.stats()["windows_per_bucket"]) == {3, 12}
    with pytest.raises(ValueError, match="n"):  # n > the largest bucket cannot be placed
        llm.generate(prompts[0], SamplingParams(n=13))


def test_cli_buckets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path))
    assert main(["generate", "--buckets", "1,4", "--max-tokens", "3", "--stats", "Hi", "Ho"]) == 0
    assert '"windows_per_bucket": {\n    "4"' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--buckets", "1,x", "Hi"])
