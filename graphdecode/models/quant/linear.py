"""A quantized linear's weight, run quantized: y = x W^T (+ b) with W held as a QuantizedTensor (tensor.py).

`QuantizedWeight` is a cpu_linear.CpuWeight (a handle for the opaque op a compiled forward calls), built once at
load for its device; `kernel` names what runs:

* `panels` (CPU with the kernel library): int8, int4 or FP8 in column panels of bytes (csrc/cpu_qlinear.cpp),
  float32 or bf16 activations, any group that divides K; also inside the one-call decode layers. On a CPU with
  AVX-512 VNNI, int8 and int4 in groups of whole 32-column blocks take the integer dot products instead
  (`panel_kind`: "int8_vnni" / "int4_vnni"): the activations quantized to int8 per row and 32 columns, as
  llama.cpp's Q8_0 / Q4_0 kernels do (1.6-2.4x the float-activation panels per matmul, section 19);
* without the library, `int8_rows` (CPU): 8-bit integers with one scale per output row, through torch's
  `aten._weight_int8pack_mm` (zero points: minus rowsum(x) * zero * scale);
* `int4_groups` (CPU): 4-bit integers in groups of 32-256, through `aten._weight_int4pack_mm_for_cpu` over
  `_convert_weight_to_int4pack_for_cpu`'s packing; zero points fold into its per-group offsets;
* `int4_groups_cuda` (GPU): `aten._weight_int4pack_mm` (tinygemm) over `_convert_weight_to_int4pack`, bf16;
* `fp8_rows_cuda` (GPU, sm89+): FP8 weights with one scale per row through `torch._scaled_mm`, activations
  scaled per token on the device (no host sync: fits CUDA graphs);
* `dequantize` (everything else: FP8 block scales on the GPU; int8 in groups or FP8 on a CPU without the library):
  the weight is rebuilt in the compute dtype inside each call from its quantized form (memory stays quantized;
  slow).

torch's CPU kernels take 16-bit activations (with float32 ones they are 10-30x slower): where they run, a float32
engine's quantized linears take bfloat16 activations, as the W8A16 / W4A16 schemes name them.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from ...attention.kv_cache import FP8_MAX
from ..cpu_linear import CpuWeight
from .tensor import QuantizedTensor

INT4_GROUPS = (32, 64, 128, 256)


def choose_kernel(qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> str:
    n, k = qt.shape
    if device.type == "cpu":
        from ...kernels.cpu import cpu_kernels

        if cpu_kernels() is not None and dtype in (torch.float32, torch.bfloat16) and (qt.bits == 8 or (
                k % _panel_group(qt) == 0 and _panel_group(qt) % 2 == 0)):
            return "panels"
        if not qt.is_float and qt.bits == 8 and qt.group >= k:
            return "int8_rows"
        if not qt.is_float and qt.bits == 4 and qt.group in INT4_GROUPS and k % qt.group == 0:
            return "int4_groups"
        return "dequantize"
    if device.type == "cuda":
        if (not qt.is_float and qt.bits == 4 and qt.group in INT4_GROUPS and k % qt.group == 0 and n % 8 == 0
                and k % 128 == 0 and dtype == torch.bfloat16):
            return "int4_groups_cuda"
        if (qt.is_float and qt.group >= k and n % 16 == 0 and k % 16 == 0
                and torch.cuda.get_device_capability(device) >= (8, 9)):
            return "fp8_rows_cuda"
    return "dequantize"


PANEL = 64  # output columns per panel (csrc/cpu_qlinear.cpp)


def _panel_group(qt: QuantizedTensor) -> int:
    """The input columns per scale the panels use: the weight's group, or its greatest common divisor with K
    (FP8 128-column blocks of a 576-wide weight: scales repeated per 64 columns, the same products)."""
    k = qt.shape[1]
    return k if qt.group >= k else math.gcd(qt.group, k)


INT8_ACTIVATIONS_ENV = "GRAPHDECODE_INT8_ACTIVATIONS"  # "0": the int panels keep float activations everywhere


def panel_kind(qt: QuantizedTensor, kernels) -> str:
    """The panels' kind for `qt`: FP8, or int8 / int4 with float activations, or (a CPU with AVX-512 VNNI, groups
    of whole 32-column blocks, unless GRAPHDECODE_INT8_ACTIVATIONS=0) int8 / int4 by integer dot products over
    activations quantized per 32 columns."""
    if qt.is_float:
        return "fp8"
    kind = f"int{qt.bits}"
    k = qt.shape[1]
    if kernels.vnni and k % 32 == 0 and _panel_group(qt) % 32 == 0 and os.environ.get(INT8_ACTIVATIONS_ENV) != "0":
        return kind + "_vnni"
    return kind


_UNSIGNED = {"int4": 8, "int8_vnni": 128, "int4_vnni": 8}  # the kinds stored as q + this (unsigned)


def _pack_panels(qt: QuantizedTensor, kind: str):
    """(panels, scales [P, G, 64] float32, offsets likewise or None, group); panels [P, K or K / 2, 64] uint8, or
    for the vnni kinds [P, K / 4 (int4: K / 8), 64, 4] (csrc/cpu_qlinear.cpp's layouts)."""
    n, k = qt.shape
    count = -(-n // PANEL)
    shift = _UNSIGNED.get(kind, 0)
    codes = (qt.values.to(torch.int16) + shift).to(torch.uint8) if shift else qt.values.view(torch.uint8)
    padded = torch.zeros(count * PANEL, k, dtype=torch.uint8)
    padded[:n] = codes
    if kind == "int8_vnni":  # each column's 4 consecutive k side by side
        panels = padded.view(count, PANEL, k // 4, 4).transpose(1, 2)
    elif kind == "int4_vnni":  # k = 8 i + 4 h + j: byte (i, column, j) holds k = 8 i + j low, 8 i + 4 + j high
        pairs = padded.view(count, PANEL, k // 8, 2, 4)
        panels = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).transpose(1, 2)
    else:
        panels = padded.view(count, PANEL, k).transpose(1, 2)
        if kind == "int4":  # two k rows a byte: the even one low
            panels = panels[:, 0::2] | (panels[:, 1::2] << 4)
    group = _panel_group(qt)
    repeat = 1 if qt.group >= k else qt.group // group  # each scale column over `repeat` panel groups

    def per_group(t: torch.Tensor) -> torch.Tensor:
        """[N, ceil(K / qt.group)] -> [P, K / group, 64] float32, padded rows 0."""
        t = t.float().repeat_interleave(repeat, dim=1)[:, : k // group]
        out = torch.zeros(count * PANEL, t.shape[1], dtype=torch.float32)
        out[:n] = t
        return out.view(count, PANEL, t.shape[1]).transpose(1, 2).contiguous()

    offsets = None
    if shift or qt.zero is not None:  # (q - z) s = (q + shift) s - (z + shift) s
        zero = qt.zero.float() if qt.zero is not None else torch.zeros_like(qt.scale, dtype=torch.float32)
        offsets = per_group((zero + shift) * qt.scale.float())
    return panels.contiguous(), per_group(qt.scale), offsets, group


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in memory of its own: tensors read from safetensors may start at any byte, and torch's
    int8 kernel's vector loads fault on such a start."""
    return t.contiguous().clone()


class QuantizedWeight(CpuWeight):
    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device, kernel: str | None = None,
                 kind: str | None = None):
        """kernel: what runs (default: choose_kernel's); kind: the panels' (default: panel_kind's)."""
        super().__init__(qt.values)
        self.dtype = dtype
        self.bits = qt.bits
        self.group = qt.group
        self.kernel = kernel or choose_kernel(qt, dtype, device)
        self.perm = None if qt.perm is None else qt.perm.to(device)
        self.act_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        self.qt = None  # kept only by the kernels that read it per call
        self.row_zero = None
        if self.kernel == "int8_rows":
            self.values = _aligned(qt.values.to(device))
            scale = qt.scale[:, 0].float()
            self.scale = scale.to(device, self.act_dtype)
            if qt.zero is not None:  # (q - z) s = q s - z s: y -= rowsum(x) (z s)
                self.row_zero = (qt.zero[:, 0].float() * scale).to(device, torch.float32)
        elif self.kernel in ("int4_groups", "int4_groups_cuda"):
            unsigned = (qt.values.to(torch.int32) + 8)  # torch's int4: (u - 8) s + offset
            zero = torch.zeros_like(qt.scale, dtype=torch.float32) if qt.zero is None else qt.zero.float()
            scale = qt.scale.float()
            offsets = -zero * scale  # (u - 8 - z) s = (u - 8) s - z s
            self.scales_and_zeros = torch.stack([scale.t(), offsets.t()], dim=-1).to(device, self.act_dtype)
            self.scales_and_zeros = self.scales_and_zeros.contiguous()
            if self.kernel == "int4_groups":
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned.contiguous(), 1)
            else:
                u8 = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)
                self.packed = torch.ops.aten._convert_weight_to_int4pack(u8.to(device).contiguous(), 8)
        elif self.kernel == "panels":
            from ...kernels.cpu import cpu_kernels

            self.kernels = cpu_kernels()
            self.kind = kind or panel_kind(qt, self.kernels)
            self.panels, self.panel_scales, self.panel_offsets, self.group = _pack_panels(qt, self.kind)
        elif self.kernel == "fp8_rows_cuda":
            self.values = _aligned(qt.values.to(device))
            self.scale = qt.scale[:, 0].float().to(device).view(1, -1).contiguous()
        else:
            self.qt = qt.to(device)

    @property
    def extra_bytes(self) -> int:
        held = [getattr(self, name, None) for name in ("values", "scale", "row_zero", "scales_and_zeros", "packed",
                                                        "perm", "panels", "panel_scales", "panel_offsets")]
        total = sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))
        return total + (self.qt.nbytes if self.qt is not None else 0)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        if self.perm is not None and self.kernel != "dequantize":  # dequantize() restores the input order
            x = x.index_select(-1, self.perm)
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        kernel = self.kernel
        if kernel == "panels":
            y = self.kernels.qpanel_linear(x, self.panels, self.kind, self.panel_scales, self.panel_offsets,
                                           self.group, self.out_features, bias)
            return y.reshape(*shape[:-1], self.out_features)
        if kernel == "int8_rows":
            a = x.to(self.act_dtype)
            y = torch.ops.aten._weight_int8pack_mm(a, self.values, self.scale)
            if self.row_zero is not None:
                y = (y.float() - a.float().sum(-1, keepdim=True) * self.row_zero).to(self.act_dtype)
        elif kernel == "int4_groups":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.act_dtype).contiguous(), self.packed,
                                                           self.group, self.scales_and_zeros)
        elif kernel == "int4_groups_cuda":
            y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.packed, self.group,
                                                   self.scales_and_zeros)
        elif kernel == "fp8_rows_cuda":
            a = x.float()
            a_scale = (a.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            a8 = (a / a_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(a8, self.values.t(), scale_a=a_scale, scale_b=self.scale,
                                 out_dtype=dtype if dtype != torch.float32 else torch.bfloat16)
        else:
            y = F.linear(x, self.qt.dequantize(dtype))
        y = y.to(dtype).reshape(*shape[:-1], self.out_features)
        return y + bias if bias is not None else y
