"""Build a model from a HuggingFace directory: config.json + safetensors (one file or shards).

Loading has two passes.

1. `plan_checkpoint` reads only the safetensors headers and checks them against the
   model built on the meta device: every tensor has a place, the expected shape and
   a floating-point dtype, none is missing or appears twice. Nothing is allocated yet.
2. The parameters are materialised directly on the target device and filled tensor
   by tensor, fusing q/k/v and gate/up on the way in; then one reduction per
   parameter (`aminmax`: a single pass, no temporary as large as the tensor) rejects
   NaN or inf weights, which would otherwise decode as token 0 forever. On a GPU the
   flags are gathered and read once, so the check adds one synchronisation in all.

Every error is a ValueError naming the file and the checkpoint's own tensor name
(`model.layers.3.self_attn.k_proj.weight`, never the fused `qkv_proj`).

Tensor parallelism: a rank reads only its part of each sharded tensor (a ShardSpec on
the owning module: rows of q/k/v, gate/up and the vocabulary, columns of o_proj and
down_proj) through safetensors' slices; headers are checked against the full shapes.

Checkpoints that store q/k/v or gate/up fused already (Phi-3's `qkv_proj`, `gate_up_proj`:
the model class's `fused_checkpoint`) fill each shard from its block of rows of the one
tensor (q rows first, then k, then v), the same rows per rank as from unfused tensors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from . import expert_weights, mxfp4
from .blocked_linear import block_linears
from .config_fields import read_json_object
from .cpu_decode import CpuDecodeLayers
from .cpu_linear import can_prepack, prepack_cpu_linears
from .huge_pages import HugePages
from .layers import FusedLinear, attach_cpu_kernels
from .model_config import ModelConfig
from .parallel import ParallelLMHead, RowParallelLinear, ShardSpec, TPGroup
from .quant import formats
from .quant.config import QuantConfig, WeightScheme
from .quant.linear import QuantizedWeight
from .quant.tensor import QuantizedTensor
from .registry import model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
BLOCKED_DEVICES = ("cuda",)  # batch-invariant linears in fixed row blocks (blocked_linear.py); the CPU has panels
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names; anything else (ints, bool, fp8) is refused
_INDEX = "model.safetensors.index.json"
_LINEARS = (FusedLinear, RowParallelLinear, ParallelLMHead)  # the modules whose weights may be quantized


@dataclass(frozen=True)
class _Entry:
    key: str  # the checkpoint's own tensor name
    path: str  # the file that holds it
    name: str  # the parameter it fills
    shard: str | None  # its shard of a fused parameter (q, k, v, gate, up), or None
    offset: int = 0  # a fused checkpoint tensor's rows before this shard's (fused_checkpoint)
    fused: bool = False  # the checkpoint tensor holds several shards
    experts: str | None = None  # the Experts module it fills (expert_weights.py), with `slot`
    slot: expert_weights.Slot | None = None
    quant: WeightScheme | None = None  # a quantized linear (key: its module): its scheme, with `parts`
    parts: tuple[tuple[str, str, str], ...] = ()  # (suffix, checkpoint key, file) of each of its tensors
    full: tuple[int, ...] = ()  # ... and its float weight's shape in the checkpoint [N, K]
    kv_scale: str | None = None  # an attention layer's FP8 KV-cache scale (name: the module): k, v or kv (both)


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(f"{index}: weight_map must map tensor names to safetensors file names")
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        absent = next((path for path in files if not os.path.isfile(path)), None)
        if absent is not None:
            raise ValueError(f"{index}: lists {absent}, which does not exist")
        return files
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"model: no model.safetensors or {_INDEX} in {model_dir!r}")


def load_model(model_dir: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               tp: TPGroup = TPGroup(), build=None, batch_invariant: bool = True, huge_pages: bool = False):
    """build: (cfg, tp) -> the module, for one that is not a registered family's (an EAGLE-3 head);
    batch_invariant: its CPU linears' rows do not depend on the batch (EngineConfig.batch_invariant);
    huge_pages: a CPU model's weights are collapsed onto 2 MiB pages, in a thread (`model.huge_pages`,
    huge_pages.py; EngineConfig.cpu_huge_pages)."""
    build = build or model_class(cfg)
    with torch.device("meta"):
        model = build(cfg, tp)
    plan = plan_checkpoint(model_dir, model)  # headers only: raises before any memory is allocated
    modules = dict(model.named_modules())
    quantized = {e.name for _, entries in plan for e in entries if e.quant is not None}
    for name in quantized:  # held quantized (a QuantizedWeight): no float weight is allocated
        modules[_owner(name)].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    for owner in {e.experts for _, entries in plan for e in entries if e.slot is not None and e.slot.layout == "mxfp4"}:
        modules[owner].hold_mxfp4()  # MXFP4 experts stay in 4 bits (where this rank's slice allows)
    model = model.to(dtype=dtype)
    for module in modules.values():  # parameters a module keeps float32 whatever the dtype (a sigmoid router's)
        for name in getattr(module, "fp32_params", ()):
            param = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(param.float(), requires_grad=param.requires_grad))
    model = model.to_empty(device=device)  # in place: `modules` still names its modules
    params = dict(model.named_parameters())
    # each parameter's shape as loaded, before the CPU layouts release some (weight_update.py checks against it)
    model.checkpoint_shapes = {name: tuple(param.shape) for name, param in params.items()}
    files = {entry.key: path for path, entries in plan for entry in entries}
    pending: dict[str, dict[str | None, QuantizedTensor]] = {}  # quantized linear -> its shards
    progress = _progress(model_dir, plan, tp)
    for path, entries in plan:
        with _open(path) as f:
            for entry in entries:
                try:
                    if entry.quant is not None:
                        pending.setdefault(entry.name, {})[entry.shard] = _read_quantized(f, path, entry, modules)
                        continue
                    if entry.slot is not None:
                        _load_experts(f, entry, modules[entry.experts], files)
                        continue
                    if entry.kv_scale is not None:
                        _load_kv_scale(f, path, entry, modules[entry.name])
                        continue
                    tensor = _read(f, entry.key, _spec(modules, entry.name, entry.shard), entry.offset, entry.fused)
                except (SafetensorError, OSError) as e:
                    raise ValueError(f"{path}: tensor {entry.key!r} cannot be read ({e})") from None
                param = params[entry.name]
                if entry.shard is None:
                    param.data.copy_(tensor)
                else:
                    modules[_owner(entry.name)].load_shard(param, entry.shard, tensor)
        progress.update(os.path.getsize(path))
    progress.close()
    for name, shards in pending.items():
        module = modules[_owner(name)]
        order = list(getattr(module, "shard_offsets", None) or [None])
        weight = QuantizedWeight(QuantizedTensor.cat([shards[s] for s in order], _owner(name)), dtype, device)
        if name == "lm_head.weight":
            model.packed_head = weight
        else:
            module.packed = weight
    _check_finite(params, modules, plan, dtype)
    if dtype == torch.float16:  # MXFP4 experts dequantize per call: their largest value must fit float16
        for name, module in modules.items():
            if getattr(module, "mxfp4", False):
                exponent = max(int(module.gate_up_scales.max()), int(module.down_scales.max())) - mxfp4.SCALE_BIAS
                if 6.0 * 2.0**exponent > torch.finfo(torch.float16).max:
                    raise ValueError(f"{name}: MXFP4 expert weights reach 6 x 2**{exponent}, beyond float16; load "
                                     f"with dtype='bfloat16' or 'float32'")
    model.post_load(max_positions)
    model.eval()
    if can_prepack(device, dtype):
        prepack_cpu_linears(model, batch_invariant)  # panels (fixed-order sums) or oneDNN's blocked weights
    elif batch_invariant and device.type in BLOCKED_DEVICES:
        block_linears(model)  # every GEMM of one shape: cuBLAS's algorithm no longer follows the batch
    from ..kernels.cpu import cpu_kernels_for

    kernels = cpu_kernels_for(device)
    if kernels is not None and dtype in kernels.supported_dtypes:
        attach_cpu_kernels(model, kernels)  # one pass for each plain norm and full rotary
        if tp.stage.size == 1:  # plain layers' decode steps in one call (every layer of the model)
            model.cpu_decode = CpuDecodeLayers.build(model, kernels)
    if huge_pages and device.type == "cpu":
        model.huge_pages = HugePages(model, os.path.basename(os.path.normpath(model_dir)))
    return model


PROGRESS_BYTES = 1 << 30  # checkpoints from this size up show a loading bar (on a terminal)


def _progress(model_dir: str, plan, tp: TPGroup):
    """A tqdm bar over the checkpoint files' bytes (each file counted once read): for a checkpoint of
    PROGRESS_BYTES or more, on the first rank, on a terminal (tqdm's disable=None), so a model that takes
    minutes to read says how far it is."""
    from tqdm import tqdm

    total = sum(os.path.getsize(path) for path, _ in plan)
    shown = total >= PROGRESS_BYTES and tp.rank == 0 and tp.stage.index == 0
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"loading "
                f"{os.path.basename(os.path.normpath(model_dir))}", disable=None if shown else True)


def plan_checkpoint(model_dir: str, model) -> list[tuple[str, list[_Entry]]]:
    """Check every tensor header against `model` (on the meta device): [(file, entries)]."""
    cls = type(model)
    packed = cls.packed_modules
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    files = checkpoint_files(model_dir)
    found: dict[tuple[str, str | None], _Entry] = {}
    # per Experts parameter: the first tensor of each form seen (True: stacked "all", False: per expert / MXFP4)
    forms: dict[str, dict[bool, str]] = {}
    quant = model.config.weight_quant
    quant_parts: dict[str, dict[str, tuple[str, str, tuple[int, ...], str]]] = {}  # module -> suffix -> header
    plan = []
    for path in files:
        entries = []
        with _open(path) as f:
            for key in f.keys():
                if skipped_key(key, model):
                    continue
                kv_scale = _kv_scale_entry(path, f, key, cls, modules)
                if kv_scale is not None:
                    entries.append(kv_scale)
                    continue
                if quant is not None and _quant_part(path, f, key, quant, quant_parts, cls, modules):
                    continue
                experts = _experts_entry(path, f, key, cls, modules)
                if experts is not None:
                    if (experts.name, experts.slot.part) in found:
                        raise ValueError(f"{path}: tensor {key!r} is also in "
                                         f"{found[experts.name, experts.slot.part].path}")
                    if experts.slot.part != "scales":  # scales come with their blocks
                        stacked = experts.slot.part == "all"
                        seen = forms.setdefault(experts.name, {})
                        if (not stacked) in seen:
                            raise ValueError(f"{path}: tensor {key!r} and {seen[not stacked]!r} both hold "
                                             f"{experts.name} (stacked and per-expert or MXFP4 forms at once)")
                        seen.setdefault(stacked, key)
                    found[experts.name, experts.slot.part] = experts
                    entries.append(experts)
                    continue
                ours = _renamed(key, cls)
                fused = _fused_shards(ours, cls, modules)
                name, shard = (ours, None) if fused is not None else _target(ours, packed)
                if name not in params:
                    raise ValueError(
                        f"{path}: tensor {key!r} has no place in {cls.__name__} as config.json describes it "
                        f"(num_hidden_layers, attention_bias, tie_word_embeddings)"
                    )
                header = f.get_slice(key)
                kind = header.get_dtype()
                if kind not in _FLOAT_DTYPES:
                    raise ValueError(
                        f"{path}: tensor {key!r} has dtype {kind}; weights must be floating point "
                        f"({', '.join(_FLOAT_DTYPES)})"
                    )
                shape = tuple(header.get_shape())
                if fused is not None:
                    shards, rows = fused
                    expected = (rows, *params[name].shape[1:])
                else:
                    shards, expected = [(shard, 0)], expected_shape(params[name].shape, modules, name, shard)
                if shape != expected:
                    raise ValueError(f"{path}: tensor {key!r} has shape {shape}, expected {expected} from config.json")
                for shard, offset in shards:
                    if (name, shard) in found:
                        raise ValueError(f"{path}: tensor {key!r} is also in {found[name, shard].path}")
                    found[name, shard] = _Entry(key, path, name, shard, offset, fused is not None)
                    entries.append(found[name, shard])
        plan.append((path, entries))
    for module, headers in quant_parts.items():
        entry = _quant_entry(module, headers, quant, cls, params, modules)
        if (entry.name, entry.shard) in found:
            raise ValueError(f"{entry.path}: tensor {entry.key + '.weight'!r} is also in "
                             f"{found[entry.name, entry.shard].path}")
        found[entry.name, entry.shard] = entry
        next(entries for path, entries in plan if path == entry.path).append(entry)
    index = os.path.join(model_dir, _INDEX)
    where = index if os.path.isfile(index) else files[0]
    expert_parts: dict[str, set[tuple[str, str]]] = {}  # Experts module -> (parameter, part) found
    for (name, part), entry in found.items():
        if entry.experts is not None:
            expert_parts.setdefault(entry.experts, set()).add((name.rsplit(".", 1)[1], part))
    for owner, module in modules.items():
        if isinstance(module, expert_weights.Experts):
            lacking = expert_weights.missing(module, expert_parts.get(owner, set()), cls.expert_format)
            if lacking is not None:
                raise ValueError(f"{where}: tensor {_original(owner + '.' + lacking, cls)!r} is missing from the "
                                 f"checkpoint")
    for name in params:
        if isinstance(modules[_owner(name)], expert_weights.Experts):
            continue  # checked above, per expert or stacked
        for shard in _shards(modules, name):
            if (name, shard) not in found:
                key = name if _fused_shards(name, cls, modules) is not None else _checkpoint_key(name, shard, packed)
                key = _original(key, cls)
                scheme = quant.scheme_for(_owner(key)) if quant is not None else None
                if scheme is not None:
                    key = f"{_owner(key)}.{next(iter(formats.parts(scheme)))}"  # its first quantized tensor
                hint = (" (if lm_head shares embed_tokens' weights, config.json should say "
                        "\"tie_word_embeddings\": true)") if key == "lm_head.weight" else ""
                raise ValueError(f"{where}: tensor {key!r} is missing from the checkpoint{hint}")
    return plan


def skipped_key(key: str, model) -> bool:
    """A checkpoint tensor the model does not read: rotary tables, a tied head's copy, tensors the class reads
    itself (an EAGLE-3 head's id maps), and the parts it does not run (a vision tower; the MTP layers after
    GLM-4.5's decoder; another pipeline stage's layers), as the checkpoint or this engine names them, asked of the
    model (they may follow its config), or outside the one prefix it reads (`checkpoint_only`)."""
    cls = type(model)
    skipped = getattr(model, "checkpoint_skipped", ())
    kept = getattr(model, "checkpoint_only", None)
    return (key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and model.config.tie_word_embeddings)
            or key in getattr(cls, "checkpoint_extras", ()) or key.startswith(skipped)
            or _renamed(key, cls).startswith(skipped) or (kept is not None and not key.startswith(kept)))


def _quant_part(path: str, f, key: str, quant: QuantConfig, found: dict, cls, modules: dict) -> bool:
    """Record `key` if it is a tensor of a quantized linear (True); False for any other tensor. A float weight
    where quantization_config quantizes the linear is refused, naming both."""
    module, _, suffix = key.rpartition(".")
    scheme = quant.scheme_for(module)
    if scheme is None or suffix == "bias":
        return False
    name, _ = _target(_renamed(module + ".weight", cls), cls.packed_modules)
    if not isinstance(modules.get(_owner(name)), _LINEARS):
        return False
    header = f.get_slice(key)
    kind = header.get_dtype()
    if suffix not in formats.parts(scheme):
        if suffix == "weight":
            raise ValueError(f"{path}: tensor {key!r} has dtype {kind}, but quantization_config "
                             f"({scheme.describe()}) quantizes {module!r} (list it in the config's ignore list to "
                             f"keep it float)")
        return False
    seen = found.setdefault(module, {})
    if suffix in seen:
        raise ValueError(f"{path}: tensor {key!r} is also in {seen[suffix][3]}")
    seen[suffix] = (key, kind, tuple(header.get_shape()), path)
    return True


def _quant_entry(module: str, headers: dict, quant: QuantConfig, cls, params: dict, modules: dict) -> _Entry:
    """The plan entry of one quantized linear (HuggingFace name `module`), its headers checked."""
    scheme = quant.scheme_for(module)
    path = next(iter(headers.values()))[3]
    ours = _renamed(module + ".weight", cls)
    if _fused_shards(ours, cls, modules) is not None:
        raise ValueError(f"{path}: tensor {module!r}: quantized weights in a fused checkpoint tensor "
                         f"({cls.__name__}) are not supported")
    name, shard = _target(ours, cls.packed_modules)
    owner = modules.get(_owner(name))
    if name not in params or not isinstance(owner, _LINEARS):
        first = next(iter(headers.values()))[0]
        raise ValueError(f"{path}: tensor {first!r} has no place in {cls.__name__} as config.json describes it "
                         f"(quantized tensors belong to linear layers)")
    n, k = expected_shape(params[name].shape, modules, name, shard)
    formats.check(scheme, {suffix: (kind, shape) for suffix, (_, kind, shape, _) in headers.items()}, module, n, k,
                  path)
    parts = tuple((suffix, key, where) for suffix, (key, _, _, where) in headers.items())
    return _Entry(module, path, name, shard, quant=scheme, parts=parts, full=(n, k))


def _read_quantized(f, path: str, entry: _Entry, modules: dict) -> QuantizedTensor:
    """One quantized linear's tensors, read whole, as this rank's rows or input columns."""
    tensors = {suffix: _get_tensor(f, path, key, where) for suffix, key, where in entry.parts}
    spec = _spec(modules, entry.name, entry.shard)
    qt = formats.read(entry.quant, tensors, entry.key, *entry.full, path)
    if spec is None:
        return qt
    if spec.dim == 0:
        return qt.rows(spec.start, spec.stop)
    return qt.columns(spec.start, spec.stop, f"{path}: tensor {entry.key!r}")


_KV_SCALES = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv"}  # an attention layer's FP8 KV-cache scales


def _kv_scale_entry(path: str, f, key: str, cls, modules: dict) -> _Entry | None:
    """An attention layer's K / V cache scale (compressed-tensors' and vLLM's `self_attn.k_scale` / `v_scale`, the
    older single `kv_scale`): a float scalar, else a ValueError naming it; None for any other tensor."""
    owner, _, suffix = _renamed(key, cls).rpartition(".")
    if suffix not in _KV_SCALES or not hasattr(modules.get(owner), "k_scale"):
        return None
    header = f.get_slice(key)
    if header.get_dtype() not in _FLOAT_DTYPES or math.prod(header.get_shape()) != 1:
        raise ValueError(f"{path}: tensor {key!r} ({header.get_dtype()}, shape {header.get_shape()}): a KV-cache "
                         f"scale must be one floating-point number per layer (per-head scales are not supported)")
    return _Entry(key, path, owner, None, kv_scale=_KV_SCALES[suffix])


def _load_kv_scale(f, path: str, entry: _Entry, attention) -> None:
    value = float(_get_tensor(f, path, entry.key, path).float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{path}: tensor {entry.key!r} is {value}: a KV-cache scale must be finite and > 0")
    if "k" in entry.kv_scale:
        attention.k_scale = value
    if "v" in entry.kv_scale:
        attention.v_scale = value


def _renamed(key: str, cls) -> str:
    """A checkpoint name in this engine's module names (cls.checkpoint_renames: Mixtral's block_sparse_moe)."""
    for theirs, ours in cls.checkpoint_renames.items():
        key = key.replace(theirs, ours)
    return key


def _original(name: str, cls) -> str:
    for theirs, ours in cls.checkpoint_renames.items():
        name = name.replace(ours, theirs) if ours else theirs + name  # "": a prefix the module drops (mtp.)
    return name


def _experts_entry(path: str, f, key: str, cls, modules: dict) -> _Entry | None:
    """The entry of a tensor under an Experts module (expert_weights.py), checked; None for any other tensor."""
    ours = _renamed(key, cls)  # (Granite's experts are named so only after the renames)
    if cls.expert_format is None or ".experts." not in ours:
        return None
    owner, suffix = ours.split(".experts.", 1)
    owner += ".experts"
    module = modules.get(owner)
    if not isinstance(module, expert_weights.Experts):
        return None
    slot = expert_weights.slot(module, suffix, cls.expert_format)
    quantized = modules[""].config.quantization == "mxfp4"
    if slot is not None and slot.param in ("gate_up_proj", "down_proj") and cls.expert_format.gpt_oss and (
            (slot.layout == "gpt_oss") == quantized):
        said = "says quantization_config mxfp4" if quantized else "has no quantization_config"
        raise ValueError(f"{path}: tensor {key!r} is {'float' if quantized else 'MXFP4'}, but config.json {said}")
    if slot is None:
        raise ValueError(f"{path}: tensor {key!r} has no place in {cls.__name__} as config.json describes it "
                         f"(num_local_experts, intermediate_size, quantization_config)")
    header = f.get_slice(key)
    kind = header.get_dtype()
    if kind not in slot.dtypes:
        raise ValueError(f"{path}: tensor {key!r} has dtype {kind}, expected {' or '.join(slot.dtypes)}")
    shape = tuple(header.get_shape())
    if shape != slot.shape:
        raise ValueError(f"{path}: tensor {key!r} has shape {shape}, expected {slot.shape} from config.json")
    return _Entry(key, path, f"{owner}.{slot.param}", None, experts=owner, slot=slot)


def _load_experts(f, entry: _Entry, module, files: dict[str, str]) -> None:
    prefix = entry.key.rsplit(".experts.", 1)[0] + ".experts."

    def sibling(suffix: str) -> torch.Tensor:
        return _get_tensor(f, entry.path, prefix + suffix, files[prefix + suffix])

    tensor = None if entry.slot.layout == "scales" else f.get_tensor(entry.key)
    expert_weights.load(module, entry.slot, tensor, sibling)


def _get_tensor(f, path: str, key: str, where: str) -> torch.Tensor:
    """Tensor `key` of file `where`, through `f` (file `path`, open) when it is that file."""
    if where == path:
        return f.get_tensor(key)
    with _open(where) as other:
        return other.get_tensor(key)


def _open(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file; is it truncated or corrupt? ({e})") from None


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _shards(modules: dict, name: str) -> list[str | None]:
    offsets = getattr(modules[_owner(name)], "shard_offsets", None)
    return list(offsets) if offsets else [None]


def _spec(modules: dict, name: str, shard: str | None) -> ShardSpec | None:
    """This rank's part of the checkpoint tensor, or None for the whole tensor."""
    owner = modules[_owner(name)]
    if shard is not None:
        return owner.shard_specs[shard]
    return getattr(owner, "tp_specs", {}).get(name.rsplit(".", 1)[1])


