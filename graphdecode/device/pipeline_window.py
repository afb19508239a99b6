"""The decode window over pipeline stages with micro-batches in flight, so that the stages overlap.

With one micro-batch, a window's step runs stage 0's layers, then stage 1's, ...: each stage idles while the
others run (the pipeline bubble: P stages at one stage's speed). Here the bucket's rows are split into G >= P
contiguous micro-batches, and a window's k steps become k x G units (step, micro-batch), unit u = step * G + g.
Every rank walks the units in order: it runs its stage's part of unit u (the first stage embeds the
micro-batch's tokens, later stages receive the hidden states; each sends them on without waiting; the last
stage computes the logits), then finishes unit u + s + 1 - P (s: its stage): the last stage's logits of that
unit are broadcast to every rank, each samples the micro-batch's tokens with the same noise and advances its
rows. In steady state the last stage finishes unit u right after computing it, and stage 0 has the tokens of
unit u - G (its micro-batch's previous step) before it starts unit u, so every stage computes all the time.

Each micro-batch's rows are sampled, recorded and advanced as the whole bucket's are in decode_window (the same
sample_into, advance_step's per-row part on the rows, the bounds checks): a row's tokens are the same as
without micro-batches. Only the last stage samples (the sampler is stateless: its noise is keyed by seed and
position): what goes to every rank is the micro-batch's tokens and, where the window reports them, their
logprobs (`shared_sample`), not its [rows, vocab] logits. CPU ranks (gloo), backends that read block tables
directly (no CSR metadata).
"""

from __future__ import annotations

import torch

from ..attention.backend import ForwardContext
from .sampler import LogprobsOut
from .window import sample_into


def shared_sample(stage, sampled: tuple | None, rows: int, num_logprobs: int, device: torch.device) -> tuple:
    """The last stage's (tokens [R], LogprobsOut or None) on every rank (`sampled`: the last stage's; None
    elsewhere), as one broadcast of float64 rows [token, logprob, rank, N top ids, N top logprobs] (ids and
    ranks exact in float64, logprobs float32 values)."""
    width = 1 + (2 + 2 * num_logprobs if num_logprobs else 0)
    if sampled is None:
        packed = torch.empty(rows, width, dtype=torch.float64, device=device)
    else:
        tokens, logprobs = sampled
        parts = [tokens[:, None]]
        if num_logprobs:
            parts += [logprobs.sampled[:, None], logprobs.rank[:, None], logprobs.top_ids, logprobs.top_logprobs]
        packed = torch.cat([part.to(torch.float64) for part in parts], dim=1)
    stage.share(packed)
    tokens = packed[:, 0].to(torch.int64)
    if not num_logprobs:
        return tokens, None
    n = num_logprobs
    return tokens, LogprobsOut(packed[:, 1].to(torch.float32), packed[:, 2].to(torch.int64),
                               packed[:, 3:3 + n].to(torch.int64), packed[:, 3 + n:].to(torch.float32))


def micro_batches(bucket: int, count: int) -> list[tuple[int, int]]:
    """count contiguous row ranges covering 0..bucket-1, sizes differing by at most one."""
    bounds = [bucket * i // count for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(count)]


def pipelined_window(model, sampler, backend, state, bucket: int, num_decode_steps: int, page_size: int, variant,
                     kv_width: int, micro: int) -> None:
    stage = model.stage
    groups = micro_batches(bucket, micro)
    contexts = [ForwardContext(backend, decode=state.decode_rows(r0, r1, kv_width)) for r0, r1 in groups]
    state.advance(bucket, state.input_ids[:bucket], page_size, advance=False, csr=False)
    state.out_count[:bucket] = num_decode_steps
    units = [(step, g) for step in range(num_decode_steps) for g in range(len(groups))]
    held, sends = {}, []

    def finish(u: int) -> None:
        step, g = units[u]
        r0, r1 = groups[g]
        rows = slice(r0, r1)
        next_pos = state.positions[rows] + 1

        def share(sampled):
            return shared_sample(stage, sampled, r1 - r0, variant.num_logprobs, next_pos.device)

        tokens = sample_into(state, sampler, held.pop(u), rows, step + 1, next_pos, variant, state.done[rows], share)
        state.advance_rows(r0, r1, tokens, page_size)

    lag = stage.size - 1 - stage.index  # units this stage runs ahead of the broadcasts
    for u, (_, g) in enumerate(units):
        if state.bounds is not None and g == 0:
            state.bounds.decode(state, bucket, False)
        r0, r1 = groups[g]
        held[u] = model.stage_logits(state.input_ids[r0:r1], state.positions[r0:r1], contexts[g], sends)
        if u - lag >= 0:
            finish(u - lag)
    for u in range(max(len(units) - lag, 0), len(units)):
        finish(u)
    for handle in sends:
        handle.wait()
