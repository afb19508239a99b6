"""Scheduler: admissions between windows, lookahead pages, preemption by recompute.

Sequence-native. State: a deque of waiting groups, a row table for running
sequences (struct-of-arrays slots on the device), and a dict of running sequences in
admission order. Per call the work is O(running + admitted + preempted): nothing
here ever walks the waiting queue or the finished requests.

A waiting group is a list of sequences that share their tokens at admission: the n
children of a fresh request (prefilled once, then forked) or one preempted sequence
(recomputed from its prompt and the tokens it already produced).

Before a window is launched every live sequence holds pages for
`num_scheduled_tokens + k` tokens, so the device never needs the host inside a
window. When pages run out, the most recently admitted sequence is preempted: it
frees its pages and goes back to the front of the queue; its in-flight tokens are
discarded (its row epoch no longer matches) and recomputed, which gives the same
tokens because sampling noise depends only on (seed, position, token).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from ..compiled.sampler import RowCounts, SamplerVariant
from .page_allocator import PageAllocator
from .row_staging import RowStaging
from .sequence import Sequence


@dataclass
class PrefillGroup:
    seqs: list[Sequence]  # share their token ids at admission; seqs[0] owns the prompt pages
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (leader's partial page, child's copy)

    @property
    def token_ids(self) -> list[int]:
        return self.seqs[0].token_ids


@dataclass
class WindowPlan:
    prefills: list[PrefillGroup]
    steps: int  # k, or 0 when no running sequence needs more tokens
    bucket: int
    variant: SamplerVariant
    kv_width: int  # block-table columns an eager torch-reference window gathers
    rows: list[tuple[int, Sequence, int, bool]]  # (row, sequence, epoch, admitted now)

    @property
    def empty(self) -> bool:
        return not self.prefills and self.steps == 0


class Scheduler:
    def __init__(self, config, allocator: PageAllocator, staging: RowStaging, bucket_for):
        self.steps = config.num_decode_steps
        self.page_size = config.page_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_pages_per_seq = config.max_pages_per_seq
        self.allocator = allocator
        self.staging = staging
        self.bucket_for = bucket_for
        self.waiting: deque[list[Sequence]] = deque()
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, oldest admission first
        self._free_rows = list(range(config.max_batch_size))  # a heap: lowest row first keeps buckets small
        self._epoch = 0
        self._counts = RowCounts(config.max_logprobs)  # what the running rows need of the sampler
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue
    def add(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def group_pages(self, num_tokens: int, n: int, max_len: int) -> int:
        """Pages a group needs at admission: prompt + first token + one window."""
        total = self.pages_for(min(num_tokens + 1 + self.steps, max_len))
        shared = num_tokens // self.page_size if n > 1 else 0
        return total + (n - 1) * (total - shared)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> WindowPlan:
        self._retire_drained()
        preempted = self._reserve_lookahead()
        prefills = [] if preempted else self._admit()
        admitted = {id(s) for g in prefills for s in g.seqs}
        steps = self.steps if any(not s.is_draining for s in self.running.values()) else 0
        for seq in self.running.values():
            seq.num_scheduled_tokens = min(seq.num_scheduled_tokens + steps, seq.max_len)
        top = max((s.row for s in self.running.values()), default=-1) + 1
        return WindowPlan(
            prefills=prefills,
            steps=steps,
            bucket=self.bucket_for(top) if top else 0,
            variant=self._counts.variant(),
            kv_width=self._kv_width(),
            rows=[(s.row, s, s.epoch, id(s) in admitted) for s in self.running.values()],
        )

    def _retire_drained(self) -> None:
        """Release sequences whose every remaining token is already covered by launched work.

        The device finishes them inside the windows in flight (done flags freeze them), so
        their row and pages can serve the next window right away: stream order puts any
        reuse after those windows, and their outputs were already copied out. They stay
        unfinished on the host (epoch unchanged) until their tokens are pythonized.
        """
        for seq in [s for s in self.running.values() if s.is_draining]:
            self._release(seq)

    def _kv_width(self) -> int:
        """Pages an eager torch-attention window gathers per row: the longest block table,
        rounded up to a power of two, and at least 2 (a compiled forward specialises a
        dimension of size 1, so width 1 would compile again)."""
        longest = max((len(s.pages) for s in self.running.values()), default=2)
        return min(max(2, 1 << (longest - 1).bit_length()), self.max_pages_per_seq)

    def _reserve_lookahead(self) -> int:
        preempted = 0
        for seq in list(self.running.values()):
            if not seq.is_running:
                continue
            need = self.pages_for(min(seq.num_scheduled_tokens + self.steps, seq.max_len)) - len(seq.pages)
            if need <= 0:
                continue
            while self.allocator.num_free < need:
                victim = next(reversed(self.running.values()))
                self.preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.is_running:
                start = len(seq.pages)
                new_pages = self.allocator.allocate(need)
                seq.pages.extend(new_pages)
                self.staging.set_pages(seq.row, start, new_pages)
        return preempted

    def _admit(self) -> list[PrefillGroup]:
        budget = self.max_num_batched_tokens
        groups: list[PrefillGroup] = []
        while self.waiting:
            group = self.waiting[0]
            if all(s.is_finished for s in group):  # aborted while waiting
                self.waiting.popleft()
                continue
            num_tokens = group[0].num_tokens
            if len(self._free_rows) < len(group) or (groups and num_tokens > budget):
                break
            if self.group_pages(num_tokens, len(group), group[0].max_len) > self.allocator.num_free:
                break
            self.waiting.popleft()
            budget -= num_tokens
            groups.append(self._place(group))
        return groups

    def _place(self, group: list[Sequence]) -> PrefillGroup:
        leader = group[0]
        num_tokens = leader.num_tokens
        total = self.pages_for(min(num_tokens + 1 + self.steps, leader.max_len))
        shared = num_tokens // self.page_size if len(group) > 1 else 0
        leader_pages = self.allocator.allocate(total)
        placed = PrefillGroup(seqs=group)
        self._start(leader, leader_pages)
        for child in group[1:]:
            self.allocator.share(leader_pages[:shared])
            own = self.allocator.allocate(total - shared)
            if num_tokens % self.page_size:
                placed.page_copies.append((leader_pages[shared], own[0]))
            self._start(child, leader_pages[:shared] + own)
        return placed

    def _start(self, seq: Sequence, pages: list[int]) -> None:
        row = heapq.heappop(self._free_rows)
        params = seq.request.params
        seq.row = row
        seq.pages = pages
        seq.epoch = self._epoch
        self._epoch += 1
        seq.num_scheduled_tokens = seq.num_tokens + 1
        self.running[seq.seq_id] = seq
        self._counts.add(params)
        self.staging.set_row(
            row,
            position=seq.num_tokens,
            max_len=seq.max_len,
            min_len=seq.num_prompt_tokens + params.min_tokens,
            stop_ids=seq.stop_ids,
            params=params,
            seed=seq.seed,
            pages=pages,
        )

    # ------------------------------------------------------- leaving the batch
    def finish(self, seq: Sequence) -> None:
        if seq.is_running:
            self._release(seq)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.epoch = -1  # tokens of windows in flight are void: they will be recomputed
        seq.num_scheduled_tokens = seq.num_tokens
        self.waiting.appendleft([seq])
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
        self.staging.clear_row(seq.row)
        heapq.heappush(self._free_rows, seq.row)
        seq.row = None
        del self.running[seq.seq_id]
        self._counts.remove(seq.request.params)

