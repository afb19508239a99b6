"""Prepacked CPU linears (models/cpu_linear.py): the same products as aten's linear, through
eager calls and the opaque op a compiled forward uses; a CPU model is packed at load, bf16
drops its dense linear weights, and memory accounting counts the packed ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphdecode.models import cpu_linear
from graphdecode.models.cpu_linear import PackedWeight, can_prepack

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_equals_dense_linear(dtype, rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 64, generator=g).to(dtype)
    packed = PackedWeight(weight)
    assert (packed.dense is not None) == (dtype == torch.float32)  # bf16 keeps only the packed copy
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed(x, b).float(), want, **tol)


def test_compiled_calls_go_through_the_opaque_op():
    weight = torch.randn(48, 32)
    packed = PackedWeight(weight)
    x = torch.randn(5, 32)

    def fn(x):
        return torch.relu(packed(x)) + 1

    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), torch.relu(x @ weight.T) + 1, rtol=1e-5, atol=1e-5)
    handle = packed.handle
    del packed, fn, compiled
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match="no live packed weight"):  # a dead engine leaves nothing behind
        torch.ops.graphdecode.packed_linear(x, None, handle, 48)


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3_untied"])
def test_small_fp32_weights_are_column_major_in_place(tiny_models, name):
    """A 64-wide model's fp32 weights are far below FP32_PACK_MIN: nothing is copied; the projections (and an
    untied LM head) are stored column-major, the embedding (a tied head) row-major for its lookups."""
    from graphdecode import LLM
    from graphdecode.models.layers import FusedLinear
    from graphdecode.models.parallel import RowParallelLinear

    model = LLM(tiny_models[name], max_model_len=64, max_batch_size=4).engine.runner.model
    assert model.packed_head is None and all(getattr(m, "packed", None) is None for m in model.modules())
    linears = [m for m in model.modules() if isinstance(m, (FusedLinear, RowParallelLinear))]
    assert linears and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert model.model.embed_tokens.weight.is_contiguous()
    if not model.config.tie_word_embeddings:
        assert model.lm_head.weight.t().is_contiguous()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_model_is_packed_at_load(tiny_models, dtype, monkeypatch):
    from graphdecode import LLM

    monkeypatch.setattr(cpu_linear, "FP32_PACK_MIN", 0)  # the tiny model's fp32 weights count as large
    llm = LLM(tiny_models["qwen2_tied"], dtype=dtype, max_model_len=64, max_batch_size=4)
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and layer.mlp.down_proj.packed is not None
    assert model.packed_head is not None  # tied: a packed copy of the embedding, which stays
    assert model.model.embed_tokens.weight.numel() > 0
    dense = layer.mlp.gate_up_proj.weight.numel()
    assert (dense > 0) == (dtype == "float32")
    sizes = llm.engine.runner.memory_sizes()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sizes["weight_bytes"] == params + cpu_linear.packed_bytes(model) > params
