"""The CPU paged-attention kernel (csrc/cpu_attention.cpp): built once per machine, called in place.

The torch reference gathers every row's pages into fresh tensors at every decode step and
layer; on a CPU that copy is most of attention's cost (SmolLM2's heads, batch 16, 200-token
rows, fp32: 3.6 ms a layer gathered, 0.7 ms read in place; batch 64, 300 tokens: 38 ms and
5.6 ms; profiling/bench_cpu.py's attention probe, BENCHMARKS.md section 12). The kernel reads K and V
straight from the pages through each row's block table, in float32 arithmetic, with the
attention variants (sliding window, soft-cap, sinks) as parameters.

`cpu_kernels()` loads the library that `pip install` built for this CPU into the package
(`graphdecode/_kernels/<source hash>-cpu-<cpu hash>/`), else builds it at first use with the
system C++ compiler (`build.build_cpu`, -march=native, a few seconds) into
`$GRAPHDECODE_CACHE/kernels/<same key>/`, and returns a `CpuKernels` (or None, with one
warning saying why, where no compiler works; GRAPHDECODE_CPU_KERNELS=0 turns it off): the
torch reference then runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from ..cache import cache_root
from . import build as kernel_build

logger = logging.getLogger("graphdecode")
ABI_VERSION = 25
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # csrc's DType for activations (cpu_common.h)
FP8_CODE = 2  # csrc's kFloat8E4M3: an FP8 KV cache (K / k_scale, V / v_scale)
_P, _I64, _F32, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class CpuKernels:
    """The loaded library: `paged_attention` writes out[...] from q over the paged cache."""

    supported_dtypes = tuple(DTYPE_CODES)
    MAX_HEAD_DIM = 1024  # csrc/cpu_attention.cpp's generic loop (an MLA latent's 576 fits)

    def __init__(self, path: str):
        self.path = path
        self._lib = ctypes.CDLL(path)
        if self._lib.graphdecode_cpu_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI {self._lib.graphdecode_cpu_abi_version()}, expected {ABI_VERSION}")
        fn = self._lib.graphdecode_cpu_paged_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _P, _P, _I64, _P, _P, _P] + [_I64] * 8 + [_F32, _I64, _F32, _P, _I32, _I32, _F32, _I32]
        self._fn = fn
        self._norm = self._lib.graphdecode_cpu_rms_norm_variant
        self._norm.restype = ctypes.c_int
        self._norm.argtypes = [_P] * 5 + [_I64] * 3 + [_F32, _I32, _I32, _I32]
        self._rope = self._lib.graphdecode_cpu_rope
        self._rope.restype = ctypes.c_int
        self._rope.argtypes = [_P] * 7 + [_I64] * 6 + [_I32, _I32]
        self._swiglu = self._lib.graphdecode_cpu_swiglu
        self._swiglu.restype = ctypes.c_int
        self._swiglu.argtypes = [_P, _I64, _I64, _P, _I32, _I32]
        self._panel_rows = self._lib.graphdecode_cpu_panel_rows
        self._panel_rows.restype = ctypes.c_int
        self._panel_rows.argtypes = [_P] + [_I64] * 3 + [_P, _I64, _P, _I64, _I32]
        self._mask = self._lib.graphdecode_cpu_mask_words
        self._mask.restype = ctypes.c_int
        self._mask.argtypes = [_P, _P, _P] + [_I64] * 4
        # bf16 panels in pairs ([P, ceil(K / 2), 64, 2], vdpbf16ps) when the library was built with avx512_bf16
        self.bf16_pairs = bool(self._lib.graphdecode_cpu_bf16_pairs())
        # their k pairs padded to a multiple of this (16: the AMX kernel runs them, csrc/cpu_linear.cpp)
        self.bf16_pair_rows = self._lib.graphdecode_cpu_bf16_pair_rows() if self.bf16_pairs else 1
        self._panel = self._lib.graphdecode_cpu_panel_linear
        self._panel.restype = ctypes.c_int
        self._panel.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32, _I32]
        self._panel_add = self._lib.graphdecode_cpu_panel_linear_add
        self._panel_add.restype = ctypes.c_int
        self._panel_add.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _P, _I64, _I32, _I32]
        self._panel_swiglu = self._lib.graphdecode_cpu_panel_linear_swiglu
        self._panel_swiglu.restype = ctypes.c_int
        self._panel_swiglu.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I32, _I32]
        self._qpanel = self._lib.graphdecode_cpu_qpanel_linear
        self._qpanel.restype = ctypes.c_int
        self._qpanel.argtypes = [_P, _I64, _I64, _I64, _P, _I32, _P, _P, _I64, _I64, _P, _P, _I64, _I32, _I32]
        self.vnni = bool(self._lib.graphdecode_cpu_qlinear_vnni())  # the integer dot-product kinds are built
        self._write_kv = self._lib.graphdecode_cpu_write_kv
        self._write_kv.restype = ctypes.c_int
        self._write_kv.argtypes = [_P] * 4 + [_I64] * 7 + [_I32, _I32, _F32, _F32]
        self._prefill = self._lib.graphdecode_cpu_prefill_attention
        self._prefill.restype = ctypes.c_int
        self._prefill.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _P] + [_I64] * 5 + [
            _F32, _I64, _P, _I32, _I32, _F32, _I32]
        self._layers = self._lib.graphdecode_cpu_decoder_layers
        self._layers.restype = ctypes.c_int
        self._layers.argtypes = [_P, _P, _P, _I64, _P, _I64] + [_P] * 4 + [_I64, _I64] + [_P] * 3 + [_I64] * 8 + [
            _F32, _I32, _I32, _P, _I64, _P, _I64]
        self._layers_scratch = self._lib.graphdecode_cpu_layers_scratch
        self._layers_scratch.restype = ctypes.c_int64
        self._layers_scratch.argtypes = [_I64] * 6
        self._delta = self._lib.graphdecode_cpu_delta_step
        self._delta.restype = ctypes.c_int
        self._delta.argtypes = [_P] * 8 + [_I64] * 5 + [_I32]
        self._advance = self._lib.graphdecode_cpu_automaton_advance
        self._advance.restype = ctypes.c_int
        self._advance.argtypes = [_P] * 8 + [_I64] * 3
        self._gumbel_argmax = self._lib.graphdecode_cpu_gumbel_argmax
        self._gumbel_argmax.restype = ctypes.c_int
        self._gumbel_argmax.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _I32]

    def paged_attention(self, out, q, kv, block_table, *, positions=None, seq_lens=None, scale: float,
                        window_left: int = -1, soft_cap: float = 0.0, sinks=None, k_scale: float = 1.0,
                        v_scale: float = 1.0, threads: int | None = None) -> None:
        """out, q [B, Q, H, D] contiguous; kv [pages, 2, P, H_kv, D] contiguous, q's dtype or float8_e4m3fn
        (then holding K / k_scale and V / v_scale); block_table [B, W] int32 with unit column stride; positions
        [B, Q] int64 contiguous, or seq_lens [B] int32 (Q = 1, the query at seq_len - 1); sinks [H] float32 or
        None. All CPU tensors. The rows go over `threads` (default torch's) threads; a row's result does not
        depend on it."""
        rows, queries, heads, head_dim = q.shape
        kv_code, scale, out_scale = _kv_terms(kv, q.dtype, scale, k_scale, v_scale)
        err = self._fn(
            q.data_ptr(), kv.data_ptr(), block_table.data_ptr(), block_table.stride(0),
            positions.data_ptr() if positions is not None else None,
            seq_lens.data_ptr() if seq_lens is not None else None, out.data_ptr(),
            rows, queries, heads, kv.shape[3], head_dim, kv.shape[2], block_table.shape[1], kv.shape[0],
            scale, window_left, soft_cap, sinks.data_ptr() if sinks is not None else None, DTYPE_CODES.get(q.dtype, -1),
            kv_code, out_scale, _threads(threads),
        )
        if err:
            raise ValueError(f"graphdecode_cpu_paged_attention rejected its arguments: q {tuple(q.shape)} "
                             f"{q.dtype}, kv {tuple(kv.shape)}, block_table {tuple(block_table.shape)}")

    @staticmethod
    def prefill_supports(head_dim: int) -> bool:
        """Whether `prefill_attention` takes this head size (csrc/cpu_prefill.cpp: a multiple of 16)."""
        return head_dim % 16 == 0 and 16 <= head_dim <= 512

    def prefill_attention(self, q, kv, block_table, q_starts, q_lens, kv_lens, *, scale: float,
                          window_left: int = -1, sinks=None, k_scale: float = 1.0, v_scale: float = 1.0,
                          threads: int | None = None):
        """Causal attention of prefill chunks over the paged cache (their own K/V already written):
        sequence b's queries are q[q_starts[b] : q_starts[b] + q_lens[b]] (q [T, H, D], any token stride) at
        positions kv_lens[b] - q_lens[b] .. kv_lens[b] - 1, over its keys 0 .. kv_lens[b] - 1 read through
        block_table [B, W] int32. q_starts / q_lens / kv_lens: [B] int64 CPU tensors. -> out [T, H, D].
        A page outside the cache, or lengths the table cannot hold, is a ValueError (nothing computed). An
        FP8 cache (float8_e4m3fn) holds K / k_scale and V / v_scale."""
        q = _heads_contiguous(q)
        kv_code, scale, out_scale = _kv_terms(kv, q.dtype, scale, k_scale, v_scale)
        tokens, heads, head_dim = q.shape
        out = torch.empty((tokens, heads, head_dim), dtype=q.dtype)
        arrays = [_dense(t, torch.int64) for t in (q_starts, q_lens, kv_lens)]
        if (block_table.dtype != torch.int32 or block_table.stride(1) != 1 or not kv.is_contiguous()
                or kv_code < 0 or kv.shape[4] != head_dim or len({a.shape[0] for a in arrays}) != 1
                or (sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()))) or self._prefill(
                q.data_ptr(), tokens, q.stride(0), kv.data_ptr(), block_table.data_ptr(), block_table.stride(0),
                block_table.shape[1], kv.shape[0], out.data_ptr(), out.stride(0), *(a.data_ptr() for a in arrays),
                arrays[0].shape[0], heads, kv.shape[3], head_dim, kv.shape[2], scale, window_left,
                sinks.data_ptr() if sinks is not None else None, DTYPE_CODES.get(q.dtype, -1), kv_code, out_scale,
                _threads(threads)):
            raise ValueError(f"graphdecode_cpu_prefill_attention rejected q {tuple(q.shape)} {q.dtype}, kv "
                             f"{tuple(kv.shape)}, block_table {tuple(block_table.shape)} (a page outside the cache, "
                             f"or more pages than the table holds?)")
        return out

    def layers_scratch(self, rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> int:
        """Elements of scratch `decoder_layers` needs for `rows` rows."""
        return self._layers_scratch(rows, hidden, heads, kv_heads, head_dim, inter)

    def decoder_layers(self, words, quant, reals, num_layers: int, x, positions, seq_lens, slots, block_table, cos,
                       sin, scratch, dims, page_size: int, num_pages: int, eps: float,
                       threads: int | None = None, lora=None) -> None:
        """A decode step's Llama layers in one call (csrc/cpu_layers.cpp; models/cpu_decode.py builds the
        tables): x [M, hidden] contiguous, in place. lora: (each row's adapter slot [M] int64, max_loras, scratch
        [M, cols] of x's dtype) where the quant table names LoRA panels, else None. A position past the rotary
        table, a slot outside the cache or an adapter slot past max_loras is a ValueError before any work."""
        hidden, heads, kv_heads, head_dim, inter = dims
        rows = x.shape[0]
        positions, slots = _dense(positions, torch.int64), _dense(slots, torch.int64)
        seq_lens = _dense(seq_lens, torch.int32)
        lora_slots, loras, lora_scratch = lora if lora is not None else (None, 0, None)
        if lora_slots is not None:
            lora_slots = _dense(lora_slots, torch.int64)
        if (x.shape != (rows, hidden) or not x.is_contiguous() or positions.shape != (rows,) or slots.shape != (rows,)
                or seq_lens.shape != (rows,) or block_table.stride(1) != 1 or block_table.dtype != torch.int32
                or scratch.numel() < self.layers_scratch(rows, *dims) or words.shape[0] < num_layers
                or quant.shape[0] < num_layers or quant.dtype != torch.int64
                or (lora_slots is not None and (lora_slots.shape != (rows,) or lora_scratch.dtype != x.dtype
                                                or lora_scratch.shape[0] < rows or not lora_scratch.is_contiguous()))
                ) or self._layers(
                words.data_ptr(), quant.data_ptr(), reals.data_ptr(), num_layers, x.data_ptr(), rows, positions.data_ptr(),
                seq_lens.data_ptr(), slots.data_ptr(), block_table.data_ptr(), block_table.stride(0),
                block_table.shape[1], cos.data_ptr(), sin.data_ptr(), scratch.data_ptr(), hidden, heads, kv_heads,
                head_dim, inter, page_size, num_pages, cos.shape[0], eps, DTYPE_CODES.get(x.dtype, -1), _threads(threads),
                lora_slots.data_ptr() if lora_slots is not None else None, loras,
                lora_scratch.data_ptr() if lora_scratch is not None else None,
                lora_scratch.shape[1] if lora_scratch is not None else 0):
            raise ValueError(f"graphdecode_cpu_decoder_layers rejected x {tuple(x.shape)} {x.dtype}, positions "
                             f"{positions.tolist()[:8]}, slots {slots.tolist()[:8]} (a position past the rotary "
                             f"table's {cos.shape[0]} rows, a slot outside the cache's {num_pages * page_size}, or "
                             f"an adapter slot past max_loras?)")

    def write_kv(self, kv, k, v, slots, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """k, v [T, H_kv, D] into kv [pages, 2, P, H_kv, D] at slots [T] int64 (page * P + offset), in place:
        kv_cache.write_kv's eight torch ops in one call (an FP8 cache: k / k_scale and v / v_scale, rounded
        and saturated as kv_cache.write_kv does). A slot outside the cache is a ValueError (nothing written)."""
        k, v = _heads_contiguous(_ready(k)), _heads_contiguous(_ready(v))
        slots = _dense(slots, torch.int64)
        pages, _, page_size, kv_heads, head_dim = kv.shape
        kv_code = _kv_terms(kv, k.dtype, 1.0, k_scale, v_scale)[0]
        if (kv_code < 0 or v.dtype != k.dtype or k.shape[1:] != (kv_heads, head_dim) or v.shape != k.shape
                or slots.shape != k.shape[:1] or not kv.is_contiguous()) or self._write_kv(
                kv.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), k.shape[0], kv_heads, head_dim,
                k.stride(0), v.stride(0), page_size, pages, DTYPE_CODES.get(k.dtype, -1), kv_code, 1.0 / k_scale,
                1.0 / v_scale):
            raise ValueError(f"graphdecode_cpu_write_kv rejected k {tuple(k.shape)} {k.dtype}, kv {tuple(kv.shape)} "
                             f"{kv.dtype}, slots {tuple(slots.shape)} (a slot outside the cache's "
                             f"{pages * page_size}?)")

    # Fused decoder-layer passes (csrc/cpu_fused.cpp): torch's arithmetic in one pass each, rows over
    # `threads` (default torch's) threads once a call is large enough. Inputs are CPU tensors in a supported
    # dtype whose last dim is contiguous; outputs are new contiguous tensors.
    def delta_step(self, state, slots, q, k, v, decay, beta, threads: int | None = None):
        """One decode step of the gated delta rule in place on state [slots, H, Dk, Dv] float32 at the rows'
        slots [B] int64: q, k [B, H, Dk], v [B, H, Dv], decay and beta [B, H] (float32) -> out [B, H, Dv] (csrc/
        cpu_recurrent.cpp; rows on the scratch slot 0 are skipped and read zeros)."""
        rows, heads, dk = q.shape
        dv = v.shape[-1]
        q, k, v, decay, beta = (_dense(t, torch.float32) for t in (q, k, v, decay, beta))
        slots = _dense(slots, torch.int64)
        out = torch.empty((rows, heads, dv), dtype=torch.float32)
        err = self._delta(state.data_ptr(), slots.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                          decay.data_ptr(), beta.data_ptr(), out.data_ptr(), rows, heads, dk, dv, state.shape[0],
                          _threads(threads))
        if err:
            raise ValueError(f"graphdecode_cpu_delta_step rejected q {tuple(q.shape)}, state {tuple(state.shape)} "
                             f"(error {err})")
        return out

    NORM_MODES = {"llama": 0, "offset": 1, "weight_fp32": 2}  # csrc/cpu_fused.cpp: NormMode

    def add_rms_norm(self, x, residual, weight, eps: float, threads: int | None = None, mode: str = "llama"):
        """(x + residual, its RMSNorm), or (x, its norm) when residual is None; x [T, H]. mode: "llama"
        (LlamaRMSNorm), "offset" (Gemma's: (1 + w) times the float32 normalised value) or "weight_fp32"
        (gpt-oss's: w times it), the last two rounded once."""
        x, residual = _ready(x), _ready(residual)
        rows, hidden = x.shape
        out = torch.empty((rows, hidden), dtype=x.dtype)
        total = torch.empty_like(out) if residual is not None else x
        err = self._norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                         out.data_ptr(), total.data_ptr() if residual is not None else None, rows, hidden,
                         x.stride(0), eps, self.NORM_MODES[mode], DTYPE_CODES[x.dtype], _threads(threads))
        if err:
            raise ValueError(f"graphdecode_cpu_rms_norm_variant rejected x {tuple(x.shape)} {x.dtype} ({mode})")
        return total, out

    def rope(self, q, k, cos, sin, positions, threads: int | None = None):
        """q [T, Hq, D], k [T, Hk, D] (token stride free, heads contiguous) rotated by the table rows at
        positions [T] int64 -> new contiguous (q, k)."""
        tokens, q_heads, dim = q.shape
        q_out, k_out = torch.empty((tokens, q_heads, dim), dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        err = self._rope(q.data_ptr(), k.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), positions.data_ptr(), tokens, q_heads, k.shape[1], dim, q.stride(0),
                         k.stride(0), DTYPE_CODES[q.dtype], _threads(threads))
        if err:
            raise ValueError(f"graphdecode_cpu_rope rejected q {tuple(q.shape)}, k {tuple(k.shape)}")
        return q_out, k_out

    def swiglu(self, gate_up, threads: int | None = None):
        """silu(gate) * up of a fused gate_up [T, 2 * I] (row stride 2 * I) -> new [T, I], with torch's roundings
        (silu rounded to the dtype, then the product): one pass where torch takes three."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        if width % 2 or not gate_up.is_contiguous() or gate_up.dtype not in DTYPE_CODES or self._swiglu(
                gate_up.data_ptr(), rows, width // 2, out.data_ptr(), DTYPE_CODES[gate_up.dtype], _threads(threads)):
            raise ValueError(f"graphdecode_cpu_swiglu rejected gate_up {tuple(gate_up.shape)} {gate_up.dtype}")
        return out

    def panel_rows(self, panels: torch.Tensor, ids: torch.Tensor, k: int, threads: int | None = None):
        """W[ids] -> new [n, k] of the panels' dtype, read from W's column panels ([P, R, 64] or bf16 pairs [P, R,
        64, 2]; ids [n] int64 in 0 .. 64 P - 1, checked): an embedding lookup in a tied head's panels."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.shape[0], k), dtype=panels.dtype)
        unit = panels.element_size() * (panels.shape[3] if panels.dim() == 4 else 1)
        if not panels.is_contiguous() or self._panel_rows(
                panels.data_ptr(), panels.shape[0], panels.shape[1], unit, ids.data_ptr(), ids.shape[0],
                out.data_ptr(), k * panels.element_size(), _threads(threads)):
            raise ValueError(f"graphdecode_cpu_panel_rows rejected panels {tuple(panels.shape)} {panels.dtype}, "
                             f"{ids.shape[0]} ids (each in 0 .. {panels.shape[0] * 64 - 1}), k {k}")
        return out

    def pair_rows_for(self, k: int) -> int:
        """The k pairs of a bf16 pair panel over K = k inputs: ceil(k / 2), padded to `bf16_pair_rows`."""
        pairs, align = (k + 1) // 2, self.bf16_pair_rows
        return (pairs + align - 1) // align * align

    def _panels_fit(self, x, panels, k: int) -> bool:
        """Whether `panels` are panel_linear's layout for x's dtype over k inputs."""
        pairs = x.dtype == torch.bfloat16 and self.bf16_pairs
        return (x.dtype in DTYPE_CODES and panels.dtype == x.dtype and panels.dim() == 3 + pairs
                and panels.shape[1] == (self.pair_rows_for(k) if pairs else k))

    def panel_linear(self, x, panels, out_features: int, bias=None, threads: int | None = None):
        """x [..., K] @ W^T (+ bias) -> new [..., N], W held as panels [ceil(N / 64), K, 64] (models/cpu_linear.py:
        PanelWeight; csrc/cpu_linear.cpp; bf16 with `bf16_pairs`: [ceil(N / 64), pair_rows_for(K), 64, 2]), x, panels,
        bias and the result all float32 or all bf16 (float32 sums), on `threads` (default torch's) threads; the
        result depends neither on their number nor on the number of rows."""
        x, x2, lead, k, y = _linear_io(x, out_features)
        if not self._panels_fit(x, panels, k) or (bias is not None and bias.dtype != x.dtype) or self._panel(
                x2.data_ptr(), x2.shape[0], k, x2.stride(0), panels.data_ptr(), out_features,
                bias.data_ptr() if bias is not None else None, y.data_ptr(), out_features,
                _threads(threads), DTYPE_CODES[x.dtype]):
            raise ValueError(f"graphdecode_cpu_panel_linear rejected x {tuple(x.shape)} {x.dtype}, panels "
                             f"{tuple(panels.shape)} {panels.dtype}, {out_features} outputs")
        return y.view(*lead, out_features)

    def panel_linear_add(self, x, panels, out_features: int, add, threads: int | None = None):
        """x [..., K] @ W^T + add -> new [..., N] in one pass (panel_linear's panels; add [..., N] of x's dtype, its
        rows contiguous): the projection's outputs rounded to the dtype, then the sum rounded again, the bits of
        panel_linear then `add + result`."""
        x, x2, lead, k, y = _linear_io(x, out_features)
        add2 = add.reshape(-1, out_features)
        if not self._panels_fit(x, panels, k) or add.dtype != x.dtype or (
                add2.shape[0] != x2.shape[0] or add2.stride(1) != 1) or self._panel_add(
                x2.data_ptr(), x2.shape[0], k, x2.stride(0), panels.data_ptr(), out_features, add2.data_ptr(),
                add2.stride(0), y.data_ptr(), out_features, _threads(threads), DTYPE_CODES[x.dtype]):
            raise ValueError(f"graphdecode_cpu_panel_linear_add rejected x {tuple(x.shape)} {x.dtype}, panels "
                             f"{tuple(panels.shape)}, add {tuple(add.shape)} {add.dtype}, {out_features} outputs")
        return y.view(*lead, out_features)

    def panel_linear_swiglu(self, x, panels, inter: int, threads: int | None = None):
        """silu(gate) * up of x [..., K] @ [gate | up]^T -> new [..., inter] in one pass: the panels of the fused
        [2 * inter, K] projection (as panel_linear's), inter a multiple of 64. The same bits as panel_linear then
        swiglu; the [..., 2 * inter] projection is never written."""
        x, x2, lead, k, y = _linear_io(x, inter)
        if not self._panels_fit(x, panels, k) or panels.shape[0] != 2 * inter // 64 or (
                self._panel_swiglu(x2.data_ptr(), x2.shape[0], k, x2.stride(0), panels.data_ptr(), inter, y.data_ptr(),
                                   inter, _threads(threads), DTYPE_CODES[x.dtype])):
            raise ValueError(f"graphdecode_cpu_panel_linear_swiglu rejected x {tuple(x.shape)} {x.dtype}, panels "
                             f"{tuple(panels.shape)} {panels.dtype}, inter {inter}")
        return y.view(*lead, inter)

    QUANT_KINDS = {"int8": 0, "int4": 1, "fp8": 2, "int8_vnni": 3, "int4_vnni": 4}
    # bytes per panel row of each kind's layout, and k values per such row (csrc/cpu_qlinear.cpp)
    _PANEL_ROWS = {"int8": (64, 1), "int4": (64, 2), "fp8": (64, 1), "int8_vnni": (256, 4), "int4_vnni": (256, 8)}

    def qpanel_linear(self, x, panels, kind: str, scales, offsets, group: int, out_features: int, bias=None,
                      threads: int | None = None):
        """x [..., K] @ W^T (+ bias) -> new [..., N], W quantized in panels of bytes (csrc/cpu_qlinear.cpp; kind
        int8, int4 or fp8: panels [ceil(N / 64), K (int4: K / 2), 64] uint8; int8_vnni / int4_vnni, the integer
        dot products' layout with activations quantized per 32 columns: [ceil(N / 64), K / 4 (K / 8), 64, 4]),
        scales and offsets (or None; the vnni kinds need them) [ceil(N / 64), K / group, 64] float32; x, bias and
        the result float32 or bf16."""
        x, x2, lead, k, y = _linear_io(x, out_features)
        row_bytes, per_row = self._PANEL_ROWS[kind]
        if x.dtype not in DTYPE_CODES or panels.dtype != torch.uint8 or panels[0].numel() != (k // per_row) * row_bytes or (
                k % per_row) or (
                scales.dtype != torch.float32) or (bias is not None and bias.dtype != x.dtype) or self._qpanel(
                x2.data_ptr(), x2.shape[0], k, x2.stride(0), panels.data_ptr(), self.QUANT_KINDS[kind],
                scales.data_ptr(), offsets.data_ptr() if offsets is not None else None, group, out_features,
                bias.data_ptr() if bias is not None else None, y.data_ptr(), out_features, _threads(threads),
                DTYPE_CODES[x.dtype]):
            raise ValueError(f"graphdecode_cpu_qpanel_linear rejected x {tuple(x.shape)} {x.dtype}, {kind} panels "
                             f"{tuple(panels.shape)}, group {group}, {out_features} outputs")
        return y.view(*lead, out_features)

    # The structured-outputs step's two pieces (token_mask.py, structured_tables.py), eager CPU windows only.
    def mask_words_(self, logits, words, active) -> None:
        """In place: -inf where a token's bit is clear in its row's words, in the active rows (token_mask.py)."""
        rows, vocab = logits.shape
        words, active = words.contiguous(), active.to(torch.uint8).contiguous()
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or words.dtype != torch.int32:
            raise ValueError(f"graphdecode_cpu_mask_words: logits {logits.dtype}, words {words.dtype}")
        if self._mask(logits.data_ptr(), words.data_ptr(), active.data_ptr(), rows, vocab, words.shape[1],
                      logits.stride(0)):
            raise ValueError(f"graphdecode_cpu_mask_words rejected logits {tuple(logits.shape)}, words "
                             f"{tuple(words.shape)}")

    def gumbel_argmax(self, logits, seeds, positions, vocab_keys, threads: int | None = None):
        """[R] int64: argmax over each row of logits [R, V] float32 plus the sampler's Gumbel noise keyed by its
        seed and position (seeds, positions [R] int64) and vocab_keys [V] int32 (device/sampler.py), in one pass
        (csrc/cpu_sampling.cpp)."""
        rows, vocab = logits.shape
        seeds, positions = seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        vocab_keys = vocab_keys.contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or vocab_keys.dtype != torch.int32 or \
                vocab_keys.shape[0] != vocab or seeds.shape != (rows,) or positions.shape != (rows,) or \
                self._gumbel_argmax(logits.data_ptr(), rows, vocab, logits.stride(0), seeds.data_ptr(),
                                    positions.data_ptr(), vocab_keys.data_ptr(), out.data_ptr(), _threads(threads)):
            raise ValueError(f"graphdecode_cpu_gumbel_argmax rejected logits {tuple(logits.shape)} {logits.dtype}, "
                             f"seeds {tuple(seeds.shape)}, positions {tuple(positions.shape)}, vocab keys "
                             f"{tuple(vocab_keys.shape)} {vocab_keys.dtype}")
        return out

    def automaton_advance(self, tables, states, tokens):
        """[R] states, [R] tokens -> [R] int32 next states (structured_tables.StructuredTables.advance)."""
        states = states.to(torch.int32).contiguous()
        tokens = tokens.to(torch.int64).contiguous()
        out = torch.empty(states.shape, dtype=torch.int32)
        err = self._advance(states.data_ptr(), tokens.data_ptr(), tables.exc_start.data_ptr(),
                            tables.exc_count.data_ptr(), tables.exc_tokens.data_ptr(), tables.exc_next.data_ptr(),
                            tables.default_next.data_ptr(), out.data_ptr(), states.shape[0],
                            tables.default_next.shape[0], tables.exc_tokens.shape[0])
        if err:
            raise ValueError(f"graphdecode_cpu_automaton_advance: a state out of range ({states.tolist()[:8]})")
        return out


