"""The scheduler's waiting queue, one class per scheduling policy.

Both hold groups (lists of sequences that are admitted together, see scheduler.py) and
cost O(1) (FCFS) or O(log n) (priority) per push and pop, so a step's scheduling cost
never grows with the number of waiting requests.

* FCFSQueue: arrival order; a preempted group goes back to the front.
* PriorityQueue: lowest `priority` first, then arrival order (vLLM's rule); a preempted
  group goes back under its own key, which puts it ahead of every later arrival of its
  priority.
"""

from __future__ import annotations

import heapq
from collections import deque

from .sequence import Sequence


class FCFSQueue:
    def __init__(self):
        self._groups: deque[list[Sequence]] = deque()
        self.num_seqs = 0  # sequences in the queued groups, kept as they come and go

    def push(self, group: list[Sequence]) -> None:
        self._groups.append(group)
        self.num_seqs += len(group)

    def push_front(self, group: list[Sequence]) -> None:
        """A preempted group: it is the next to be admitted again."""
        self._groups.appendleft(group)
        self.num_seqs += len(group)

    def peek(self) -> list[Sequence]:
        return self._groups[0]

    def pop(self) -> list[Sequence]:
        group = self._groups.popleft()
        self.num_seqs -= len(group)
        return group

    def __len__(self) -> int:
        return len(self._groups)


class PriorityQueue:
    def __init__(self):
        self._heap: list[tuple[int, int, int, list[Sequence]]] = []
        self.num_seqs = 0

    def push(self, group: list[Sequence]) -> None:
        leader = group[0]
        heapq.heappush(self._heap, (leader.request.priority, leader.request.arrival, leader.seq_id, group))
        self.num_seqs += len(group)

    push_front = push  # a preempted group's own key already places it

    def peek(self) -> list[Sequence]:
        return self._heap[0][3]

    def pop(self) -> list[Sequence]:
        group = heapq.heappop(self._heap)[3]
        self.num_seqs -= len(group)
        return group

    def __len__(self) -> int:
        return len(self._heap)


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
