"""The masked matmul pair (lora/layers.py) without an engine: each token gets exactly its own slot's B A x, a
token of slot 0 nothing; a reload replaces a slot's whole adapter; the same on every matmul path (dense, CUDA's
fixed row blocks, the CPU's panels)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphdecode.lora.layers import LoRALinear, LoRAState


def _paths():
    from graphdecode.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    return [("dense", None, False), ("blocked", None, True)] + ([("panels", kernels, False)] if kernels else [])


@pytest.mark.parametrize("name, kernels, blocked", _paths())
def test_each_token_gets_its_own_slots_update(name, kernels, blocked):
    torch.manual_seed(0)
    k, n, rank = 24, 40, 4
    base = nn.Linear(k, n, bias=False)
    state = LoRAState(max_loras=2, max_rank=rank, dtype=torch.float32, device=torch.device("cpu"))
    linear = LoRALinear(base, state, groups=2, in_features=k, out_features=n, kernels=kernels, blocked=blocked)
    # slot 1: both shards (rows 0..19 and 20..39), rank 4 and 3; slot 2: the second shard only, rank 2
    a1, b1, a1b, b1b = torch.randn(4, k), torch.randn(20, 4), torch.randn(3, k), torch.randn(20, 3)
    a2, b2 = torch.randn(2, k), torch.randn(20, 2)
    linear.load(1, [(0, 0, 20, a1, b1), (1, 20, 20, a1b, b1b)])
    linear.load(2, [(1, 20, 20, torch.randn(4, k), torch.randn(20, 4))])
    linear.load(2, [(1, 20, 20, a2, b2)])  # a reload: nothing of the first adapter stays
    x = torch.randn(5, k)
    slots = torch.tensor([0, 1, 2, 1, 0])
    state.begin(slots)
    with torch.no_grad():
        got = linear(x)
        want = base(x)
        one = torch.cat([x @ a1.T @ b1.T, x @ a1b.T @ b1b.T], dim=1)
        two = torch.cat([torch.zeros(5, 20), x @ a2.T @ b2.T], dim=1)
    expected = torch.where((slots == 1)[:, None], want + one, torch.where((slots == 2)[:, None], want + two, want))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[[0, 4]], base(x)[[0, 4]].detach())  # no adapter: the base's bits exactly
