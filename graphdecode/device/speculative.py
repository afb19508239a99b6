"""Speculative decoding inside the window: drafts verified and accepted on the device.

Each of a window's k rounds, per row, with no host involvement:

1. draft (drafters.py): up to d tokens, from the row's own history (n-gram: the most recent
   earlier occurrence of its last n tokens, and what followed) or from a draft model's d small
   forwards;
2. verify: one forward over the d + 1 query tokens (the row's next input and its
   drafts) at positions p .. p + d, causal attention over the paged cache (the K/V of
   all d + 1 is written first), then sample every position with the row's usual
   parameters and position-keyed noise; queries at or past the row's max_len (a row
   within d tokens of its end) run at max_len - 1 and write the scratch slot, since
   nothing they sample is kept (`verify_metadata`);
3. accept drafts while each equals the token sampled at its position, and emit the
   accepted drafts plus the one sampled token after them, up to the first stop (stop
   ids, max_len; min_tokens masks stops as usual): 1 to d + 1 tokens per row;
4. advance the row by its own count, extend its history, and recompute the attention
   metadata (advance_step with advance=False). K/V written for rejected positions is
   simply overwritten later: attention never reads past a query's own position. A hybrid's
   recurrent states, which have no positions to overwrite, are moved over exactly the
   consumed inputs (`commit_states`, models/gated_deltanet.py).

Because the noise depends only on (seed, position, token), the token sampled at a
position is the token plain decoding samples there whenever the drafts before it are
accepted: speculation changes speed, never output. Rows without a match still run
(static shapes) and emit one token. Windows whose rows need penalties (token counts
that would have to include each draft) run the plain variant. A structured-outputs row
samples each position under the automaton state its drafts before it lead to (a draft
its state does not allow cannot equal the allowed token sampled there, so it is
rejected), and its state then moves over the tokens it emitted.

Shapes are static (bucket B, Q = d + 1), so a speculative window is captured as one
CUDA graph per bucket like a plain one.
"""

from __future__ import annotations

import torch

from ..attention.backend import AttentionBackend, ForwardContext
from ..attention.metadata import VerifyMetadata
from .decode_state import DecodeState
from .features.constraints import ConstraintRows
from .rejection import rejection_sample
from .sampler import Sampler, SamplerVariant


def verify_metadata(state: DecodeState, bucket: int, queries: int, page_size: int, kv_width: int,
                    live: torch.Tensor, start: torch.Tensor | None = None,
                    limit: torch.Tensor | None = None, drafted: torch.Tensor | None = None) -> VerifyMetadata:
    """The verify forward's metadata for the bucket's rows: Q queries from each row's position p
    (or from `start` [B], a draft model's queries: drafters.py); `limit` [B] in place of max_len
    (a draft's catch-up, whose queries at or past p are inert: draft_model.py); `drafted` [B], the
    drafts each row proposed (n-gram rows may propose fewer than d): its queries past them are
    inert, since nothing reads what they sample (a CPU forward leaves inert queries out).

    Near its end a live row's last queries sit at or past its max_len: nothing they sample is
    kept (the window cuts the row at max_len), so they write the scratch slot and run at the
    row's last position max_len - 1, inside the rope tables and the row's own pages. Inert rows
    run at their position and write the scratch slot."""
    rows = slice(0, bucket)
    position = state.positions[rows] if start is None else start  # [B]
    max_len = (state.max_len[rows] if limit is None else limit).to(torch.int64)  # [B]
    query_pos = position[:, None] + torch.arange(queries, device=position.device)  # [B, Q]
    in_context = live[:, None] & (query_pos < max_len[:, None])  # [B, Q]
    if drafted is not None:
        in_context &= query_pos <= position[:, None] + drafted[:, None]
    # live rows run at most at max_len - 1 (a draft's queries may start past it), inert rows at most where they are
    cap = torch.where(live, max_len - 1, torch.maximum(max_len - 1, state.positions[rows]))
    run_pos = torch.minimum(query_pos, cap[:, None])  # [B, Q]
    column = torch.div(run_pos, page_size, rounding_mode="floor").clamp(0, state.max_pages - 1)
    page = state.block_table[rows].gather(1, column).to(torch.int64)
    slots = torch.where(in_context, page * page_size + query_pos % page_size, 0)
    kv_lens = torch.where(live, position + queries, queries)  # [B]: what the last query sees (inert: scratch)
    return VerifyMetadata(
        block_table=state.block_table[:bucket, :kv_width],
        query_positions=run_pos,
        slot_mapping=slots.reshape(-1),
        live=live,
        kv_lens=kv_lens.to(torch.int32),
        context_lens=torch.where(live, torch.minimum(kv_lens, max_len), 0).to(torch.int32),
        state_slots=state.state_slot[rows],
    )


