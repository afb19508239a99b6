"""Where a speculative window's drafts come from, once per verify round inside the window.

A drafter is called as `drafter(state, bucket, live, history, variant, kv_width, page_size)` and
returns (drafts [B, d] int64, counts [B] int64 in 0..d (speculative_window zeroes the counts of rows
that are not live), proposal [B, d, V] float32 or None: the distribution each draft was sampled from, for
rejection sampling (rejection.py); model drafters give it in sampled windows). It runs
on the device with static shapes and no host sync, so it is captured with the window.

Drafters that read the target's hidden states (EAGLE-3 heads and MTP layers, draft_head.py) set
`reads_hidden`: the window's forward then returns them beside the logits, and the window hands them to
`accepted` after each verify and to `follow` after each plain decode step (`followed` after the window's
last), so the drafter's own state stays current.

* NgramDrafter: the row's own history (prompt lookup, `ngram_drafts`).
* ModelDrafter: a draft model (draft_model.py) running d small forwards per round. The first
  runs two queries per row, at positions p - 1 and p: the K/V at p - 1 is the last token the
  previous round accepted, which the draft never ran when it accepted every draft (its last
  draft is verified, not drafted from); rewriting it when it did is harmless. The other d - 1
  forwards run one query each, at p + 1 .. p + d - 1, as decode steps (on a CPU, through the
  one-call decode layers). K/V the draft wrote for drafts that were
  then rejected is rewritten by a later round before any query reads it (attention never reads
  past a query's own position). Each draft is sampled with the row's own temperature, top-k/p
  and min-p and the position-keyed noise the verify samples that position with (Gumbel-max
  coupling), and a constrained row's drafts under the automaton state the drafts before them lead
  to: where the draft's distribution is close to the target's it draws the target's own token,
  and whatever it draws, the window emits the tokens plain decoding samples
  (speculative.py accepts a draft only where it equals the target's sample).
* HeadDrafter (draft_head.py): an EAGLE-3 head or the target's MTP layer over the target's hidden states.
"""

from __future__ import annotations

import torch

from ..attention.backend import ForwardContext
from ..attention.metadata import DecodeMetadata
from .features.constraints import ConstraintRows
from .sampler import SamplerMode, SamplerVariant
from .speculative import verify_metadata


def ngram_drafts(history: torch.Tensor, lengths: torch.Tensor, num_drafts: int, lookup_max: int,
                 lookup_min: int) -> tuple[torch.Tensor, torch.Tensor]:
    """history [B, H] int64, lengths [B] int64 (tokens known: the last is history[b, len - 1])
    -> drafts [B, d] int64 (0 past each row's count), counts [B] int64 in 0..d.

    For n from lookup_max down to lookup_min, the first n that matches wins; among its
    matches, the most recent start s with s + n <= len - 1 (strictly before the suffix,
    with at least one token after it).
    """
    rows, width = history.shape
    device = history.device
    drafts = torch.zeros(rows, num_drafts, dtype=torch.int64, device=device)
    counts = torch.zeros(rows, dtype=torch.int64, device=device)
    found = torch.zeros(rows, dtype=torch.bool, device=device)
    steps = torch.arange(num_drafts, device=device)
    for n in range(lookup_max, lookup_min - 1, -1):
        if n >= width:
            continue
        spans = width - n + 1
        suffix = history.gather(1, (lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0))  # [B, n]
        match = torch.ones(rows, spans, dtype=torch.bool, device=device)
        for i in range(n):  # n passes over [B, spans]: no [B, spans, n] temporary
            match &= history[:, i : i + spans] == suffix[:, i : i + 1]
        starts = torch.arange(spans, device=device)
        match &= starts[None, :] + n <= lengths[:, None] - 1
        best = torch.where(match, starts[None, :], -1).amax(dim=1)  # [B]: the most recent start, or -1
        use = (best >= 0) & ~found
        source = (best + n).clamp(min=0)
        candidate = history.gather(1, (source[:, None] + steps).clamp(max=width - 1))
        available = (lengths - source).clamp(0, num_drafts)
        drafts = torch.where(use[:, None], candidate, drafts)
        counts = torch.where(use, available, counts)
        found |= use
    drafts = torch.where(steps[None, :] < counts[:, None], drafts, 0)
    return drafts, counts


class Drafter:
    reads_hidden = False  # the window's forward returns the target's hidden states for this drafter

    def begin_window(self, state, bucket: int, live: torch.Tensor, kv_width: int, page_size: int) -> None:
        """Before a speculative window's first round."""

    def accepted(self, state, bucket: int, meta, hidden: torch.Tensor, sampled: torch.Tensor,
                 emit: torch.Tensor) -> None:
        """After a verify (before the rows advance): its metadata, the target's hidden states [B * Q, ...],
        the tokens sampled at each position [B, Q] and the tokens each row emits [B]."""

    def follow(self, state, bucket: int, step: int, meta: DecodeMetadata, hidden: torch.Tensor,
               tokens: torch.Tensor, live: torch.Tensor) -> None:
        """After a plain decode step (before the rows advance): the step's index in the window, its metadata,
        the target's hidden states [B, ...], the sampled tokens [B], the rows that were live."""

    def followed(self, state, bucket: int, steps: int) -> None:
        """After a plain window's `steps` steps (each one `follow`ed)."""


