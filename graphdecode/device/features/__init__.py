"""Per-row device state, one object per feature (vLLM's model runner V2 keeps its sampling
features in sample/*.py the same way).

The decode state (device/decode_state.py) holds what every row needs: model inputs,
attention metadata, stop state, the plain sampling parameters and the output tokens.
Everything a feature adds lives in its own object here, which owns
* its buffers, [B_max, ...] struct-of-arrays indexed by row (`tensors()` lists them for
  the window-writes registry);
* its host staging: `add_row(start)` (a plan's RowStart) and `clear_row(row)` record a
  change on the host, `flush()` enqueues the pending rows' copies, in stream order after
  the decode state's own rows (device/row_staging.py); rows that never used the feature
  send nothing;
* what a window does with it: the rows' inputs for the sampler, how the logits change,
  what is recorded after a token is sampled.

Features: penalties.py (logit_bias, bad words, repetition / presence / frequency),
constraints.py (structured outputs and allowed_token_ids: automaton states and tables),
logprobs.py (the logprob output columns), speculation.py (token history and draft counts).
A new feature adds one file here and one line in DecodeState.__init__.
"""

from __future__ import annotations

import numpy as np
import torch


class RowFeature:
    """Base: no staging, no buffers. Subclasses override what they need."""

    def __init__(self, device):
        self.device = torch.device(device)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in vars(self).items() if isinstance(t, torch.Tensor)}

    def add_row(self, start) -> None:
        """A row starts (plan.RowStart): stage what the feature needs of it."""

    def clear_row(self, row: int) -> None:
        """The row is freed: drop what is still pending for it."""

    def flush(self) -> None:
        """Enqueue the pending rows' copies."""

    def send(self, array: np.ndarray) -> torch.Tensor:
        """A fresh host tensor (pinned on CUDA: torch's caching host allocator keeps it until the
        copy that reads it has run), copied to the device without blocking."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)


class SparseRows(RowFeature):
    """A feature most rows do not use: a row that uses it stages its entry; a row that does not
    stages a neutral one (None) only where its row's previous occupant used it."""

    def __init__(self, rows: int, device):
        super().__init__(device)
        self._used = np.zeros(rows, dtype=bool)  # the device row may hold a user's entries
        self._pending: dict[int, object] = {}  # row -> its entry (None: neutral), until flush

    def stage(self, row: int, entry) -> None:
        if entry is not None:
            self._pending[row] = entry
            self._used[row] = True
        elif self._used[row]:
            self._pending[row] = None
            self._used[row] = False
        else:
            self._pending.pop(row, None)

    def clear_row(self, row: int) -> None:
        """Nothing to send: an inert row's entries are harmless, and the next occupant resets them."""
        if row in self._pending:  # staged but never sent: the device row may still hold a user's entries
            del self._pending[row]
            self._used[row] = True

    def take(self) -> tuple[list[int], list]:
        """The pending rows, ascending, and their entries; nothing stays pending."""
        rows = sorted(self._pending)
        entries = [self._pending[r] for r in rows]
        self._pending.clear()
        return rows, entries


def buffer(*shape, dtype, device, fill=0) -> torch.Tensor:
    return torch.full(shape, fill, dtype=dtype, device=device)
