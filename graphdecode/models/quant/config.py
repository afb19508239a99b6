"""config.json's `quantization_config` -> which linears hold quantized weights, and in which checkpoint format.

Read before any weight (`parse_quant_config`); a scheme this engine does not run is refused by name here. The
methods (quant_method) and what each one's checkpoint stores per quantized linear (formats.py reads them):

* `compressed-tensors` (llm-compressor): `config_groups` of `targets` ("Linear", a module name, or "re:<regex>")
  with their weight scheme, and an `ignore` list; the format per group or for the whole model:
  - `pack-quantized`: int4 / int8 weight-only, `weight_packed` (int32, dense packing), `weight_scale` per group,
    channel or tensor, `weight_zero_point` (asymmetric), `weight_shape`, `weight_g_idx` (activation ordering);
  - `int-quantized` / `naive-quantized`: int8 `weight` with its scales (and zero points);
  - `float-quantized`: FP8 E4M3 `weight` with per-tensor, per-channel or block `weight_scale`; activations dynamic
    per token or static (`input_scale`);
* `fp8` with `weight_block_size` (transformers' FineGrainedFP8, DeepSeek-V3 and the Qwen "-FP8" releases): FP8
  `weight` with `weight_scale_inv` per [128, 128] block, activations dynamic;
* `gptq` (AutoGPTQ / GPTQModel): `qweight`, `qzeros`, `scales`, `g_idx`, 4 or 8 bits, `desc_act` off or on,
  `checkpoint_format` "gptq" (zero points stored minus one) or "gptq_v2";
* `awq` (AutoAWQ, version "gemm"): `qweight` / `qzeros` packed along the output columns in AWQ's order, `scales`.

mxfp4 (gpt-oss's experts) stays `ModelConfig.quantization` (expert_weights.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "gptq", "awq")
FLOAT_FORMATS = ("float-quantized", "fp8-block")
METHODS = ("compressed-tensors", "fp8", "gptq", "awq")


@dataclass(frozen=True)
class WeightScheme:
    """How one linear's weight is quantized and stored."""

    format: str  # an INT_FORMATS or FLOAT_FORMATS name
    bits: int  # 4 or 8
    group: int | None = None  # input columns per scale (None: one scale per output row or per tensor)
    block: tuple[int, int] | None = None  # [rows, columns] per scale (FP8 block scales)
    symmetric: bool = True  # no zero points
    act_order: bool = False  # a group index per input column (gptq desc_act, compressed-tensors actorder)
    zeros_minus_one: bool = False  # gptq v1: the stored zero points are one less than the true ones
    dynamic_activations: bool = True  # FP8: activations scaled per token at run time (False: input_scale)

    @property
    def is_float(self) -> bool:
        return self.format in FLOAT_FORMATS

    def describe(self) -> str:
        kind = "fp8" if self.is_float else f"int{self.bits}"
        shape = (f"block {self.block[0]}x{self.block[1]}" if self.block else f"group {self.group}" if self.group
                 else "per channel")
        return f"{self.format} {kind} {shape}{'' if self.symmetric else ' asymmetric'}"


