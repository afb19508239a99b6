"""The bounds-checked mode: every index a window's kernels follow is checked before they follow it.

A window computes its indices on the device (positions, KV slots, KV lengths, automaton
states) and hands them to kernels that do not check them: the CPU's fused C++ passes, the
rope table gather, FlashInfer. An index off by a few reads or writes the wrong memory
silently. With `EngineConfig.check_bounds` (default: the environment variable
GRAPHDECODE_CHECK_BOUNDS=1; the CPU test suite turns it on) each window step first checks:

* positions: every row's (and every verify query's) position is inside the rope tables;
* KV slots: a live row writes only inside its own pages (the block-table column of its
  position, among the pages it holds) and every other row only the scratch page 0; its page
  ids are real pages;
* KV lengths: a live row attends at most the tokens its pages hold (seq_len = position + 1,
  and where the backend reads FlashInfer's CSR, one page list entry per ceil(len / P));
* recurrent-state slots (a hybrid's): inside the state cache, and a live row's not the scratch slot 0;
* automaton states: every constrained row's state is inside the table store, and the token
  it sampled is one its state allows.

A row's pages are the leading non-zero entries of its block-table row: the host stages a
row's pages from column 0 and zeros the rest, and page 0 (the scratch page) is never handed
to a row. On a CPU a failed check raises IndexError naming the index and the rows; on CUDA
it is a device-side assert (no host sync; the engine is unusable afterwards, as with any
device assert). The checks are plain tensor ops on [B]-sized tensors: a few per step.
"""

from __future__ import annotations

import torch


class BoundsError(IndexError):
    """A window index outside its bounds (the bounds-checked mode)."""


def _require(ok: torch.Tensor, what: str) -> None:
    """ok: a bool tensor, all True when the check holds."""
    if ok.device.type == "cuda":
        torch._assert_async(ok.all(), f"graphdecode bounds check: {what}")
        return
    if not bool(ok.all()):
        bad = torch.nonzero(~ok.reshape(ok.shape[0], -1).all(dim=1)).flatten().tolist() if ok.dim() else []
        raise BoundsError(f"graphdecode bounds check: {what} (rows {bad[:8]})")


class BoundsCheck:
    def __init__(self, rope_rows: int, page_size: int, num_pages: int, num_state_slots: int = 0,
                 num_lora_slots: int = 0):
        self.rope_rows = rope_rows  # positions index the rope tables: [0, rope_rows)
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_state_slots = num_state_slots  # a hybrid's recurrent-state slots (0: none)
        self.num_lora_slots = num_lora_slots  # a LoRA engine's adapter slots, slot 0 (none) included (0: no LoRA)

    def _pages(self, state, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's block tables (int64) and each row's page count."""
        table = state.block_table[:bucket].to(torch.int64)
        _require((table >= 0) & (table < self.num_pages), "block_table: a page id outside the KV cache")
        return table, (table != 0).sum(dim=1)

    def decode(self, state, bucket: int, csr: bool) -> None:
        """Before a decode step's forward: its positions, slots, lengths (and CSR)."""
        P = self.page_size
        rows = slice(0, bucket)
        live = ~state.done[rows]
        position = state.positions[rows]
        table, owned = self._pages(state, bucket)
        _require((position >= 0) & (position < self.rope_rows), "positions: outside the rope tables")
        column = torch.div(position, P, rounding_mode="floor")
        page = table.gather(1, column.clamp(0, table.shape[1] - 1)[:, None])[:, 0]
        slot = state.slot_mapping[rows]
        own = (column < owned) & (slot == page * P + position % P) & (page != 0)
        _require(torch.where(live, own, torch.div(slot, P, rounding_mode="floor") == 0),
                 "slot_mapping: a KV slot outside its row's pages (inert rows: the scratch page)")
        seq_len = state.seq_lens[rows].to(torch.int64)
        _require(torch.where(live, (seq_len == position + 1) & (seq_len <= owned * P), seq_len >= 1),
                 "seq_lens: a KV length past the pages its row holds")
        if self.num_state_slots:
            slots = state.state_slot[rows]
            _require((slots >= torch.where(live, 1, 0)) & (slots < self.num_state_slots),
                     "state_slot: a recurrent-state slot outside the state cache (a live row's: not the scratch slot)")
        if self.num_lora_slots:
            slots = state.lora_slot[rows]
            _require((slots >= 0) & (slots < self.num_lora_slots), "lora_slot: an adapter slot outside the device's")
        if csr:
            count = (state.kv_indptr[1 : bucket + 1] - state.kv_indptr[:bucket]).to(torch.int64)
            need = torch.div(seq_len + P - 1, P, rounding_mode="floor")
            last = state.kv_last_page_len[rows].to(torch.int64)
            _require(torch.where(live, (count == need) & (count <= owned), count == 1) & (last >= 1) & (last <= P),
                     "kv_indptr / kv_last_page_len: a row's page list past the pages it holds")

    def verify(self, state, bucket: int, meta, start=None) -> None:
        """Before a verify forward (speculative decoding): query positions, slots, lengths.
        `start` [B]: the first query's position where it is not the row's (a draft model's)."""
        P = self.page_size
        live = meta.live
        run = meta.query_positions  # [B, Q]
        queries = run.shape[1]
        table, owned = self._pages(state, bucket)
        _require((run >= 0) & (run < self.rope_rows), "verify query_positions: outside the rope tables")
        column = torch.div(run, P, rounding_mode="floor")
        page = table.gather(1, column.clamp(0, table.shape[1] - 1))
        slot = meta.slot_mapping.view(bucket, queries)
        scratch = torch.div(slot, P, rounding_mode="floor") == 0
        own = (column < owned[:, None]) & (slot == page * P + run % P) & (page != 0)
        _require(scratch | (live[:, None] & own), "verify slot_mapping: a KV slot outside its row's pages")
        _require(~live[:, None] | (column < owned[:, None]), "verify query_positions: a query past its row's pages")
        if meta.kv_lens is not None:
            kv_len, context = meta.kv_lens.to(torch.int64), meta.context_lens.to(torch.int64)
            first = state.positions[:bucket] if start is None else start
            _require(torch.where(live, (kv_len == first + queries) & (context <= owned * P), kv_len == queries),
                     "verify kv_lens / context_lens: a KV length past the pages its row holds")

    def automaton(self, tables, states: torch.Tensor, words: torch.Tensor, tokens: torch.Tensor,
                  check: torch.Tensor) -> None:
        """Constrained rows: states inside the table store; where `check` [R], the sampled token
        is allowed by its state's mask `words` [R, ceil(V / 32)]."""
        _require((states >= 0) & (states < tables.allowed.shape[0]), "struct_state: outside the table store")
        vocab = words.shape[1] * 32
        in_vocab = (tokens >= 0) & (tokens < vocab)
        safe = tokens.clamp(0, vocab - 1)
        word = words.gather(1, torch.div(safe, 32, rounding_mode="floor")[:, None])[:, 0]
        allowed = ((word >> (safe % 32).to(word.dtype)) & 1) == 1
        _require(~check | (in_vocab & allowed), "structured outputs: a sampled token its automaton state forbids")