def _kv_terms(kv, dtype, scale: float, k_scale: float, v_scale: float) -> tuple[int, float, float]:
    """The cache's dtype code (-1: neither `dtype`'s nor FP8), the query scale and the output factor: an FP8 cache
    folds its K scale into the scores' scale and its V scale into the output; any other ignores them."""
    if kv.dtype == torch.float8_e4m3fn:
        return FP8_CODE, scale * k_scale, v_scale
    return (DTYPE_CODES[dtype] if kv.dtype == dtype and dtype in DTYPE_CODES else -1), scale, 1.0


def _threads(threads: int | None) -> int:
    """A kernel's OpenMP thread count: torch's unless given (0 or less reaches the kernel's check)."""
    return torch.get_num_threads() if threads is None else threads


def _linear_io(x, out_features: int):
    """(x ready, x as [M, K] with unit column stride, x's leading shape, K, the new [M, N] result) of a linear."""
    x = _ready(x)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x, x2, lead, k, torch.empty((x2.shape[0], out_features), dtype=x.dtype)


def _dense(t, dtype):
    """t as a contiguous tensor of dtype (itself when it already is one), as a raw pointer read needs it."""
    return t.to(dtype).contiguous()


def _heads_contiguous(t):
    """t [T, H, D] with its heads and dims packed (any token stride), as the kernels read it."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def _ready(t):
    """The tensor itself: an all-reduce's result (tensor parallelism) is a lazy AsyncCollectiveTensor
    that torch ops wait for on first use; a raw pointer read must wait first."""
    return t.wait() if t is not None and type(t) is not torch.Tensor and hasattr(t, "wait") else t


def cpu_kernels_for(device) -> CpuKernels | None:
    """The CPU kernels for tensors on `device`: the library on a CPU, None elsewhere."""
    return cpu_kernels() if torch.device(device).type == "cpu" else None


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The CPU kernels for this machine, built on first use; None where they cannot be had."""
    if os.environ.get("GRAPHDECODE_CPU_KERNELS", "1") == "0":
        return None
    src = kernel_build.source_dir(kernel_build.CPU_SOURCES + kernel_build.CPU_HEADERS)
    try:
        if src is None:
            raise RuntimeError("csrc/cpu_attention.cpp is not available")
        key = kernel_build.cpu_library_key(src)
        packaged = os.path.join(kernel_build.package_dir(), "_kernels", key, kernel_build.CPU_LIB_NAME)
        path = os.path.join(cache_root(), "kernels", key, kernel_build.CPU_LIB_NAME)
        if os.path.isfile(packaged):
            return CpuKernels(packaged)
        if not os.path.isfile(path):
            kernel_build.build_cpu(path, src)
        return CpuKernels(path)
    except (RuntimeError, OSError) as exc:
        logger.warning("graphdecode: CPU attention kernels unavailable, using the torch reference: %s", exc)
        return None
