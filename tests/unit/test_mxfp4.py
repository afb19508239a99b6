"""MXFP4 expert weights (gpt-oss): `mxfp4.dequantize` is transformers' own dequantiser bit for bit;
`quantize` round-trips representable tensors exactly and rounds any other to the nearest FP4 value of its
block's scale; an MXFP4 checkpoint decodes the same greedy tokens as the float checkpoint holding the same
(representable) weights, in this engine and in transformers, with identical expert weights after load;
a missing or misshapen `_blocks` / `_scales` tensor is a ValueError naming it before any weight is read."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphdecode import LLM, SamplingParams
from graphdecode.models import mxfp4
from tests.helpers import SMALL_ENGINE, edit_tensors, generate_tokens, hf_greedy, random_prompts, remove_tensor

FP4 = torch.tensor(mxfp4.FP4_VALUES, dtype=torch.float32)
# the FP4 E2M1 magnitudes' spacing: 0.5 below 2, 1 below 4, 2 up to 6
FP4_GAPS = ((2.0, 0.5), (4.0, 1.0), (float("inf"), 2.0))
# what the Hub's gpt-oss configs (and transformers' convert_gpt_oss_weights_to_hf) write
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
}
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # [E, H, 2I] and [E, I, H]: [E, in, out], quantized along in
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
ENGINE = dict(SMALL_ENGINE, page_size=16, max_batch_size=4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


# ------------------------------------------------------------------------------ dequantize
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_transformers_bit_for_bit(dtype):
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 6, 16), generator=g, dtype=torch.uint8)  # [E, out, in / 32, 16]
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles, -0.0 included
    scales = torch.randint(120, 135, (3, 40, 6), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    theirs = _convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype).transpose(1, 2)  # [E, out, in]
    assert ours.dtype == dtype and ours.shape == (3, 40, 6 * 32) == theirs.shape
    assert torch.equal(_bits(ours), _bits(theirs.contiguous()))


def test_dequantize_reads_the_low_nibble_first_and_scale_as_a_power_of_two():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21  # low nibble 1 (0.5), high nibble 2 (1.0)
    blocks[0, 1] = 0xF7  # 7 (6.0), 15 (-6.0)
    out = mxfp4.dequantize(blocks, torch.tensor([129], dtype=torch.uint8), torch.float32)  # times 2**2
    assert out.shape == (32,)
    assert out[:4].tolist() == [2.0, 4.0, 24.0, -24.0] and not out[4:].any()


# ------------------------------------------------------------------------------ quantize
def _representable(shape, low: int, high: int, seed: int) -> torch.Tensor:
    """FP4 values times 2**e, e random per 32-value block (in low..high). Of each row's first four blocks,
    one is all zeros and three peak below 6 times their 2**e (at 0.5, 1.5 and 3: quantize picks a smaller
    scale for them, which holds the same values)."""
    g = torch.Generator().manual_seed(seed)
    values = FP4[torch.randint(0, 16, shape, generator=g)].view(*shape[:-1], -1, 32)
    for block, peak in enumerate((0.0, 0.5, 1.5, 3.0)[:values.shape[-2]]):
        values[..., block, :] = values[..., block, :].clamp(-peak, peak)
    exps = torch.randint(low, high + 1, (*values.shape[:-1], 1), generator=g)
    return (values * torch.exp2(exps.float())).reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trips_representable_tensors(dtype):
    w = _representable((3, 24, 192), -30, 30, seed=1).to(dtype)
    blocks, scales = mxfp4.quantize(w)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (3, 24, 6, 16) and scales.shape == (3, 24, 6)
    assert blocks.is_contiguous() and scales.is_contiguous()
    out = mxfp4.dequantize(blocks, scales, dtype)
    assert torch.equal(out, w)  # (value equality: -0.0 may come back as 0.0)
    # a 1-d tensor, and a tensor of one block
    for v in (w[0, 0], w[0, 0, 32:64]):
        assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(v), dtype), v)


def test_quantize_rounds_to_the_nearest_fp4_value_of_the_block_scale():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 16, 96, generator=g) * torch.exp2(torch.randint(-12, 8, (5, 16, 1), generator=g).float())
    w[0, 0, 40] = 1e6  # one block with an outlier
    blocks, scales = mxfp4.quantize(w)
    out = mxfp4.dequantize(blocks, scales, torch.float32)
    step = torch.exp2(scales.float() - mxfp4.SCALE_BIAS).repeat_interleave(32, -1)  # each value's block scale
    scaled = w.abs() / step
    peaks = scaled.view(5, 16, 3, 32).amax(-1)
    assert (peaks <= 6).all() and (peaks > 3).all()  # the smallest scale that holds the block's peak
    err = (out - w).abs()
    gap = torch.full_like(w, FP4_GAPS[-1][1])
    for bound, spacing in reversed(FP4_GAPS[:-1]):
        gap = torch.where(scaled < bound, spacing, gap)
    assert (err <= gap / 2 * step).all()  # within half an FP4 step of its block's scale
    nearest = (FP4[:, None, None, None] * step - w).abs().amin(0)
    assert torch.equal(err, nearest)  # and no other FP4 value of that scale is nearer


@pytest.mark.parametrize("call,fragment", [
    (lambda: mxfp4.quantize(torch.ones(4, 33)), "multiple of 32"),
    (lambda: mxfp4.quantize(torch.ones(4, 16)), "multiple of 32"),
    (lambda: mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8),
                              torch.float32), "do not match"),
    (lambda: mxfp4.dequantize(torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8),
                              torch.float32), "do not match"),
    (lambda: mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, 1, dtype=torch.uint8),
                              torch.float32), "do not match"),
    (lambda: mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.uint8),
                              torch.float32), "uint8"),
    (lambda: mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.int32),
                              torch.float32), "uint8"),
    (lambda: mxfp4.dequantize(torch.zeros(2, 3, 16), torch.zeros(2, 3), torch.float32), "uint8"),
], ids=["last-dim-33", "last-dim-16", "scales-groups", "blocks-half-width", "scales-extra-dim", "int8-blocks",
        "int32-scales", "float-blocks"])
def test_bad_inputs_are_value_errors(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


# ------------------------------------------------------------------------------ checkpoints
def _write(path: str, tensors: dict, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny gpt-oss with MXFP4-representable expert weights: (float dir, MXFP4 dir, the float tensors).

    Each expert weight's 32-value blocks along `in` are scaled by 2**k (k in -3..2, per block) so the
    scales differ block to block, then quantized and dequantized; the expert biases are made non-zero.
    The float copy holds those weights as F32, the MXFP4 copy their `_blocks` / `_scales` ([E, out, in])."""
    import transformers

    from graphdecode.default_model import save_random_model

    root = tmp_path_factory.mktemp("mxfp4")
    config = transformers.GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        max_position_embeddings=1024, initializer_range=0.1, eos_token_id=2, bos_token_id=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    base = str(root / "random")
    save_random_model(base, config, seed=1234)
    tensors = load_file(os.path.join(base, "model.safetensors"))
    with open(os.path.join(base, "config.json")) as f:
        raw = json.load(f)

    g = torch.Generator().manual_seed(7)
    plain, packed = {}, {}
    for key, value in tensors.items():
        if key.endswith(tuple(f".experts.{name}" for name in EXPERT_WEIGHTS)):
            w = value.transpose(1, 2)  # [E, out, in]
            factors = torch.exp2(torch.randint(-3, 3, (*w.shape[:-1], w.shape[-1] // 32, 1), generator=g).float())
            w = (w.reshape(*w.shape[:-1], -1, 32) * factors).reshape(w.shape)
            blocks, scales = mxfp4.quantize(w)
            plain[key] = mxfp4.dequantize(blocks, scales, torch.float32).transpose(1, 2).contiguous()
            packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
            assert len(scales.unique()) >= 4
            continue
        if key.endswith("_proj_bias") and ".experts." in key:
            value = torch.randn(value.shape, generator=g) * 0.1
        plain[key] = packed[key] = value
    float_dir = _write(str(root / "float"), plain, raw)
    mxfp4_dir = _write(str(root / "mxfp4"), packed, dict(raw, quantization_config=QUANTIZATION_CONFIG))
    for d in (float_dir, mxfp4_dir):
        shutil.copy(os.path.join(base, "generation_config.json"), d)
    return float_dir, mxfp4_dir, plain


def _experts(llm: LLM, layer: int):
    return llm.engine.runner.model.model.layers[layer].mlp.experts


def test_mxfp4_checkpoint_decodes_as_the_float_one_and_as_transformers(checkpoints):
    float_dir, mxfp4_dir, _ = checkpoints
    prompts = random_prompts(4, [3, 17, 40, 70], seed=3)  # past the 16-token window and YaRN's 64 positions
    expected = hf_greedy(float_dir, prompts, MAX_NEW)
    assert len({tuple(t) for t in expected}) == len(prompts)  # not a degenerate model
    assert generate_tokens(LLM(float_dir, **ENGINE), prompts, GREEDY) == expected
    assert generate_tokens(LLM(mxfp4_dir, **ENGINE), prompts, GREEDY) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_experts_load_the_float_checkpoints_weights(checkpoints, dtype):
    """The experts stay MXFP4 (uint8 blocks and scales, 4.25 bits a weight; no float weight), and dequantize to
    exactly the float checkpoint's weights in the engine's layout."""
    float_dir, mxfp4_dir, plain = checkpoints
    ours, reference = LLM(mxfp4_dir, **ENGINE, dtype=dtype), LLM(float_dir, **ENGINE, dtype=dtype)
    for layer in range(2):
        got, want = _experts(ours, layer), _experts(reference, layer)
        assert got.mxfp4 and not want.mxfp4
        assert got.gate_up_proj.numel() == 0 and got.down_proj.numel() == 0
        packed = sum(getattr(got, f"{n}_{part}").numel() for n in ("gate_up", "down") for part in ("blocks", "scales"))
        assert packed * 32 == (want.gate_up_proj.numel() + want.down_proj.numel()) * 17  # 4.25 bits a weight
        gate_up, down = got.dequantized(getattr(torch, dtype))
        assert torch.equal(gate_up, want.gate_up_proj) and torch.equal(down, want.down_proj), layer
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == getattr(torch, dtype) and torch.equal(a, b), (layer, name)
        # the engine's layout: [E, 2I, H] gate rows then up rows (the checkpoint interleaves them), [E, H, I]
        prefix = f"model.layers.{layer}.mlp.experts."
        interleaved = plain[prefix + "gate_up_proj"].transpose(1, 2)  # [E, 2I, H]
        assert torch.equal(gate_up.float(), torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1))
        assert torch.equal(down.float(), plain[prefix + "down_proj"].transpose(1, 2))
        bias = plain[prefix + "gate_up_proj_bias"].to(getattr(torch, dtype)).float()
        assert torch.equal(got.gate_up_proj_bias.float(), torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))


def test_mxfp4_decode_dequantizes_only_the_routed_experts(checkpoints, monkeypatch):
    """One sequence's decode step routes 2 of the 4 experts: only those dequantize (one batched matmul per
    projection); a prefill dequantizes each expert once. Both give the float checkpoint's tokens, also in the
    CPU twin of CUDA graphs."""
    from graphdecode.models import moe

    float_dir, mxfp4_dir, _ = checkpoints
    dequantized = []
    real = moe.Experts.dequantized
    monkeypatch.setattr(moe.Experts, "dequantized", lambda self, dtype, experts=None: dequantized.append(
        None if experts is None else experts.numel()) or real(self, dtype, experts))
    prompts = random_prompts(1, [40], seed=5)
    want = generate_tokens(LLM(float_dir, **ENGINE), prompts, GREEDY)
    assert generate_tokens(LLM(mxfp4_dir, **ENGINE), prompts, GREEDY) == want
    assert None in dequantized and 2 in dequantized  # the prefill's every expert, the decode steps' 2 routed
    assert generate_tokens(LLM(mxfp4_dir, **ENGINE, cuda_graphs=True), prompts, GREEDY) == want


def test_transformers_dequantizes_the_mxfp4_checkpoint_to_the_same_weights(checkpoints):
    """transformers loads an MXFP4 checkpoint on CPU by dequantizing it (no triton kernels here; asking for
    dequantize=True makes that so on any machine): its expert weights are ours, the float copy's."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    _, mxfp4_dir, plain = checkpoints
    model = AutoModelForCausalLM.from_pretrained(mxfp4_dir, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    state = model.state_dict()
    expert_keys = [k for k in plain if ".experts." in k]
    assert len(expert_keys) == 8
    for key in expert_keys:
        assert state[key].dtype == torch.float32 and torch.equal(state[key], plain[key]), key


# ------------------------------------------------------------------------------ errors
def _replace(key, shape, dtype=torch.uint8):
    return lambda t: t.__setitem__(key, torch.zeros(shape, dtype=dtype))


L0 = "model.layers.0.mlp.experts."
L1 = "model.layers.1.mlp.experts."
BAD_MXFP4 = [
    (remove_tensor(L0 + "gate_up_proj_scales"), [f"'{L0}gate_up_proj_scales'", "missing"]),
    (remove_tensor(L1 + "down_proj_scales"), [f"'{L1}down_proj_scales'", "missing"]),
    (remove_tensor(L1 + "down_proj_blocks"), [f"'{L1}down_proj_blocks'", "missing"]),
    (_replace(L0 + "gate_up_proj_blocks", (4, 128, 2, 8)), [f"'{L0}gate_up_proj_blocks'", "(4, 128, 2, 8)",
                                                            "expected (4, 128, 2, 16)"]),
    (_replace(L1 + "down_proj_blocks", (4, 64, 4, 16)), [f"'{L1}down_proj_blocks'", "expected (4, 64, 2, 16)"]),
    (_replace(L0 + "down_proj_scales", (4, 64, 3)), [f"'{L0}down_proj_scales'", "expected (4, 64, 2)"]),
    (_replace(L0 + "gate_up_proj_blocks", (4, 128, 2, 16), torch.float32), [f"'{L0}gate_up_proj_blocks'", "F32",
                                                                            "U8"]),
]


@pytest.mark.parametrize("edit,fragments", BAD_MXFP4, ids=["no-gate-up-scales", "no-down-scales", "no-down-blocks",
                                                           "gate-up-blocks-shape", "down-blocks-shape",
                                                           "down-scales-shape", "float-blocks"])
def test_bad_mxfp4_tensors_are_named_before_any_weight_is_read(checkpoints, tmp_path, monkeypatch, edit, fragments):
    _, mxfp4_dir, _ = checkpoints
    model_dir = str(tmp_path / "broken")
    shutil.copytree(mxfp4_dir, model_dir)
    weights = os.path.join(model_dir, "model.safetensors")
    edit_tensors(model_dir, edit)

    def not_yet(*args, **kwargs):
        raise AssertionError("weights were read before the checkpoint headers were checked")

    monkeypatch.setattr(torch.nn.Module, "to_empty", not_yet)
    monkeypatch.setattr(mxfp4, "dequantize", not_yet)
    with pytest.raises(Exception) as info:
        LLM(model_dir, **ENGINE)
    assert type(info.value) is ValueError, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert weights in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_mxfp4_experts_count_as_4_bits_in_the_pool_budget(checkpoints):
    """EngineConfig sizes the KV pool after the weights: MXFP4 experts count 17 bytes per 32 weights."""
    from graphdecode.config import model_weight_bytes
    from graphdecode.models.model_config import load_model_config

    float_dir, mxfp4_dir, _ = checkpoints
    plain, packed = load_model_config(float_dir), load_model_config(mxfp4_dir)
    experts = 2 * 4 * 3 * 64 * 64  # layers x experts x (gate, up, down) x hidden x intermediate
    assert model_weight_bytes(plain, torch.bfloat16) - model_weight_bytes(packed, torch.bfloat16) == \
        experts * 2 - experts * 17 // 32


def test_mxfp4_scales_beyond_float16_are_refused_for_float16(checkpoints, tmp_path):
    _, mxfp4_dir, _ = checkpoints
    model_dir = str(tmp_path / "loud")
    shutil.copytree(mxfp4_dir, model_dir)
    edit_tensors(model_dir, lambda t: t[L1 + "down_proj_scales"].view(-1)[5].fill_(127 + 14))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts: MXFP4 expert weights reach 6 x 2\*\*14, "
                                         r"beyond float16"):
        LLM(model_dir, **ENGINE, dtype="float16")