def expected_shape(held, modules: dict, name: str, shard: str | None) -> tuple[int, ...]:
    """The tensor's shape in the checkpoint (whole, whichever part this rank holds), from the shape the parameter
    `name` is `held` in."""
    spec = _spec(modules, name, shard)
    shape = list(held)
    if spec is not None:
        shape[spec.dim] = spec.full
    return tuple(shape)


def _fused_shards(key: str, cls, modules: dict) -> tuple[list[tuple[str, int]], int] | None:
    """For a tensor of a module the checkpoint stores fused (cls.fused_checkpoint): each shard with
    its first row in the checkpoint tensor, and the tensor's rows; else None."""
    owner = _owner(key)
    shards = cls.fused_checkpoint.get(owner.rsplit(".", 1)[-1])
    if not shards or owner not in modules:
        return None
    specs, out, rows = modules[owner].shard_specs, [], 0
    for shard in shards:
        out.append((shard, rows))
        rows += specs[shard].full
    return out, rows


def _read(f, key: str, spec: ShardSpec | None, offset: int = 0, fused: bool = False) -> torch.Tensor:
    """The whole tensor, or only this rank's part of it, read from the file (only that part is read)."""
    return rank_part(spec, offset, fused, lambda: f.get_tensor(key), lambda index: f.get_slice(key)[index])


