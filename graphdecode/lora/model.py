"""A loaded model's projections made LoRA-capable, and adapters loaded into its device slots.

`LoRAModel(model, ...)` wraps each decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj in a LoRALinear
(layers.py) and sets `model.lora` (the LoRAState its forward begins with). gate_up's one-pass SwiGLU, which would
bypass the wrapper, is turned off. The CPU's one-call decode layers get each projection's LoRA panels
(cpu_decode.CpuDecodeLayers.use_lora) and add the updates themselves; without panels for them they are turned
off. `load(slot, adapter)` writes an adapter's weights into slot 1..max_loras of every wrapped projection (zeros
where the adapter leaves one out).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.loader import BLOCKED_DEVICES
from .adapter import GROUPS, LoadedAdapter, module_shapes
from .layers import LoRALinear, LoRAState


def lora_kernels(device: torch.device, dtype: torch.dtype, batch_invariant: bool):
    """The CPU kernels the LoRA matmuls run on (panels: a row's bits independent of the batch), or None."""
    if device.type != "cpu" or not batch_invariant:
        return None
    from ..models.cpu_linear import can_prepack

    if not can_prepack(device, dtype):  # the projections' own rule: panels only where they take them
        return None
    from ..kernels.cpu import cpu_kernels_for

    kernels = cpu_kernels_for(device)
    return kernels if kernels is not None and dtype in kernels.supported_dtypes else None


class LoRAModel:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, batch_invariant: bool = True):
        weight = model.anchor()
        self.state = LoRAState(max_loras, max_rank, weight.dtype, weight.device)
        kernels = lora_kernels(weight.device, weight.dtype, batch_invariant)
        blocked = batch_invariant and weight.device.type in BLOCKED_DEVICES  # cuBLAS: one GEMM shape, as theirs
        shapes = module_shapes(model.config)  # one rank holds them whole (no tensor parallelism with LoRA)
        self.linears: dict[tuple[int, str], LoRALinear] = {}
        for i, layer in enumerate(model.model.layers):
            for parent_name, names in (("self_attn", ("qkv_proj", "o_proj")), ("mlp", ("gate_up_proj", "down_proj"))):
                parent = getattr(layer, parent_name)
                for name in names:
                    wrapped = LoRALinear(getattr(parent, name), self.state, GROUPS[name], *shapes[name], kernels,
                                         blocked)
                    setattr(parent, name, wrapped)
                    self.linears[(i, name)] = wrapped
            layer.mlp.one_pass = None  # gate_up's one-pass SwiGLU would skip its update
        if model.cpu_decode is not None and kernels is not None:  # the one-call decode layers add them too
            model.cpu_decode.use_lora(self.linears, max_loras)
        else:
            model.cpu_decode = None  # ... which without LoRA panels would skip every update
        model.lora = self.state

    @property
    def nbytes(self) -> int:
        """Bytes of every projection's A and B (dense, and their CPU panels where they run on them)."""
        total = 0
        for linear in self.linears.values():
            for matmul in (linear.a, linear.b):
                total += matmul.dense.numel() * matmul.dense.element_size()
                if matmul.panels is not None:
                    total += matmul.panels.panels.numel() * matmul.panels.panels.element_size()
        return total

    def load(self, slot: int, adapter: LoadedAdapter) -> None:
        """Write the adapter into `slot` of every wrapped projection."""
        updates: dict[tuple[int, str], list] = {k: [] for k in self.linears}
        for layer, target, a, b in adapter.weights:
            updates[(layer, target.module)].append((target.group, target.row_offset, target.rows, a, b))
        with torch.inference_mode():
            for k, linear in self.linears.items():
                linear.load(slot, updates[k])
