"""Async pythonization: window outputs travel to pinned host memory behind an event.

`enqueue()` is called right after a window (or a prefill-only step) is launched: it
issues non-blocking copies of the bucket's output rows into one of two pinned
buffers and records an event. `wait()` is where the host waits for the device's
outputs (besides it, only the staging fence waits: device/row_staging.py); the engine calls it for window w - 1 after launching window w, so in
steady state the event has long completed and the device never idles.

Double buffering: window w fills buffer w % 2; the host has finished reading window
w - 2 (same buffer) before window w is launched.

Window timing: `start_window()` just before a decode window runs and `enqueue()` right
after bracket it; `wait()` then reports the window's time (CUDA timing events around the
graph replay on a GPU, so it is device time and costs no sync; wall time on a CPU, where
the window runs eagerly inside the launch). The speculation policy reads it. A step's
prefill is timed the same way (`start_prefill()` / `end_prefill(tokens)` around it), when
that step enqueues (a prefill chunk that samples nothing is not): the policy reads the
target's many-row rate from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .decode_state import DecodeState


@dataclass
class WindowResult:
    tokens: np.ndarray  # [bucket, width] int64: column 0 = prefill token, 1..counts[row] = the window's
    counts: np.ndarray  # [bucket] int32: window tokens each row wrote (k in a plain window)
    lp_sampled: np.ndarray | None = None  # [bucket, width] float32
    lp_rank: np.ndarray | None = None  # [bucket, width] int64
    lp_top_ids: np.ndarray | None = None  # [bucket, width, N] int64
    lp_top: np.ndarray | None = None  # [bucket, width, N] float32
    spec: np.ndarray | None = None  # [3, bucket] int32 after a speculative window: drafted, accepted, rounds
    spec_positions: np.ndarray | None = None  # [d] int64: ... drafts accepted at each draft position
    window_seconds: float | None = None  # the decode window's own time, when one ran
    prefill_tokens: int = 0  # tokens the step's prefill ran (0: none timed)
    prefill_seconds: float | None = None  # ... and its time


@dataclass
class PendingCopy:
    slot: int
    bucket: int
    with_logprobs: bool
    event: object  # torch.cuda.Event, or None on CPU (copies are synchronous there)
    extras: list | None = None  # host copies of other results (prompt logprobs), valid after wait()
    speculative: bool = False
    timed: bool = False  # a decode window ran between start_window() and enqueue()
    cpu_seconds: float | None = None  # its wall time on a CPU (CUDA: the slot's timing events)
    prefill_tokens: int = 0  # the step's prefill, timed: its tokens
    prefill_cpu_seconds: float | None = None  # ... and its wall time on a CPU
    pythonizer: "Pythonizer | None" = field(default=None, repr=False)  # whose slot holds it

    def result(self) -> "WindowResult":
        """The window's outputs on the host: the one place the host waits for the device."""
        return self.pythonizer.wait(self)


class Pythonizer:
    _LOGPROBS = ("out_lp_sampled", "out_lp_rank", "out_lp_top_ids", "out_lp_top")
    _SPEC = ("spec_drafted", "spec_accepted", "spec_rounds")

    def __init__(self, state: DecodeState, device: torch.device):
        self.state = state
        self.cuda = device.type == "cuda"
        sources = state.output_tensors(logprobs=True, speculative=state.speculation is not None)
        self._slots = [
            {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for name, t in sources.items()}
            for _ in range(2)
        ]
        self._next = 0
        self.seconds_blocked = 0.0
        self._timing = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(2)] if self.cuda else None
        self._prefill_timing = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                                for _ in range(2)] if self.cuda else None
        self._window_start: float | None = None  # perf_counter at start_window(), CPU
        self._window_open = False
        self._prefill_start: float | None = None  # perf_counter at start_prefill(), CPU
        self._prefill_tokens = 0  # tokens of the prefill timed since the last enqueue
        self._prefill_seconds: float | None = None  # its wall time, CPU

    def start_prefill(self) -> None:
        """Mark the start of a step's prefill (end_prefill() its end)."""
        if self.cuda:
            self._prefill_timing[self._next][0].record()
        else:
            self._prefill_start = time.perf_counter()

    def end_prefill(self, tokens: int) -> None:
        """The prefill started by start_prefill() ran these tokens; the next enqueue() reports it (a step
        that enqueues nothing drops it: the next start_prefill() records over it)."""
        self._prefill_tokens = tokens
        if self.cuda:
            self._prefill_timing[self._next][1].record()
        else:
            self._prefill_seconds = time.perf_counter() - self._prefill_start

    def start_window(self) -> None:
        """Mark the start of a decode window (the next enqueue() marks its end)."""
        self._window_open = True
        if self.cuda:
            self._timing[self._next][0].record()
        else:
            self._window_start = time.perf_counter()

    def enqueue(self, bucket: int, with_logprobs: bool, extras=None, speculative: bool = False) -> PendingCopy:
        """extras: a list of tuples of device tensors to bring to the host behind the same event."""
        slot_index = self._next
        self._next ^= 1
        slot = self._slots[slot_index]
        timed, cpu_seconds = self._window_open, None
        self._window_open = False
        prefill_tokens, prefill_seconds = self._prefill_tokens, self._prefill_seconds
        self._prefill_tokens, self._prefill_seconds = 0, None
        if timed:  # the window's end, before the copies
            if self.cuda:
                self._timing[slot_index][1].record()
            else:
                cpu_seconds = time.perf_counter() - self._window_start
        for name, source in self.state.output_tensors(with_logprobs, speculative).items():
            slot[name][:bucket].copy_(source[:bucket], non_blocking=True)  # a row prefix
        host_extras = None
        if extras:
            host_extras = [tuple(self._to_host(t) for t in group) for group in extras]
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return PendingCopy(slot_index, bucket, with_logprobs, event, host_extras, speculative, timed, cpu_seconds,
                           prefill_tokens, prefill_seconds, self)

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
            result.spec_positions = slot["spec_accepted_pos"][:b].numpy().sum(axis=0)
        if pending.timed:
            if self.cuda:
                start, end = self._timing[pending.slot]
                result.window_seconds = start.elapsed_time(end) / 1000.0  # both completed: the event above
            else:
                result.window_seconds = pending.cpu_seconds
        if pending.prefill_tokens:
            result.prefill_tokens = pending.prefill_tokens
            if self.cuda:
                start, end = self._prefill_timing[pending.slot]
                result.prefill_seconds = start.elapsed_time(end) / 1000.0
            else:
                result.prefill_seconds = pending.prefill_cpu_seconds
        return result
