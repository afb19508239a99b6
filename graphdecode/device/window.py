"""The decode window: k whole decode steps with no host involvement between them.

`decode_window` is the one function that both the CPU (eagerly) and the CUDA graph
runner (captured once per bucket) execute. Per step: model forward on the bucket's
rows, sample with per-row parameters, record the token (and logprobs) in the output
column, update the device-side done flags (and, in variants with penalties, the
rows' token counts and recent tokens), then advance_step prepares the next step's
inputs and attention metadata in place.
"""

from __future__ import annotations

import torch

from ..attention.backend import AttentionBackend, ForwardContext
from .decode_state import DecodeState
from .sampler import Sampler, SamplerVariant, stop_check


def sample_into(
    state: DecodeState,
    sampler: Sampler,
    logits: torch.Tensor,  # [R, V] float32
    rows,  # slice (window) or [R] int64 index (prefill)
    column: int,
    next_pos: torch.Tensor,  # [R] int64: index of the token being sampled
    variant: SamplerVariant,
    done_before: torch.Tensor | None,  # [R] bool, or None when all rows are live
    share=None,  # (tokens, logprobs) or None -> the same on every rank: one rank sampled (pipeline_window.py)
) -> torch.Tensor:
    """Sample R rows, write output column `column` and the done flags; returns tokens [R].
    Each feature the variant uses records the sampled token (device/features/). With `share`, only the ranks
    given logits sample; every rank records what `share` hands it."""
    params = state.sampling_rows(rows, variant.penalties, variant.structured)
    if done_before is not None and done_before.device.type == "cpu":
        params.live = ~done_before  # what a done row samples is not read (top_filter.py skips its sort)
    sampled = sampler(logits, params, next_pos, variant) if logits is not None else None
    tokens, logprobs = sampled if share is None else share(sampled)
    if done_before is None:
        done_before = torch.zeros_like(tokens, dtype=torch.bool)
    else:
        tokens = torch.where(done_before, state.input_ids[rows], tokens)  # inert rows keep their token
    state.out_tokens[rows, column] = tokens
    if logprobs is not None:
        state.logprobs.record(rows, column, logprobs)
    state.done[rows] = stop_check(tokens, params, next_pos, done_before)
    if variant.penalties:
        state.penalties.record(rows, tokens, ~done_before)
    if variant.structured:
        state.constraints.advance(rows, params.constraint, tokens, done_before, state.bounds)
    if state.speculation is not None:
        state.speculation.record(rows, next_pos, tokens, ~done_before)
    return tokens


def decode_window(
    logits_fn,  # (input_ids [B], positions [B], ctx) -> logits [B, V] float32 (and hidden states: drafters.py)
    sampler: Sampler,
    backend: AttentionBackend,
    state: DecodeState,
    bucket: int,
    num_decode_steps: int,
    page_size: int,
    variant: SamplerVariant,
    kv_width: int,
    ragged: bool = False,
    drafter=None,  # a drafter that reads the target's hidden states follows every step (drafters.py)
) -> None:
    rows = slice(0, bucket)
    follow = drafter is not None and drafter.reads_hidden
    ctx = ForwardContext(backend, decode=state.decode_metadata(bucket, kv_width, ragged))
    # the host may have admitted rows or grown block tables since the last window
    csr = backend.needs_csr
    state.advance(bucket, state.input_ids[rows], page_size, advance=False, csr=csr)
    state.out_count[rows] = num_decode_steps
    for step in range(num_decode_steps):
        if state.bounds is not None:
            state.bounds.decode(state, bucket, csr)
        logits = logits_fn(state.input_ids[rows], state.positions[rows], ctx)
        next_pos = state.positions[rows] + 1
        if follow:
            logits, hidden = logits
            live = ~state.done[rows]
        tokens = sample_into(state, sampler, logits, rows, step + 1, next_pos, variant, state.done[rows])
        if follow:
            drafter.follow(state, bucket, step, ctx.decode, hidden, tokens, live)
        state.advance(bucket, tokens, page_size, advance=True, csr=csr)
    if follow:
        drafter.followed(state, bucket, num_decode_steps)
