"""The writer's rounding of a float weight into an integer format: per-group scales and zero points chosen over a clip
grid, the integers, and the weight read back from them (what rtn.py writes and awq.py's search measures)."""

from __future__ import annotations

import torch

CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # the ranges each group tries (fractions of min-max)


def int_scales(w: torch.Tensor, bits: int, group: int | None, symmetric: bool,
               inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales [N, G] (float32) and signed zero points [N, G] (int8; zeros when symmetric): per group, the min-max
    range shrunk by the CLIP_GRID fraction whose rounding has the least squared error (clipping a few outliers
    buys finer steps for the rest; still round-to-nearest). inputs [G, g, g] (calibration, awq.py): the second
    moments E[x x^T] of each group's input columns; the error measured is then the group's output error,
    d E[x x^T] d^T for the rounding error d, instead of the weight's (AWQ's clip search)."""
    n, k = w.shape
    g = group or k
    blocks = w.float().reshape(n, k // g, g)
    if inputs is not None:
        inputs = inputs.to(blocks.device, torch.float32)
    best_err, best = None, None
    for clip in CLIP_GRID:
        if symmetric:
            scale = (blocks.abs().amax(-1) * clip / (2 ** (bits - 1) - 1)).clamp(min=1e-8)
            zero = torch.zeros(scale.shape, device=scale.device)
        else:
            low, high = blocks.amin(-1).clamp(max=0) * clip, blocks.amax(-1).clamp(min=0) * clip
            scale = ((high - low) / (2**bits - 1)).clamp(min=1e-8)
            zero = (torch.round(-low / scale) - 2 ** (bits - 1)).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        q = (torch.round(blocks / scale[..., None]) + zero[..., None]).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        diff = (q - zero[..., None]) * scale[..., None] - blocks
        if inputs is None:
            err = diff.pow(2).sum(-1)
        else:  # per group: d E[x x^T] d^T
            err = (torch.bmm(diff.transpose(0, 1), inputs) * diff.transpose(0, 1)).sum(-1).T
        if best is None:
            best_err, best = err, (scale, zero)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better, scale, best[0]), torch.where(better, zero, best[1]))
    return best[0], best[1].to(torch.int8)


def int_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """round(w / scale) + zero, clamped: [N, K] int8."""
    n, k = w.shape
    g = k // scale.shape[1]
    q = torch.round(w.float() / scale.repeat_interleave(g, 1)) + zero.repeat_interleave(g, 1).float()
    return q.clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1).to(torch.int8)


def int_rounding(w: torch.Tensor, fmt: str, bits: int, group: int | None, symmetric: bool,
                  scale_dtype: torch.dtype, inputs: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale float32 [N, G] holding scale_dtype's values, zero int8 [N, G], values int8 [N, K]) of an int format."""
    scale, zero = int_scales(w, bits, group, symmetric, inputs)
    if fmt == "gptq":  # v1 stores zero points minus one: keep the unsigned zero >= 1
        zero = zero.clamp(min=1 - 2 ** (bits - 1))
    scale = scale.to(scale_dtype).float()  # round to the stored dtype first: the values use the stored scales
    return scale, zero, int_values(w, scale, zero, bits)


def round_trip(w: torch.Tensor, fmt: str, bits: int, group: int | None, symmetric: bool,
               scale_dtype: torch.dtype, inputs: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K] an int format's linear is read back as, (values - zero) * scale, after this
    writer's rounding of `w` (no input order; `inputs` as int_scales'): what AWQ's search (awq.py) measures its
    candidates by."""
    if group and w.shape[1] % group:
        raise ValueError(f"group: {group} does not divide the {w.shape[1]} input columns; choose a group size that "
                         "does")
    scale, zero, values = int_rounding(w.float(), fmt, bits, group, symmetric, scale_dtype, inputs)
    g = w.shape[1] // scale.shape[1]
    return (values.float() - zero.float().repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)
