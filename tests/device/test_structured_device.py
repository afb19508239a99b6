"""The device half of structured outputs: the table store's accounting and the tables' advance
(a fixed-step binary search over each state's sorted exceptions) against a plain host walk."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphdecode.device.structured_tables import StructuredTables
from graphdecode.device.token_mask import TokenMaskUnpacker
from graphdecode.host.structured_store import RangeAllocator, StructuredStore
from graphdecode.structured.automaton import TokenAutomaton, allowed_ids_automaton, pack_token_ids, restrict


def expand(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, ceil(V / 32)] packed masks -> [R, V] bool, bit by bit (the oracle of the window's masking)."""
    ids = torch.arange(vocab)
    return ((words[:, ids // 32] >> (ids % 32).to(torch.int32)) & 1).to(torch.bool)


def random_automaton(key: str, states: int, vocab: int, seed: int):
    """Tables in TokenAutomaton's layout: per state some allowed tokens, a default next state
    and sorted exceptions; next_state walks them on the host, plainly."""
    rng = np.random.default_rng(seed)
    allowed_ids, default, offsets, tokens, nexts = [], [], [0], [], []
    for _ in range(states):
        ids = np.sort(rng.choice(vocab, size=int(rng.integers(1, vocab // 2)), replace=False))
        allowed_ids.append(ids)
        default.append(int(rng.integers(0, states)))
        exc = np.sort(rng.choice(ids, size=int(rng.integers(0, len(ids) + 1)), replace=False))
        tokens += exc.tolist()
        nexts += rng.integers(0, states, size=len(exc)).tolist()
        offsets.append(len(tokens))
    allowed = np.stack([pack_token_ids(ids, vocab) for ids in allowed_ids])

    def next_state(state: int, token: int) -> int:
        if token not in set(allowed_ids[state].tolist()):
            return -1
        lo, hi = offsets[state], offsets[state + 1]
        for j in range(lo, hi):
            if tokens[j] == token:
                return nexts[j]
        return default[state]

    return SimpleNamespace(
        key=key, vocab_size=vocab, initial_state=0, allowed=allowed, default_next=np.asarray(default, np.int32),
        exc_offsets=np.asarray(offsets, np.int32), exc_tokens=np.asarray(tokens, np.int32),
        exc_next=np.asarray(nexts, np.int32), num_states=states, num_exceptions=len(tokens),
        next_state=next_state, allowed_ids=allowed_ids, field="structured_outputs",
    )


def test_range_allocator_first_fit_and_merge():
    ranges = RangeAllocator(10)
    a, b, c = ranges.allocate(3), ranges.allocate(3), ranges.allocate(4)
    assert (a, b, c) == (0, 3, 6) and ranges.allocate(1) is None
    ranges.free(a, 3)
    ranges.free(b, 3)
    assert ranges.allocate(6) == 0 and ranges.num_free == 0
    assert ranges.allocate(0) == 0  # empty ranges always fit


def test_store_shares_evicts_least_recently_unused_and_refuses_by_name():
    store = StructuredStore(max_states=10, max_exceptions=100)
    a, b, c = (random_automaton(k, 4, 64, i) for i, k in enumerate("abc"))
    pa = store.acquire(a)
    assert store.acquire(a) is pa  # a second user shares it
    pb = store.acquire(b)
    assert [u.placement.key for u in store.take_uploads()] == ["a", "b"] and store.take_uploads() == []
    with pytest.raises(ValueError, match="structured_outputs: no room for this constraint"):
        store.acquire(c)  # a and b are both in use
    store.release(pb)
    pc = store.acquire(c)  # b's room is reused
    assert pc.state_base == pb.state_base and store.num_evictions == 1
    store.release(pa)
    assert store.acquire(a) is pa  # still placed: no new upload
    assert [u.placement.key for u in store.take_uploads()] == ["c"]
    with pytest.raises(ValueError, match=r"structured_max_states"):
        store.acquire(random_automaton("big", 11, 64, 9))


def test_allowed_token_ids_are_a_one_state_constraint_shared_by_list_and_refused_by_name():
    vocab = 100
    ids = [3, 7, 64, 99]
    one = allowed_ids_automaton(ids, vocab)
    assert one.num_states == 1 and one.num_exceptions == 0 and not one.accepting[0]
    assert one.allowed_tokens(0).tolist() == ids
    assert all(one.next_state(0, t) == 0 for t in ids) and one.next_state(0, 4) == -1
    assert allowed_ids_automaton(list(reversed(ids)), vocab).key == one.key  # the same set, the same tables
    store = StructuredStore(max_states=1, max_exceptions=10)
    placed = store.acquire(one)
    assert store.acquire(allowed_ids_automaton(ids, vocab)) is placed
    with pytest.raises(ValueError, match="^allowed_token_ids: no room"):
        store.acquire(allowed_ids_automaton([5], vocab))
    tables = StructuredTables(max_states=1, max_exceptions=10, vocab_size=vocab, device=torch.device("cpu"))
    (upload,) = store.take_uploads()
    tables.upload(upload.placement, upload.automaton)
    state = torch.tensor([placed.state(0)], dtype=torch.int32)
    mask = expand(tables.allowed_words(state), vocab)[0]
    assert mask.nonzero()[:, 0].tolist() == ids
    assert tables.advance(state, torch.tensor([64])).tolist() == [placed.state(0)]
    # with a structured-outputs constraint too: every state's mask cut to the list, the walk unchanged
    fake = random_automaton("k", 6, vocab, seed=4)
    automaton = TokenAutomaton(vocab, 0, fake.allowed, fake.default_next, fake.exc_offsets, fake.exc_tokens,
                               fake.exc_next, np.zeros(6, dtype=bool), (), 0.0, "k")
    both = restrict(automaton, ids)
    assert both.key != automaton.key and both.field == automaton.field
    for s in range(automaton.num_states):
        assert both.allowed_tokens(s).tolist() == [t for t in automaton.allowed_tokens(s).tolist() if t in ids]
        assert (both.default_next == automaton.default_next).all()


@pytest.mark.parametrize("vocab", [64, 100])
def test_device_advance_and_masks_equal_the_host_walk(vocab):
    tables = StructuredTables(max_states=40, max_exceptions=4000, vocab_size=vocab, device=torch.device("cpu"))
    store = StructuredStore(40, 4000)
    automata = [random_automaton(f"k{i}", 7 + i, vocab, seed=i) for i in range(3)]
    placements = [store.acquire(a) for a in automata]
    for upload in store.take_uploads():
        tables.upload(upload.placement, upload.automaton)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(300):
        i = int(rng.integers(0, 3))
        local = int(rng.integers(0, automata[i].num_states))
        token = int(rng.choice(automata[i].allowed_ids[local]))
        rows.append((i, local, token))
    states = torch.tensor([placements[i].state(local) for i, local, _ in rows], dtype=torch.int32)
    tokens = torch.tensor([t for _, _, t in rows], dtype=torch.int64)
    moved = tables.advance(states, tokens).tolist()
    expected = [placements[i].state(automata[i].next_state(local, t)) for i, local, t in rows]
    assert moved == expected
    masks = expand(tables.allowed_words(states), vocab)
    for (i, local, _), mask in zip(rows[:40], masks):
        assert mask.nonzero()[:, 0].tolist() == automata[i].allowed_ids[local].tolist()
    # a row resumed after some outputs starts from the state they lead to
    i, walk, state = 1, [], 0
    for _ in range(5):
        token = int(automata[i].allowed_ids[state][0])
        walk.append(token)
        state = automata[i].next_state(state, token)
    assert tables.initial_state(placements[i], walk) == placements[i].state(state)


def test_in_place_masking_equals_the_expanded_mask():
    """mask_disallowed_ (the window's four-pass form) against the bit-by-bit expansion, sign bit included."""
    vocab = 100
    unpack = TokenMaskUnpacker(vocab, "cpu")
    rng = np.random.default_rng(3)
    ids = [np.sort(rng.choice(vocab, size=30, replace=False)) for _ in range(4)]
    ids[0] = np.array([31, 63, 95, 0])  # every word's sign bit
    words = torch.from_numpy(np.stack([pack_token_ids(i, vocab) for i in ids]))
    active = torch.tensor([True, True, False, True])
    logits = torch.randn(4, vocab)
    masked = logits.clone()
    unpack.mask_disallowed_(masked, words, active)
    expected = torch.where(expand(words, vocab) | ~active[:, None], logits, float("-inf"))
    assert torch.equal(masked, expected)
