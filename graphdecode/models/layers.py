"""Small building blocks shared by the model files: RMSNorm, fused linears, gated activations.

Fused linears (qkv, gate_up) hold several HuggingFace weights side by side; each
knows where a named shard goes, so the loader can fill them from the unfused
checkpoint tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import ShardSpec


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. offset=True is Gemma's: the weight is stored as a delta and the
    scale is (1 + weight), applied in float32 before the cast back (transformers' Gemma3RMSNorm);
    weight_fp32=True is gpt-oss's: the weight times the float32 normalised value, then the cast."""

    def __init__(self, hidden_size: int, eps: float, offset: bool = False, weight_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if offset else torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset
        self.weight_fp32 = weight_fp32  # gpt-oss: weight * h in float32, then the cast

    kernels = None  # the CPU's fused pass (kernels/cpu.py's CpuKernels), attached at load (every variant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self._fused(x):  # one fixed-order pass a row, whatever the rows
            rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
            return self._kernel(rows, None)[1].view(x.shape)
        # Same arithmetic as transformers' LlamaRMSNorm / Gemma3RMSNorm: normalise in float32.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        if self.weight_fp32:
            return (self.weight * h).to(dtype)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm): one pass on the CPU, two ops elsewhere."""
        if self.kernels is not None and x.dim() == 2 and self._fused(x):
            return self._kernel(x, residual)
        total = x + residual
        return total, self(total)

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        mode = "offset" if self.offset else "weight_fp32" if self.weight_fp32 else "llama"
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps, mode=mode)

    def _fused(self, x: torch.Tensor) -> bool:
        return not torch.compiler.is_compiling() and x.stride(-1) == 1 and x.dtype == self.weight.dtype


class FusedLinear(nn.Linear):
    """A column-parallel linear layer whose output rows are the concatenation of named shards.

    Each shard (q, k, v; gate, up) is a block of rows of a checkpoint tensor: its
    ShardSpec says which rows this rank holds (all of them with one rank), so the
    loader fills the fused weight from the unfused checkpoint tensors directly.
    """

    packed = None  # a cpu_linear.PackedWeight once prepack_cpu_linears ran (CPU)

    def __init__(self, in_features: int, shards: dict[str, ShardSpec], bias: bool):
        super().__init__(in_features, sum(s.stop - s.start for s in shards.values()), bias=bias)
        self.shard_specs = dict(shards)
        self.shard_offsets: dict[str, tuple[int, int]] = {}  # shard -> (row offset, rows) in the fused weight
        offset = 0
        for name, spec in shards.items():
            self.shard_offsets[name] = (offset, spec.stop - spec.start)
            offset += spec.stop - spec.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, self.bias) if self.packed is not None else F.linear(x, self.weight, self.bias)

    def load_shard(self, param: nn.Parameter, shard: str, loaded: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"weights: shard {shard!r} has {loaded.shape[0]} rows, expected {size}")
        param.data[offset : offset + size].copy_(loaded)


class GatedActivation(nn.Module):
    """act(gate) * up over a fused [gate | up] projection: SwiGLU (silu) or GeGLU (gelu_pytorch_tanh)."""

    def __init__(self, act: str = "silu"):
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act: {act!r} is not supported")
        self.act = act

    kernels = None  # the CPU's fused pass for SwiGLU (kernels/cpu.py's CpuKernels), attached at load

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if (self.kernels is not None and self.act == "silu" and gate_up.dim() == 2 and gate_up.is_contiguous()
                and not torch.compiler.is_compiling()):
            return self.kernels.swiglu(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.act == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh") * up


SiluAndMul = GatedActivation  # the SwiGLU default


def attach_cpu_kernels(model: nn.Module, kernels) -> None:
    """Give the RMSNorms (every variant: Llama's, Gemma's offset, gpt-oss's), SwiGLU and the full-rotary tables the
    CPU's fused passes (csrc/cpu_fused.cpp): each row's mean of squares in a fixed order, where aten's reduction
    changes with the number of rows. Partial rotary keeps its torch ops. Compiled windows always trace the
    torch ops (inductor fuses them itself)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, GatedActivation)):
            module.kernels = kernels
    for rotary in model.rotary_tables():
        if rotary.rotary_dim == rotary.head_dim:
            rotary.kernels = kernels
    for module in model.modules():  # layers with their own CPU kernels (gated_deltanet.GatedDeltaNet's step)
        if hasattr(module, "use_cpu_kernels"):
            module.use_cpu_kernels(kernels)