@dataclass(frozen=True)
class QuantConfig:
    method: str  # quant_method
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme): a name match, else the class
    ignore: tuple[str, ...] = ()
    quantize_head: bool = False  # whether "Linear" covers lm_head (compressed-tensors: unless ignored; gptq's flag)

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of the linear named `module` (HuggingFace name, e.g. model.layers.0.self_attn.q_proj),
        or None where it stays float."""
        if any(_matches(target, module) for target in self.ignore):
            return None
        for targets, scheme in self.groups:  # a module's name (or regex) first, as compressed-tensors matches
            if any(target != "Linear" and _matches(target, module) for target in targets):
                return scheme
        for targets, scheme in self.groups:  # then the class
            if "Linear" in targets and (module != "lm_head" or self.quantize_head):
                return scheme
        return None

    def describe(self) -> str:
        return f"{self.method} ({', '.join(sorted({s.describe() for _, s in self.groups}))})"


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def parse_quant_config(where: str, quant) -> QuantConfig:
    """quantization_config (a JSON object) -> QuantConfig; ValueError naming the field for anything not run."""
    field = f"{where}: quantization_config"
    if not isinstance(quant, dict):
        raise ValueError(f"{field}: must be an object")
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(field, quant)
    if method == "fp8":
        return _fp8(field, quant)
    if method == "gptq":
        return _gptq(field, quant)
    if method == "awq":
        return _awq(field, quant)
    raise ValueError(f"{field}: quant_method {method!r} is not supported (supported: {', '.join(METHODS)}; mxfp4 "
                     f"for gpt-oss)")


def _int(field: str, raw: dict, key: str, choices: tuple[int, ...] | None = None, default=None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or (choices is not None and value not in choices):
        allowed = f"one of {', '.join(map(str, choices))}" if choices else "an integer"
        raise ValueError(f"{field}.{key}: {value!r} is not supported (must be {allowed})")
    return value


def _group_size(field: str, raw: dict, key: str = "group_size") -> int | None:
    value = raw.get(key)
    if value is None or value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 16:
        raise ValueError(f"{field}.{key}: {value!r} must be a positive multiple of 16, or -1 for one per channel")
    return value


def _names(field: str, raw: dict, key: str) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field}.{key}: must be a list of module names")
    return tuple(value)


def _compressed_tensors(field: str, quant: dict) -> QuantConfig:
    if quant.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"{field}.quantization_status: {quant.get('quantization_status')!r} is not supported "
                         f"(only compressed checkpoints, as llm-compressor saves them)")
    kv_scheme = quant.get("kv_cache_scheme")
    if kv_scheme is not None:
        _check_kv_cache_scheme(f"{field}.kv_cache_scheme", kv_scheme)
    model_format = quant.get("format")
    groups = quant.get("config_groups")
    if groups in ({}, None) and kv_scheme is not None:
        groups = {}  # only the KV cache's scales (the weights are float)
    elif not isinstance(groups, dict) or not groups:
        raise ValueError(f"{field}.config_groups: must be a non-empty object")
    parsed = []
    for name, group in groups.items():
        where = f"{field}.config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{where}: must be an object")
        targets = _names(where, group, "targets")
        if not targets:
            raise ValueError(f"{where}.targets: must name at least one module")
        parsed.append((targets, _compressed_scheme(where, group, group.get("format") or model_format)))
    return QuantConfig("compressed-tensors", tuple(parsed), _names(field, quant, "ignore"), quantize_head=True)


def _check_kv_cache_scheme(field: str, scheme) -> None:
    """An FP8 KV cache's scheme: per-tensor E4M3, its scales the checkpoint's `self_attn.k_scale` / `v_scale`
    (the engine's kv_cache_dtype="fp8" reads them; the cache stays in the model's dtype otherwise)."""
    if not isinstance(scheme, dict):
        raise ValueError(f"{field}: must be an object")
    if scheme.get("type", "float") != "float" or scheme.get("num_bits", 8) != 8:
        raise ValueError(f"{field}: {scheme.get('num_bits')!r}-bit {scheme.get('type')!r} KV caches are not supported "
                         f"(FP8: num_bits 8, type float)")
    if scheme.get("strategy", "tensor") != "tensor":
        raise ValueError(f"{field}.strategy: {scheme.get('strategy')!r} is not supported (one scale per layer: "
                         f"'tensor')")
    if scheme.get("dynamic", False) not in (False, None):
        raise ValueError(f"{field}.dynamic: dynamic KV scales are not supported (static per-layer scales)")


def _compressed_scheme(where: str, group: dict, fmt) -> WeightScheme:
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{where}.weights: must be an object (weight quantization is required)")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: output quantization is not supported")
    kind = weights.get("type", "int")
    bits = _int(f"{where}.weights", weights, "num_bits", (4, 8) if kind == "int" else (8,))
    strategy = weights.get("strategy", "tensor")
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"{where}.weights.symmetric: must be true or false")
    if weights.get("dynamic", False):
        raise ValueError(f"{where}.weights.dynamic: dynamic weight scales are not supported")
    act_order = weights.get("actorder") not in (None, False)
    acts = group.get("input_activations")
    if kind == "int":
        if fmt not in ("pack-quantized", "int-quantized", "naive-quantized"):
            raise ValueError(f"{where}.format: {fmt!r} is not supported for int weights (pack-quantized, "
                             f"int-quantized, naive-quantized)")
        if acts is not None:
            raise ValueError(f"{where}.input_activations: int activations (W8A8 int) are not supported; weight-only "
                             f"int schemes (W4A16, W8A16) are")
        if strategy not in ("group", "channel", "tensor"):
            raise ValueError(f"{where}.weights.strategy: {strategy!r} is not supported for int weights "
                             f"(group, channel, tensor)")
        group_size = _group_size(f"{where}.weights", weights) if strategy == "group" else None
        if strategy == "group" and group_size is None:
            raise ValueError(f"{where}.weights.group_size: the group strategy needs a group size")
        return WeightScheme(fmt if fmt != "naive-quantized" else "int-quantized", bits, group_size,
                            symmetric=symmetric, act_order=act_order)
    if kind != "float":
        raise ValueError(f"{where}.weights.type: {kind!r} is not supported (int, float)")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"{where}.format: {fmt!r} is not supported for FP8 weights (float-quantized)")
    if not symmetric:
        raise ValueError(f"{where}.weights.symmetric: FP8 weights must be symmetric")
    block = None
    if strategy == "block":
        size = weights.get("block_structure")
        if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
            raise ValueError(f"{where}.weights.block_structure: must be [rows, columns]")
        block = (size[0], size[1])
    elif strategy not in ("channel", "tensor"):
        raise ValueError(f"{where}.weights.strategy: {strategy!r} is not supported for FP8 weights "
                         f"(channel, tensor, block)")
    dynamic = True
    if acts is not None:
        if not isinstance(acts, dict) or acts.get("type", "float") != "float" or acts.get("num_bits", 8) != 8:
            raise ValueError(f"{where}.input_activations: only FP8 activations are supported with FP8 weights")
        dynamic = bool(acts.get("dynamic", False))
        if acts.get("strategy", "tensor") not in ("token", "tensor", "group"):
            raise ValueError(f"{where}.input_activations.strategy: {acts.get('strategy')!r} is not supported "
                             f"(token, tensor, group)")
    return WeightScheme("float-quantized", 8, block=block, dynamic_activations=dynamic)


def _fp8(field: str, quant: dict) -> QuantConfig:
    size = quant.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise ValueError(f"{field}.weight_block_size: {size!r} is not supported (fp8 needs [rows, columns] "
                         f"block scales, e.g. [128, 128])")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{field}.activation_scheme: {quant.get('activation_scheme')!r} is not supported (dynamic)")
    scheme = WeightScheme("fp8-block", 8, block=(size[0], size[1]))
    return QuantConfig("fp8", ((("Linear",), scheme),), _names(field, quant, "modules_to_not_convert"))


def _gptq(field: str, quant: dict) -> QuantConfig:
    bits = _int(field, quant, "bits", (4, 8))
    fmt = quant.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{field}.checkpoint_format: {fmt!r} is not supported (gptq, gptq_v2)")
    sym = quant.get("sym", True)
    desc_act = quant.get("desc_act", False)
    if not isinstance(sym, bool) or not isinstance(desc_act, bool):
        raise ValueError(f"{field}: sym and desc_act must be true or false")
    scheme = WeightScheme("gptq", bits, _group_size(field, quant), symmetric=sym, act_order=desc_act,
                          zeros_minus_one=fmt == "gptq")
    head = quant.get("lm_head", False)
    return QuantConfig("gptq", ((("Linear",), scheme),), _names(field, quant, "modules_to_not_convert"),
                       quantize_head=bool(head))


def _awq(field: str, quant: dict) -> QuantConfig:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{field}.version: {quant.get('version')!r} is not supported (gemm)")
    bits = _int(field, quant, "bits", (4,), default=quant.get("w_bit"))
    group = _group_size(field, quant, "group_size" if "group_size" in quant else "q_group_size")
    if group is None:
        raise ValueError(f"{field}.group_size: AWQ needs a group size")
    if quant.get("zero_point", True) is not True:
        raise ValueError(f"{field}.zero_point: AWQ without zero points is not supported")
    scheme = WeightScheme("awq", bits, group, symmetric=False)
    return QuantConfig("awq", ((("Linear",), scheme),), _names(field, quant, "modules_to_not_convert"))
