"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next, over a per-sequence state cache.

A layer keeps no history. Each sequence holds a slot of two tensors per layer (states.py allocates them):

* the convolution window `conv_state` [slots, C, K - 1]: the last K - 1 inputs of the causal depthwise
  convolution over the mixed q/k/v channels (C = 2 key_dim + value_dim, K = linear_conv_kernel_dim);
* the recurrent matrix `recurrent_state` [slots, Hv, Dk, Dv], float32: S in the gated delta rule

      S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,   o_t = S_t^T q_t

  with q, k L2-normalised per head (q also scaled by Dk ** -0.5), beta = sigmoid(b), and the decay
  g = -exp(A_log) softplus(a + dt_bias) (Yang et al., "Gated Delta Networks", 2024; transformers'
  Qwen3_5GatedDeltaNet computes the same). Key heads are shared by Hv / Hk value heads.

Decode (one token per row, `ctx.decode`) runs the recurrence once per row on the rows' slots, gathered and
written back with index ops on static buffers, so it runs inside a captured window; padded and finished rows
point at the scratch slot 0. A speculative verify (`ctx.verify`: Q positions per row) runs it Q times from the
row's state without writing it, keeping the positions' inputs in static buffers; once the window knows how
many positions each row accepted, `commit` moves the state over exactly those (recomputing them from the kept
inputs; recurrent.RecurrentMixer), so rejected drafts never reach a state. Prefill (`ctx.prefill`) runs each
sequence's chunk in the chunked form: within blocks of CHUNK tokens the updates are solved together (the WY / UT
transform: one triangular solve per block), across blocks the state carries. A chunk starts from the slot's
state, so a prompt split anywhere continues exactly; the runner zeroes the slot before a sequence's first chunk.
The output passes an RMSNorm gated by silu(z) (per value head) and the out projection.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .causal_conv import CausalConv
from .layers import FusedLinear
from .parallel import RowParallelLinear, TPGroup
from .parallel import split as split_rows
from .recurrent import RecurrentMixer, keep_rows