def speculative_window(
    logits_fn,  # (input_ids [T], positions [T], ctx) -> logits [T, V] float32 (and hidden states: drafters.py)
    sampler: Sampler,
    backend: AttentionBackend,
    state: DecodeState,
    bucket: int,
    num_decode_steps: int,
    page_size: int,
    variant: SamplerVariant,
    kv_width: int,
    drafter,  # drafters.py: (state, bucket, live, history, variant, kv_width, page_size) -> drafts, counts, q
    commit_states=None,  # a hybrid's (accepted [B], slots [B]) -> None: recurrent states over accepted positions
) -> None:
    rows = slice(0, bucket)
    d = state.spec_tokens
    queries = d + 1
    device = state.input_ids.device
    offsets = torch.arange(queries, device=device)
    flat_rows = torch.arange(bucket, device=device).repeat_interleave(queries)  # [B * Q]
    params = state.sampling_rows(flat_rows)
    constraints = state.constraints
    tables = constraints.tables if variant.structured else None
    if tables is not None:
        constrained = constraints.constrained[rows]
        flat_constrained = constrained.repeat_interleave(queries)
    count = torch.zeros(bucket, dtype=torch.int64, device=device)
    drafted = torch.zeros(bucket, dtype=torch.int32, device=device)
    accepted = torch.zeros(bucket, dtype=torch.int32, device=device)
    accepted_pos = torch.zeros(bucket, d, dtype=torch.int32, device=device)
    rounds = torch.zeros(bucket, dtype=torch.int32, device=device)
    speculation = state.speculation
    history = speculation.history[rows] if speculation.history is not None else None  # a head's: none
    max_len = state.max_len[rows].to(torch.int64)  # [B]
    rejecting = (state.temperature[rows] > 0) & ~state.seeded[rows]  # [B]: rows whose drafts are rejection-sampled
    drafter.begin_window(state, bucket, ~state.done[rows], kv_width, page_size)
    for _ in range(num_decode_steps):
        live = ~state.done[rows]
        position = state.positions[rows]  # [B]: where each row's next input sits
        drafts, num_drafts, proposal = drafter(state, bucket, live, history, variant, kv_width, page_size)
        num_drafts = torch.where(live, num_drafts, 0)
        tokens = torch.cat([state.input_ids[rows][:, None], drafts], dim=1)  # [B, Q]
        query_pos = position[:, None] + offsets  # [B, Q]
        meta = verify_metadata(state, bucket, queries, page_size, kv_width, live, drafted=num_drafts)
        if state.bounds is not None:
            state.bounds.verify(state, bucket, meta)
        backend.prepare_verify(bucket, meta, state, page_size)
        ctx = ForwardContext(backend, verify=meta)
        logits = logits_fn(tokens.reshape(-1), meta.query_positions.reshape(-1), ctx)
        if drafter.reads_hidden:
            logits, hidden = logits
        next_pos = (query_pos + 1).reshape(-1)  # index of the token each position samples
        if tables is not None:  # each position's automaton state: the row's, moved over the drafts before it
            before = constraints.struct_state[rows]
            walk = [before]
            for j in range(d):
                moved = tables.advance(walk[-1], drafts[:, j])
                walk.append(torch.where(moved >= 0, moved.to(torch.int32), walk[-1]))
            position_states = torch.stack(walk, dim=1)  # [B, Q]
            flat = position_states.reshape(-1)
            params.constraint = ConstraintRows(flat_constrained, **tables.row_inputs(flat))
        if device.type == "cpu":  # what an inert query samples is not read (top_filter.py skips its sort)
            params.live = ctx.live_tokens()
        prepared = sampler.prepare(logits, params, next_pos, variant)
        sampled = sampler.draw(prepared, params, next_pos, variant).view(bucket, queries)
        if proposal is not None:  # unseeded sampled rows: rejection sampling (rejection.py)
            rejected = rejection_sample(sampler, prepared, params.seed.view(bucket, queries),
                                        next_pos.view(bucket, queries), drafts, proposal, sampled)
            sampled = torch.where(rejecting[:, None], rejected, sampled)
        logprobs = sampler.logprobs(prepared, sampled.reshape(-1), variant)
        # accept drafts while each equals the token sampled at its position
        agree = (drafts == sampled[:, :d]) & (offsets[None, :d] < num_drafts[:, None])
        num_accepted = agree.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
        emit = num_accepted + 1
        # stops inside the run: a stop id, or the row reaching max_len
        index = position[:, None] + 1 + offsets  # [B, Q]: the index each sampled token would take
        stopping = (sampled[:, :, None] == params.stop_ids.view(bucket, queries, -1)).any(dim=-1)
        stopping |= index + 1 >= max_len[:, None]
        stopping &= offsets[None, :] < emit[:, None]
        first_stop = torch.where(stopping.any(dim=1), stopping.to(torch.int64).argmax(dim=1), queries)
        emit = torch.where(live, torch.minimum(emit, first_stop + 1), 0)  # [B] tokens this round emits
        written = offsets[None, :] < emit[:, None]  # [B, Q]
        if commit_states is not None:  # the rows' inputs consumed this round: emit (the rest were rejected)
            commit_states(emit, state.state_slot[rows])
        if drafter.reads_hidden:  # the drafter's state over the verified positions, before the rows advance
            drafter.accepted(state, bucket, meta, hidden, sampled, emit)
        # outputs: columns 1 + count .. (distinct per row and offset: no scatter collisions)
        columns = 1 + count[:, None] + offsets
        out = state.out_tokens[rows]
        out.scatter_(1, columns, torch.where(written, sampled, out.gather(1, columns)))
        if logprobs is not None:
            state.logprobs.record_columns(bucket, queries, columns, written, logprobs)
        if history is not None:
            history.scatter_(1, index, torch.where(written, sampled, history.gather(1, index)))
        # advance each row by its own count
        last = sampled.gather(1, (emit - 1).clamp(min=0)[:, None])[:, 0]
        state.input_ids[rows] = torch.where(emit > 0, last, state.input_ids[rows])
        if tables is not None and state.bounds is not None:  # each emitted token under its position's state
            state.bounds.automaton(tables, params.constraint.state, params.constraint.words, sampled.reshape(-1),
                                   (written & constrained[:, None]).reshape(-1))
        if tables is not None:  # the state after the emitted tokens (accepted drafts, then the sampled one)
            last_state = position_states.gather(1, (emit - 1).clamp(min=0)[:, None])[:, 0]
            moved = tables.advance(last_state, last)
            after = torch.where(moved >= 0, moved.to(torch.int32), last_state)
            constraints.struct_state[rows] = torch.where((emit > 0) & constrained, after, before)
        state.positions[rows] += emit
        state.seq_lens[rows] += emit.to(torch.int32)
        state.done[rows] |= live & stopping.any(dim=1)
        count += emit
        drafted += num_drafts.to(torch.int32)
        kept = torch.minimum(num_accepted, emit - 1).clamp(min=0)  # [B]: drafts this round emitted
        accepted += kept.to(torch.int32)
        accepted_pos += (offsets[None, :d] < kept[:, None]).to(torch.int32)
        rounds += live.to(torch.int32)
    # slot mapping (and the CSR where the backend reads it): for what comes next
    state.advance(bucket, state.input_ids[rows], page_size, advance=False, csr=backend.needs_csr)
    state.out_count[rows] = count.to(torch.int32)
    speculation.spec_drafted[rows] = drafted
    speculation.spec_accepted[rows] = accepted
    speculation.spec_rounds[rows] = rounds
    speculation.spec_accepted_pos[rows] = accepted_pos

