"""Drafting by a head over the target's own hidden states, inside the window: an EAGLE-3 head
(`speculative_config={"method": "eagle3", "model": DIR}`, models/eagle3.py) or the target's own
multi-token-prediction layer (`{"method": "mtp"}`, models/mtp.py). Both read, at position i, a hidden state of
the target at i and the token at i + 1, and give an output that predicts the token at i + 2 and stands in for
the target's hidden state at i + 1 when they draft further; they differ only in what they read (`fuse`: the
EAGLE-3 head's fc over three layers' inputs; the MTP layer: the final hidden states as they are).

State, per row, kept true at every window boundary (row p: the position of the row's next input):

* the head's K/V (its own one-layer cache, the target pool's geometry: a row's block table indexes it, its
  pages are freed, shared, copied and rebuilt with the row's) holds, at every position i < p, what the head
  computes from the target's hidden states at i and the token at i + 1;
* `prenorm` [B_max, H]: the head's output at position p - 1 (an EAGLE-3 head's before its final norm), from
  which the first draft of the row's next round is read; or, where `stale` (the row's last window ran plain),
  `pending` [B_max, H]: the fused target hidden state at p - 1, from which the next speculative window's
  first step computes it (`begin_window`).

How each part keeps it:

* prefill (`prefill`, `start_rows`): the target's prefill forward returns its hidden states; the head writes
  its K/V over the chunk's positions with the tokens one ahead (the prompt's; a non-final chunk's last
  position reads the first token of the next chunk). The prompt's last position needs the sampled first token,
  which differs per row when n > 1: after sampling (and the page copies of n > 1 forks) each row runs it
  alone, in its own pages, and sets its `prenorm`.
* a speculative round (`HeadDrafter.__call__`, `accepted`): draft 1 from `prenorm`; drafts 2..d from d - 1
  one-query steps at p .. p + d - 2 that read the head's own output in place of the target's hidden
  state (EAGLE's and MTP's drafting; their K/V is rewritten below). After the verify, one forward of d + 1 queries at
  p .. p + d over the verify's hidden states and the tokens the verify sampled rewrites the head's K/V there
  (exact up to the accepted p + n; later positions are rewritten before any query reads them: attention
  never reads past a query's own position) and takes `prenorm` from the query at p + n.
* a plain window (`follow` each step, `followed` at its end): each step keeps its hidden states, sampled
  tokens, positions and slots; after the last, one pass over all of them writes the head's K/V at each
  position (the fused hidden state, the norms and k/v: no attention, no MLP) and sets `pending` from each
  row's last live step. Windows that run plain (the policy's choice, penalty rows) keep the head current for
  one read of its fc and k/v weights a window, not one a step; the next speculative window's first step (one
  query at p - 1 for the stale rows) makes `prenorm` again.

The K/V at a shared page's last position was computed with its first owner's next token (prefix-cache hits,
n > 1 forks of a prompt that fills its last page): that can lower acceptance; it never changes output,
which is always the target's (speculative.py).
"""

from __future__ import annotations

import dataclasses

import torch

from ..attention import ForwardContext, PrefillMetadata, TorchAttentionBackend
from ..attention.kv_cache import allocate_kv_caches, copy_page, copy_slots
from ..attention.metadata import DecodeMetadata
from ..models.eagle3 import load_eagle3_head
from ..models.mtp import load_mtp_head
from .drafters import Drafter, DraftSampling, one_query
from .sampler import SamplerMode, SamplerVariant
from .speculative import verify_metadata


