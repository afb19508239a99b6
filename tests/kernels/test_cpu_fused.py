"""The CPU's fused decoder-layer passes (csrc/cpu_fused.cpp): residual add + RMSNorm and rotary in one
pass each, against the torch ops they replace; where the engine uses them, and where it does not."""

from __future__ import annotations

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.kernels.cpu import CpuKernels, cpu_kernels
from graphdecode.models.layers import RMSNorm
from graphdecode.models.model_config import RopeConfig
from graphdecode.models.rope import RotaryEmbedding
from tests.helpers import generate_tokens, hf_greedy, random_prompts

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ compiler: the CPU kernels cannot be built here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_and_norm_equal_torch(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=g).to(dtype) * 3 for _ in range(2))
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    norm = norm.to(dtype)
    want_sum, want = norm.add_and_norm(x, residual)
    want_alone = norm(x)
    norm.kernels = KERNELS
    got_sum, got = norm.add_and_norm(x, residual)
    assert torch.equal(got_sum, want_sum)  # the add is torch's, rounding included
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # a sum's order
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(norm(x), want_alone, **tol)
    strided = torch.randn(rows, 1000, generator=g).to(dtype)[:, 100:676]  # a row stride wider than the row
    torch.testing.assert_close(norm(strided), RMSNorm.forward(_plain(norm), strided), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_passes_give_the_same_bits_on_any_number_of_threads(dtype):
    """A prefill chunk's rows go over OpenMP threads (csrc/cpu_fused.cpp, PARALLEL_MIN): each row's arithmetic
    runs in one thread, so 1, 2 and 5 threads (more than this machine's cores) agree bit for bit, and with
    torch's ops as on one thread."""
    g = torch.Generator().manual_seed(5)
    rows = 300  # 300 x 576 elements: past the kernels' threshold for threads
    x, residual = (torch.randn(rows, 576, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=g).to(dtype)
    qkv = torch.randn(rows, 960, generator=g).to(dtype)
    q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 400, dtype, "cpu")
    positions = torch.randperm(400, generator=g)[:rows]
    one_norm = KERNELS.add_rms_norm(x, residual, weight, 1e-5, threads=1)
    one_rope = KERNELS.rope(q, k, rotary.cos, rotary.sin, positions, threads=1)
    assert all(torch.equal(a, b) for a, b in zip(one_rope, rotary(positions, q, k)))  # torch's, bit for bit
    for threads in (2, 5):
        assert all(torch.equal(a, b) for a, b in zip(KERNELS.add_rms_norm(x, residual, weight, 1e-5, threads=threads),
                                                     one_norm))
        assert all(torch.equal(a, b) for a, b in zip(KERNELS.rope(q, k, rotary.cos, rotary.sin, positions,
                                                                  threads=threads), one_rope))


@pytest.mark.parametrize("variant", ["offset", "weight_fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_variants_equal_torch_and_do_not_depend_on_the_rows(dtype, variant):
    """Gemma's (1 + w) norm and gpt-oss's float32 product in the kernel's pass: torch's values (within a sum's
    order), per-head [T, H, D] inputs too (q / k norms), and a row alone the same bits as among 64."""
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(256, 1e-6, **{variant: True})
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=g) * 0.5)
    norm = norm.to(dtype)
    x, residual = (torch.randn(64, 256, generator=g).to(dtype) * 3 for _ in range(2))
    heads = torch.randn(5, 4, 256, generator=g).to(dtype)
    want, want_heads, (want_sum, want_added) = norm(x), norm(heads), norm.add_and_norm(x, residual)
    norm.kernels = KERNELS
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(norm(x), want, **tol)
    torch.testing.assert_close(norm(heads), want_heads, **tol)
    got_sum, got_added = norm.add_and_norm(x, residual)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got_added, want_added, **tol)
    assert torch.equal(torch.cat([norm(x[i : i + 1]) for i in range(64)]), norm(x))


def _plain(norm):
    twin = RMSNorm(norm.weight.shape[0], norm.eps).to(norm.weight.dtype)
    twin.weight = norm.weight
    return twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bit_for_bit_torch_on_split_views(dtype):
    """q and k as the fused qkv projection's views (token stride wider than their heads)."""
    g = torch.Generator().manual_seed(3)
    tokens = 9
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64, generator=g).to(dtype)
    q, k, _ = qkv.split([576, 192, 192], dim=-1)
    q, k = q.view(tokens, 9, 64), k.view(tokens, 3, 64)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0,
                                        original_max_position_embeddings=64), 64, 300, dtype, "cpu")
    positions = torch.tensor([0, 1, 63, 64, 65, 150, 299, 7, 7])
    want = rotary(positions, q, k)
    rotary.kernels = KERNELS
    got = rotary(positions, q, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].is_contiguous() and got[1].is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_torch_on_any_number_of_threads(dtype):
    """silu(gate) * up in one pass: torch's roundings (bf16: the same bits; float32: silu's exp within an ulp),
    row widths with a tail past the 16 lanes, and the same bits on 1, 2 and 5 threads."""
    g = torch.Generator().manual_seed(9)
    for rows, inter in ((1, 40), (7, 1536), (300, 200)):
        gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        one = KERNELS.swiglu(gate_up, threads=1)
        if dtype == torch.bfloat16:
            assert torch.equal(one, want)
        else:
            torch.testing.assert_close(one, want, rtol=1e-6, atol=1e-6)
        for threads in (2, 5):
            assert torch.equal(KERNELS.swiglu(gate_up, threads=threads), one)
    with pytest.raises(ValueError, match="swiglu"):
        KERNELS.swiglu(torch.randn(3, 8).to(dtype)[:, :6])  # not contiguous


