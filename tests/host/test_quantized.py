"""Quantized checkpoints (graphdecode/models/quant): every format written from a float model (by the
compressed-tensors library where it writes them, by hand after the published layouts otherwise), dequantized
bit for bit like the reference, run quantized by the engine like its dequantized float weights, split over
two ranks, and refused clearly where malformed or unsupported."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from graphdecode import LLM, SamplingParams
from graphdecode.models.loader import load_model
from graphdecode.models.model_config import load_model_config, parse_model_config
from graphdecode.models.quant import formats
from graphdecode.models.quant.config import parse_quant_config
from graphdecode.models.quant.linear import QuantizedWeight
from graphdecode.models.quant.rtn import quantize_checkpoint
from graphdecode.models.quant.tensor import QuantizedTensor
from tests.helpers import SMALL_ENGINE, edit_tensors, random_prompts, rewrite_config
from tests.quant_reference import checkpoint_modules, reference, reference_checkpoint

SOURCE = "llama_gqa_llama3"  # hidden 64, intermediate 128: groups of 32 divide every width
# (format, bits, group, symmetric, act_order)
CASES = {
    "ct-w4-group": ("pack-quantized", 4, 32, True, False),
    "ct-w4-group-asym": ("pack-quantized", 4, 32, False, False),
    "ct-w8-channel": ("pack-quantized", 8, None, True, False),
    "ct-int8-asym": ("int-quantized", 8, None, False, False),
    "ct-int8-group": ("int-quantized", 8, 32, True, False),
    "ct-fp8-channel": ("float-quantized", 8, None, True, False),
    "fp8-block": ("fp8-block", 8, None, True, False),
    "gptq-w4": ("gptq", 4, 32, True, False),
    "gptq-w4-desc-act": ("gptq", 4, 32, False, True),
    "gptq-w8": ("gptq", 8, 32, True, False),
    "awq-w4": ("awq", 4, 32, False, False),
}
KERNELS = {  # the torch kernel each case runs on without the CPU kernel library
    "ct-w4-group": "int4_groups", "ct-w4-group-asym": "int4_groups", "ct-w8-channel": "int8_rows",
    "ct-int8-asym": "int8_rows", "ct-int8-group": "dequantize", "ct-fp8-channel": "dequantize",
    "fp8-block": "dequantize", "gptq-w4": "int4_groups", "gptq-w4-desc-act": "int4_groups",
    "gptq-w8": "dequantize", "awq-w4": "int4_groups",
}


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    """case -> (its quantized directory, a float directory holding the reference dequantization)."""
    root = tmp_path_factory.mktemp("quantized")
    src = tiny_models[SOURCE]
    out = {}
    for case, (fmt, bits, group, symmetric, act_order) in CASES.items():
        qdir = quantize_checkpoint(src, str(root / case), fmt, bits, group, symmetric, act_order)
        out[case] = (qdir, reference_checkpoint(src, qdir, str(root / f"{case}-float")))
    return out


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", list(CASES))
def test_dequantized_weights_equal_the_reference_bit_for_bit(quantized, case):
    qdir, _ = quantized[case]
    cfg = load_model_config(qdir)
    with open(os.path.join(qdir, "config.json")) as f:
        config = json.load(f)
    modules = checkpoint_modules(qdir)
    checked = 0
    for module, tensors in modules.items():
        scheme = cfg.weight_quant.scheme_for(module)
        if not any(part in tensors for part in ("weight_scale", "scales", "weight_scale_inv")):
            continue  # not a quantized linear
        want = reference(tensors, config)
        n, k = want.shape
        qt = formats.read(scheme, tensors, module, n, k, qdir)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(qt.dequantize(dtype), want.to(dtype)), (module, dtype)
        checked += 1
    assert checked == 14  # 7 linears x 2 layers


@pytest.mark.parametrize("case", list(CASES))
def test_packed_kernels_equal_a_float_matmul_of_the_dequantized_weights(quantized, case):
    """The CPU's panels (what the engine runs), the torch kernel it runs without the CPU kernel library, and the
    per-call dequantization, each against a float32 matmul of the reference dequantization."""
    qdir, _ = quantized[case]
    cfg = load_model_config(qdir)
    with open(os.path.join(qdir, "config.json")) as f:
        config = json.load(f)
    modules = checkpoint_modules(qdir)
    parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(qdir, cfg, dtype, torch.device("cpu"), 64)
        linears = [(n, m) for n, m in model.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj",
                                                                            "down_proj"))]
        assert len(linears) == 8
        for name, linear in linears:
            assert isinstance(linear.packed, QuantizedWeight) and linear.packed.kernel == "panels"
            assert linear.weight.numel() == 0  # no float copy
            parent, own = name.rsplit(".", 1)
            shards = [f"{parent}.{p}" for p in parts.get(own, [own])]
            dense = torch.cat([reference(modules[m], config) for m in shards])
            qt = QuantizedTensor.cat([formats.read(cfg.weight_quant.scheme_for(m), modules[m], m,
                                                   *reference(modules[m], config).shape, qdir) for m in shards], name)
            for kernel in ("panels", KERNELS[case], "dequantize"):
                weight = linear.packed if kernel == "panels" else QuantizedWeight(qt, dtype, torch.device("cpu"),
                                                                                  kernel)
                for rows in (1, 5, 70):
                    x = torch.randn(rows, weight.in_features).to(dtype)
                    want = F.linear(x.float(), dense.float())
                    got = weight(x).float()
                    # torch's int kernels take bf16 activations (W8A16 / W4A16); the panels and the dequantization
                    # sum float32 products of the exact weights (the reference rounds them to the scale's dtype)
                    bound = (x.float().abs() @ dense.float().abs().t()).amax()
                    # (the vnni panels quantize the activations to int8 per 32 columns: bf16's tolerance)
                    exact = kernel == "dequantize" or (kernel == "panels" and not weight.kind.endswith("vnni"))
                    tolerance = {"panels": 2e-3, "dequantize": 1e-5}[kernel] if exact and dtype == torch.float32 \
                        else 8e-3
                    assert (got - want).abs().max() <= tolerance * bound, (case, name, kernel, dtype, rows)
                    if kernel == "panels":  # a row's result does not depend on the rows beside it
                        assert torch.equal(weight(x[:1]), weight(x)[:1])


def _int8_activation_reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """x [M, K] quantized as the integer dot products quantize it (per row and 32 columns: a = max|x| / 127 and
    xq = x * (127 / max|x|) rounded to nearest even, in float32), times the dense weights, in float64."""
    blocks = x.float().view(x.shape[0], -1, 32)
    peak = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    xq = torch.round(blocks * inv)
    return ((xq * (peak / 127.0)).view(x.shape).double() @ dense.double().t())


@pytest.mark.parametrize("bits, group, zero", [(8, None, False), (8, 32, True), (4, 32, False), (4, 64, True),
                                               (4, 96, False)])
def test_integer_dot_product_panels_are_their_quantized_arithmetic(bits, group, zero):
    """The vnni kinds (csrc/cpu_qlinear.cpp) equal the float64 product of the int8-quantized activations and the
    exact weights to float32 rounding, for float32 and bf16 inputs, with and without zero points, any number of
    rows (a row's result alone, on AMX's int8 tiles or not); the float-activation panels of the same weight stay
    within that quantization."""
    from graphdecode.kernels.cpu import cpu_kernels

    if cpu_kernels() is None or not cpu_kernels().vnni:
        pytest.skip("the integer dot products need the kernel library on a CPU with AVX-512 VNNI")
    g = torch.Generator().manual_seed(bits * 100 + (group or 0))
    n, k = 200, 576
    groups = 1 if group is None else k // group
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)
    values = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
    scale = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(-3, 4, (n, groups), generator=g).to(torch.int8) if zero else None
    qt = QuantizedTensor(values, scale, zeros, group or k, bits)
    dense = qt.dequantize(torch.float32)
    vnni = QuantizedWeight(qt, torch.float32, torch.device("cpu"), "panels")
    plain = QuantizedWeight(qt, torch.float32, torch.device("cpu"), "panels", kind=f"int{bits}")
    assert vnni.kind == f"int{bits}_vnni" and plain.kind == f"int{bits}"
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 3, 7, 12, 24, 70):  # 12, 24, 70: AMX's int8 tiles where the CPU has them, vnni for the rest
            x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(dtype)
            x[0, :32] = 0  # an all-zero block: scale 0
            got = vnni(x).double()
            want = _int8_activation_reference(x, dense)
            bound = (x.double().abs() @ dense.double().abs().t()).amax()
            rounding = 1e-6 if dtype == torch.float32 else 8e-3  # bf16 results are rounded to bf16
            assert (got - want).abs().max() <= rounding * bound, (dtype, rows)
            assert (got - F.linear(x.double(), dense.double())).abs().max() <= 8e-3 * bound
            assert (plain(x).double() - got).abs().max() <= 8e-3 * bound
            whole = vnni(x)
            for i in {0, rows // 2, rows - 1}:  # a row's bits alone, whichever kernel ran it in the batch
                assert torch.equal(vnni(x[i:i + 1]), whole[i:i + 1]), (dtype, rows, i)


@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("case", list(CASES))
def test_engine_runs_each_format_like_its_dequantized_float_weights(quantized, case, activations, monkeypatch):
    """Teacher-forced logprobs of the quantized engine against the float engine on the reference dequantization:
    the panels with float activations and the dequantize kernels agree to float32 rounding, the bf16-activation
    int kernels to their rounding, greedy tokens alike; the panels' integer dot products (activations quantized
    to int8 per 32 columns, the default on a CPU with AVX-512 VNNI) to that quantization's error (these tiny
    random models' activations are heavy-tailed: SmolLM2's perplexity moves 0.1%, BENCHMARKS.md section 19)."""
    from graphdecode.kernels.cpu import cpu_kernels
    from graphdecode.models.quant import linear

    if activations == "int8" and (cpu_kernels() is None or not cpu_kernels().vnni or CASES[case][0] == "float-quantized"
                                  or case == "fp8-block"):
        pytest.skip("int8 activations: int weights on a CPU with AVX-512 VNNI")
    monkeypatch.setenv(linear.INT8_ACTIVATIONS_ENV, "1" if activations == "int8" else "0")
    qdir, fdir = quantized[case]
    prompt = random_prompts(1, [40], seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)
    with LLM(qdir, **SMALL_ENGINE) as q, LLM(fdir, **SMALL_ENGINE) as f:
        (got,), (want,) = q.generate({"prompt_token_ids": prompt}, params), f.generate(
            {"prompt_token_ids": prompt}, params)
    gaps = [abs(got.prompt_logprobs[j][t].logprob - want.prompt_logprobs[j][t].logprob)
            for j, t in enumerate(prompt) if j > 0]
    if activations == "int8":
        assert 0 < max(gaps) < 0.1, (case, max(gaps))
        return
    assert max(gaps) < 2e-3, (case, max(gaps))  # float32 sums of the exact weights; the reference rounds them
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("case", ["ct-w4-group-asym", "ct-int8-asym", "ct-fp8-channel", "gptq-w4-desc-act"])
def test_decode_steps_in_one_call_give_the_eager_forwards_tokens(quantized, case):
    """Quantized panels in the one-call decode layers (csrc/cpu_layers.cpp) where the input order is the
    checkpoint's (an act-order weight gathers its input: the eager forward runs it)."""
    qdir, _ = quantized[case]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [20, 9, 33], seed=7)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    with LLM(qdir, **SMALL_ENGINE) as llm:
        model = llm.engine.runner.model
        assert (model.cpu_decode is not None) == (case != "gptq-w4-desc-act")
        one_call = llm.generate(prompts, params)
        model.cpu_decode = None
        eager = llm.generate(prompts, params)
    for a, b in zip(one_call, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


@pytest.mark.parametrize("fmt, bits, group", [("pack-quantized", 4, 32), ("float-quantized", 8, None)])
def test_a_quantized_head_untied_from_its_embedding(tiny_models, tmp_path, fmt, bits, group, monkeypatch):
    """quantize_head writes a tied model's head as its own quantized lm_head (a name-targeted config group, which
    takes precedence over "Linear"): the engine runs it on the head's panels like the float lm_head (float
    activations: the comparison is exact)."""
    from graphdecode.models.quant import linear

    monkeypatch.setenv(linear.INT8_ACTIVATIONS_ENV, "0")
    src = tiny_models["qwen2_tied"]
    qdir = quantize_checkpoint(src, str(tmp_path / "q"), fmt, bits, group, quantize_head=True)
    fdir = reference_checkpoint(src, qdir, str(tmp_path / "f"))
    cfg = load_model_config(qdir)
    assert not cfg.tie_word_embeddings and cfg.weight_quant.scheme_for("lm_head").bits == 8
    assert cfg.weight_quant.scheme_for("model.layers.0.mlp.up_proj").bits == bits
    prompt = random_prompts(1, [30], seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)
    with LLM(qdir, **SMALL_ENGINE) as q, LLM(fdir, **SMALL_ENGINE) as f:
        assert isinstance(q.engine.runner.model.packed_head, QuantizedWeight)
        (got,), (want,) = q.generate({"prompt_token_ids": prompt}, params), f.generate(
            {"prompt_token_ids": prompt}, params)
    gaps = [abs(got.prompt_logprobs[j][t].logprob - want.prompt_logprobs[j][t].logprob)
            for j, t in enumerate(prompt) if j > 0]
    assert max(gaps) < 2e-3 and got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("case, compile", [("ct-w4-group-asym", False), ("gptq-w4-desc-act", False),
                                           ("ct-fp8-channel", True)])
def test_graph_twin_bounds_and_compiled_windows_give_the_plain_tokens(quantized, case, compile):
    """Quantized linears inside the CPU twin of CUDA graphs (captured windows, the first replay refusing host
    copies), in the bounds-checked mode, with a tight pool (preemption) and, for one case, a compiled window (the
    weights through the opaque packed_linear op): the tokens of the plain engine."""
    qdir, _ = quantized[case]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, [20, 9, 33, 50, 3, 41], seed=9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tight = dict(SMALL_ENGINE, max_model_len=96, num_pages=12, page_size=16)
    want = [o.outputs[0].token_ids for o in LLM(qdir, **tight).generate(prompts, params)]
    llm = LLM(qdir, cuda_graphs=True, check_bounds=True, compile=compile, **tight,
              **(dict(buckets=[8]) if compile else {}))  # compiled: one bucket, one compile
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats()["preemptions"] > 0 and llm.stats()["graphs_captured"] > 0


def test_quantized_weights_are_smaller(quantized):
    sizes = {}
    for case in ("ct-w4-group", "ct-w8-channel"):
        model = load_model(quantized[case][0], load_model_config(quantized[case][0]), torch.float32,
                           torch.device("cpu"), 64)
        sizes[case] = sum(m.packed.extra_bytes for m in model.modules() if isinstance(getattr(m, "packed", None),
                                                                                      QuantizedWeight))
    floats = 2 * (64 * (64 + 32 + 32) + 64 * 64 + 2 * 128 * 64 + 64 * 128) * 4  # the linears' fp32 bytes
    assert sizes["ct-w8-channel"] < floats / 3.5 and sizes["ct-w4-group"] < floats / 3.5


@pytest.mark.parametrize("case", ["gptq-w4", "ct-w8-channel"])
def test_tp2_shards_quantized_weights_like_tp1(quantized, case):
    """Each rank's rows / input columns of the weights, scales and zero points: TP=2's first-step logprobs are
    TP=1's up to the bf16 rounding of the partial sums, and its token where TP=1's margin exceeds that."""
    qdir, _ = quantized[case]
    prompts = random_prompts(3, [20, 9, 33], seed=5)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=2)
    engine = dict(SMALL_ENGINE, max_batch_size=4)
    with LLM(qdir, **engine) as one, LLM(qdir, tensor_parallel_size=2, **engine) as two:
        single = one.generate([{"prompt_token_ids": p} for p in prompts], params)
        split = two.generate([{"prompt_token_ids": p} for p in prompts], params)
    for a, b in zip(single, split):
        first, second = sorted(a.outputs[0].logprobs[0].values(), key=lambda e: e.rank)[:2]
        top = a.outputs[0].token_ids[0]
        assert abs(a.outputs[0].logprobs[0][top].logprob - b.outputs[0].logprobs[0][top].logprob) < 0.03
        if first.logprob - second.logprob > 0.06:
            assert b.outputs[0].token_ids[0] == top