def rank_part(spec: ShardSpec | None, offset: int, fused: bool, whole, sliced) -> torch.Tensor:
    """A checkpoint tensor as this rank holds it: `whole()`, or only its rows / columns, `sliced(index)`,
    zero-padded past the end (a vocabulary); a shard of a fused checkpoint tensor starts `offset` rows in. The
    loader reads a file's slice, a weight update (weight_update.py) indexes a tensor in memory."""
    if spec is None or (not fused and spec.start == 0 and spec.stop == spec.full):
        return whole()
    stop = min(spec.stop, spec.full)
    part = sliced((slice(None),) * spec.dim + (slice(offset + spec.start, offset + max(stop, spec.start)),))
    missing = spec.stop - spec.start - part.shape[spec.dim]
    if missing > 0:
        pad = list(part.shape)
        pad[spec.dim] = missing
        part = torch.cat([part, part.new_zeros(pad)], dim=spec.dim)
    return part


def _target(key: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for fragment, (fused, shard) in packed.items():
        marker = f".{fragment}."
        if marker in key:
            return key.replace(marker, f".{fused}."), shard
    return key, None


def _checkpoint_key(name: str, shard: str | None, packed: dict[str, tuple[str, str]]) -> str:
    """The inverse of _target: the HuggingFace name of a parameter or of one shard of it."""
    if shard is None:
        return name
    for fragment, (fused, fused_shard) in packed.items():
        marker = f".{fused}."
        if fused_shard == shard and marker in name:
            return name.replace(marker, f".{fragment}.")
    return f"{name}[{shard}]"


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor, without a host sync; aminmax propagates NaN and is one pass over t."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _check_finite(params: dict, modules: dict, plan, dtype: torch.dtype) -> None:
    names = list(params)
    flags = torch.stack([_all_finite(params[name].detach()) for name in names])
    if bool(flags.all()):  # the only host sync of the check
        return
    entries = {(e.name, e.shard): e for _, file_entries in plan for e in file_entries if e.slot is None}
    for name, ok in zip(names, flags.tolist()):
        if ok:
            continue
        if isinstance(modules[_owner(name)], expert_weights.Experts):
            keys = sorted(e.key for _, file_entries in plan for e in file_entries if e.name == name)
            raise ValueError(f"{name}: expert weights loaded from {keys[0]!r} (and {len(keys) - 1} more tensors) "
                             f"hold NaN, infinite values or values beyond {dtype}; the checkpoint is corrupt, or "
                             f"load it with dtype='float32' or 'bfloat16'")
        param = params[name].detach()
        for shard in _shards(modules, name):
            view = param
            if shard is not None:
                offset, size = modules[_owner(name)].shard_offsets[shard]
                view = param.narrow(0, offset, size)
            if not bool(_all_finite(view)):
                raise _non_finite_error(entries[name, shard], dtype)


def _non_finite_error(entry: _Entry, dtype: torch.dtype) -> ValueError:
    with _open(entry.path) as f:
        source = f.get_tensor(entry.key)
    nan, inf = int(torch.isnan(source).sum()), int(torch.isinf(source).sum())
    if nan or inf:
        return ValueError(
            f"{entry.path}: tensor {entry.key!r} holds {nan} NaN and {inf} infinite values "
            f"(of {source.numel()}); the checkpoint is corrupt"
        )
    largest = float(source.abs().max())
    return ValueError(
        f"{entry.path}: tensor {entry.key!r} has values up to {largest:g}, beyond {dtype} "
        f"(largest {torch.finfo(dtype).max:g}); load it with dtype='float32' or 'bfloat16'"
    )