def test_the_engine_uses_them_for_every_norm_variant_and_full_rotary(tiny_models):
    """Every RMSNorm variant takes the kernel's fixed-order pass (batch invariance: aten's reduction may split
    by the row count), SwiGLU its one pass (inside the gate_up projection's where its panels allow); partial
    rotary keeps torch's ops."""
    llm = LLM(tiny_models["llama_gqa_llama3"], max_model_len=128, max_batch_size=4)
    model = llm.engine.runner.model
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(isinstance(m.kernels, CpuKernels) for m in norms)
    assert isinstance(model.rotary.kernels, CpuKernels)
    assert all(isinstance(m.mlp.act.kernels, CpuKernels) for m in model.model.layers)  # SwiGLU
    # and with gate_up in panels (intermediate 128: whole panels), the projection and SwiGLU in one pass
    assert all(m.mlp.one_pass is m.mlp.gate_up_proj.packed for m in model.model.layers)
    gemma = LLM(tiny_models["gemma3_text"], max_model_len=64, max_batch_size=2).engine.runner.model
    assert all(isinstance(m.kernels, CpuKernels) for m in gemma.modules() if isinstance(m, RMSNorm))  # (1 + w)
    phi = LLM(tiny_models["phi3_partial_swa"], max_model_len=64, max_batch_size=2).engine.runner.model
    assert phi.rotary.kernels is None  # partial rotary keeps torch's ops


def test_fused_and_torch_passes_give_transformers_tokens(tiny_models, monkeypatch):
    """Greedy tokens with the fused passes equal transformers' and the torch ops' (prefill and decode)."""
    path = tiny_models["qwen3_untied"]  # q/k norms too: [T, H, D] norms keep torch's ops
    prompts = random_prompts(4, [5, 40, 90, 17], seed=12)
    params = SamplingParams(temperature=0, max_tokens=20)
    fused = LLM(path, num_decode_steps=4, max_model_len=256, max_batch_size=4)
    tokens = generate_tokens(fused, prompts, params)
    assert tokens == hf_greedy(path, prompts, 20)


def test_token_mask_and_automaton_advance_equal_the_torch_ops():
    """The structured-outputs step's CPU passes: a token mask from packed words (every active row, bits
    clear -> -inf, inactive rows untouched) and the automaton advance (exceptions by binary search, else
    the state's default), against the torch ops the compiled window and GPUs run."""
    from graphdecode.device.structured_tables import StructuredTables
    from graphdecode.device.token_mask import TokenMaskUnpacker, num_words

    g = torch.Generator().manual_seed(9)
    vocab, rows = 1000, 6
    masks = TokenMaskUnpacker(vocab, "cpu")
    assert masks.kernels is not None
    words = torch.randint(-2**31, 2**31 - 1, (rows, num_words(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
    active = torch.tensor([True, False, True, True, False, True])
    logits = torch.randn(rows, vocab, generator=g)
    want, got = logits.clone(), logits.clone()
    kernels, masks.kernels = masks.kernels, None
    masks.mask_disallowed_(want, words, active)
    masks.kernels = kernels
    masks.mask_disallowed_(got, words, active)
    assert torch.equal(got, want) and torch.isinf(got[0]).any() and torch.equal(got[1], logits[1])

    tables = StructuredTables(max_states=20, max_exceptions=200, vocab_size=vocab, device="cpu")
    counts = torch.randint(0, 15, (20,), generator=g)
    counts[3] = 0  # a state without exceptions: every token takes its default
    starts = torch.cumsum(counts, 0) - counts
    tables.exc_start.copy_(starts.int())
    tables.exc_count.copy_(counts.int())
    for s, (start, count) in enumerate(zip(starts.tolist(), counts.tolist())):
        tables.exc_tokens[start:start + count] = torch.randperm(vocab, generator=g)[:count].sort().values.int()
        tables.exc_next[start:start + count] = torch.randint(0, 20, (count,), generator=g).int()
    tables.default_next.copy_(torch.randint(-1, 20, (20,), generator=g).int())
    states = torch.randint(0, 20, (300,), generator=g).int()
    hits = tables.exc_tokens[(tables.exc_start[states.long()]).long()].long()  # some tokens are exceptions
    tokens = torch.where(torch.rand(300, generator=g) < 0.5, hits, torch.randint(0, vocab, (300,), generator=g))
    tokens[::7] = 3  # the same token in many states
    fast = tables.advance(states, tokens)
    tables.kernels = None
    assert torch.equal(fast, tables.advance(states, tokens))
    assert (fast != tables.default_next[states.long()]).any()  # exceptions were found
