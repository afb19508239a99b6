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

Rows with penalties (logit_bias, bad_words, repetition / presence / frequency) also
send, in the same flush and only for them, their bias entries, bad-word token
sequences, last output tokens, and their token counts as sparse (token, value) pairs
computed here from the prompt and the tokens so far (an admission after a preemption
or a prefix-cache hit carries them all). Their size varies, so they travel in fresh
pinned tensors from torch's caching host allocator, which keeps each one until the
copy that reads it has run (it records an event on the stream), like the runner's
prefill inputs. Other rows send none of it: their `penalized` flag is 0, which keeps
whatever stale bias or bad words their row holds inert, and their neutral penalties
make stale counts harmless.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .decode_state import FLOAT_COLUMNS, INT_COLUMNS, DecodeState
from .sampler import COUNT_MASK, PROMPT_BIT

_COL = {name: i for i, name in enumerate(INT_COLUMNS)}
_NEUTRAL_FLOATS = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)  # FLOAT_COLUMNS of an inert row


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
        # penalty rows waiting for the next flush: row -> (ints, floats, sparse counts or None)
        self._penalties: dict[int, tuple] = {}
        self.vocab_size = state.token_counts.shape[1]
        self.history_len = state.history.shape[1] if state.history is not None else 0
        self._history: dict[int, np.ndarray] = {}  # row -> its tokens, waiting for the next flush
        self.num_bias = state.bias_ids.shape[1]
        self.num_word_slots, self.num_word_tokens = state.bad_words.shape[1:]
        self._last_counts: tuple | None = None  # (key, counts): n children share one computation
        self.num_flushes = 0
        self.num_rows_staged = 0

    def set_row(self, row: int, *, position: int, max_len: int, min_len: int, stop_ids, params, seed: int, pages,
                token_ids=(), num_prompt_tokens: int = 0, struct_state: int | None = None):
        """`token_ids` (prompt + tokens so far) and `num_prompt_tokens` matter only for params
        with penalties: they give the row's token counts and recent tokens. `struct_state`:
        a constrained row's automaton state (global id), None for other rows."""
        ints = self.ints[row]
        ints[_COL["positions"]] = position
        ints[_COL["seq_lens"]] = position + 1
        ints[_COL["max_len"]] = max_len
        ints[_COL["min_len"]] = min_len
        ints[_COL["top_k"]] = params.top_k if params.top_k > 0 else 0
        ints[_COL["seed"]] = seed
        ints[_COL["done"]] = 0
        ints[_COL["penalized"]] = params.needs_penalties
        ints[_COL["constrained"]] = struct_state is not None
        ints[_COL["struct_state"]] = struct_state or 0
        ints[len(INT_COLUMNS) :] = -1
        ints[len(INT_COLUMNS) : len(INT_COLUMNS) + len(stop_ids)] = stop_ids
        self.floats[row] = (params.temperature, params.top_p, params.min_p, params.repetition_penalty,
                            params.presence_penalty, params.frequency_penalty)
        self.block_table[row] = 0
        self.block_table[row, : len(pages)] = pages
        self._dirty_rows.add(row)
        if params.needs_penalties:
            self._penalties[row] = self._penalty_row(params, token_ids, num_prompt_tokens)
        else:
            self._penalties.pop(row, None)
        if self.history_len:
            self._history[row] = np.asarray(token_ids, dtype=np.int64)  # speculation drafts from it

    def _penalty_row(self, params, token_ids, num_prompt_tokens: int):
        """(ints [L + W * T + T]: bias ids, bad words right-aligned, last T output tokens; floats [L]:
        bias values; sparse counts or None)."""
        width, slots, size = self.num_bias, self.num_word_slots, self.num_word_tokens
        ints = np.full(width + slots * size + size, -1, dtype=np.int64)
        floats = np.zeros(width, dtype=np.float32)
        if params.logit_bias:
            ids = list(params.logit_bias)
            ints[: len(ids)] = ids
            floats[: len(ids)] = [params.logit_bias[t] for t in ids]
        words = ints[width : width + slots * size].reshape(slots, size)
        for i, word in enumerate(params.bad_words_token_ids):
            words[i, size - len(word) :] = word
        recent = tuple(token_ids[num_prompt_tokens:][-size:])
        if recent:
            ints[len(ints) - len(recent) :] = recent
        counts = self._token_counts(token_ids, num_prompt_tokens) if params.needs_token_counts else None
        return ints, floats, counts

    def _token_counts(self, token_ids, num_prompt_tokens: int):
        """Sparse token_counts row: (token ids [m] int64, values [m] int16 = output count | PROMPT_BIT)."""
        key = (num_prompt_tokens, tuple(token_ids))
        if self._last_counts is not None and self._last_counts[0] == key:
            return self._last_counts[1]
        tokens = np.asarray(key[1], dtype=np.int64)
        prompt = np.unique(tokens[:num_prompt_tokens])
        output, times = np.unique(tokens[num_prompt_tokens:], return_counts=True)
        ids = np.union1d(prompt, output)
        values = np.zeros(len(ids), dtype=np.int16)
        values[np.searchsorted(ids, prompt)] = PROMPT_BIT
        values[np.searchsorted(ids, output)] += np.minimum(times, COUNT_MASK).astype(np.int16)
        self._last_counts = (key, (ids, values))
        return ids, values

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
        self._penalties.pop(row, None)
        self._history.pop(row, None)

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
            if self._penalties:
                self._flush_penalties(state)
            if self._history:
                self._flush_history(state)
        n = len(tables)
        table_idx.numpy()[:n] = tables
        table_rows.numpy()[:n] = self.block_table[tables]
        state.apply_block_tables(self._send(table_idx[:n]), self._send(table_rows[:n]))
        self._fences[index] = self._new_fence()
        self.num_flushes += 1
        self.num_rows_staged += len(tables)
        return len(tables)

    def _flush_penalties(self, state: DecodeState) -> None:
        """The penalty rows' own copies (after apply_rows, in stream order)."""
        rows = sorted(self._penalties)
        staged = [self._penalties[r] for r in rows]
        self._penalties.clear()
        state.apply_penalty_rows(
            self._upload(np.asarray(rows, dtype=np.int64)),
            self._upload(np.stack([ints for ints, _, _ in staged])),
            self._upload(np.stack([floats for _, floats, _ in staged])),
        )
        counted = [(r, counts) for r, (_, _, counts) in zip(rows, staged) if counts is not None]
        if counted:
            flat = np.concatenate([r * self.vocab_size + ids for r, (ids, _) in counted])
            values = np.concatenate([values for _, (_, values) in counted])
            state.apply_token_counts(
                self._upload(np.asarray([r for r, _ in counted], dtype=np.int64)),
                self._upload(flat), self._upload(values),
            )

    def _flush_history(self, state: DecodeState) -> None:
        """Admitted rows' tokens (prompt + so far) into their history rows (speculative decoding)."""
        staged, self._history = self._history, {}
        flat = np.concatenate([row * self.history_len + np.arange(len(ids)) for row, ids in staged.items()])
        state.apply_history(self._upload(flat), self._upload(np.concatenate(list(staged.values()))))

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A fresh (pinned on CUDA) host tensor, copied without blocking: see the module docstring."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _new_fence(self):
        """An event recorded behind the copies just enqueued (None on CPU: copies are synchronous)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _send(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)