CHUNK = 64  # tokens per block of the chunked form


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers' sizes (config.json's linear_* fields)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # how the checkpoint stores the input projections: "split" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b,
    # in_proj_a) or "grouped" (Qwen3-Next: in_proj_qkvz and in_proj_ba, each key head's q, k, v, z (b, a) rows
    # together; their rows are reordered into the split order at load)
    layout: str = "split"

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def local(self, ranks: int) -> LinearAttentionConfig:
        """One tensor-parallel rank's share: its key heads and their value heads."""
        return replace(self, num_key_heads=self.num_key_heads // ranks, num_value_heads=self.num_value_heads // ranks)

    def rank_rows(self, rank: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rank's rows of in_proj in the split order [q | k | v | z | b | a], its convolution channels [q | k | v],
        its value heads)."""
        hk, dk, hv, dv = self.num_key_heads, self.key_head_dim, self.num_value_heads, self.value_head_dim
        mine_k = torch.arange(rank * hk // ranks * dk, (rank + 1) * hk // ranks * dk)
        mine_v = torch.arange(rank * hv // ranks * dv, (rank + 1) * hv // ranks * dv)
        mine_h = torch.arange(rank * hv // ranks, (rank + 1) * hv // ranks)
        key, value = hk * dk, hv * dv
        channels = torch.cat([mine_k, key + mine_k, 2 * key + mine_v])
        rows = torch.cat([channels, self.conv_dim + mine_v, self.conv_dim + value + mine_h,
                          self.conv_dim + value + hv + mine_h])
        return rows, channels, mine_h

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, times silu(gate) (transformers' RMSNormGated: norm, weight, then gate)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(RecurrentMixer):
    """Tensor parallelism splits the key heads (and their value heads) across ranks: each rank loads the whole
    input projections and convolution and keeps its rows at load (`post_load`), its state holds its heads, and
    out_proj (split by columns) all-reduces."""

    def __init__(self, lin: LinearAttentionConfig, hidden_size: int, eps: float, tp: TPGroup = TPGroup()):
        super().__init__()
        self.full_lin = lin
        self.lin = lin.local(tp.size)
        self.tp = tp
        full = TPGroup()  # the whole projections are read; post_load keeps this rank's rows
        if lin.layout == "grouped":
            shards = {"qkvz": split_rows(lin.conv_dim + lin.value_dim, full),
                      "ba": split_rows(2 * lin.num_value_heads, full)}
        else:
            shards = {"qkv": split_rows(lin.conv_dim, full), "z": split_rows(lin.value_dim, full),
                      "b": split_rows(lin.num_value_heads, full), "a": split_rows(lin.num_value_heads, full)}
        self.in_proj = FusedLinear(hidden_size, shards, bias=False)
        local = self.lin
        self.split_sizes = [local.conv_dim, local.value_dim, local.num_value_heads, local.num_value_heads]
        self.conv1d = CausalConv(lin.conv_dim, lin.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.num_value_heads))
        self.norm = GatedRMSNorm(lin.value_head_dim, eps)
        self.out_proj = RowParallelLinear(lin.value_dim, hidden_size, False, tp)

    kernels = None  # the CPU kernel library (kernels/cpu.py), for the decode step in place

    def use_cpu_kernels(self, kernels) -> None:
        self.kernels = kernels

    @property
    def rewritable(self) -> bool:
        """Its weights are the checkpoint's rows as they are (no grouped reorder, no rank's slice): a weight update
        may write them in place (weight_update.py)."""
        return self.lin.layout != "grouped" and self.tp.size == 1

    def post_load(self) -> None:
        """Once, at load: a grouped checkpoint's in_proj rows put in the split order the forward reads; then, with
        tensor parallelism, this rank's rows of the projections, channels of the convolution and heads."""
        weight = self.in_proj.weight
        if self.lin.layout == "grouped":
            weight.data.copy_(weight.data[grouped_order(self.full_lin).to(weight.device)])
        if self.tp.size > 1:
            rows, channels, heads = self.full_lin.rank_rows(self.tp.rank, self.tp.size)
            keep_rows(self.in_proj, rows)
            keep_rows(self.conv1d, channels)
            self.keep_heads(heads, "dt_bias", "A_log")

    def forward(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        lin = self.lin
        mixed, z, b, a = self.in_proj(hidden).split(self.split_sizes, dim=-1)
        beta = torch.sigmoid(b.float())
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # g, log space, <= 0
        if ctx.prefill is not None:
            core = self._prefill(mixed, beta, decay, ctx.prefill)
        elif ctx.verify is not None:
            core = self._verify(mixed, beta, decay, ctx.verify.state_slots)
        else:
            core = self._decode(mixed, beta, decay, ctx.decode.state_slots)
        tokens = hidden.shape[0]
        core = self.norm(core.to(hidden.dtype), z.view(tokens, lin.num_value_heads, lin.value_head_dim))
        return self.out_proj(core.reshape(tokens, lin.value_dim))

    # ---------------------------------------------------------------- the two forms
    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved channels [T, C] -> q, k [T, Hv, Dk] (normalised, q scaled; key heads repeated) and
        v [T, Hv, Dv], float32."""
        lin = self.lin
        tokens = conv_out.shape[0]
        q, k, v = conv_out.float().split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        q = q.view(tokens, lin.num_key_heads, lin.key_head_dim)
        k = k.view(tokens, lin.num_key_heads, lin.key_head_dim)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * lin.key_head_dim**-0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        group = lin.num_value_heads // lin.num_key_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return q, k, v.view(tokens, lin.num_value_heads, lin.value_head_dim)

    def _decode(self, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """One token per row: [B, C] -> [B, Hv, Dv]; reads and writes the rows' slots."""
        q, k, v = self._qkv(self.conv1d.decode(self.conv_state, slots, mixed))
        if self.kernels is not None and not torch.compiler.is_compiling():  # in place, two passes a state
            return self.kernels.delta_step(self.recurrent_state, slots, q, k, v, decay, beta)
        state = _delta_step(self.recurrent_state.index_select(0, slots), k, v, decay, beta)  # [B, Hv, Dk, Dv]
        self.recurrent_state.index_copy_(0, slots, state)
        return _delta_read(state, q)

    def _verify(self, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """B rows of Q positions ([B * Q, C], row-major) from the rows' states, which stay as they are: the
        positions' inputs are kept for `commit`, which advances each state by the positions the round
        accepted. -> [B * Q, Hv, Dv]."""
        rows = slots.shape[0]
        queries = mixed.shape[0] // rows
        x = mixed.to(self.conv_state.dtype).view(rows, queries, -1)
        conv_out = self.conv1d.verify(self.conv_state, slots, x)  # [B, Q, C]
        q, k, v = self._qkv(conv_out.reshape(rows * queries, -1))
        q, k, v = (t.view(rows, queries, *t.shape[1:]) for t in (q, k, v))
        decay, beta = decay.view(rows, queries, -1), beta.view(rows, queries, -1)
        self.keep_verified(inputs=x, k=k, v=v, decay=decay, beta=beta)
        state, outputs = self.recurrent_state.index_select(0, slots), []
        for t in range(queries):
            state = _delta_step(state, k[:, t], v[:, t], decay[:, t], beta[:, t])
            outputs.append(_delta_read(state, q[:, t]))
        return torch.stack(outputs, dim=1).view(rows * queries, *outputs[0].shape[1:])

    def state_step(self, state, k, v, decay, beta) -> torch.Tensor:
        return _delta_step(state, k, v, decay, beta)

    def verified_shapes(self) -> dict[str, tuple[int, ...]]:
        lin = self.lin
        return {"k": (lin.num_value_heads, lin.key_head_dim), "v": (lin.num_value_heads, lin.value_head_dim),
                "decay": (lin.num_value_heads,), "beta": (lin.num_value_heads,)}

    def _prefill(self, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, meta) -> torch.Tensor:
        """Each sequence's chunk from its slot's state: [T, C] -> [T, Hv, Dv]."""
        outputs = []
        starts, lengths, _ = meta.host_lens()
        for slot, start, length in zip(meta.state_slots_host, starts.tolist(), lengths.tolist()):
            q, k, v = self._qkv(self.conv1d.prefill(self.conv_state, slot, mixed[start : start + length]))
            out, final = chunked_delta_rule(q, k, v, decay[start : start + length], beta[start : start + length],
                                            self.recurrent_state[slot])
            self.recurrent_state[slot].copy_(final)
            outputs.append(out)
        return torch.cat(outputs)


def grouped_order(lin: LinearAttentionConfig) -> torch.Tensor:
    """Rows of [in_proj_qkvz; in_proj_ba] (Qwen3-Next: per key head g, its q, k, then its r = Hv / Hk value heads'
    v and z; then per g its r b's and r a's) in the split order [q | k | v | z | b | a]."""
    hk, dk, dv = lin.num_key_heads, lin.key_head_dim, lin.value_head_dim
    r = lin.num_value_heads // hk
    group = 2 * dk + 2 * r * dv
    base = torch.arange(hk)[:, None] * group
    q = (base + torch.arange(dk)).reshape(-1)
    k = (base + dk + torch.arange(dk)).reshape(-1)
    v = (base + 2 * dk + torch.arange(r * dv)).reshape(-1)
    z = (base + 2 * dk + r * dv + torch.arange(r * dv)).reshape(-1)
    ba = hk * group + torch.arange(hk)[:, None] * 2 * r
    b = (ba + torch.arange(r)).reshape(-1)
    a = (ba + r + torch.arange(r)).reshape(-1)
    return torch.cat([q, k, v, z, b, a])


def _delta_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule per row: state [B, Hv, Dk, Dv], k [B, Hv, Dk], v [B, Hv, Dv],
    decay and beta [B, Hv] -> the new state (a new tensor; `state` is not written). The products are batched
    matmuls over the B x Hv heads: S^T k and the rank-one update (baddbmm_, in place on the new state)."""
    rows, heads, dk, dv = state.shape
    state = state * decay.exp()[..., None, None]
    flat = state.view(rows * heads, dk, dv)
    keys = k.reshape(rows * heads, dk)
    recalled = torch.bmm(keys[:, None, :], flat).view(rows, heads, dv)  # S^T k
    delta = (v - recalled) * beta[..., None]
    flat.baddbmm_(keys[:, :, None], delta.reshape(rows * heads, 1, dv))
    return state


def _delta_read(state: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """S^T q per row and head: state [B, Hv, Dk, Dv], q [B, Hv, Dk] -> [B, Hv, Dv]."""
    rows, heads, dk, dv = state.shape
    return torch.bmm(q.reshape(rows * heads, 1, dk), state.view(rows * heads, dk, dv)).view(rows, heads, dv)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over L tokens of one sequence, CHUNK at a time, float32.

    q, k [L, H, Dk] (normalised), v [L, H, Dv], decay (g) and beta [L, H], state [H, Dk, Dv] ->
    (outputs [L, H, Dv], the final state). Within a block, with G the cumulative decay from the block's start,
    the updates solve (I + A) U = V_beta and (I + A) W = K_beta exp(G), A the strictly lower part of
    (K_beta K^T) exp(G_i - G_j); each block then reads the carried state once and adds its own correction."""
    length, heads = decay.shape
    pad = (-length) % chunk
    blocks = (length + pad) // chunk

    def blocked(x: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, N, C, ...], padding with zeros
        x = x.transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(heads, blocks, chunk, *x.shape[2:])

    q, k, v = blocked(q), blocked(k), blocked(v)
    decay, beta = blocked(decay), blocked(beta)  # padded tokens: no decay, no update
    cum = decay.cumsum(-1)  # [H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, N, C, C], i >= j
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(values)
    state = state.float()
    for i in range(blocks):
        new = values[:, i] - reads[:, i] @ state  # what the carried state does not already predict
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ new
        state = state * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ new
    out = out.reshape(heads, blocks * chunk, -1)[:, :length].transpose(0, 1)
    return out, state
