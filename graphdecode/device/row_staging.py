"""Host-side staging of row changes for the device's DecodeState.

The host records what changed (a row admitted, a row cleared, a block table grown)
into numpy mirrors and marks the row dirty. `flush()` gathers only the dirty rows
into one of two pinned buffers and enqueues non-blocking copies + scatters on the
stream, after the window that is still running: the stream orders them, and the
host never touches device memory a running window reads. A window whose batch did
not change costs no copy at all.

Double buffering: a flush that sends rows fills one of two pinned buffers, alternately,
and records an event behind its copies (the fence). Before a buffer is filled again
its fence is waited on: that copy was enqueued two flushes ago, so in steady state the
wait returns at once. (The pythonizer's wait on window events is not enough: a step
that launches nothing records no window event, yet can flush rows, e.g. an abort.)
This is the one wait in the runtime besides the pythonizer's.

The features' rows (device/features/: penalties, constraints, speculation's history) are
staged by their own objects, which `set_row` / `clear_row` forward to, and flushed
right after these rows, in the same stream order. Their sizes vary, so they travel in
fresh pinned tensors from torch's caching host allocator, which keeps each one until the
copy that reads it has run (it records an event on the stream), like the runner's
prefill inputs.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..plan import RowStart
from .decode_state import FLOAT_COLUMNS, INT_COLUMNS, DecodeState

_COL = {name: i for i, name in enumerate(INT_COLUMNS)}
_NEUTRAL_FLOATS = (0.0, 1.0, 0.0)  # FLOAT_COLUMNS of an inert row


class RowStaging:
    def __init__(self, state: DecodeState, device: torch.device):
        rows = state.max_rows
        self.device = device
        self.num_stop_ids = state.stop_ids.shape[1]
        self.ints = np.zeros((rows, len(INT_COLUMNS) + self.num_stop_ids), dtype=np.int64)
        self.ints[:, _COL["done"]] = 1
        self.ints[:, _COL["seq_lens"]] = 1
        self.ints[:, len(INT_COLUMNS) :] = -1
        self.floats = np.zeros((rows, len(FLOAT_COLUMNS)), dtype=np.float32)
        self.floats[:] = _NEUTRAL_FLOATS
        self.block_table = np.zeros((rows, state.max_pages), dtype=np.int32)
        pin = device.type == "cuda"

        def pinned(like: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.zeros_like(like)).pin_memory() if pin else torch.from_numpy(np.zeros_like(like))

        self._buffers = [
            (
                pinned(np.zeros(rows, dtype=np.int64)),
                pinned(self.ints),
                pinned(self.floats),
                pinned(np.zeros(rows, dtype=np.int64)),
                pinned(self.block_table),
            )
            for _ in range(2)
        ]
        self._flip = 0
        self._fences: list[torch.cuda.Event | None] = [None, None]  # behind each buffer's last copy
        self.seconds_blocked = 0.0
        self._dirty_rows: set[int] = set()
        self._dirty_tables: set[int] = set()
        self.features = state.features
        self.num_flushes = 0
        self.num_rows_staged = 0

    def set_row(self, start: RowStart) -> None:
        """A row starts: its columns here, and whatever each feature needs of it."""
        row, params = start.row, start.params
        ints = self.ints[row]
        ints[_COL["positions"]] = start.position
        ints[_COL["seq_lens"]] = start.position + 1
        ints[_COL["max_len"]] = start.max_len
        ints[_COL["min_len"]] = start.min_len
        ints[_COL["top_k"]] = params.top_k if params.top_k > 0 else 0
        ints[_COL["seed"]] = start.seed
        ints[_COL["seeded"]] = start.params.seed is not None
        ints[_COL["done"]] = 0
        ints[_COL["state_slot"]] = start.state_slot
        ints[_COL["lora_slot"]] = start.lora_slot
        ints[len(INT_COLUMNS) :] = -1
        ints[len(INT_COLUMNS) : len(INT_COLUMNS) + len(start.stop_ids)] = start.stop_ids
        self.floats[row] = (params.temperature, params.top_p, params.min_p)
        self.block_table[row] = 0
        self.block_table[row, : len(start.pages)] = start.pages
        self._dirty_rows.add(row)
        for feature in self.features:
            feature.add_row(start)

    def set_pages(self, row: int, start: int, pages) -> None:
        """Pages pages[i] now sit at block-table column start + i."""
        self.block_table[row, start : start + len(pages)] = pages
        self._dirty_tables.add(row)

    def clear_row(self, row: int) -> None:
        self.ints[row, : len(INT_COLUMNS)] = 0
        self.ints[row, _COL["done"]] = 1
        self.ints[row, _COL["seq_lens"]] = 1  # an inert row attends to one (scratch) token, never zero
        self.ints[row, len(INT_COLUMNS) :] = -1
        self.floats[row] = _NEUTRAL_FLOATS
        self.block_table[row] = 0
        self._dirty_rows.add(row)
        for feature in self.features:
            feature.clear_row(row)

    def flush(self, state: DecodeState) -> int:
        """Enqueue the dirty rows' copies; returns how many rows were sent."""
        full = sorted(self._dirty_rows)
        tables = sorted(self._dirty_tables.union(self._dirty_rows))
        self._dirty_rows.clear()
        self._dirty_tables.clear()
        if not tables:
            return 0
        index = self._flip
        self._flip ^= 1
        fence = self._fences[index]
        if fence is not None:
            start = time.perf_counter()
            fence.synchronize()  # the copy two flushes ago has left this pinned buffer
            self.seconds_blocked += time.perf_counter() - start
        row_idx, ints, floats, table_idx, table_rows = self._buffers[index]
        if full:
            n = len(full)
            row_idx.numpy()[:n] = full
            ints.numpy()[:n] = self.ints[full]
            floats.numpy()[:n] = self.floats[full]
            state.apply_rows(self._send(row_idx[:n]), self._send(ints[:n]), self._send(floats[:n]))
            for feature in self.features:
                feature.flush()
        n = len(tables)
        table_idx.numpy()[:n] = tables
        table_rows.numpy()[:n] = self.block_table[tables]
        state.apply_block_tables(self._send(table_idx[:n]), self._send(table_rows[:n]))
        self._fences[index] = self._new_fence()
        self.num_flushes += 1
        self.num_rows_staged += len(tables)
        return len(tables)

    def _new_fence(self):
        """An event recorded behind the copies just enqueued (None on CPU: copies are synchronous)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _send(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)
