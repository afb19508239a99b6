"""The bounds-checked mode (device/bounds.py): each check fires on the index it guards, and
through `LLM` it turns the defects it exists for into errors instead of silent reads and writes.
(The whole CPU suite runs with it on: tests/conftest.py.)"""

from __future__ import annotations

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.device import speculative
from graphdecode.device.bounds import BoundsCheck, BoundsError
from graphdecode.device.decode_state import DecodeState
from graphdecode.device.speculative import verify_metadata
from tests.helpers import random_prompts

P, MAX_PAGES, NUM_PAGES, ROPE_ROWS = 4, 6, 40, 24


def live_state(lengths: dict[int, int], pages: dict[int, int], spec_tokens: int = 0) -> DecodeState:
    """Rows with `lengths[row]` tokens holding `pages[row]` pages (ids 1 + 6 row ..), others inert."""
    state = DecodeState(4, MAX_PAGES, 2, 2, 1, "cpu", spec_tokens=spec_tokens, history_len=64)
    for row, length in lengths.items():
        state.block_table[row, : pages[row]] = torch.arange(pages[row], dtype=torch.int32) + 1 + 6 * row
        state.positions[row], state.seq_lens[row], state.done[row] = length - 1, length, False
        state.max_len[row] = ROPE_ROWS
    state.advance(4, state.input_ids[:4], P, advance=False)  # slots and CSR for the current positions
    return state


def test_decode_checks_pass_on_a_consistent_state_and_name_what_breaks():
    check = BoundsCheck(ROPE_ROWS, P, NUM_PAGES)
    state = live_state({0: 5, 1: 12}, {0: 2, 1: 3})
    check.decode(state, 4, csr=True)
    broken = live_state({0: 5, 1: 12}, {0: 2, 1: 3})
    broken.slot_mapping[1] = broken.block_table[0, 0] * P  # into another row's page
    with pytest.raises(BoundsError, match=r"slot_mapping.*rows \[1\]"):
        check.decode(broken, 4, csr=False)
    short = live_state({0: 5, 1: 12}, {0: 2, 1: 2})  # 12 tokens in 2 pages of 4
    with pytest.raises(BoundsError, match="slot_mapping|seq_lens"):
        check.decode(short, 4, csr=False)
    far = live_state({0: 5}, {0: 2})
    far.positions[3] = ROPE_ROWS  # an inert row past the rope tables
    with pytest.raises(BoundsError, match="positions: outside the rope tables"):
        check.decode(far, 4, csr=False)
    csr = live_state({0: 5}, {0: 2})
    csr.kv_indptr[1] += 1  # one page more than the row holds
    with pytest.raises(BoundsError, match="kv_indptr"):
        check.decode(csr, 4, csr=True)


def test_state_slot_check_for_hybrid_rows():
    """A hybrid's rows: a live row's recurrent-state slot is one of the cache's own, never the scratch slot."""
    check = BoundsCheck(ROPE_ROWS, P, NUM_PAGES, num_state_slots=5)
    state = live_state({0: 5, 1: 12}, {0: 2, 1: 3})
    state.state_slot[:2] = torch.tensor([3, 1])
    check.decode(state, 4, csr=False)
    state.state_slot[1] = 0  # a live row on the scratch slot would share its state with every padded row
    with pytest.raises(BoundsError, match=r"state_slot.*rows \[1\]"):
        check.decode(state, 4, csr=False)
    state.state_slot[1] = 1
    state.state_slot[3] = 5  # an inert row past the cache
    with pytest.raises(BoundsError, match=r"state_slot.*rows \[3\]"):
        check.decode(state, 4, csr=False)
    BoundsCheck(ROPE_ROWS, P, NUM_PAGES).decode(state, 4, csr=False)  # not a hybrid: no slots to check


def _old_verify_metadata(state, bucket, queries, page_size, kv_width, live, drafted=None):
    """The verify metadata before the end-of-context fix: page columns clamped into the row's
    table, positions unclamped (the drafts near max_len wrote over the row's last page); every query
    live (`drafted` unread)."""
    from graphdecode.attention import VerifyMetadata

    position = state.positions[:bucket]
    query_pos = position[:, None] + torch.arange(queries)
    page = state.block_table[:bucket].gather(1, (query_pos // page_size).clamp(max=state.max_pages - 1))
    slots = torch.where(live[:, None], page.to(torch.int64) * page_size + query_pos % page_size, 0)
    return VerifyMetadata(block_table=state.block_table[:bucket, :kv_width], query_positions=query_pos,
                          slot_mapping=slots.reshape(-1), live=live)


def test_verify_checks_catch_the_end_of_context_writes():
    """A row 2 tokens from max_len with 3 drafts: the fixed metadata passes, the old one (slots
    through a clamped page column over the row's own entries) fails."""
    check = BoundsCheck(MAX_PAGES * P, P, NUM_PAGES)
    state = live_state({0: MAX_PAGES * P - 2, 1: 7}, {0: MAX_PAGES, 1: 3}, spec_tokens=3)
    state.max_len[:2] = MAX_PAGES * P
    live = ~state.done[:4]
    check.verify(state, 4, verify_metadata(state, 4, 4, P, MAX_PAGES, live))
    with pytest.raises(BoundsError, match="verify"):
        check.verify(state, 4, _old_verify_metadata(state, 4, 4, P, MAX_PAGES, live))


def test_automaton_check_catches_a_forbidden_token_and_a_state_outside_the_store():
    class Tables:
        allowed = torch.zeros(3, 2, dtype=torch.int32)

    check = BoundsCheck(ROPE_ROWS, P, NUM_PAGES)
    words = torch.tensor([[0b1010, 0], [0, -(1 << 31)]], dtype=torch.int32)  # row 0: tokens 1, 3; row 1: token 63
    states = torch.tensor([1, 2], dtype=torch.int32)
    everyone = torch.ones(2, dtype=torch.bool)
    check.automaton(Tables, states, words, torch.tensor([3, 63]), everyone)
    with pytest.raises(BoundsError, match="forbids"):
        check.automaton(Tables, states, words, torch.tensor([2, 63]), everyone)
    check.automaton(Tables, states, words, torch.tensor([2, 63]), torch.tensor([False, True]))  # row 0 not checked
    with pytest.raises(BoundsError, match="struct_state"):
        check.automaton(Tables, torch.tensor([1, 3], dtype=torch.int32), words, torch.tensor([3, 63]), everyone)


def test_through_llm_the_old_end_of_context_metadata_is_an_error(tiny_models, monkeypatch):
    """What hid the end-of-context defect (a fused kernel reading and writing past a row's pages
    silently) fails the engine in the bounds-checked mode."""
    monkeypatch.setattr(speculative, "verify_metadata", _old_verify_metadata)
    llm = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, max_model_len=64, max_batch_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 6}, check_bounds=True)
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
    prompt = {"prompt_token_ids": (random_prompts(1, [3], seed=1)[0] * 30)[:60]}
    with pytest.raises(BoundsError, match="verify"):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))


def test_check_bounds_follows_the_environment(tiny_models, monkeypatch):
    path = tiny_models["llama_gqa_llama3"]
    monkeypatch.setenv("GRAPHDECODE_CHECK_BOUNDS", "0")
    assert LLM(path, max_model_len=64, max_batch_size=2).engine.runner.state.bounds is None
    assert LLM(path, max_model_len=64, max_batch_size=2, check_bounds=True).engine.runner.state.bounds is not None
    monkeypatch.setenv("GRAPHDECODE_CHECK_BOUNDS", "1")
    assert LLM(path, max_model_len=64, max_batch_size=2).config.check_bounds is True
