"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their expert weights.

Each block of 32 consecutive values along the last (input) dim shares one scale byte E
(the power of two 2**(E - 127)); each value is an FP4 E2M1 code, two to a byte, the low
nibble first. A tensor [..., N] is stored as `_blocks` uint8 [..., N/32, 16] and `_scales`
uint8 [..., N/32]. gpt-oss stores its experts' weights this way as [E, out, in], which
`dequantize` turns back into [E, out, in] floats (the loader transposes to the layout the
unquantized checkpoint has).

The engine keeps the experts in this form (moe.Experts.hold_mxfp4: 4.25 bits a weight) and
dequantises them inside each MoE call into the compute dtype: every FP4 value times a power
of two is exact in bfloat16 and float32 (float16 can overflow: the loader checks the scales).
Where a tensor-parallel rank's slice is no whole number of 32-blocks, that rank dequantises
at load instead.
"""

from __future__ import annotations

import torch

# E2M1 codes 0..15: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               lut: torch.Tensor | None = None) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in dtype. lut: FP4_VALUES as a float32
    tensor on the blocks' device (`fp4_table`), so that a call inside a CUDA graph copies nothing from the host."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    lut = fp4_table(blocks.device) if lut is None else lut
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, ...
    exponent = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponent[..., None]).flatten(-2).to(dtype)


def fp4_table(device) -> torch.Tensor:
    """The 16 E2M1 values, float32, on `device`."""
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)


def quantize(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N] (N a multiple of 32) -> (blocks, scales), rounding each value to the nearest FP4 code of
    its block's scale (the largest magnitude maps to at most 6). For building test checkpoints and
    tools; dequantize(quantize(w)) is w wherever w already is MXFP4-representable."""
    if weights.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4: the last dim ({weights.shape[-1]}) must be a multiple of {BLOCK}")
    w = weights.float().reshape(*weights.shape[:-1], -1, BLOCK)
    peak = w.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-SCALE_BIAS, 127)  # peak / 2**e <= 6
    scaled = w / torch.exp2(exponent)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # nearest code (ties: the lower)
    codes = codes.view(*codes.shape[:-1], BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    scales = (exponent[..., 0] + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
