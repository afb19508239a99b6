"""RowStaging reuses a pinned buffer only after the copy that last used it has run.

On CUDA each flush that sends rows records a fence event; the flush that next fills
the same buffer waits on it first. A stand-in event records the order on CPU.
"""

from __future__ import annotations

import torch

from graphdecode.device.decode_state import DecodeState
from graphdecode.device.row_staging import RowStaging
from graphdecode.plan import RowStart
from graphdecode.sampling_params import SamplingParams


class FakeEvent:
    def __init__(self, log, name):
        self.log, self.name, self.done = log, name, False

    def synchronize(self):
        self.log.append(f"wait {self.name}")
        self.done = True


class FencedStaging(RowStaging):
    def __init__(self, *args):
        super().__init__(*args)
        self.log, self.made = [], []

    def _new_fence(self):
        event = FakeEvent(self.log, f"fence{len(self.made)}")
        self.made.append(event)
        self.log.append(f"record {event.name}")
        return event


def _row(staging, row):
    staging.set_row(RowStart(row=row, position=3, pages=(1, 2), params=SamplingParams(), seed=7, stop_ids=(2,),
                             max_len=10, min_len=0))


def test_a_buffer_is_refilled_only_after_its_fence():
    state = DecodeState(4, 4, 2, num_decode_steps=2, max_logprobs=1, device="cpu")
    staging = FencedStaging(state, torch.device("cpu"))
    _row(staging, 0)
    assert staging.flush(state) == 1  # buffer 0, fence0
    assert staging.flush(state) == 0  # nothing dirty: no buffer, no fence, no wait
    staging.clear_row(0)
    assert staging.flush(state) == 1  # buffer 1, fence1: buffer 0 untouched, nothing to wait for
    assert staging.log == ["record fence0", "record fence1"]
    _row(staging, 1)
    staging.set_pages(1, 2, [5])
    assert staging.flush(state) == 1  # buffer 0 again: waits for fence0 first, never fence1
    assert staging.log == ["record fence0", "record fence1", "wait fence0", "record fence2"]
    assert not staging.made[1].done
    _row(staging, 2)
    staging.flush(state)  # buffer 1: fence1
    assert staging.log[-2:] == ["wait fence1", "record fence3"]
    assert state.block_table[1].tolist() == [1, 2, 5, 0] and not state.done[1] and state.done[0]


def test_cpu_staging_records_no_fence():
    state = DecodeState(2, 2, 1, num_decode_steps=1, max_logprobs=1, device="cpu")
    staging = RowStaging(state, torch.device("cpu"))
    for _ in range(3):
        _row(staging, 0)
        staging.flush(state)
    assert staging._fences == [None, None] and staging.seconds_blocked == 0.0
