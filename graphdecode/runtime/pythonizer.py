"""Async pythonization: window outputs travel to pinned host memory behind an event.

`enqueue()` is called right after a window (or a prefill-only step) is launched: it
issues non-blocking copies of the bucket's output rows into one of two pinned
buffers and records an event. `wait()` is the only place in the engine that waits
on the device; the engine calls it for window w - 1 after launching window w, so in
steady state the event has long completed and the device never idles.

Double buffering: window w fills buffer w % 2; the host has finished reading window
w - 2 (same buffer) before window w is launched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..compiled.decode_state import DecodeState


@dataclass
class WindowResult:
    tokens: np.ndarray  # [bucket, k + 1] int64: column 0 = prefill token, 1..k = window steps
    lp_sampled: np.ndarray | None = None  # [bucket, k + 1] float32
    lp_rank: np.ndarray | None = None  # [bucket, k + 1] int64
    lp_top_ids: np.ndarray | None = None  # [bucket, k + 1, N] int64
    lp_top: np.ndarray | None = None  # [bucket, k + 1, N] float32


@dataclass
class _Slot:
    tokens: torch.Tensor
    lp_sampled: torch.Tensor
    lp_rank: torch.Tensor
    lp_top_ids: torch.Tensor
    lp_top: torch.Tensor


@dataclass
class PendingCopy:
    slot: int
    bucket: int
    with_logprobs: bool
    event: object  # torch.cuda.Event, or None on CPU (copies are synchronous there)
    extras: list | None = None  # host copies of other results (prompt logprobs), valid after wait()


class Pythonizer:
    _FIELDS = ("tokens", "lp_sampled", "lp_rank", "lp_top_ids", "lp_top")

    def __init__(self, state: DecodeState, device: torch.device):
        self.state = state
        self.cuda = device.type == "cuda"
        sources = self._sources()
        self._slots = [
            _Slot(*(torch.empty(src.shape, dtype=src.dtype, pin_memory=self.cuda) for src in sources))
            for _ in range(2)
        ]
        self._next = 0
        self.seconds_blocked = 0.0

    def _sources(self) -> tuple[torch.Tensor, ...]:
        s = self.state
        return (s.out_tokens, s.out_lp_sampled, s.out_lp_rank, s.out_lp_top_ids, s.out_lp_top)

    def enqueue(self, bucket: int, with_logprobs: bool, extras=None) -> PendingCopy:
        """extras: a list of tuples of device tensors to bring to the host behind the same event."""
        slot_index = self._next
        self._next ^= 1
        slot = self._slots[slot_index]
        sources = self._sources() if with_logprobs else self._sources()[:1]
        for name, src in zip(self._FIELDS, sources):
            getattr(slot, name)[:bucket].copy_(src[:bucket], non_blocking=True)  # contiguous row prefix
        host_extras = None
        if extras:
            host_extras = [tuple(self._to_host(t) for t in group) for group in extras]
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return PendingCopy(slot_index, bucket, with_logprobs, event, host_extras)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def wait(self, pending: PendingCopy) -> WindowResult:
        if pending.event is not None:
            start = time.perf_counter()
            pending.event.synchronize()
            self.seconds_blocked += time.perf_counter() - start
        slot = self._slots[pending.slot]
        b = pending.bucket
        if not pending.with_logprobs:
            return WindowResult(tokens=slot.tokens[:b].numpy())
        return WindowResult(*(getattr(slot, name)[:b].numpy() for name in self._FIELDS))