# ------------------------------------------------------------------------------------ refusals
BASE = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("quant, field", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits: 3 is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version: 'gemv'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size: 100"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "config_groups.g.input_activations"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}}, "config_groups.g.weights.num_bits"),
])
def test_unsupported_schemes_are_refused_by_name(quant, field):
    with pytest.raises(ValueError, match="quantization_config") as e:
        parse_model_config(dict(BASE, quantization_config=quant))
    assert field in str(e.value)


def test_targets_and_ignore_lists():
    config = parse_quant_config("c", {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "ignore": ["lm_head", "re:.*layers\\.1\\..*"], "config_groups": {
        "attn": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}},
        "rest": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                    "group_size": 32}}}})
    assert config.scheme_for("model.layers.0.self_attn.q_proj").bits == 8
    assert config.scheme_for("model.layers.0.mlp.down_proj").bits == 4
    assert config.scheme_for("model.layers.1.mlp.down_proj") is None
    assert config.scheme_for("lm_head") is None


def _malformed(quantized, tmp_path, case: str, edit) -> str:
    import shutil

    path = str(tmp_path / case)
    shutil.copytree(quantized[case][0], path)
    edit_tensors(path, edit)
    return path


@pytest.mark.parametrize("case, edit, message", [
    ("gptq-w4", lambda t: t.pop("model.layers.0.self_attn.k_proj.scales"),
     "'model.layers.0.self_attn.k_proj.scales' is missing"),
    ("ct-w4-group", lambda t: t.update({"model.layers.1.mlp.up_proj.weight_scale":
                                        t["model.layers.1.mlp.up_proj.weight_scale"][:, :1].contiguous()}),
     "'model.layers.1.mlp.up_proj.weight_scale'.*has shape \\(128, 1\\), expected \\(128, 2\\)"),
    ("awq-w4", lambda t: t.update({"model.layers.0.mlp.down_proj.qweight":
                                   t["model.layers.0.mlp.down_proj.qweight"].float()}),
     "'model.layers.0.mlp.down_proj.qweight'.*has dtype F32, expected I32"),
    ("ct-fp8-channel", lambda t: t.update({"model.layers.0.self_attn.o_proj.weight":
                                           t["model.layers.0.self_attn.o_proj.weight"].float()}),
     "'model.layers.0.self_attn.o_proj.weight' \\(float-quantized fp8 per channel\\): has dtype F32, expected F8_E4M3"),
    ("gptq-w4", lambda t: [t.pop(f"model.layers.1.mlp.up_proj.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")]
     + [t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64)})],
     "'model.layers.1.mlp.up_proj.weight' has dtype F32, but quantization_config \\(gptq int4 group 32\\) quantizes"),
    ("ct-fp8-channel", lambda t: t["model.layers.1.mlp.down_proj.weight"].view(torch.uint8)[3, 5].fill_(0xFF),
     "'model.layers.1.mlp.down_proj.weight' holds NaN weights"),
    ("gptq-w4", lambda t: t.update({"model.layers.0.self_attn.q_proj.scales":
                                    t["model.layers.0.self_attn.q_proj.scales"] * float("nan")}),
     "'model.layers.0.self_attn.q_proj.scales' holds NaN"),
])
def test_malformed_checkpoints_name_the_tensor(quantized, tmp_path, case, edit, message):
    path = _malformed(quantized, tmp_path, case, edit)
    with pytest.raises(ValueError, match=message):
        LLM(path, **SMALL_ENGINE)


def test_a_group_size_that_does_not_divide_the_width_is_refused(quantized, tmp_path):
    path = _malformed(quantized, tmp_path, "gptq-w4", lambda t: None)
    rewrite_config(path, lambda raw: raw["quantization_config"].update(group_size=48))
    with pytest.raises(ValueError, match="gptq int4 group 48\\): the group size 48 does not divide the (64|128) input"):
        LLM(path, **SMALL_ENGINE)


def test_activation_ordered_shards_must_share_their_order():
    values = torch.zeros(4, 64, dtype=torch.int8)
    scale = torch.ones(4, 2)
    a = QuantizedTensor(values, scale, None, 32, 4, torch.arange(64))
    b = QuantizedTensor(values, scale, None, 32, 4, torch.arange(64).flip(0))
    with pytest.raises(ValueError, match="quantized differently"):
        QuantizedTensor.cat([a, b], "qkv_proj")
