"""Quantized weights on the GPU, inside the window's CUDA graphs (profiling/gpu_check's pytest_extended stage).

The wide-margin bf16 checkpoint of tests/hf_parity_models (hidden 512, intermediate 1536: groups of 128 divide
every width) is quantized here by round-to-nearest (graphdecode/models/quant/rtn.py) into int4 groups
(compressed-tensors pack-quantized and GPTQ: tinygemm's `_weight_int4pack_mm`), FP8 per channel
(compressed-tensors float-quantized: `torch._scaled_mm`, activations scaled per token on the device) and FP8
128x128 blocks (fine-grained fp8: dequantized per call). Each runs in CUDA graphs with FlashInfer beside a float
engine on the reference dequantization of the same weights (tests/quant_reference.py): prefill logprobs agree
in argmax at >= 97% of positions, and greedy decode in graphs gives the float engine's tokens on 3 of 4 prompts
or more (FP8 activations round each input to 3 mantissa bits; the margins carry that).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import require_flashinfer
from tests.hf_parity_models import GPU_D64, build_model, free_memory, random_prompts
from tests.quant_reference import reference_checkpoint

CASES = {  # (format, bits, group, symmetric) -> the kernel its linears run
    "ct-w4-group128": (("pack-quantized", 4, 128, True), "int4_groups_cuda"),
    "gptq-w4-asym": (("gptq", 4, 128, False), "int4_groups_cuda"),
    "ct-fp8-channel": (("float-quantized", 8, None, True), "fp8_rows_cuda"),
    "fp8-block": (("fp8-block", 8, None, True), "dequantize"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("quant_src") / "d64"), GPU_D64, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.extended
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_quantized_graphs_match_the_dequantized_float_model(source, tmp_path, case, record_testsuite_property):
    pytest.importorskip("compressed_tensors")  # carried as a wheel by gpu_check (profiling/gpu_wheels.txt)
    from graphdecode import LLM, SamplingParams
    from graphdecode.models.quant.rtn import quantize_checkpoint

    require_flashinfer(GPU_D64.head_dim, torch.bfloat16)
    (fmt, bits, group, symmetric), kernel = CASES[case]
    qdir = quantize_checkpoint(source, str(tmp_path / "q"), fmt, bits, group, symmetric)
    fdir = reference_checkpoint(source, qdir, str(tmp_path / "f"))
    common = dict(page_size=16, max_model_len=256, seed=0, device="cuda", max_batch_size=8, num_decode_steps=4,
                  attention_backend="flashinfer", cuda_graphs=True, compile=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([8, 30, 60, 90], GPU_D64.vocab_size, seed=21)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)

    def run(path: str, check_kernel: bool):
        llm = LLM(path, **common)
        if check_kernel:
            linear = llm.engine.runner.model.model.layers[0].mlp.gate_up_proj.packed
            assert linear.kernel == kernel
        outs = llm.generate(prompts, params)
        assert llm.stats()["graphs_captured"] > 0
        del llm
        free_memory()
        return outs

    got, want = run(qdir, True), run(fdir, False)
    agree = total = 0
    for g, w in zip(got, want):
        for j in range(1, len(g.prompt_token_ids)):
            agree += int(_argmax(g.prompt_logprobs[j]) == _argmax(w.prompt_logprobs[j]))
            total += 1
    same = sum(g.outputs[0].token_ids == w.outputs[0].token_ids for g, w in zip(got, want))
    record_testsuite_property(f"{case}.prefill_argmax_agreement", round(agree / total, 4))
    record_testsuite_property(f"{case}.same_greedy_prompts", same)
    assert agree / total >= 0.97
    assert same >= 3


def _argmax(entry: dict) -> int:
    return next(t for t, e in entry.items() if e.rank == 1)


@pytest.mark.gpu
@pytest.mark.extended
def test_gpu_fp8_kv_cache_in_graphs_gives_the_bf16_caches_tokens(source, record_testsuite_property):
    """kv_cache_dtype="fp8" with FlashInfer in CUDA graphs: its FP8-KV kernel where the kit or JIT has it, else
    the torch reference on the same FP8 cache (one warning); either way the bf16 cache's greedy tokens on 3 of 4
    prompts or more, and the pool holds 2x the pages at the same bytes."""
    from graphdecode import LLM, SamplingParams
    from graphdecode.attention.kv_cache import FP8

    require_flashinfer(GPU_D64.head_dim, torch.bfloat16)
    common = dict(page_size=16, max_model_len=256, seed=0, device="cuda", max_batch_size=8, num_decode_steps=4,
                  attention_backend="flashinfer", cuda_graphs=True, compile=False, kv_cache_memory_bytes=64 << 20)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([8, 30, 60, 90], GPU_D64.vocab_size, seed=22)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, pages = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(source, kv_cache_dtype=kv, **common)
        runner = llm.engine.runner
        if kv == "fp8":
            assert runner.kv_caches[0].dtype == FP8
            record_testsuite_property("fp8_kv.flashinfer_kernel", runner.backend.reference is None)
        outs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        pages[kv] = llm.config.num_pages
        assert llm.stats()["graphs_captured"] > 0
        del llm, runner
        free_memory()
    same = sum(a == b for a, b in zip(outs["auto"], outs["fp8"]))
    record_testsuite_property("fp8_kv.same_greedy_prompts", same)
    assert pages["fp8"] == 2 * pages["auto"]
    assert same >= 3


@pytest.mark.gpu
@pytest.mark.extended
def test_gpu_mxfp4_experts_in_graphs_give_the_float_checkpoints_tokens(tmp_path_factory):
    """gpt-oss's MXFP4 experts kept in 4 bits, dequantized inside the captured windows (the routed experts at
    decode, every expert for a prefill), bf16: the tokens of the same weights stored as floats."""
    from graphdecode import LLM, SamplingParams
    from tests.unit.test_mxfp4 import checkpoints as build

    float_dir, mxfp4_dir, _ = build.__wrapped__(tmp_path_factory)
    common = dict(device="cuda", dtype="bfloat16", cuda_graphs=True, compile=False, max_model_len=256,
                  max_batch_size=4, num_decode_steps=4)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 40, 70], 512, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got, want = ([o.outputs[0].token_ids for o in LLM(d, **common).generate(prompts, params)]
                 for d in (mxfp4_dir, float_dir))
    assert list(got) == list(want)
