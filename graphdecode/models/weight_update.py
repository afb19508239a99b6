"""New weights for a loaded model, in place: the tensors an RL trainer sends between rollouts.

    writer = WeightWriter(model)            # refuses a model whose weights it cannot rewrite, by name
    targets = writer.check(named_tensors)   # every tensor checked before any is written (ValueError naming it)
    writer.write(targets)                   # each into the memory the forward reads

Names are the checkpoint's (HuggingFace's: `model.layers.0.self_attn.q_proj.weight`, what a trainer's
`named_parameters()` or `state_dict()` gives), matched as the loader matches them (loader.py): q/k/v and
gate/up into their fused projection's rows, a fused checkpoint's `qkv_proj` into all of its shards, renames
(Mixtral's, the multimodal checkpoints' `language_model.`), and the tensors the engine never runs (a vision
tower, MTP layers, a tied `lm_head.weight`) skipped as at load, counted in `skipped`. Any subset of the
weights may come; the rest keep their values.

Every write lands in the memory the model already reads, so nothing the engine built at load is rebuilt:
CUDA graphs and compiled windows keep their pointers, the CPU's one-call decode layers their tables. A
projection on the CPU panels (cpu_linear.PanelWeight) takes its rows straight into the panels (a tied
embedding's lookups read the head's panels, so both change); where the variant engine also keeps oneDNN's
blocked copy, that copy is made again from the panels once all tensors are in. A weight the variant engine
holds only in oneDNN's layout (bf16 projections of a small model, batch_invariant=False) is laid out again
from its new rows, so all of them must come (q, k and v together). A dense parameter (GPU, the fp32
column-major CPU weights, an embedding) is copied into, in its own layout.

MoE experts (per expert, stacked, or gpt-oss's float layout) go through the loader's own expert reader
(expert_weights.load), into this rank's rows of each expert.

Refused by name (`WeightWriter` raises ValueError): quantized linears (their packed blocks) and MXFP4 experts,
layers that derive their weights' layout at load (MLA's W_UK / W_UV; Qwen3-Next's grouped Gated DeltaNet
projections, and the recurrent layers' rank slices with tensor parallelism: `rewritable` on the layer says),
and LoRA engines (the base projections are wrapped).

Tensor and pipeline parallelism: every rank gets every tensor and writes its own part (its rows or columns, as
the loader reads them; a pipeline stage skips the other stages' layers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from . import expert_weights, loader
from .cpu_linear import CpuWeight, PackedWeight, PanelWeight
from .moe import Experts
from .quant.linear import QuantizedWeight


@dataclass(frozen=True)
class Target:
    """One checked tensor: where its rows go."""

    key: str  # the name it came with
    tensor: torch.Tensor  # its rows for this model (a fused checkpoint tensor: one shard's), on its own device
    name: str  # the parameter it fills
    offset: int  # its first row in that parameter
    slot: expert_weights.Slot | None = None  # an MoE layer's expert tensor: what of `name`'s Experts it fills


class WeightWriter:
    def __init__(self, model: nn.Module):
        reason = refusal(model)
        if reason is not None:
            raise ValueError(f"weights: {reason}")
        self.model = model
        self.cls = type(model)
        self.modules = dict(model.named_modules())
        self.shapes: dict[str, tuple[int, ...]] = model.checkpoint_shapes
        self.dtype = model.anchor().dtype

    # ------------------------------------------------------------------ check
    def check(self, weights) -> tuple[list[Target], list[str]]:
        """(targets, skipped keys) for `weights` (pairs of name and tensor, or a mapping): every name placed,
        every shape, dtype and value checked, before anything is written (ValueError naming the tensor)."""
        pairs = weights.items() if isinstance(weights, dict) else weights
        targets: list[Target] = []
        skipped: list[str] = []
        seen: dict[tuple[str, str | None], str] = {}
        for item in pairs:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"weights: each item must be a (name, tensor) pair, got {type(item).__name__}")
            key, tensor = item
            if not isinstance(key, str):
                raise TypeError(f"weights: a tensor's name must be a str, got {type(key).__name__}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"weights: {key!r} must be a torch.Tensor, got {type(tensor).__name__}")
            if loader.skipped_key(key, self.model):
                skipped.append(key)
                continue
            for target, shard in self._place(key, tensor):
                if (target.name, shard) in seen:
                    raise ValueError(f"weights: {key!r} fills the same rows as {seen[target.name, shard]!r}")
                seen[target.name, shard] = key
                targets.append(target)
        self._check_layouts(targets)
        return targets, skipped

    def _place(self, key: str, tensor: torch.Tensor) -> list[tuple[Target, str | None]]:
        cls, modules = self.cls, self.modules
        ours = loader._renamed(key, cls)
        experts = self._experts(key, ours, tensor)
        if experts is not None:
            return [experts]
        fused = loader._fused_shards(ours, cls, modules)
        name, shard = (ours, None) if fused is not None else loader._target(ours, cls.packed_modules)
        if name not in self.shapes:
            raise ValueError(f"weights: {key!r} has no place in {cls.__name__} (its parameters are named as in "
                             f"the checkpoint: model.layers.N.self_attn.q_proj.weight, ...)")
        shape = tuple(self.shapes[name])
        if fused is not None:
            shards, rows = fused
            _check_tensor(key, tensor, (rows, *shape[1:]))
        else:
            shards = [(shard, 0)]
            _check_tensor(key, tensor, loader.expected_shape(shape, modules, name, shard))
        owner = modules[loader._owner(name)]
        out = []
        for shard, first in shards:
            spec = loader._spec(modules, name, shard)
            part = loader.rank_part(spec, first, fused is not None, lambda: tensor, tensor.__getitem__)
            offset = owner.shard_offsets[shard][0] if shard is not None else 0
            out.append((Target(key, part, name, offset), shard))
        return out

    def _experts(self, key: str, ours: str, tensor: torch.Tensor) -> tuple[Target, str] | None:
        """An expert tensor (expert_weights.py's layouts), checked, with the part of its Experts it fills; None for
        a tensor outside the experts."""
        fmt = self.cls.expert_format
        if fmt is None or ".experts." not in ours:
            return None
        owner, suffix = ours.split(".experts.", 1)
        owner += ".experts"
        module = self.modules.get(owner)
        if not isinstance(module, Experts):
            return None
        found = expert_weights.slot(module, suffix, fmt)
        if found is None:
            raise ValueError(f"weights: {key!r} has no place in {self.cls.__name__}'s experts")
        if found.layout in ("mxfp4", "scales") or getattr(module, "mxfp4", False):
            raise ValueError(f"weights: {key!r}: updating MXFP4 experts is not supported (float experts only)")
        _check_tensor(key, tensor, found.shape)
        return Target(key, tensor, f"{owner}.{found.param}", 0, found), found.part

    # ------------------------------------------------------------------ write
    def write(self, targets: list[Target]) -> None:
        """Each tensor into the memory the forward reads (see the module docstring); then the copies made from
        what was written (oneDNN's blocked layouts)."""
        rebuilt: dict[int, tuple[PackedWeight, torch.Tensor]] = {}  # oneDNN-only weights: their new dense rows
        stale: dict[int, PackedWeight] = {}  # panels or a tied embedding whose oneDNN copy is behind them
        for target in targets:
            owner_name, leaf = target.name.rsplit(".", 1)
            owner = self.modules[owner_name]
            if target.slot is not None:  # this rank's part of the expert parameter, as the loader fills it
                expert_weights.load(owner, target.slot, target.tensor.to(self.dtype), None)
                continue
            param, rows = getattr(owner, leaf), target.tensor
            cpu = self._cpu_weight(owner, leaf)
            if isinstance(cpu, PanelWeight):
                cpu.write_rows(target.offset, rows)
            elif isinstance(cpu, PackedWeight) and not param.numel():  # only oneDNN's copy: rebuilt whole
                dense = rebuilt.setdefault(id(cpu), (cpu, torch.empty(cpu.out_features, cpu.in_features,
                                                                      dtype=self.dtype)))[1]
                dense[target.offset: target.offset + rows.shape[0]].copy_(rows)
            if param.numel():  # a dense parameter the forward reads (a tied embedding's rows, a blocked GPU weight)
                param.data[target.offset: target.offset + rows.shape[0]].copy_(rows)
            if isinstance(cpu, PackedWeight) and cpu.packed is not None and id(cpu) not in rebuilt:
                stale[id(cpu)] = cpu
        for cpu, dense in rebuilt.values():
            cpu.packed = torch.ops.mkldnn._reorder_linear_weight(dense)
        for cpu in stale.values():
            if isinstance(cpu, PanelWeight):
                cpu.repack()
            else:  # a tied head packed from the embedding, which keeps its rows for the lookups
                cpu.packed = torch.ops.mkldnn._reorder_linear_weight(self.model.model.embed_tokens.weight.detach())
        device = self.model.anchor().device
        if device.type == "cuda":  # the next window, on whatever stream, reads only finished writes
            torch.cuda.synchronize(device)

    def _cpu_weight(self, owner: nn.Module, leaf: str) -> CpuWeight | None:
        """The CPU layout that holds this weight instead of (or besides) its parameter, if any."""
        if leaf != "weight":
            return None
        model = self.model
        head = model.model.embed_tokens if model.config.tie_word_embeddings else getattr(model, "lm_head", None)
        return model.packed_head if owner is head else getattr(owner, "packed", None)

    def _check_layouts(self, targets: list[Target]) -> None:
        """Every tensor has memory to go to (nothing is dropped unwritten); a weight held only in oneDNN's blocked
        layout is laid out again whole, so every row of it must come (all of q, k and v; gate and up)."""
        rows: dict[str, int] = {}
        first: dict[str, str] = {}
        for target in targets:
            if target.slot is not None:
                continue
            owner_name, leaf = target.name.rsplit(".", 1)
            owner = self.modules[owner_name]
            cpu = self._cpu_weight(owner, leaf)
            if not getattr(owner, leaf).numel() and not isinstance(cpu, PackedWeight):
                raise ValueError(f"weights: {target.key!r} is held in a layout this engine cannot rewrite")
            if isinstance(cpu, PackedWeight) and not isinstance(cpu, PanelWeight) and not getattr(owner, leaf).numel():
                rows[target.name] = rows.get(target.name, 0) + target.tensor.shape[0]
                first.setdefault(target.name, target.key)
        for name, count in rows.items():
            full = self.shapes[name][0]
            if count != full:
                raise ValueError(f"weights: {first[name]!r} gives {count} of {name}'s {full} rows, which this engine "
                                 f"holds only in oneDNN's blocked layout (bf16, batch_invariant=False) and lays out "
                                 f"again whole: send every tensor it fuses (q, k and v; gate and up)")


def refusal(model: nn.Module) -> str | None:
    """Why this model's weights cannot be rewritten in place, or None (see the module docstring)."""
    if getattr(model, "lora", None) is not None:
        return ("updating the base weights of a LoRA engine is not supported; merge the adapter into the weights "
                "(PEFT's merge_and_unload) and update an engine without enable_lora")
    for name, module in model.named_modules():
        if module is not model and hasattr(module, "post_load") and not getattr(module, "rewritable", False):
            return (f"{type(module).__name__} ({name}) derives its weights' layout at load (MLA's W_UK / W_UV; a "
                    f"recurrent layer's grouped rows or a rank's slice of them); updating them in place is not "
                    f"supported")
        if _quantized(getattr(module, "packed", None)):
            return f"{name} is quantized; updating quantized weights is not supported"
    if _quantized(getattr(model, "packed_head", None)):
        return "the LM head is quantized; updating quantized weights is not supported"
    if not hasattr(model, "checkpoint_shapes"):
        return f"{type(model).__name__} was not built by the checkpoint loader"
    return None


def _quantized(weight) -> bool:
    """A linear's weight held quantized (quant/linear.py), or in any layout this module cannot write."""
    return weight is not None and (isinstance(weight, QuantizedWeight) or not isinstance(weight, CpuWeight))


def _check_tensor(key: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if not tensor.is_floating_point():
        raise ValueError(f"weights: {key!r} has dtype {tensor.dtype}; weights must be floating point")
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"weights: {key!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    if not bool(loader._all_finite(tensor)):  # one pass, no temporary as large as the tensor
        raise ValueError(f"weights: {key!r} holds NaN or infinite values")


def checkpoint_tensors(model_path) -> dict[str, torch.Tensor]:
    """Every tensor of a HuggingFace checkpoint directory (model.safetensors, or the shards its index lists), read
    into host memory: ValueError naming model_path if it is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(f"model_path: must be a path, got {type(model_path).__name__}")
    path = os.fspath(model_path)
    if not os.path.isdir(path):
        raise ValueError(f"model_path: {path!r} is not a directory")
    try:
        files = loader.checkpoint_files(path)
    except ValueError as e:
        raise ValueError(f"model_path: {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            part = load_file(file)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"model_path: {file} cannot be read ({e})") from None
        clash = next((key for key in part if key in tensors), None)
        if clash is not None:
            raise ValueError(f"model_path: tensor {clash!r} is in more than one file of {path}")
        tensors.update(part)
    return tensors
