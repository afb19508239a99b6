"""Mamba2: the selective state-space layer of Nemotron-H, over the same per-sequence state cache as Gated DeltaNet.

in_proj gives the gate z, the convolved channels [x | B | C] and the time step dt; per head h (P dims, N state
dims, heads sharing B and C in n_groups groups):

    dt = clamp(softplus(dt + dt_bias), time_step_limit),   dA = exp(dt A),   A = -exp(A_log)
    S_t = dA S_{t-1} + (dt x_t) B_t^T          [P, N], float32
    y_t = S_t C_t + D x_t

then an RMSNorm over groups of the intermediate size applied to y * silu(z), and out_proj (Dao & Gu, "Transformers
are SSMs", 2024; transformers' NemotronHMamba2Mixer computes the same). The state is `conv_state`
[slots, C, K - 1] (causal_conv.py) and `recurrent_state` [slots, H, P, N]; decode runs the recurrence once per
row, prefill the chunked (SSD) form: within blocks of `chunk_size` tokens the contributions are one masked
matmul, the state carried between blocks. A speculative verify runs Q steps without writing the state and
`commit` moves it over the accepted positions, as gated_deltanet.py does.
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


@dataclass(frozen=True)
class Mamba2Config:
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 128
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def local(self, ranks: int) -> Mamba2Config:
        """One tensor-parallel rank's share: its heads and their groups."""
        return replace(self, num_heads=self.num_heads // ranks, n_groups=self.n_groups // ranks)

    def rank_rows(self, rank: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rank's rows of in_proj [z | x | B | C | dt], its convolution channels [x | B | C], its heads)."""
        inner, groups = self.intermediate_size, self.n_groups * self.state_size
        heads = torch.arange(rank * self.num_heads // ranks, (rank + 1) * self.num_heads // ranks)
        dims = (heads[:, None] * self.head_dim + torch.arange(self.head_dim)).reshape(-1)
        group = torch.arange(rank * groups // ranks, (rank + 1) * groups // ranks)
        channels = torch.cat([dims, inner + group, inner + groups + group])
        rows = torch.cat([dims, inner + channels, inner + self.conv_dim + heads])
        return rows, channels, heads

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.state_size)


def read_time_step_limit(where: str, raw: dict) -> tuple[float, float]:
    """config.json's time_step_limit: two numbers (transformers 5 writes infinity as {"__float__": "Infinity"})."""
    limit = raw.get("time_step_limit", [0.0, float("inf")])
    try:
        low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)
    except (TypeError, ValueError, KeyError):
        raise ValueError(f"{where}: time_step_limit must be two numbers, got {limit!r}") from None
    return low, high


def check_mamba(where: str, cfg: Mamba2Config, heads_key: str, groups_key: str, kernel_key: str) -> Mamba2Config:
    """The sizes' consistency, errors naming the family's own fields."""
    if cfg.num_heads % cfg.n_groups:
        raise ValueError(f"{where}: {heads_key} ({cfg.num_heads}) must be a multiple of {groups_key} ({cfg.n_groups})")
    if cfg.conv_kernel < 2:
        raise ValueError(f"{where}: {kernel_key} must be at least 2, got {cfg.conv_kernel}")
    return cfg


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of the intermediate size, times the weight (NemotronHRMSNormGated)."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups = groups
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        shape = h.shape
        h = h.view(*shape[:-1], self.groups, -1)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).view(shape)
        return self.weight * h.to(dtype)


class Mamba2Mixer(RecurrentMixer):
    """Tensor parallelism splits the heads (and their groups of B and C) across ranks: each rank loads the whole
    in_proj and convolution and keeps its rows at load (`post_load`); out_proj (split by columns) all-reduces."""

    def __init__(self, cfg: Mamba2Config, hidden_size: int, eps: float, tp: TPGroup = TPGroup()):
        super().__init__()
        self.full_cfg = cfg
        self.cfg = cfg.local(tp.size)
        self.tp = tp
        one = TPGroup()  # the whole in_proj is read; post_load keeps this rank's rows
        self.in_proj = FusedLinear(hidden_size, {"all": split_rows(cfg.intermediate_size + cfg.conv_dim
                                                                   + cfg.num_heads, one)}, bias=cfg.proj_bias)
        local = self.cfg
        self.split_sizes = [local.intermediate_size, local.conv_dim, local.num_heads]
        self.conv1d = CausalConv(cfg.conv_dim, cfg.conv_kernel, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_heads))
        self.D = nn.Parameter(torch.ones(cfg.num_heads))
        self.norm = GroupedGatedRMSNorm(cfg.intermediate_size, cfg.n_groups, eps)
        self.out_proj = RowParallelLinear(cfg.intermediate_size, hidden_size, cfg.proj_bias, tp)

    @property
    def rewritable(self) -> bool:
        """Its weights are the checkpoint's as they are (one rank): a weight update may write them in place."""
        return self.tp.size == 1

    def post_load(self) -> None:
        """With tensor parallelism: this rank's rows of in_proj, channels of the convolution, heads and norm groups."""
        if self.tp.size == 1:
            return
        rows, channels, heads = self.full_cfg.rank_rows(self.tp.rank, self.tp.size)
        keep_rows(self.in_proj, rows)
        keep_rows(self.conv1d, channels)
        keep_rows(self.norm, rows[: self.cfg.intermediate_size])
        self.norm.groups = self.cfg.n_groups
        self.keep_heads(heads, "dt_bias", "A_log", "D")

    def forward(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        z, xbc, dt = self.in_proj(hidden).split(self.split_sizes, dim=-1)
        low, high = self.cfg.time_step_limit
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if low > 0.0 or high != float("inf"):
            dt = dt.clamp(low, high)
        if ctx.prefill is not None:
            y = self._prefill(xbc, dt, ctx.prefill)
        elif ctx.verify is not None:
            y = self._verify(xbc, dt, ctx.verify.state_slots)
        else:
            y = self._decode(xbc, dt, ctx.decode.state_slots)
        return self.out_proj(self.norm(y, z, hidden.dtype))

    # ---------------------------------------------------------------- pieces
    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [T, C] -> x [T, H, P], B and C [T, H, N] (groups repeated over their heads), float32."""
        cfg = self.cfg
        tokens = conv_out.shape[0]
        x, b, c = conv_out.float().split([cfg.intermediate_size, cfg.n_groups * cfg.state_size,
                                          cfg.n_groups * cfg.state_size], dim=-1)
        repeat = cfg.num_heads // cfg.n_groups
        b = b.view(tokens, cfg.n_groups, cfg.state_size).repeat_interleave(repeat, dim=1)
        c = c.view(tokens, cfg.n_groups, cfg.state_size).repeat_interleave(repeat, dim=1)
        return x.view(tokens, cfg.num_heads, cfg.head_dim), b, c

    def state_step(self, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One token per row: state [B, H, P, N], x [B, H, P], b [B, H, N], dt [B, H] -> the new state (a new
        tensor); the outer product (dt x) b^T added in place by a batched matmul."""
        rows, heads, p, n = state.shape
        state = state * torch.exp(dt * -self.A_log.float().exp())[..., None, None]
        state.view(rows * heads, p, n).baddbmm_((x * dt[..., None]).reshape(rows * heads, p, 1),
                                                b.reshape(rows * heads, 1, n))
        return state

    def _read(self, state: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """y = S C + D x: [B, H, P, N], [B, H, P], [B, H, N] -> [B, H * P]."""
        rows, heads, p, n = state.shape
        y = torch.bmm(state.view(rows * heads, p, n), c.reshape(rows * heads, n, 1)).view(rows, heads, p)
        return (y + x * self.D.float()[:, None]).reshape(rows, -1)

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        x, b, c = self._split(self.conv1d.decode(self.conv_state, slots, xbc))
        state = self.state_step(self.recurrent_state.index_select(0, slots), x, b, dt)
        self.recurrent_state.index_copy_(0, slots, state)
        return self._read(state, x, c)

    def _verify(self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows = slots.shape[0]
        queries = xbc.shape[0] // rows
        inputs = xbc.to(self.conv_state.dtype).view(rows, queries, -1)
        x, b, c = self._split(self.conv1d.verify(self.conv_state, slots, inputs).reshape(rows * queries, -1))
        x, b, c = (t.view(rows, queries, *t.shape[1:]) for t in (x, b, c))
        dt = dt.view(rows, queries, -1)
        self.keep_verified(inputs=inputs, x=x, b=b, dt=dt)
        state, outputs = self.recurrent_state.index_select(0, slots), []
        for t in range(queries):
            state = self.state_step(state, x[:, t], b[:, t], dt[:, t])
            outputs.append(self._read(state, x[:, t], c[:, t]))
        return torch.stack(outputs, dim=1).view(rows * queries, -1)

    def verified_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.cfg
        return {"x": (cfg.num_heads, cfg.head_dim), "b": (cfg.num_heads, cfg.state_size), "dt": (cfg.num_heads,)}

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, meta) -> torch.Tensor:
        outputs = []
        starts, lengths, _ = meta.host_lens()
        log_a = -self.A_log.float().exp()
        for slot, start, length in zip(meta.state_slots_host, starts.tolist(), lengths.tolist()):
            x, b, c = self._split(self.conv1d.prefill(self.conv_state, slot, xbc[start : start + length]))
            y, final = chunked_scan(x, b, c, dt[start : start + length] * log_a, dt[start : start + length],
                                    self.recurrent_state[slot], self.cfg.chunk_size)
            self.recurrent_state[slot].copy_(final)
            outputs.append((y + x * self.D.float()[:, None]).reshape(length, -1))
        return torch.cat(outputs)


def chunked_scan(x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, log_decay: torch.Tensor, dt: torch.Tensor,
                 state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over L tokens of one sequence, `chunk` at a time, float32 (the D skip not included).

    x [L, H, P], b and c [L, H, N], log_decay (dt A) and dt [L, H], state [H, P, N] -> (y [L, H, P], the final
    state). Within a block, with G the cumulative log decay from its start, y_t = exp(G_t) S0 c_t +
    sum_{s <= t} exp(G_t - G_s) (c_t . b_s) dt_s x_s, and the block's end state is exp(G_end) S0 +
    sum_s exp(G_end - G_s) dt_s x_s b_s^T."""
    length, heads = dt.shape
    pad = (-length) % chunk
    blocks = (length + pad) // chunk

    def blocked(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, N, C, ...], zero-padded
        t = t.transpose(0, 1)
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(heads, blocks, chunk, *t.shape[2:])

    xs = blocked(x * dt[..., None])  # dt x, padded tokens contribute nothing
    b, c, cum = blocked(b), blocked(c), blocked(log_decay).cumsum(-1)  # [H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, N, C, C]
    scores = (c @ b.transpose(-1, -2)) * pair  # [H, N, C, C]
    within = scores @ xs  # [H, N, C, P]
    to_end = (cum[..., -1:] - cum).exp()  # [H, N, C]
    out = torch.empty_like(within)
    state = state.float()
    for i in range(blocks):
        out[:, i] = within[:, i] + cum[:, i].exp()[..., None] * (c[:, i] @ state.transpose(-1, -2))
        update = (xs[:, i] * to_end[:, i, :, None]).transpose(-1, -2) @ b[:, i]
        state = state * cum[:, i, -1].exp()[:, None, None] + update
    return out.reshape(heads, blocks * chunk, -1)[:, :length].transpose(0, 1), state
