"""csrc/cpu_recurrent.cpp: the gated delta rule's decode step in place on the state cache, against the torch step
(models/gated_deltanet.py) it replaces in eager CPU windows."""

from __future__ import annotations

import pytest
import torch

from graphdecode.kernels.cpu import cpu_kernels
from graphdecode.models.gated_deltanet import _delta_read, _delta_step

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ compiler: the CPU kernels cannot be built here")


@pytest.mark.parametrize("threads", [1, 2])
def test_the_step_equals_torch_and_leaves_every_other_slot_alone(threads):
    torch.manual_seed(0)
    slots_total, heads, dk, dv = 9, 3, 16, 24
    state = torch.randn(slots_total, heads, dk, dv)
    slots = torch.tensor([4, 0, 7, 2, 0])  # two padded rows on the scratch slot
    rows = len(slots)
    q = torch.nn.functional.normalize(torch.randn(rows, heads, dk), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(rows, heads, dk), dim=-1)
    v, decay, beta = torch.randn(rows, heads, dv), -torch.rand(rows, heads), torch.rand(rows, heads)
    expected_state = _delta_step(state[slots], k, v, decay, beta)
    expected_out = _delta_read(expected_state, q)
    before = state.clone()
    out = KERNELS.delta_step(state, slots, q, k, v, decay, beta, threads=threads)
    live = slots != 0
    torch.testing.assert_close(out[live], expected_out[live], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))  # scratch rows: skipped, never raced on
    torch.testing.assert_close(state[slots[live]], expected_state[live], rtol=1e-5, atol=1e-5)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots[live]] = False
    assert torch.equal(state[untouched], before[untouched])  # the scratch slot and every unused one


def test_a_slot_outside_the_cache_is_refused():
    state = torch.zeros(2, 1, 4, 4)
    args = [torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1), torch.zeros(1, 1)]
    with pytest.raises(ValueError, match="delta_step rejected"):
        KERNELS.delta_step(state, torch.tensor([2]), *args)
