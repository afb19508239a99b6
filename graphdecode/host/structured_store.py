"""StructuredStore: the host's account of the device's constraint tables.

Every constraint a request brings (a compiled TokenAutomaton, graphdecode/structured)
occupies a range of state rows and a range of transition exceptions in one device table
store (device/structured_tables.py), like pages in the KV cache: placed once when the
first request using it is submitted, shared by every request using it (a reference
count), and kept after the last one ends until its room is needed (least recently used
first), so a repeated schema is neither compiled nor uploaded again. The store is bounded
(`structured_max_states`, `structured_max_exceptions`): a constraint that does not fit
beside the ones in use is refused at submission with a ValueError naming its field
(`structured_outputs`, or `allowed_token_ids`: a one-state constraint), and nothing else is
disturbed.

Placing a new constraint queues a TableUpload; the engine hands the queued uploads to
the runner with the next step's plan, before any row that uses them starts. Nothing
here touches the device.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TablePlacement:
    """Where a constraint's tables sit in the device store (global state ids = state_base + local)."""

    key: str
    state_base: int
    exc_base: int
    num_states: int
    num_exceptions: int

    def state(self, local: int) -> int:
        return self.state_base + local


@dataclass(frozen=True, slots=True)
class TableUpload:
    placement: TablePlacement
    automaton: object  # structured.automaton.TokenAutomaton


class RangeAllocator:
    """First-fit contiguous ranges in [0, capacity), merged when freed."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[list[int]] = [[0, capacity]] if capacity else []  # [start, length], by start

    def allocate(self, length: int) -> int | None:
        if length == 0:
            return 0
        for block in self._free:
            if block[1] >= length:
                start = block[0]
                block[0] += length
                block[1] -= length
                if not block[1]:
                    self._free.remove(block)
                return start
        return None

    def free(self, start: int, length: int) -> None:
        if not length:
            return
        self._free.append([start, length])
        self._free.sort()
        merged: list[list[int]] = []
        for block in self._free:
            if merged and merged[-1][0] + merged[-1][1] == block[0]:
                merged[-1][1] += block[1]
            else:
                merged.append(block)
        self._free = merged

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._free)


def check_capacity(automaton, max_states: int, max_exceptions: int) -> None:
    """ValueError naming the constraint's field when it alone exceeds the store."""
    states, exceptions = automaton.num_states, automaton.num_exceptions
    if states > max_states or exceptions > max_exceptions:
        raise ValueError(
            f"{automaton.field}: the constraint compiles to {states} states and {exceptions} transition "
            f"exceptions, more than the table store holds (structured_max_states={max_states}, "
            f"structured_max_exceptions={max_exceptions})"
        )


class StructuredStore:
    def __init__(self, max_states: int, max_exceptions: int):
        self.max_states = max_states
        self.max_exceptions = max_exceptions
        self._states = RangeAllocator(max_states)
        self._exceptions = RangeAllocator(max_exceptions)
        self._placed: dict[str, TablePlacement] = {}
        self._users: dict[str, int] = {}
        self._unused: OrderedDict[str, None] = OrderedDict()  # placed, no user: evictable, oldest first
        self._uploads: list[TableUpload] = []
        self.num_uploads = 0
        self.num_evictions = 0

    def acquire(self, automaton) -> TablePlacement:
        """The constraint's placement (placing and queueing its upload if it is new); one more user."""
        key = automaton.key
        placement = self._placed.get(key)
        if placement is None:
            placement = self._place(automaton)
        self._unused.pop(key, None)
        self._users[key] = self._users.get(key, 0) + 1
        return placement

    def release(self, placement: TablePlacement) -> None:
        key = placement.key
        self._users[key] -= 1
        if not self._users[key]:
            del self._users[key]
            self._unused[key] = None

    def take_uploads(self) -> list[TableUpload]:
        uploads, self._uploads = self._uploads, []
        return uploads

    @property
    def states_in_use(self) -> int:
        return sum(self._placed[key].num_states for key in self._users)

    def _place(self, automaton) -> TablePlacement:
        check_capacity(automaton, self.max_states, self.max_exceptions)
        states, exceptions = automaton.num_states, automaton.num_exceptions
        while True:
            state_base = self._states.allocate(states)
            exc_base = self._exceptions.allocate(exceptions) if state_base is not None else None
            if state_base is not None and exc_base is not None:
                break
            if state_base is not None:
                self._states.free(state_base, states)
            if not self._unused:
                raise ValueError(
                    f"{automaton.field}: no room for this constraint's {states} states and {exceptions} exceptions "
                    f"beside the constraints of the requests in flight ({self.states_in_use} of "
                    f"{self.max_states} states in use); retry when they finish, or raise structured_max_states / "
                    f"structured_max_exceptions"
                )
            self._evict(next(iter(self._unused)))
        placement = TablePlacement(automaton.key, state_base, exc_base, states, exceptions)
        self._placed[automaton.key] = placement
        self._uploads.append(TableUpload(placement, automaton))
        self.num_uploads += 1
        return placement

    def _evict(self, key: str) -> None:
        del self._unused[key]
        placement = self._placed.pop(key)
        self._states.free(placement.state_base, placement.num_states)
        self._exceptions.free(placement.exc_base, placement.num_exceptions)
        self._uploads = [u for u in self._uploads if u.placement.key != key]
        self.num_evictions += 1
