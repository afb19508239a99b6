"""compile_decode_logits leaves room for one compiled entry per bucket, never lowering the limit."""

from __future__ import annotations

import torch._dynamo.config as dynamo_config

from graphdecode.compiled.torch_compile import compile_decode_logits


def _limit_name() -> str:
    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


def test_limit_fits_every_bucket_and_is_never_lowered(monkeypatch):
    name = _limit_name()
    monkeypatch.setattr(dynamo_config, name, 8)
    compile_decode_logits(lambda x: x, num_buckets=9)  # the default buckets 1..256
    assert getattr(dynamo_config, name) >= 2 * 9
    monkeypatch.setattr(dynamo_config, name, 1000)
    compile_decode_logits(lambda x: x, num_buckets=9)
    assert getattr(dynamo_config, name) == 1000
