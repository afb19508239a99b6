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
    tokens: np.ndarray  # [bucket, width] int64: column 0 = prefill token, 1..counts[row] = the window's
    counts: np.ndarray  # [bucket] int32: window tokens each row wrote (k in a plain window)
    lp_sampled: np.ndarray | None = None  # [bucket, width] float32
    lp_rank: np.ndarray | None = None  # [bucket, width] int64
    lp_top_ids: np.ndarray | None = None  # [bucket, width, N] int64
    lp_top: np.ndarray | None = None  # [bucket, width, N] float32
    spec: np.ndarray | None = None  # [3, bucket] int32 after a speculative window: drafted, accepted, rounds


@dataclass
class PendingCopy:
    slot: int
    bucket: int
    with_logprobs: bool
    event: object  # torch.cuda.Event, or None on CPU (copies are synchronous there)
    extras: list | None = None  # host copies of other results (prompt logprobs), valid after wait()
    speculative: bool = False


class Pythonizer:
    _ALWAYS = ("out_tokens", "out_count")
    _LOGPROBS = ("out_lp_sampled", "out_lp_rank", "out_lp_top_ids", "out_lp_top")
    _SPEC = ("spec_drafted", "spec_accepted", "spec_rounds")

    def __init__(self, state: DecodeState, device: torch.device):
        self.state = state
        self.cuda = device.type == "cuda"
        names = self._ALWAYS + self._LOGPROBS + self._SPEC
        self._slots = [
            {name: torch.empty(getattr(state, name).shape, dtype=getattr(state, name).dtype, pin_memory=self.cuda)
             for name in names}
            for _ in range(2)
        ]
        self._next = 0
        self.seconds_blocked = 0.0

    def enqueue(self, bucket: int, with_logprobs: bool, extras=None, speculative: bool = False) -> PendingCopy:
        """extras: a list of tuples of device tensors to bring to the host behind the same event."""
        slot_index = self._next
        self._next ^= 1
        slot = self._slots[slot_index]
        names = self._ALWAYS + (self._LOGPROBS if with_logprobs else ()) + (self._SPEC if speculative else ())
        for name in names:
            slot[name][:bucket].copy_(getattr(self.state, name)[:bucket], non_blocking=True)  # a row prefix
        host_extras = None
        if extras:
            host_extras = [tuple(self._to_host(t) for t in group) for group in extras]
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return PendingCopy(slot_index, bucket, with_logprobs, event, host_extras, speculative)

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
        slot, b = self._slots[pending.slot], pending.bucket
        result = WindowResult(tokens=slot["out_tokens"][:b].numpy(), counts=slot["out_count"][:b].numpy())
        if pending.with_logprobs:
            result.lp_sampled, result.lp_rank, result.lp_top_ids, result.lp_top = (
                slot[name][:b].numpy() for name in self._LOGPROBS
            )
        if pending.speculative:
            result.spec = np.stack([slot[name][:b].numpy() for name in self._SPEC])
        return result
