"""The CPU's linears (models/cpu_linear.py): prepacked and panelled weights give the same products as
aten's linear, through eager calls and the opaque op a compiled forward uses; a CPU model gets them at
load (fp32 and bf16 in a model that streams its weights: panels and oneDNN's packed weights, or without
the CPU kernels packed only; in a model that fits in cache fp32 column-major parameters, bf16 packed;
packed models drop their dense weights), and memory accounting counts the extra copies."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from graphdecode.kernels import cpu as cpu_kernels_module
from graphdecode.models import cpu_linear
from graphdecode.models.cpu_linear import PackedWeight, PanelWeight, can_prepack, onednn_packs
from tests.helpers import first_tokens, generate_tokens, hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_equals_dense_linear(dtype, rows, bias):
    if not onednn_packs(dtype):
        pytest.skip("oneDNN has no bf16 on this CPU (the engine takes the panels instead)")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 64, generator=g).to(dtype)
    packed = PackedWeight(weight)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed(x, b).float(), want, **tol)


needs_kernels = pytest.mark.skipif(cpu_kernels_module.cpu_kernels() is None,
                                   reason="no C++ compiler for the CPU kernels")


@needs_kernels
@pytest.mark.parametrize("shape", [(96, 64), (100, 37), (130, 200), (5, 3), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_weight_equals_dense_linear_at_every_row_count(shape, bias, dtype):
    """The panel kernel (csrc/cpu_linear.cpp) for 0..PANEL_ROWS rows, across its register tiles (6 rows),
    a last panel narrower than 64 columns and K not a multiple of its 64-row blocks; oneDNN's packed GEMM
    past PANEL_ROWS; the kernel itself for any row count (its passes of 64 rows). bf16: float32 sums of the
    exact products, each output rounded once (within one bf16 step of the float64 result rounded). A row's
    result does not depend on the batch."""
    n, k = shape
    g = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    panel = PanelWeight(weight, cpu_kernels_module.cpu_kernels())
    size = weight.element_size()
    if onednn_packs(dtype):
        packed_bytes = panel.packed.numel() * panel.packed.element_size()
        assert packed_bytes >= n * k * size
    else:  # bf16 without oneDNN's (AVX2 only): no oneDNN copy, the panels at every row count
        packed_bytes = 0
        assert panel.packed is None and panel.rows == math.inf
    k_panel = 2 * panel.kernels.pair_rows_for(k) if panel.pairs else k  # bf16 pair panels pad K (AMX: to 32)
    assert panel.extra_bytes == -(-n // 64) * 64 * k_panel * size + packed_bytes
    x = torch.randn(70, k, generator=g).to(dtype)
    limit = cpu_linear.PANEL_ROWS[dtype]
    for rows in sorted({0, 1, 2, 5, 6, 7, 13, limit, limit + 1, 70}):
        exact = F.linear(x[:rows].double(), weight.double(), None if b is None else b.double())
        for got in (panel(x[:rows], b), panel.kernels.panel_linear(x[:rows], panel.panels, n, b)):
            assert got.shape == (rows, n) and got.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, exact.float(), rtol=1e-5, atol=1e-4 * k ** 0.5)
            else:  # one bf16 step: 2^-7 of the magnitude, plus float32 sums' error near zero
                step = exact.abs() * 2 ** -7 + 1e-4 * k ** 0.5
                assert ((got.double() - exact).abs() <= step).all()
    one = [panel(x[i : i + 1], b) for i in range(limit)]
    assert torch.equal(torch.cat(one), panel(x[:limit], b))  # the same sums whichever tile a row lands in
    # past one task's 64 rows the kernel walks K in longer blocks: still each sum's k in ascending order
    alone = [panel.kernels.panel_linear(x[i : i + 1], panel.panels, n, b) for i in range(70)]
    assert torch.equal(torch.cat(alone), panel.kernels.panel_linear(x, panel.panels, n, b))
    assert panel(x[:6].view(2, 3, k), b).shape == (2, 3, n)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 37])
def test_panel_rows_are_the_weight_rows(dtype, k):
    """An embedding lookup in a tied head's panels (graphdecode_cpu_panel_rows): W[ids] bit for bit, for K odd
    (bf16 pairs padded past K) and even, one id or a prefill's thousands over two threads, repeats and the last
    panel's rows; an id past the panels' rows is refused, not read."""
    g = torch.Generator().manual_seed(k)
    n = 200
    weight = torch.randn(n, k, generator=g).to(dtype)
    panel = PanelWeight(weight, cpu_kernels_module.cpu_kernels())
    for ids in (torch.tensor([7]), torch.randint(0, n, (3000,), generator=g), torch.tensor([n - 1, 0, n - 1])):
        assert torch.equal(panel.weight_rows(ids), weight[ids])
    grid = torch.tensor([[3, 4], [5, 199]])
    assert torch.equal(panel.weight_rows(grid), weight[grid])
    kernels = panel.kernels
    assert torch.equal(kernels.panel_rows(panel.panels, torch.arange(n), k, threads=2), weight)
    for bad in (-1, 4 * 64):  # 200 rows fill 4 panels of 64
        with pytest.raises(ValueError, match="panel_rows"):
            kernels.panel_rows(panel.panels, torch.tensor([1, bad]), k)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 48, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_kernel_gives_the_same_bits_on_any_number_of_threads(rows, dtype):
    """The kernel splits its (row block, panel) pairs over OpenMP threads: every output's sum runs in one
    thread in the same order, so 1, 2 and 5 threads (more than this machine's cores) agree bit for bit."""
    n, k = 200, 96  # 4 panels, the last narrower than 64 columns
    g = torch.Generator().manual_seed(rows)
    weight, b, x = (torch.randn(*shape, generator=g).to(dtype) for shape in ((n, k), (n,), (rows, k)))
    panel = PanelWeight(weight, cpu_kernels_module.cpu_kernels())
    one = panel.kernels.panel_linear(x, panel.panels, n, b, threads=1)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(one.float(), F.linear(x.float(), weight.float(), b.float()), **tol)
    for threads in (2, 5):
        assert torch.equal(panel.kernels.panel_linear(x, panel.panels, n, b, threads=threads), one)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gated_projection_and_its_swiglu_in_one_pass_give_the_two_passes_bits(dtype):
    """run_swiglu (csrc/cpu_linear.cpp's gated tasks and AMX units: a gate panel, then its up panel, then SwiGLU
    of the two) writes exactly what the projection then the SwiGLU pass write, at decode's and prefill's row
    counts, on any thread count, for a model's width and for K not a multiple of the kernels' steps."""
    kernels = cpu_kernels_module.cpu_kernels()
    for inter, k in ((128, 96), (192, 37), (1536, 576)):
        g = torch.Generator().manual_seed(inter + k)
        panel = PanelWeight((torch.randn(2 * inter, k, generator=g) / k ** 0.5).to(dtype), kernels, invariant=True)
        assert panel.gated_one_pass
        for rows in (0, 1, 5, 16, 17, 33, 64, 70, 200):
            if inter == 1536 and rows not in (1, 70):
                continue
            x = (torch.randn(rows, k, generator=g) * 2).to(dtype)
            one = panel.run_swiglu(x)
            assert one.shape == (rows, inter) and one.dtype == dtype
            assert torch.equal(one, kernels.swiglu(panel.run(x)) if rows else torch.empty(0, inter, dtype=dtype))
            assert torch.equal(kernels.panel_linear_swiglu(x, panel.panels, inter, threads=1), one)
            assert torch.equal(kernels.panel_linear_swiglu(x, panel.panels, inter, threads=5), one)
    assert panel.run_swiglu(x.view(2, 35, k)).shape == (2, 35, inter)
    narrow = PanelWeight(torch.randn(2 * 96, 64).to(dtype), kernels, invariant=True)
    assert not narrow.gated_one_pass  # gate's 96 columns end inside a panel: up's first would share it
    with pytest.raises(ValueError, match="panel_linear_swiglu rejected .* inter 96"):
        kernels.panel_linear_swiglu(torch.randn(3, 64).to(dtype), narrow.panels, 96)
    assert not PanelWeight(torch.randn(256, 64), kernels).gated_one_pass  # oneDNN's GEMM past its row limit


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_projection_and_its_residual_in_one_pass_give_the_two_ops_bits(dtype):
    """run_add (graphdecode_cpu_panel_linear_add: the projection's outputs rounded, then the residual added and
    rounded again) writes exactly `residual + run(x)`, at decode's and prefill's row counts, on any thread
    count, with a last panel narrower than 64 columns and rows of the residual wider than the output."""
    kernels = cpu_kernels_module.cpu_kernels()
    for n, k in ((576, 1536), (200, 37)):
        g = torch.Generator().manual_seed(n + k)
        panel = PanelWeight((torch.randn(n, k, generator=g) / k ** 0.5).to(dtype), kernels, invariant=True)
        for rows in (0, 1, 5, 17, 70, 200):
            x = torch.randn(rows, k, generator=g).to(dtype)
            residual = torch.randn(rows, n + 8, generator=g).to(dtype)[:, :n]  # rows n + 8 apart
            want = residual + panel.run(x)
            assert torch.equal(kernels.panel_linear_add(x, panel.panels, n, residual, threads=1), want)
            assert torch.equal(kernels.panel_linear_add(x, panel.panels, n, residual, threads=5), want)
            if rows:
                assert torch.equal(panel.run_add(x, residual.contiguous()), want)
    with pytest.raises(ValueError, match="panel_linear_add rejected"):
        kernels.panel_linear_add(x, panel.panels, n, residual[:, ::2].float())


@needs_kernels
def test_panel_weight_runs_the_kernel_on_any_thread_count(monkeypatch):
    """With several torch threads the panel kernel still takes up to PANEL_ROWS rows (on those threads)."""
    weight = torch.randn(128, 64)
    panel = PanelWeight(weight, cpu_kernels_module.cpu_kernels())
    calls = []
    monkeypatch.setattr(panel, "kernels", type("Spy", (), {"panel_linear": lambda self, *a: calls.append(a)})())
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    panel(torch.randn(4, 64))
    assert len(calls) == 1
    rows = cpu_linear.PANEL_ROWS[torch.float32] + 1
    assert panel(torch.randn(rows, 64)).shape == (rows, 128)
    assert len(calls) == 1  # past PANEL_ROWS: oneDNN's GEMM


@needs_kernels
def test_an_engine_on_two_threads_runs_its_kernels_on_both_and_decodes_transformers_tokens(tiny_models, monkeypatch):
    """What a user with two cores meets: LLM(cpu_threads=2) runs the panel kernel, prefill attention and the
    decode step's layers (one call: panels and paged attention inside) on both threads, and its greedy tokens
    are transformers' fp32 ones, at batch 1 and 3."""
    from graphdecode import LLM, SamplingParams

    monkeypatch.setattr(cpu_linear, "STREAM_BYTES", 0)  # the tiny model's weights take the panels
    kernel_threads = {"panel_linear": [], "prefill_attention": [], "decoder_layers": []}
    for name, seen in kernel_threads.items():
        kernel = getattr(cpu_kernels_module.CpuKernels, name)
        monkeypatch.setattr(cpu_kernels_module.CpuKernels, name, lambda self, *a, _k=kernel, _s=seen, **kw: (
            _s.append(torch.get_num_threads()), _k(self, *a, **kw))[1])
    threads = torch.get_num_threads()
    try:
        llm = LLM(tiny_models["qwen2_tied"], max_model_len=64, max_batch_size=4, cpu_threads=2)
        prompts = random_prompts(3, [5, 9, 3], seed=32)
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        want = hf_greedy(tiny_models["qwen2_tied"], prompts, 8)
        assert generate_tokens(llm, prompts[:1], sp) == want[:1]
        assert generate_tokens(llm, prompts, sp) == want
    finally:
        torch.set_num_threads(threads)  # the engine set two for the process
    assert all(seen and set(seen) == {2} for seen in kernel_threads.values())


@pytest.mark.parametrize("kind", ["packed", "panel"])
def test_compiled_calls_go_through_the_opaque_op(kind):
    weight = torch.randn(48, 32)
    if kind == "panel":
        if cpu_kernels_module.cpu_kernels() is None:
            pytest.skip("no C++ compiler for the CPU kernels")
        packed = PanelWeight(weight, cpu_kernels_module.cpu_kernels())
    else:
        packed = PackedWeight(weight)
    x = torch.randn(5, 32)

    def fn(x):
        return torch.relu(packed(x)) + 1  # noqa: F821 - the closure is deleted with packed below

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
    """batch_invariant=False: a 64-wide model's fp32 weights fit in cache (under STREAM_BYTES): nothing is copied;
    the projections (and an untied LM head) are stored column-major, the embedding (a tied head) row-major."""
    from graphdecode import LLM
    from graphdecode.models.layers import FusedLinear
    from graphdecode.models.parallel import RowParallelLinear

    model = LLM(tiny_models[name], max_model_len=64, max_batch_size=4, batch_invariant=False).engine.runner.model
    assert model.packed_head is None and all(getattr(m, "packed", None) is None for m in model.modules())
    linears = [m for m in model.modules() if isinstance(m, (FusedLinear, RowParallelLinear))]
    assert linears and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert model.model.embed_tokens.weight.is_contiguous()
    if not model.config.tie_word_embeddings:
        assert model.lm_head.weight.t().is_contiguous()


@pytest.mark.parametrize("dtype,onednn_bf16", [("float32", True), ("bfloat16", True), ("bfloat16", False)])
def test_a_cpu_model_is_packed_at_load(tiny_models, dtype, onednn_bf16, monkeypatch):
    """batch_invariant=False: panels for few rows and oneDNN's packed weights for more; where oneDNN has no bf16
    (an AVX2-only CPU), bf16 takes the panels at every row count and keeps no oneDNN copy."""
    from graphdecode import LLM

    panels = cpu_kernels_module.cpu_kernels() is not None  # fp32 and bf16 alike, else PackedWeight only
    if dtype == "bfloat16" and onednn_bf16 and not onednn_packs(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 on this CPU (the onednn_bf16=False case covers it)")
    if not onednn_bf16:
        if not panels:
            pytest.skip("no C++ compiler for the CPU kernels")
        monkeypatch.setattr(cpu_linear, "onednn_packs", lambda dt: dt != torch.bfloat16)
    monkeypatch.setattr(cpu_linear, "STREAM_BYTES", 0)  # the tiny model's fp32 weights count as streaming
    llm = LLM(tiny_models["qwen2_tied"], dtype=dtype, max_model_len=64, max_batch_size=4, batch_invariant=False)
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and layer.mlp.down_proj.packed is not None
    assert (type(layer.mlp.gate_up_proj.packed) is PanelWeight) == panels
    head, embedding = model.packed_head, model.model.embed_tokens
    assert head is not None and (type(head) is PanelWeight) == panels
    if onednn_bf16:
        assert head.rows == cpu_linear.HEAD_PANEL_ROWS
    else:
        assert head.rows == math.inf and head.packed is None and layer.mlp.gate_up_proj.packed.packed is None
    if panels:  # tied: the embedding's lookups read the head's panels, the row-major copy released
        assert embedding.rows_from is head and embedding.weight.numel() == 0
        from safetensors.torch import load_file

        checkpoint = load_file(os.path.join(tiny_models["qwen2_tied"], "model.safetensors"))["model.embed_tokens.weight"]
        ids = torch.tensor([[0, 63, 64], [checkpoint.shape[0] - 1, 5, 5]])
        assert torch.equal(embedding(ids), checkpoint.to(head.panels.dtype)[ids])
    else:  # a packed copy of the embedding, which stays
        assert embedding.weight.numel() > 0
    assert layer.mlp.gate_up_proj.weight.numel() == 0 and layer.self_attn.o_proj.weight.numel() == 0
    sizes = llm.engine.runner.memory_sizes()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sizes["weight_bytes"] == params + cpu_linear.packed_bytes(model) > params


def test_without_the_cpu_kernels_fp32_projections_are_packed(tiny_models, monkeypatch):
    """No C++ compiler (or GRAPHDECODE_CPU_KERNELS=0): fp32 projections get oneDNN's packed weight alone, and
    greedy tokens are those of the panelled engine."""
    from graphdecode import LLM, SamplingParams

    monkeypatch.setattr(cpu_linear, "STREAM_BYTES", 0)
    prompts = [{"prompt_token_ids": [3, 7, 11, 5]}, {"prompt_token_ids": [9, 2]}]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(cpu_kernels_module, "cpu_kernels", lambda: None)
        llm = LLM(tiny_models["qwen2_tied"], max_model_len=64, max_batch_size=4)
        proj = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert type(proj.packed) is (PanelWeight if kernels and cpu_kernels_module.cpu_kernels() else PackedWeight)
        assert proj.weight.numel() == 0
        tokens[kernels] = first_tokens(llm.generate(prompts, sp, use_tqdm=False))
    assert tokens[True] == tokens[False]
