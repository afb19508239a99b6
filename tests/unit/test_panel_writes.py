"""PanelWeight.write_rows (weight updates): rows written at any offset, across panel edges, give the panels a
weight built from the new rows has, in fp32's layout and in bf16's pairs (AMX-padded), whatever this CPU runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graphdecode.models.cpu_linear import PanelWeight

PAIRS = SimpleNamespace(bf16_pairs=True, pair_rows_for=lambda k: -(-(-(-k // 2)) // 16) * 16)  # AMX: 16 pairs
PLAIN = SimpleNamespace(bf16_pairs=False, pair_rows_for=None)


@pytest.mark.parametrize("dtype, kernels", [(torch.float32, PLAIN), (torch.bfloat16, PLAIN), (torch.bfloat16, PAIRS)])
def test_rows_written_anywhere_give_a_fresh_weights_panels(dtype, kernels):
    gen = torch.Generator().manual_seed(0)
    old, new = (torch.randn(200, 70, generator=gen).to(dtype) for _ in range(2))
    written = PanelWeight(old, kernels, invariant=True)
    for start, stop in ((0, 13), (13, 64), (64, 192), (192, 200)):  # inside, up to, over and past panel edges
        written.write_rows(start, new[start:stop])
    fresh = PanelWeight(new, kernels, invariant=True)
    assert written.pairs == (kernels is PAIRS) and torch.equal(written.panels, fresh.panels)
    with pytest.raises(ValueError, match="do not fit"):
        written.write_rows(190, new[:20])
