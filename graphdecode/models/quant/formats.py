"""Each checkpoint format's tensors for one quantized linear -> a QuantizedTensor (tensor.py).

`parts(scheme)` names the tensors a linear `<module>.` holds ({suffix: required}); `check` validates their
safetensors headers against the linear's [N, K] before any weight is read; `read` builds the engine's form.
Packed integers are unpacked with compressed-tensors' own `unpack_from_int32` (its dense int32 packing is also
GPTQ's and, up to AWQ's column order, AWQ's). Shapes, per format ([N out, K in], G = ceil(K / group)):

| format | values | scales | zero points | other |
|---|---|---|---|---|
| pack-quantized | `weight_packed` I32 [N, ceil(K bits / 32)] | `weight_scale` [N, G] / [N, 1] / [1] |
  `weight_zero_point` I32 [ceil(N bits / 32), G] | `weight_shape` [2], `weight_g_idx` [K] |
| int-quantized | `weight` I8 [N, K] | `weight_scale` | `weight_zero_point` I8 [N, G] | |
| float-quantized | `weight` F8_E4M3 [N, K] | `weight_scale` [N, 1] / [1] / blocks | | `input_scale` [1] (static) |
| fp8-block | `weight` F8_E4M3 [N, K] | `weight_scale_inv` F32 [ceil(N / r), ceil(K / c)] | | |
| gptq | `qweight` I32 [K bits / 32, N] | `scales` [G, N] | `qzeros` I32 [G, N bits / 32] | `g_idx` I32 [K] |
| awq | `qweight` I32 [K, N bits / 32] | `scales` [G, N] | `qzeros` I32 [G, N bits / 32] | |
"""

from __future__ import annotations

import torch

from .config import WeightScheme
from .tensor import QuantizedTensor

FLOATS = ("F32", "F16", "BF16")
_AWQ_ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # dense nibble i of AWQ's words holds column ORDER[i]; inverse


def parts(scheme: WeightScheme) -> dict[str, bool]:
    """{suffix: required} of the tensors one quantized linear holds."""
    fmt = scheme.format
    if fmt == "pack-quantized":
        return {"weight_packed": True, "weight_scale": True, "weight_shape": True,
                "weight_zero_point": not scheme.symmetric, "weight_g_idx": scheme.act_order}
    if fmt == "int-quantized":
        return {"weight": True, "weight_scale": True, "weight_zero_point": not scheme.symmetric}
    if fmt == "float-quantized":
        return {"weight": True, "weight_scale": True, "input_scale": not scheme.dynamic_activations}
    if fmt == "fp8-block":
        return {"weight": True, "weight_scale_inv": True}
    if fmt == "gptq":
        return {"qweight": True, "qzeros": True, "scales": True, "g_idx": scheme.act_order}
    if fmt == "awq":
        return {"qweight": True, "qzeros": True, "scales": True}
    raise AssertionError(fmt)


