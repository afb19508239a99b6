"""Constraints: structured outputs and allowed_token_ids, as automaton states per row.

A constrained row (structured/automaton.py: allowed_token_ids is a one-state automaton)
has `constrained` set and its global automaton state in `struct_state` [B_max] int32; the
automata's tables live in one store on the device (device/structured_tables.py), made at
the first constraint and filled by the plan's table uploads, in stream order before the
rows that read them start. A row's state is walked on the host when it starts (a resumed
row recomputes it from its outputs so far). Rows that never held a constraint send
nothing; a row whose previous occupant was constrained sends its cleared flag.

In a window: the sampler masks each constrained row's logits by its state's allowed
tokens (`ConstraintRows.mask_`), min_tokens yields where the state allows only EOS (the
constraint is complete), and after sampling the state moves by the sampled token
(`advance`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..structured_tables import StructuredTables
from . import SparseRows, buffer


@dataclass
class ConstraintRows:
    """The constraint inputs of R rows."""

    constrained: torch.Tensor  # [R] bool: the row follows an automaton
    state: torch.Tensor  # [R] int32: its state (global id)
    words: torch.Tensor  # [R, ceil(V / 32)] int32: that state's allowed tokens, packed
    complete: torch.Tensor  # [R] bool: that state allows only EOS

    def mask_(self, logits: torch.Tensor, unpacker) -> None:
        """-inf, in place, on every token a constrained row's state does not allow."""
        unpacker.mask_disallowed_(logits, self.words, self.constrained)


class Constraints(SparseRows):
    def __init__(self, rows: int, max_states: int, max_exceptions: int, vocab_size: int, device):
        super().__init__(rows, device)
        self.constrained = buffer(rows, dtype=torch.bool, device=device)
        self.struct_state = buffer(rows, dtype=torch.int32, device=device)
        self.tables: StructuredTables | None = None  # made at the first upload
        self._table_sizes = (max_states, max_exceptions, vocab_size)

    # ------------------------------------------------------------------ host
    def upload(self, table_upload) -> None:
        """Place one constraint's tables (the plan's TableUpload)."""
        if self.tables is None:
            self.tables = StructuredTables(*self._table_sizes, self.device)
        self.tables.upload(table_upload.placement, table_upload.automaton)

    def add_row(self, start) -> None:
        state = None
        if start.structured is not None:  # recomputed from the outputs so far (a resumed row has some)
            state = self.tables.initial_state(start.structured, start.token_ids[start.num_prompt_tokens :])
        self.stage(start.row, state)

    def flush(self) -> None:
        if not self._pending:
            return
        rows, states = self.take()
        index = self.send(np.asarray(rows, dtype=np.int64))
        self.constrained.index_copy_(0, index, self.send(np.asarray([s is not None for s in states])))
        self.struct_state.index_copy_(0, index, self.send(np.asarray([s or 0 for s in states], dtype=np.int32)))

    # ---------------------------------------------------------------- window
    def rows(self, rows) -> ConstraintRows:
        """`rows`: a slice (views, for the window) or an index tensor (gathers, for prefill)."""
        state = self.struct_state[rows]
        return ConstraintRows(self.constrained[rows], **self.tables.row_inputs(state))

    def advance(self, rows, inputs: ConstraintRows, tokens: torch.Tensor, done_before: torch.Tensor,
                bounds=None) -> None:
        """Constrained live rows move by the token they sampled ([R] each); EOS keeps the state."""
        if bounds is not None:
            bounds.automaton(self.tables, inputs.state, inputs.words, tokens, inputs.constrained & ~done_before)
        moved = self.tables.advance(inputs.state, tokens)
        keep = done_before | ~inputs.constrained | (moved < 0)
        self.struct_state[rows] = torch.where(keep, inputs.state, moved.to(torch.int32))
