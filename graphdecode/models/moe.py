"""Mixture-of-experts MLP: a router, top-k routing per family, expert SwiGLU MLPs, a weighted sum.

Routing (`MoEConfig.routing`), as each family's transformers module computes it:

* "softmax_topk" (Mixtral, Qwen3-MoE): softmax over every expert's logit in float32, the
  top k, renormalised to sum to 1 when `renormalize` (Mixtral always; Qwen3-MoE with
  `norm_topk_prob`). Mixtral keeps the weights in float32, Qwen3-MoE casts them to the
  model dtype (`weights_fp32`).
* "topk_softmax" (gpt-oss): the router has a bias; the top k logits, then a softmax over
  those k only, in the model dtype.
* "sigmoid_groups" (GLM-4.5, DeepSeek-V3's "noaux_tc"): float32 logits from a float32 router, their
  sigmoids as scores; the choice adds each expert's `e_score_correction_bias` (a router parameter, float32
  too) and keeps the experts of the `topk_groups` best of `num_groups` groups (a group's worth: its two
  best biased scores, summed); the top k of those, weighted by their unbiased scores, renormalised (plus
  1e-20) when `renormalize`, times `routed_scaling`; the weights stay float32.

Experts hold their weights stacked: `gate_up_proj` [E, 2I, H] (each expert's gate rows,
then its up rows, like the dense FusedLinear) and `down_proj` [E, H, I], with optional
biases (gpt-oss). The activation is SwiGLU, or gpt-oss's clamped variant
(`(clamp(up) + 1) * g * sigmoid(alpha * g)` with g = gate clamped from above), or Nemotron 3's
ungated relu squared ("relu2": `gate_up_proj` holds only the up rows, [E, I, H]).

The expert computation is one custom op, `graphdecode::moe_experts`, so the shapes a
compiled window or a CUDA graph sees are static ([T, H] in, [T, H] out) whatever the
routing; dynamo treats it as opaque, its fake only gives the shape. Three implementations:

* grouped (`moe_grouped`): the T*k (token, expert) pairs sorted by expert (stable, so each
  expert sees its tokens in order), one `torch._grouped_mm` over the sorted rows per
  projection with per-expert offsets, then each token's k outputs summed in ascending
  expert order. Nothing syncs with the host: sort, counts and cumsum stay on the device,
  so it is capturable where _grouped_mm is (CUDA bf16 on sm90/sm100; on the CPU it is an
  eager loop of matmuls inside the op). The CPU path and the GPU's bf16 path.
* dense (`moe_dense`): every expert on every row, the unselected contributions zeroed:
  E/k times the FLOPs, but static and capturable anywhere. The documented fallback for
  CUDA dtypes or devices without a grouped-GEMM kernel (_grouped_mm there copies its
  offsets to the host, which a CUDA graph cannot capture).
* reference (`moe_reference`): transformers' own loop over the experts that received a
  token (a host sync per layer); the oracle in the tests, and the CPU's path where torch
  has no _grouped_mm.

Every implementation adds a token's expert outputs in ascending expert order, starting
from the lowest, as transformers' loop does (index_add_ per expert into zeros), so the
sums agree bit for bit when the per-expert matmuls do.

MXFP4 checkpoints (gpt-oss) keep their experts' weights in 4 bits (`Experts.hold_mxfp4`: blocks of 32 FP4
values with a power-of-two scale byte, 4.25 bits a weight, the float parameters empty) and dequantize them
inside each call: a decode step's few (token, expert) pairs dequantize only their experts (one batched matmul
per projection); a larger batch dequantizes every expert of the layer once and runs the implementation above.
No host sync either way, so it runs inside CUDA graphs; memory is the checkpoint's, compute pays the unpacking.

Tensor parallelism: each rank holds every expert's slice of the intermediate size (rows
of gate and up, columns of down); the router is replicated; the MoE's output is
all-reduced once, as a dense MLP's is (the down bias is added by rank 0 only).

Load balance: each MoE layer adds its live tokens (rows whose K/V slot is not the scratch
slot: padding and finished rows are not counted) to a per-expert counter on the device,
read only by `stats()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import mxfp4
from .layers import FusedLinear, GatedActivation
from .parallel import RowParallelLinear, TPGroup, split, whole

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_groups")
ACTIVATIONS = ("silu", "gpt_oss", "relu2")  # relu2: ungated (up, relu squared, down)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    routing: str = "softmax_topk"
    renormalize: bool = True  # softmax_topk: the top-k weights renormalised to sum to 1
    weights_fp32: bool = False  # the routing weights stay float32 (Mixtral) or take the model dtype
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702  # gpt_oss activation
    swiglu_limit: float = 7.0
    sparse_layers: tuple[bool, ...] = ()  # per decoder layer: MoE (True) or a dense MLP; empty: all MoE
    shared_intermediate_size: int = 0  # an always-on shared expert beside the routed ones ...
    shared_gate: bool = True  # ... scaled by sigmoid(shared_expert_gate(x)) (Qwen3-Next), or not (GLM-4.5)
    num_groups: int = 1  # sigmoid_groups: the experts in this many equal groups ...
    topk_groups: int = 1  # ... of which the best this many are eligible
    routed_scaling: float = 1.0  # sigmoid_groups: the weights' factor
    latent_size: int = 0  # the experts work in a latent space this wide, projected in and out (Nemotron 3 Super)

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the number of experts ({self.num_experts}) "
                             f"and topk_group ({self.topk_groups}) be between 1 and n_group")
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError(f"n_group ({self.num_groups}) leaves fewer than 2 experts a group: a group's worth is "
                             f"its two best scores")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts "
                             f"({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        return not self.sparse_layers or self.sparse_layers[layer]

    @property
    def gated(self) -> bool:
        """Whether an expert has gate rows beside its up rows (all but relu2's)."""
        return self.activation != "relu2"


# ------------------------------------------------------------------------------------------ routing
def route(logits: torch.Tensor, cfg: MoEConfig, score_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k] int64), ids ascending per token;
    score_bias [E]: sigmoid_groups' e_score_correction_bias."""
    if cfg.routing == "sigmoid_groups":
        scores = logits.float().sigmoid()
        choice = scores + score_bias
        if cfg.num_groups > 1:
            tokens = choice.shape[0]
            worth = choice.view(tokens, cfg.num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            best = worth.topk(cfg.topk_groups, dim=-1)[1]
            keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1),
                                        float("-inf"))
        ids = choice.topk(cfg.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if cfg.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling
    elif cfg.routing == "topk_softmax":
        top, ids = torch.topk(logits, cfg.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not cfg.weights_fp32:
            weights = weights.to(logits.dtype)
    ids, order = ids.sort(dim=-1)  # ascending expert per token: the order the outputs are summed in
    return weights.gather(-1, order), ids


def activate(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "relu2":  # ungated: the up rows only
        return torch.relu(gate_up).square()
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _sum_in_order(contrib: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H], adding slot 0, then 1, ... (each token's experts ascending)."""
    out = contrib[:, 0]
    for j in range(1, contrib.shape[1]):
        out = out + contrib[:, j]
    return out


# ------------------------------------------------------------------------------------ implementations
def _expert(x, e: int, w13, w2, b13, b2, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """One expert's MLP on rows x; biases added after each matmul, as transformers' gpt-oss does."""
    h = F.linear(x, w13[e])
    h = h if b13 is None else h + b13[e]
    y = F.linear(activate(h, activation, alpha, limit), w2[e])
    return y if b2 is None else y + b2[e]


def moe_grouped(x, ids, weights, w13, w2, b13, b2, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """Sorted by expert, one grouped GEMM per projection; no host sync."""
    tokens, k = ids.shape
    num_experts = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending within each
    experts = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, experts, torch.ones_like(experts, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[order // k]  # [T*k, H]
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    if b13 is not None:
        h = h + b13[experts]
    y = torch._grouped_mm(activate(h, activation, alpha, limit), w2.transpose(1, 2), offs=offsets)
    if b2 is not None:
        y = y + b2[experts]
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(tokens, k, -1)
    return _sum_in_order((unsorted * weights[..., None]).to(x.dtype))


def moe_dense(x, ids, weights, w13, w2, b13, b2, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """Every expert on every row, unselected contributions zeroed (static shapes, E/k times the FLOPs)."""
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)
    for e in range(num_experts):
        y = _expert(x, e, w13, w2, b13, b2, activation, alpha, limit)
        picked = ids == e  # [T, k]: at most one slot per token
        w = (weights * picked).sum(-1, keepdim=True)
        out = out + torch.where(picked.any(-1, keepdim=True), (y * w).to(x.dtype), 0)
    return out


def moe_reference(x, ids, weights, w13, w2, b13, b2, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """transformers' loop: each expert that received a token, over its tokens (one host sync)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        y = _expert(x[token], e, w13, w2, b13, b2, activation, alpha, limit)
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


IMPLEMENTATIONS = {"grouped": moe_grouped, "dense": moe_dense, "reference": moe_reference}


def default_implementation(device: torch.device, dtype: torch.dtype) -> str:
    """grouped where _grouped_mm runs without the host (the CPU; CUDA bf16 on sm90/sm100), else
    dense on CUDA (capturable) and the reference loop on a CPU whose torch has no _grouped_mm."""
    device = torch.device(device)
    grouped = hasattr(torch, "_grouped_mm")
    if device.type != "cuda":
        return "grouped" if grouped else "reference"
    major = torch.cuda.get_device_capability(device)[0]
    return "grouped" if grouped and dtype == torch.bfloat16 and major in (9, 10) else "dense"


@torch.library.custom_op("graphdecode::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                b13: torch.Tensor | None, b2: torch.Tensor | None, activation: str, alpha: float, limit: float,
                implementation: str) -> torch.Tensor:
    return IMPLEMENTATIONS[implementation](x, ids, weights, w13, w2, b13, b2, activation, alpha, limit)


@moe_experts.register_fake
def _(x, ids, weights, w13, w2, b13, b2, activation, alpha, limit, implementation):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------ modules
class Experts(nn.Module):
    """Every expert's weights, stacked; this rank's slice of each expert's intermediate size.

    The checkpoint layouts it reads (the loader asks `expert_weights.slot` about each tensor under
    this module's name): per-expert tensors `N.<gate>.weight`, `N.<up>.weight`, `N.<down>.weight`
    (names per family: `ExpertFormat.names`), or the stacked tensors `gate_up_proj` / `down_proj`
    (+ `_bias`) in the family's own layout, or their MXFP4 `_blocks` / `_scales` (gpt-oss).
    """

    def __init__(self, cfg: MoEConfig, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.rows = split(cfg.intermediate_size, tp)  # this rank's rows of gate and of up
        local = self.rows.stop - self.rows.start
        e = cfg.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(e, (2 if cfg.gated else 1) * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, local))
        if cfg.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * local))
            self.down_proj_bias = nn.Parameter(torch.empty(e, hidden_size))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.implementation = "reference"  # what runs anywhere; post_load picks the device's (default_implementation)
        self.mxfp4 = False  # hold_mxfp4: the weights kept as MXFP4 blocks and scales

    def hold_mxfp4(self) -> bool:
        """Keep gate_up / down as MXFP4 (gpt-oss's checkpoints): uint8 buffers gate_up_blocks [E, 2I, H / 32, 16]
        and gate_up_scales [E, 2I, H / 32] (gate rows, then up rows), down_blocks [E, H, I / 32, 16] and
        down_scales [E, H, I / 32], 4.25 bits a weight; the float parameters become empty. Called on the meta
        device before the weights are read; False (floats kept) where this rank's intermediate slice is no whole
        number of 32-column blocks."""
        local = self.rows.stop - self.rows.start
        if local % mxfp4.BLOCK or self.rows.start % mxfp4.BLOCK:
            return False
        e, h = self.cfg.num_experts, self.gate_up_proj.shape[2]
        if h % mxfp4.BLOCK:
            return False
        device = self.gate_up_proj.device
        for name, (out, inp) in (("gate_up", (2 * local, h)), ("down", (h, local))):
            setattr(self, f"{name}_proj", nn.Parameter(torch.empty(0, device=device), requires_grad=False))
            self.register_buffer(f"{name}_blocks", torch.empty(e, out, inp // mxfp4.BLOCK, mxfp4.BLOCK // 2,
                                                               dtype=torch.uint8, device=device))
            self.register_buffer(f"{name}_scales", torch.empty(e, out, inp // mxfp4.BLOCK, dtype=torch.uint8,
                                                               device=device))
        self.register_buffer("fp4_values", torch.empty(len(mxfp4.FP4_VALUES), device=device),
                             persistent=False)  # post_load fills it
        self.mxfp4 = True
        return True

    def dequantized(self, dtype: torch.dtype, experts: torch.Tensor | None = None):
        """(gate_up [E', 2I, H], down [E', H, I]) in dtype: every expert's, or those `experts` names (MXFP4)."""
        pick = (lambda t: t) if experts is None else (lambda t: t[experts])
        lut = self.fp4_values  # on the device already: no host copy inside a graph
        return (mxfp4.dequantize(pick(self.gate_up_blocks), pick(self.gate_up_scales), dtype, lut),
                mxfp4.dequantize(pick(self.down_blocks), pick(self.down_scales), dtype, lut))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b2 = self.down_proj_bias if self.tp.rank == 0 else None  # added once across the ranks' partial sums
        if self.mxfp4:
            return self._mxfp4_forward(x, ids, weights, b2)
        return moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, b2,
                           c.activation, c.swiglu_alpha, c.swiglu_limit, self.implementation)

    def _mxfp4_forward(self, x, ids, weights, b2) -> torch.Tensor:
        """MXFP4 experts, dequantized inside the call (no host sync; static shapes): with fewer (token, expert)
        pairs than experts (decode), only each pair's expert, one batched matmul per projection; else every
        expert once, then the device's implementation as for float weights."""
        c = self.cfg
        tokens, k = ids.shape
        if tokens * k >= c.num_experts:
            w13, w2 = self.dequantized(x.dtype)
            return moe_experts(x, ids, weights, w13, w2, self.gate_up_proj_bias, b2, c.activation, c.swiglu_alpha,
                               c.swiglu_limit, self.implementation)
        pairs = ids.reshape(-1)
        w13, w2 = self.dequantized(x.dtype, pairs)  # [P, 2I, H], [P, H, I]
        rows = x.repeat_interleave(k, dim=0)[:, None]  # [P, 1, H]
        h = torch.bmm(rows, w13.transpose(1, 2))[:, 0]
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[pairs]
        y = torch.bmm(activate(h, c.activation, c.swiglu_alpha, c.swiglu_limit)[:, None], w2.transpose(1, 2))[:, 0]
        if b2 is not None:
            y = y + b2[pairs]
        return _sum_in_order((y.view(tokens, k, -1) * weights[..., None]).to(x.dtype))

class SharedExpert(nn.Module):
    """The expert every token takes beside its routed ones (Qwen3-Next, Qwen3.5-MoE: `mlp.shared_expert`): a
    SwiGLU MLP (gate / up fused, split across ranks like a dense MLP, down all-reduced); with relu2 experts
    (Nemotron 3), up, relu squared, down."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, activation: str = "silu"):
        super().__init__()
        rows = split(intermediate_size, tp)
        self.gated = activation != "relu2"
        if self.gated:
            self.gate_up_proj = FusedLinear(hidden_size, {"gate": rows, "up": rows}, bias=False)
            self.act = GatedActivation("silu")
        else:
            self.up_proj = FusedLinear(hidden_size, {"up": rows}, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(torch.relu(self.up_proj(x)).square())
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """router -> top-k -> experts -> weighted sum (-> all-reduce across ranks); with a shared expert, plus
    shared_expert(x), scaled by sigmoid(shared_expert_gate(x)) where gated."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.gate = nn.Linear(hidden_size, cfg.num_experts, bias=cfg.router_bias)  # the router (replicated)
        self.sigmoid = cfg.routing == "sigmoid_groups"
        if self.sigmoid:  # float32 logits from float32 weights, as transformers keeps them
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))
            self.gate.fp32_params = ("weight", "e_score_correction_bias")  # the loader keeps them float32
        if cfg.latent_size:  # replicated projections around the experts (fc1 in, fc2 out)
            self.fc1_latent_proj = FusedLinear(hidden_size, {"all": whole(cfg.latent_size)}, False)
            self.fc2_latent_proj = FusedLinear(cfg.latent_size, {"all": whole(hidden_size)}, False)
        self.experts = Experts(cfg, cfg.latent_size or hidden_size, tp)
        self.expert_tokens: torch.Tensor | None = None  # [E] int64 on the device: live tokens routed
        if cfg.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, cfg.shared_intermediate_size, tp, cfg.activation)
            if cfg.shared_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)  # replicated

    def forward(self, x: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H]; live [T] bool (None: every row) -> [T, H]."""
        if self.sigmoid:
            weights, ids = route(F.linear(x.float(), self.gate.weight), self.cfg, self.gate.e_score_correction_bias)
        else:
            weights, ids = route(F.linear(x, self.gate.weight, self.gate.bias), self.cfg)
        if self.expert_tokens is not None:
            counted = torch.ones_like(ids) if live is None else live[:, None].expand_as(ids).to(ids.dtype)
            self.expert_tokens.scatter_add_(0, ids.reshape(-1), counted.reshape(-1))
        if self.cfg.latent_size:
            out = self.fc2_latent_proj(self.tp.all_reduce(self.experts(self.fc1_latent_proj(x), ids, weights)))
        else:
            out = self.tp.all_reduce(self.experts(x, ids, weights))
        if self.cfg.shared_intermediate_size:
            shared = self.shared_expert(x)
            if self.cfg.shared_gate:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
            out = out + shared
        return out


def moe_stats(model) -> dict:
    """stats()'s load-balance fields (empty for a dense model): per MoE layer, the live tokens routed
    to each expert since the engine started, and the busiest expert's count over the mean, averaged
    over the layers (1.0: perfectly balanced). Reading them waits for the device."""
    counts = getattr(model, "expert_tokens", None)
    if counts is None:
        return {}
    host = counts.cpu()
    mean = host.double().mean(dim=1)
    ratio = torch.where(mean > 0, host.double().amax(dim=1) / mean.clamp(min=1e-9), torch.ones_like(mean))
    return {"moe_tokens_per_expert": host.tolist(), "moe_max_over_mean_load": float(ratio.mean())}
