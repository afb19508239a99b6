"""One quantized weight in the engine's own form, whichever checkpoint format it came from (formats.py).

W [N out, K in] = (values - zero) * scale, each scale column covering `group` input columns:

* `values`: [N, K] int8 holding the integers (signed: a 4-bit value lies in [-8, 7], as compressed-tensors
  unpacks them; unsigned checkpoints are shifted by 2^(bits-1), and so are their zero points), or FP8 E4M3;
* `scale`: [N, ceil(K / group)] in the checkpoint's scale dtype (one per row: group = K; per tensor: one value
  repeated; FP8 block scales repeated over their rows);
* `zero`: [N, ceil(K / group)] int8, or None (symmetric);
* `perm`: None, or, for activation-ordered checkpoints (gptq desc_act), the input order: column j of `values`
  is input column perm[j], so that each group's columns are contiguous (the forward gathers x[:, perm]).

`dequantize` is the reference: (values - zero) * scale computed in the scale's dtype, as compressed-tensors'
`dequantize` and GPTQ / AWQ's reference kernels compute it, then cast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class QuantizedTensor:
    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int
    bits: int
    perm: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None  # FP8 with static activation scales: one per tensor (float32)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @property
    def is_float(self) -> bool:
        return self.values.dtype == torch.float8_e4m3fn

    def expanded_scale(self) -> torch.Tensor:
        """[N, K]: each column's scale."""
        return self.scale.repeat_interleave(self.group, dim=1)[:, : self.values.shape[1]]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in the checkpoint's input order."""
        scale = self.scale.repeat_interleave(self.group, dim=1)[:, : self.values.shape[1]]
        w = self.values.to(scale.dtype)
        if self.zero is not None:
            w = w - self.zero.repeat_interleave(self.group, dim=1)[:, : self.values.shape[1]].to(scale.dtype)
        w = (w * scale).to(dtype)
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w

    def rows(self, start: int, stop: int) -> QuantizedTensor:
        """Rows [start, stop), zero-padded past N (padded rows dequantize to 0)."""
        n = self.values.shape[0]
        take = slice(start, min(stop, n))
        values, scale = self.values[take], self.scale[take]
        zero = None if self.zero is None else self.zero[take]
        missing = stop - start - values.shape[0]
        if missing > 0:
            values = torch.cat([values, values.new_zeros((missing, values.shape[1]))])
            scale = torch.cat([scale, scale.new_zeros((missing, scale.shape[1]))])
            zero = None if zero is None else torch.cat([zero, zero.new_zeros((missing, zero.shape[1]))])
        return replace(self, values=values, scale=scale, zero=zero)

    def columns(self, start: int, stop: int, where: str) -> QuantizedTensor:
        """Input columns [start, stop) (a row-parallel rank's share): whole groups only, checkpoint order."""
        k = self.values.shape[1]
        if start == 0 and stop == k:
            return self
        if self.perm is not None:
            raise ValueError(f"{where}: an activation-ordered weight (desc_act / actorder) cannot be split over "
                             f"tensor-parallel ranks by input columns")
        if self.group >= k:  # one scale per row: every rank keeps them all
            return replace(self, values=self.values[:, start:stop])
        if start % self.group or (stop - start) % self.group:
            raise ValueError(f"{where}: columns [{start}, {stop}) of a rank do not hold whole groups of "
                             f"{self.group}; choose a tensor-parallel size that splits the groups")
        g0, g1 = start // self.group, stop // self.group
        return replace(self, values=self.values[:, start:stop], scale=self.scale[:, g0:g1],
                       zero=None if self.zero is None else self.zero[:, g0:g1])

    @staticmethod
    def cat(parts: list[QuantizedTensor], where: str) -> QuantizedTensor:
        """Shards of a fused linear (q, k, v; gate, up) stacked by rows: they must be quantized alike."""
        first = parts[0]
        if len(parts) == 1:
            return first
        for p in parts[1:]:
            same_perm = (first.perm is None) == (p.perm is None) and (
                first.perm is None or torch.equal(first.perm, p.perm))
            if (p.group != first.group or p.bits != first.bits or p.values.dtype != first.values.dtype
                    or p.scale.dtype != first.scale.dtype
                    or p.scale.shape[1] != first.scale.shape[1] or not same_perm):
                raise ValueError(f"{where}: the fused projections are quantized differently (group size, bits, "
                                 f"scale dtype or activation order); they must match to run as one")
        input_scale = None
        if first.input_scale is not None:  # one static activation scale for the fused input: the largest
            input_scale = torch.stack([p.input_scale for p in parts]).amax()
        zero = None
        if any(p.zero is not None for p in parts):  # a shard whose zero points all vanished keeps zeros
            zero = torch.cat([p.zero if p.zero is not None else torch.zeros(p.scale.shape, dtype=torch.int8)
                              for p in parts])
        return QuantizedTensor(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), zero,
                               first.group, first.bits, first.perm, input_scale)

    def to(self, device: torch.device) -> QuantizedTensor:
        move = (lambda t: None if t is None else t.to(device))
        return QuantizedTensor(move(self.values), move(self.scale), move(self.zero), self.group, self.bits,
                               move(self.perm), move(self.input_scale))

    @property
    def nbytes(self) -> int:
        """Bytes as stored (values at `bits` each, scales and zeros)."""
        values = self.values.numel() * self.bits // 8
        extra = sum(t.numel() * t.element_size() for t in (self.scale, self.zero, self.perm) if t is not None)
        return values + extra
