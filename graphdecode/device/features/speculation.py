"""Speculation's per-row state: each row's token history (what n-gram drafts are looked up
in) and the draft counts of its last window.

* `history` [B_max, H] int64, H = max_model_len + d + 1: the prompt and outputs, staged when
  the row starts (also after a preemption or a prefix-cache hit) and extended by every
  window, plain or speculative, as tokens are sampled; None (H = 0) where nothing reads it
  (a draft head drafts from the target's hidden states: no buffer, nothing staged or recorded);
* `spec_drafted`, `spec_accepted`, `spec_rounds` [B_max] int32: drafts proposed and
  accepted, and verify rounds the row was live in, in the last speculative window (copied
  out with its tokens); `spec_accepted_pos` [B_max, d] int32: of those, the drafts accepted
  at each draft position (vLLM's per-position acceptance).
"""

from __future__ import annotations

import numpy as np
import torch

from . import RowFeature, buffer


class SpeculationRows(RowFeature):
    def __init__(self, rows: int, history_len: int, device, spec_tokens: int = 1):
        super().__init__(device)
        self.history = buffer(rows, history_len, dtype=torch.int64, device=device) if history_len else None
        self.spec_accepted_pos = buffer(rows, spec_tokens, dtype=torch.int32, device=device)
        self.spec_drafted = buffer(rows, dtype=torch.int32, device=device)
        self.spec_accepted = buffer(rows, dtype=torch.int32, device=device)
        self.spec_rounds = buffer(rows, dtype=torch.int32, device=device)
        self._pending: dict[int, np.ndarray] = {}  # row -> its tokens, until flush

    def counters(self) -> dict[str, torch.Tensor]:
        return {"spec_drafted": self.spec_drafted, "spec_accepted": self.spec_accepted,
                "spec_rounds": self.spec_rounds, "spec_accepted_pos": self.spec_accepted_pos}

    def add_row(self, start) -> None:
        if self.history is None:
            return
        self._pending[start.row] = np.asarray(start.token_ids, dtype=np.int64)

    def clear_row(self, row: int) -> None:
        self._pending.pop(row, None)

    def flush(self) -> None:
        if not self._pending:
            return
        staged, self._pending = self._pending, {}
        width = self.history.shape[1]
        flat = np.concatenate([row * width + np.arange(len(ids)) for row, ids in staged.items()])
        self.history.view(-1).index_copy_(0, self.send(flat), self.send(np.concatenate(list(staged.values()))))

    def record(self, rows, positions: torch.Tensor, tokens: torch.Tensor, live: torch.Tensor) -> None:
        """history[row, position] = token for live rows (rows: a slice or an index tensor; all [R])."""
        if self.history is None:
            return
        index = positions.clamp(max=self.history.shape[1] - 1)[:, None]
        if isinstance(rows, slice):
            history = self.history[rows]
            history.scatter_(1, index, torch.where(live, tokens, history.gather(1, index)[:, 0])[:, None])
        else:
            current = self.history[rows[:, None], index][:, 0]
            self.history[rows[:, None], index] = torch.where(live, tokens, current)[:, None]