def _groups(scheme: WeightScheme, k: int) -> int:
    return 1 if scheme.group is None else -(-k // scheme.group)


def check(scheme: WeightScheme, headers: dict[str, tuple[str, tuple[int, ...]]], module: str, n: int, k: int,
          where: str) -> None:
    """headers: {suffix: (safetensors dtype, shape)} of one linear whose float weight would be [n, k]."""
    def fail(suffix: str, what: str) -> ValueError:
        return ValueError(f"{where}: tensor {module + '.' + suffix!r} ({scheme.describe()}): {what}")

    def expect(suffix: str, dtypes: tuple[str, ...], *shapes: tuple[int, ...]) -> None:
        if suffix not in headers:
            return
        dtype, shape = headers[suffix]
        if dtype not in dtypes:
            raise fail(suffix, f"has dtype {dtype}, expected {' or '.join(dtypes)}")
        if shape not in shapes:
            raise fail(suffix, f"has shape {shape}, expected {' or '.join(map(str, shapes))} for a [{n}, {k}] "
                               f"weight (config.json)")

    for suffix, required in parts(scheme).items():
        if required and suffix not in headers:
            raise ValueError(f"{where}: tensor {module + '.' + suffix!r} is missing ({scheme.describe()} needs it)")
    fmt, bits = scheme.format, scheme.bits
    if scheme.group is not None and k % scheme.group and fmt in ("gptq", "awq", "pack-quantized", "int-quantized"):
        raise fail(next(iter(parts(scheme))), f"the group size {scheme.group} does not divide the {k} input columns")
    g = _groups(scheme, k)
    per_channel = [(n, 1), (1,), ()] if scheme.group is None else [(n, g)]
    if fmt == "pack-quantized":
        expect("weight_packed", ("I32",), (n, -(-k * bits // 32)))
        expect("weight_scale", FLOATS, *per_channel)
        expect("weight_shape", ("I64", "I32"), (2,))
        expect("weight_zero_point", ("I32",), (-(-n * bits // 32), g))
        expect("weight_g_idx", ("I32", "I64"), (k,))
        if not scheme.symmetric and scheme.group is None and headers["weight_scale"][1] != (n, 1):
            raise fail("weight_scale", "asymmetric weights need per-channel or per-group scales")
    elif fmt == "int-quantized":
        expect("weight", ("I8",), (n, k))
        expect("weight_scale", FLOATS, *per_channel)
        expect("weight_zero_point", ("I8", "I32"), (n, g))
    elif fmt == "float-quantized":
        expect("weight", ("F8_E4M3",), (n, k))
        if scheme.block is not None:
            r, c = scheme.block
            expect("weight_scale", FLOATS, (-(-n // r), -(-k // c)))
        else:
            expect("weight_scale", FLOATS, (n, 1), (1,), ())
        expect("input_scale", FLOATS, (1,), ())
    elif fmt == "fp8-block":
        r, c = scheme.block
        expect("weight", ("F8_E4M3",), (n, k))
        expect("weight_scale_inv", FLOATS, (-(-n // r), -(-k // c)))
    elif fmt == "gptq":
        if (k * bits) % 32:
            raise fail("qweight", f"{k} input columns do not pack into 32-bit words of {bits}-bit values")
        expect("qweight", ("I32",), (k * bits // 32, n))
        expect("qzeros", ("I32",), (g, -(-n * bits // 32)))
        expect("scales", FLOATS, (g, n))
        expect("g_idx", ("I32", "I64"), (k,))
    elif fmt == "awq":
        if (n * bits) % 32:
            raise fail("qweight", f"{n} output rows do not pack into 32-bit words of {bits}-bit values")
        expect("qweight", ("I32",), (k, n * bits // 32))
        expect("qzeros", ("I32",), (g, n * bits // 32))
        expect("scales", FLOATS, (g, n))


def read(scheme: WeightScheme, tensors: dict[str, torch.Tensor], module: str, n: int, k: int,
         where: str) -> QuantizedTensor:
    """The checkpoint's tensors of one linear (whole, as `check` passed them) -> its QuantizedTensor."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    fmt, bits = scheme.format, scheme.bits
    group = scheme.group or k
    zero = None
    input_scale = None
    if fmt == "pack-quantized":
        shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
        if shape != (n, k):
            raise ValueError(f"{where}: tensor {module + '.weight_shape'!r} says {list(shape)}, expected [{n}, {k}]")
        values = unpack_from_int32(tensors["weight_packed"], bits, torch.Size((n, k)))
        scale = _per_row(tensors["weight_scale"], n)
        if "weight_zero_point" in tensors and not scheme.symmetric:
            zero = unpack_from_int32(tensors["weight_zero_point"], bits, torch.Size((n, scale.shape[1])), packed_dim=0)
    elif fmt == "int-quantized":
        values = tensors["weight"]
        scale = _per_row(tensors["weight_scale"], n)
        if "weight_zero_point" in tensors and not scheme.symmetric:
            zero = tensors["weight_zero_point"].to(torch.int8)
    elif fmt in ("float-quantized", "fp8-block"):
        values = tensors["weight"]
        raw = tensors["weight_scale" if fmt == "float-quantized" else "weight_scale_inv"]
        if scheme.block is not None:
            r, group = scheme.block
            scale = raw.repeat_interleave(r, dim=0)[:n].contiguous()
        else:
            scale = _per_row(raw, n)
        if "input_scale" in tensors and not scheme.dynamic_activations:
            input_scale = tensors["input_scale"].float().reshape(())
    elif fmt == "gptq":
        values = unpack_from_int32(tensors["qweight"], bits, torch.Size((k, n)), packed_dim=0).t()
        scale = tensors["scales"].t()
        zero = unpack_from_int32(tensors["qzeros"], bits, torch.Size((scale.shape[1], n))).t()
        if scheme.zeros_minus_one:
            zero = zero + 1
    elif fmt == "awq":
        columns = torch.arange(n).view(-1, 8)[:, _AWQ_ORDER].reshape(-1) if n % 8 == 0 else None
        values = unpack_from_int32(tensors["qweight"], bits, torch.Size((k, n)))[:, columns].t()
        scale = tensors["scales"].t()
        zero = unpack_from_int32(tensors["qzeros"], bits, torch.Size((scale.shape[0], n)))[:, columns].t()
    else:
        raise AssertionError(fmt)
    if not bool(torch.isfinite(scale).all()):
        suffix = {"gptq": "scales", "awq": "scales", "fp8-block": "weight_scale_inv"}.get(fmt, "weight_scale")
        raise ValueError(f"{where}: tensor {module + '.' + suffix!r} holds NaN or infinite scales")
    if values.dtype == torch.float8_e4m3fn and bool(((values.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise ValueError(f"{where}: tensor {module + '.weight'!r} holds NaN weights")  # E4M3's only NaN: S.1111.111
    if zero is not None and scheme.symmetric and not bool(zero.any()):
        zero = None  # gptq's symmetric zero points: all at the midpoint
    qt = QuantizedTensor(values.contiguous(), scale.contiguous(), None if zero is None else zero.contiguous(),
                         group, bits, None, input_scale)
    g_idx = tensors.get("g_idx", tensors.get("weight_g_idx"))
    if g_idx is not None:
        qt = _act_order(qt, g_idx.long(), module, where)
    return qt


def _per_row(scale: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G], [N, 1], [1] or [] -> [N, G]."""
    if scale.dim() == 2:
        return scale
    return scale.reshape(1, 1).expand(n, 1)


def _act_order(qt: QuantizedTensor, g_idx: torch.Tensor, module: str, where: str) -> QuantizedTensor:
    """Columns sorted by group (stably), so each group's columns are contiguous; perm remembers the order."""
    k = qt.values.shape[1]
    groups = qt.scale.shape[1]
    if torch.equal(g_idx, torch.arange(k) // qt.group):
        return qt
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{where}: tensor {module + '.g_idx'!r} names groups outside [0, {groups})")
    counts = torch.bincount(g_idx, minlength=groups)
    if not bool((counts == qt.group).all()):
        raise ValueError(f"{where}: tensor {module + '.g_idx'!r} does not give every group {qt.group} columns")
    perm = torch.argsort(g_idx, stable=True)
    return QuantizedTensor(qt.values[:, perm].contiguous(), qt.scale, qt.zero, qt.group, qt.bits, perm,
                           qt.input_scale)
