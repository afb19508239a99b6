"""A hybrid model's recurrent-state slots on the host: who holds which slot, and the prefix cache's snapshots.

The device tensors are attention/state_cache.py's; this is their bookkeeping, the scheduler's only view of them.

* Live slots 1..max_batch_size: one per admitted sequence (`take` at admission, `give_back` when it finishes,
  is aborted or preempted). Every holder holds a row or a reserved row, so they never run out.
* Snapshot slots max_batch_size + 1 .. + num_snapshots: the recurrent state at the end of a cached page,
  keyed by that page's prefix-cache key (a key names the whole token prefix up to the page's end). A prefix
  hit on a hybrid needs the K/V pages *and* the state where they end: `usable_hits` cuts a hit back to the
  longest run of pages ending in a snapshot, and the sequence starts from a copy of it.

Which boundaries get a snapshot (`boundaries`): where the prompt's cached K/V ends (the point where it
diverges from an earlier prompt: a shared system prompt, found by the second request that shares it) and the
prompt's last full page (a repeated prompt, a preempted sequence's recompute, a conversation's next turn). The
scheduler ends a prefill chunk at each such boundary and the runner copies the sequence's slot into the
snapshot slot after that chunk (PrefillChunk.state_snapshot). A snapshot reserved this step becomes findable
at the next schedule (`commit`): a restore copies at the start of a prefill forward and a snapshot at its end,
so a same-step hit would read it too early. Snapshots are evicted least recently used when a new one needs a
slot, and dropped with their page when the prefix cache evicts it (`forget`).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    def __init__(self, max_batch_size: int, num_snapshots: int, page_size: int):
        self.page_size = page_size
        self._free = list(range(max_batch_size, 0, -1))  # pop() = lowest first
        first = max_batch_size + 1
        self._free_snapshots = list(range(first + num_snapshots - 1, first - 1, -1))
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, findable, oldest use first
        self._pending: dict[bytes, int] = {}  # reserved this step, findable from the next
        self.num_snapshots_taken = 0

    # ------------------------------------------------------------ live slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq) -> None:
        seq.state_slot = self._free.pop()

    def give_back(self, seq) -> None:
        if seq.state_slot:
            self._free.append(seq.state_slot)
            seq.state_slot = 0

    # ------------------------------------------------------------- snapshots
    @property
    def num_cached_snapshots(self) -> int:
        return len(self._snapshots)

    def usable_hits(self, hits: list[int], keys: list[bytes]) -> tuple[int, int]:
        """(how many of `hits` to use, the snapshot slot to start from; 0: none, start from zero)."""
        for count in range(len(hits), 0, -1):
            slot = self._snapshots.get(keys[count - 1])
            if slot is not None:
                self._snapshots.move_to_end(keys[count - 1])
                return count, slot
        return 0, 0

    def boundaries(self, computed: int, cached: int, num_tokens: int) -> list[int]:
        """Token counts (page-aligned, past `computed`) after which to snapshot: the end of the cached K/V
        (`cached` tokens) and the prompt's last full page before its last token."""
        last = (num_tokens - 1) // self.page_size * self.page_size
        return sorted({b for b in (cached, last) if b > computed})

    def reserve(self, key: bytes) -> int:
        """A slot for the snapshot that ends at `key`'s page (0: it exists already, or every slot is pending)."""
        if key in self._snapshots or key in self._pending:
            return 0
        if not self._free_snapshots:
            if not self._snapshots:
                return 0
            _, slot = self._snapshots.popitem(last=False)  # least recently used
            self._free_snapshots.append(slot)
        slot = self._free_snapshots.pop()
        self._pending[key] = slot
        self.num_snapshots_taken += 1
        return slot

    def commit(self) -> None:
        """Last step's snapshots are enqueued before anything this step plans: make them findable."""
        self._snapshots.update(self._pending)
        self._pending.clear()

    def forget(self, key: bytes) -> None:
        """The prefix cache evicted `key`'s page: its state goes too."""
        slot = self._snapshots.pop(key, None) or self._pending.pop(key, None)
        if slot:
            self._free_snapshots.append(slot)