class DraftHead:
    """A draft head over the target's hidden states: an EAGLE-3 head (models/eagle3.py; it reads the hidden states
    entering three target layers) or the target's own MTP layer (models/mtp.py; it reads the target's final
    hidden states). `reads`: the target layers whose input hidden states the head reads, or None for the final
    hidden states (what the target's forward returns beside its logits)."""

    def __init__(self, config, target, device: torch.device):
        dtype = config.torch_dtype
        if config.speculative_method == "mtp":
            mtp = config.mtp_config
            cfg = mtp.model
            self.reads = None
            self.head = load_mtp_head(mtp, target, dtype, device, config.max_model_len, config.cpu_huge_pages)
            self.embed = target.embed
        else:
            eagle = config.eagle3_config
            cfg = eagle.model
            self.reads = eagle.aux_layers
            self.head = load_eagle3_head(config.draft_model, eagle, dtype, device, config.max_model_len,
                                         config.cpu_huge_pages)
            self.embed = self.head.embed if eagle.own_embedding else target.embed
        self.kv_caches = allocate_kv_caches(1, config.num_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim,
                                            dtype, device)
        self.backend = TorchAttentionBackend(self.kv_caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             specs=self.head.attention_specs)
        rows = config.max_batch_size
        self.prenorm = torch.zeros(rows, cfg.hidden_size, dtype=dtype, device=device)
        self.pending = torch.zeros(rows, cfg.hidden_size, dtype=dtype, device=device)
        self.stale = torch.zeros(rows, dtype=torch.bool, device=device)
        self.page_size = config.page_size
        # a plain window's steps, kept for its one upkeep pass at the end (`HeadDrafter.follow` / `followed`): the
        # hidden states the head reads, the sampled tokens, and each row's position and KV slot, step by step
        steps, width = config.num_decode_steps, target.config.hidden_size * (len(self.reads) if self.reads else 1)
        self.trail_hidden = torch.zeros(steps, rows, width, dtype=dtype, device=device)
        self.trail_tokens = torch.zeros(steps, rows, dtype=torch.int64, device=device)
        self.trail_positions = torch.zeros(steps, rows, dtype=torch.int64, device=device)
        self.trail_slots = torch.zeros(steps, rows, dtype=torch.int64, device=device)
        self.trail_live = torch.zeros(steps, rows, dtype=torch.bool, device=device)

    @property
    def model(self):
        return self.head

    def logits_fn(self, target):
        """The window's target forward: (input_ids, positions, ctx) -> (logits, the hidden states the head reads)."""
        return target.logits_and_aux(self.reads)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The head at `positions` [T] reading `tokens` [T] (each position's next token) and `hidden` [T, H]."""
        return self.head(self.embed(tokens), hidden, positions, ctx)

    def drafter(self, sampler) -> HeadDrafter:
        return HeadDrafter(self, sampler)

    def prefill(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, meta: PrefillMetadata) -> None:
        """The head's K/V over a prefill's chunks (only the K/V: no query reads a prefill's output; a prompt's
        last position runs in full in `start_rows`): `tokens` [T] the token after each position. A partial
        prefix hit's copied slots are copied in the head's cache too."""
        self.head.write_kv(self.embed(tokens), self.head.fuse(aux), positions, self.backend, meta.slot_mapping)
        if meta.copy_src is not None:
            copy_slots(self.kv_caches[0], meta.copy_src, meta.copy_dst)

    def start_rows(self, state, rows: torch.Tensor, positions: torch.Tensor, aux: torch.Tensor) -> None:
        """Rows whose prefill sampled their first token (state.input_ids, at positions + 1): the head at each
        row's last prompt position, in its own pages, from the target's hidden states there (aux [R, ...])."""
        page_size = self.page_size
        table = state.block_table[rows]
        page = table.gather(1, torch.div(positions, page_size, rounding_mode="floor")[:, None])[:, 0]
        count = rows.shape[0]
        meta = DecodeMetadata(
            seq_lens=(positions + 1).to(torch.int32), block_table=table,
            slot_mapping=page.to(torch.int64) * page_size + positions % page_size,
            kv_indptr=state.kv_indptr[: count + 1], kv_indices=state.kv_indices[: count * state.max_pages],
            kv_last_page_len=state.kv_last_page_len[:count])
        out = self.step(state.input_ids[rows], self.head.fuse(aux), positions,
                        ForwardContext(self.backend, decode=meta))
        self.prenorm[rows] = out
        self.stale[rows] = False

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_page(self.kv_caches, src, dst)

    def window_tensors(self) -> dict[str, torch.Tensor | None]:
        return {"prenorm": self.prenorm, "pending": self.pending, "stale": self.stale,
                "trail_hidden": self.trail_hidden, "trail_tokens": self.trail_tokens,
                "trail_positions": self.trail_positions, "trail_slots": self.trail_slots,
                "trail_live": self.trail_live, **self.head.window_tensors()}


class HeadDrafter(Drafter):
    reads_hidden = True

    def __init__(self, eagle: DraftHead, sampler):
        self.eagle = eagle
        self.sampler = sampler

    def __call__(self, state, bucket: int, live, history, variant: SamplerVariant, kv_width: int, page_size: int):
        eagle = self.eagle
        d = state.spec_tokens
        position = state.positions[:bucket]
        # greedy rows under no automaton: the argmax over the head's own vocabulary is all a draft needs
        argmax = variant.mode == SamplerMode.GREEDY and not variant.structured
        sample = None if argmax else DraftSampling(self.sampler, state, bucket, variant)
        hidden = eagle.prenorm[:bucket]  # the head's output at p - 1
        drafts = []
        for j in range(d):
            # the token at p + j + 1
            draft = eagle.head.greedy(hidden) if argmax else sample(eagle.head.logits(hidden), j)
            drafts.append(draft)
            if j + 1 < d:  # the head at p + j, reading that draft and its own output before it
                start = position + j
                meta = verify_metadata(state, bucket, 1, page_size, kv_width, live, start=start)
                if state.bounds is not None:
                    state.bounds.verify(state, bucket, meta, start=start)
                ctx = ForwardContext(eagle.backend, decode=one_query(meta, state, bucket))
                hidden = eagle.step(draft, hidden, meta.query_positions[:, 0], ctx)
        return torch.stack(drafts, dim=1), torch.full_like(position, d), None if argmax else sample.proposal()

    def begin_window(self, state, bucket: int, live: torch.Tensor, kv_width: int, page_size: int) -> None:
        """Rows whose last window ran plain: the head's full step at p - 1 from `pending` (its K/V there
        rewritten with the same values), which gives `prenorm`."""
        eagle = self.eagle
        stale = eagle.stale[:bucket] & live
        start = (state.positions[:bucket] - 1).clamp(min=0)
        meta = verify_metadata(state, bucket, 1, page_size, kv_width, live, start=start)
        if state.bounds is not None:
            state.bounds.verify(state, bucket, meta, start=start)
        query = one_query(meta, state, bucket)
        query = dataclasses.replace(query, slot_mapping=torch.where(stale, query.slot_mapping, 0))  # others: scratch
        out = eagle.step(state.input_ids[:bucket], eagle.pending[:bucket], meta.query_positions[:, 0],
                         ForwardContext(eagle.backend, decode=query))
        prenorm = eagle.prenorm[:bucket]
        prenorm.copy_(torch.where(stale[:, None], out, prenorm))
        eagle.stale[:bucket] &= ~live

    def accepted(self, state, bucket: int, meta, hidden: torch.Tensor, sampled: torch.Tensor,
                 emit: torch.Tensor) -> None:
        eagle = self.eagle
        queries = sampled.shape[1]
        out = eagle.step(sampled.reshape(-1), eagle.head.fuse(hidden), meta.query_positions.reshape(-1),
                         ForwardContext(eagle.backend, verify=meta))
        out = out.view(bucket, queries, -1)
        last = out.gather(1, (emit - 1).clamp(min=0)[:, None, None].expand(-1, 1, out.shape[2]))[:, 0]
        prenorm = eagle.prenorm[:bucket]
        prenorm.copy_(torch.where((emit > 0)[:, None], last, prenorm))

    def follow(self, state, bucket: int, step: int, meta: DecodeMetadata, hidden: torch.Tensor,
               tokens: torch.Tensor, live: torch.Tensor) -> None:
        eagle = self.eagle
        eagle.trail_hidden[step, :bucket] = hidden
        eagle.trail_tokens[step, :bucket] = tokens
        eagle.trail_positions[step, :bucket] = state.positions[:bucket]
        eagle.trail_slots[step, :bucket] = meta.slot_mapping[:bucket]
        eagle.trail_live[step, :bucket] = live

    @staticmethod
    def kept_steps(live: torch.Tensor) -> torch.Tensor | None:
        """The (step, row) entries of a plain window [steps, B] the upkeep pass runs, flat: on a CPU the live ones
        alone (a host read); None in a graph (its static shape: every step, the inert ones writing the scratch
        slot)."""
        if live.device.type == "cpu" and not torch.compiler.is_compiling():
            return live.reshape(-1).nonzero().squeeze(1)
        return None

    def followed(self, state, bucket: int, steps: int) -> None:
        """The window's steps in one pass: the head's K/V at each live step's position (on a CPU the live steps
        alone; in a graph every step, a done row's slot the scratch one), and `pending` from each row's last live
        step."""
        eagle = self.eagle
        hidden = eagle.trail_hidden[:steps, :bucket].reshape(steps * bucket, -1)
        tokens, positions, slots = (t[:steps, :bucket].reshape(-1) for t in
                                    (eagle.trail_tokens, eagle.trail_positions, eagle.trail_slots))
        live = eagle.trail_live[:steps, :bucket]
        kept = self.kept_steps(live)
        if kept is not None and not kept.numel():  # no live step: nothing to write
            fused = hidden.new_zeros((steps * bucket, eagle.pending.shape[1]))
        else:
            take = (lambda t: t) if kept is None else (lambda t: t[kept])
            part = eagle.head.fuse(take(hidden))
            eagle.head.write_kv(eagle.embed(take(tokens)), part, take(positions), eagle.backend, take(slots))
            fused = part if kept is None else part.new_zeros((steps * bucket, part.shape[1])).index_copy_(0, kept, part)
        last = (live.sum(dim=0) - 1).clamp(min=0)  # done only ever follows live within a window
        fused = fused.view(steps, bucket, -1)
        latest = fused.gather(0, last[None, :, None].expand(1, bucket, fused.shape[2]))[0]
        ran = live.any(dim=0)
        pending = eagle.pending[:bucket]
        pending.copy_(torch.where(ran[:, None], latest, pending))
        eagle.stale[:bucket] |= ran