class NgramDrafter(Drafter):
    def __init__(self, lookup_max: int, lookup_min: int):
        self.lookup_max = lookup_max
        self.lookup_min = lookup_min

    def __call__(self, state, bucket: int, live, history, variant: SamplerVariant, kv_width: int, page_size: int):
        position = state.positions[:bucket]
        drafts, counts = ngram_drafts(history, position + 1, state.spec_tokens, self.lookup_max, self.lookup_min)
        return drafts, counts, None


def one_query(meta, state, bucket: int) -> DecodeMetadata:
    """A one-query verify as a decode step (what the CPU's one-call decode layers take): the query's
    slot, and the KV length up to and including its position; the CSR fields are the state's (the
    draft's torch attention reads the block table, not them)."""
    return DecodeMetadata(
        seq_lens=(meta.query_positions[:, 0] + 1).to(torch.int32),
        block_table=meta.block_table,
        slot_mapping=meta.slot_mapping,
        kv_indptr=state.kv_indptr[: bucket + 1],
        kv_indices=state.kv_indices[: bucket * state.max_pages],
        kv_last_page_len=state.kv_last_page_len[:bucket],
    )


class ModelDrafter(Drafter):
    def __init__(self, logits_fn, backend, sampler):
        self.logits_fn = logits_fn  # the draft model's (input_ids, positions, ctx) -> logits [T, V] float32
        self.backend = backend  # the draft's attention over its own KV caches (the rows' pages)
        self.sampler = sampler

    def __call__(self, state, bucket: int, live, history, variant: SamplerVariant, kv_width: int, page_size: int):
        d = state.spec_tokens
        position = state.positions[:bucket]
        sample = DraftSampling(self.sampler, state, bucket, variant)
        previous = (position - 1).clamp(min=0)  # live rows sit at p >= 1 (a prompt holds a token)
        tokens = torch.stack([history.gather(1, previous[:, None])[:, 0], state.input_ids[:bucket]], dim=1)
        start, queries = previous, 2
        drafts = []
        for j in range(d):
            meta = verify_metadata(state, bucket, queries, page_size, kv_width, live, start=start)
            if state.bounds is not None:
                state.bounds.verify(state, bucket, meta, start=start)
            ctx = ForwardContext(self.backend, verify=meta) if queries > 1 else \
                ForwardContext(self.backend, decode=one_query(meta, state, bucket))
            logits = self.logits_fn(tokens.reshape(-1), meta.query_positions.reshape(-1), ctx)
            draft = sample(logits.view(bucket, queries, -1)[:, -1], j)  # the query at p + j
            drafts.append(draft)
            tokens, start, queries = draft[:, None], position + j + 1, 1
        return torch.stack(drafts, dim=1), torch.full_like(position, d), sample.proposal()


class DraftSampling:
    """A round's drafts, one call per draft j: sampled with the row's own distribution (no logprobs, stop
    masks or penalties) and the noise the verify samples position p + j + 1 with; a constrained row's
    drafts under the automaton state the drafts before it lead to."""

    def __init__(self, sampler, state, bucket: int, variant: SamplerVariant):
        self.sampler = sampler
        self.position = state.positions[:bucket]
        self.params = state.sampling_rows(slice(0, bucket))
        self.variant = SamplerVariant(variant.mode, structured=variant.structured)
        constraints = state.constraints
        self.tables = constraints.tables if variant.structured else None
        if self.tables is not None:
            self.constrained, self.walked = constraints.constrained[:bucket], constraints.struct_state[:bucket]
        self.proposals: list[torch.Tensor] = []

    def proposal(self) -> torch.Tensor | None:
        """[B, d, V]: each draft's distribution (sampled windows), else None."""
        return torch.stack(self.proposals, dim=1) if self.proposals else None

    def __call__(self, logits: torch.Tensor, j: int) -> torch.Tensor:
        """logits [B, V] of draft j -> draft [B] int64."""
        tables = self.tables
        if tables is not None:  # masked by the state the drafts before it lead to
            self.params.constraint = ConstraintRows(self.constrained, **tables.row_inputs(self.walked))
        position = self.position + j + 1
        prepared = self.sampler.prepare(logits, self.params, position, self.variant)
        draft = self.sampler.draw(prepared, self.params, position, self.variant)
        if self.variant.mode != SamplerMode.GREEDY:  # what the draft was sampled from
            self.proposals.append(torch.softmax(prepared.processed, dim=-1))
        if tables is not None:
            moved = tables.advance(self.walked, draft)
            self.walked = torch.where(moved >= 0, moved.to(torch.int32), self.walked)
        return draft
