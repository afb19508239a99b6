"""host/state_slots.py: a hybrid's live slots and the prefix cache's state snapshots, as bookkeeping."""

from __future__ import annotations

from types import SimpleNamespace

from graphdecode.host.page_pool import PagePool
from graphdecode.host.state_slots import StateSlots


def test_live_slots_are_handed_out_lowest_first_and_come_back():
    slots = StateSlots(max_batch_size=3, num_snapshots=0, page_size=4)
    seqs = [SimpleNamespace(state_slot=0) for _ in range(3)]
    for seq in seqs:
        slots.take(seq)
    assert [s.state_slot for s in seqs] == [1, 2, 3] and slots.num_free == 0
    slots.give_back(seqs[1])
    slots.give_back(seqs[1])  # a second give-back of a sequence that holds none is nothing
    assert seqs[1].state_slot == 0 and slots.num_free == 1


def test_a_snapshot_is_findable_from_the_next_step_and_hits_stop_at_the_last_one():
    slots = StateSlots(max_batch_size=2, num_snapshots=2, page_size=4)
    keys = [b"a", b"b", b"c"]
    assert slots.reserve(b"b") == 3  # the slots after the live ones
    assert slots.usable_hits([10, 11, 12], keys) == (0, 0)  # pending: a same-step restore would read it early
    slots.commit()
    assert slots.usable_hits([10, 11, 12], keys) == (2, 3)  # pages a, b; the state where b ends
    assert slots.reserve(b"b") == 0  # taken once
    assert slots.boundaries(computed=8, cached=12, num_tokens=21) == [12, 20]
    assert slots.boundaries(computed=8, cached=8, num_tokens=9) == []


def test_snapshots_go_least_recently_used_and_with_their_pages():
    slots = StateSlots(max_batch_size=1, num_snapshots=2, page_size=4)
    first, second = slots.reserve(b"x"), slots.reserve(b"y")
    slots.commit()
    slots.usable_hits([5], [b"x"])  # x is used: y is now the least recent
    third = slots.reserve(b"z")
    slots.commit()
    assert third == second and slots.usable_hits([5], [b"y"]) == (0, 0)
    pool = PagePool(4)
    pool.on_forget = slots.forget
    (page,) = pool.allocate(1)
    pool.cache_page(page, b"x")
    pool.free([page])
    pool.allocate(3)  # takes the cached page too: its key, and the state that ended there, are forgotten
    assert slots.usable_hits([page], [b"x"]) == (0, 0) and slots.num_cached_snapshots == 1
    assert slots.reserve(b"w") == first  # its slot serves again
