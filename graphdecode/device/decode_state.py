"""DecodeState: the static device buffers a decode window reads and writes.

Struct of arrays indexed by row (a sequence's slot), sized to the largest bucket
B_max. A bucket of B rows works on views [:B]; rows >= B and padded rows inside the
bucket are `done`, so they compute harmlessly against the scratch page. The host
never writes these buffers directly: row changes arrive as copies from pinned
staging (device/row_staging.py), ordered on the stream after the running window.

Penalty state (read only by windows whose variant has penalties; see sampler.py):
per-row repetition / presence / frequency penalties [B_max] float32, a `penalized`
flag [B_max] bool (whether the row's logit_bias and bad words apply: rows without
penalties never receive those buffers, the flag keeps stale entries inert),
`token_counts` [B_max, V] int16 (2 bytes per row and token: 65.7 MB for 256 rows of
Llama-3's 128256 tokens), `bias_ids` [B_max, L] int64 + `bias_values` [B_max, L]
float32 (L = max_logit_bias: 192 KiB for 256 rows, L = 64), `bad_words` [B_max, W, T]
int64 (W = 2 * max_bad_words sequences of T = max_bad_word_tokens: 512 KiB for 256
rows, 32 x 8) and `recent` [B_max, T] int64, the row's last T output tokens. A
row's counts and recent tokens are staged when it is admitted (prompt and tokens so
far: also after a preemption or a prefix-cache hit) and updated by the sampler's
caller as tokens are sampled.

Speculative decoding (speculative.py) adds each row's token history [B_max, H] int64
(H = max_model_len: prompt and outputs, staged at admission and extended by every
window) and lets a window write up to k * (d + 1) tokens per row: `out_count` [B_max]
says how many window tokens each row wrote (k in a plain window), `spec_drafted` /
`spec_accepted` [B_max] the drafts a speculative window proposed and accepted per row.
"""

from __future__ import annotations

import torch

from ..attention.metadata import DecodeMetadata
from . import advance_step as _advance_step  # noqa: F401  (registers the graphdecode::advance_step op)
from .advance_step import advance_rows_reference
from .sampler import COUNT_MASK, SamplingRows

# Layout of the integer staging rows: these columns, then max_stop_ids stop ids.
INT_COLUMNS = ("positions", "seq_lens", "max_len", "min_len", "top_k", "seed", "done", "penalized",
               "constrained", "struct_state")
FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
# Rows with penalties also send, separately, [L bias ids, W * T bad-word tokens, T recent tokens]
# as integers, L bias values as floats, and their token counts sparsely.


class DecodeState:
    def __init__(self, max_rows: int, max_pages: int, max_stop_ids: int, num_decode_steps: int, max_logprobs: int,
                 device, *, vocab_size: int = 1, max_logit_bias: int = 1, bad_word_slots: int = 1,
                 max_bad_word_tokens: int = 1, spec_tokens: int = 0, history_len: int = 0):
        rows = max_rows
        width = 1 + num_decode_steps * (spec_tokens + 1)  # output columns: the prefill's token, then the window's

        def buf(*shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.max_rows = rows
        self.max_pages = max_pages
        # model inputs and attention metadata
        self.input_ids = buf(rows, dtype=torch.int64)  # [B_max]: the token each row feeds next
        self.positions = buf(rows, dtype=torch.int64)  # [B_max]: its position
        # inert rows keep seq_len 1 (never 0): an all-masked softmax would turn into NaNs
        self.seq_lens = buf(rows, dtype=torch.int32, fill=1)  # [B_max]: KV length including it
        self.block_table = buf(rows, max_pages, dtype=torch.int32)  # [B_max, max_pages]
        self.slot_mapping = buf(rows, dtype=torch.int64)  # [B_max]
        self.kv_indptr = buf(rows + 1, dtype=torch.int32)  # [B_max + 1] FlashInfer CSR
        self.kv_indices = buf(rows * max_pages, dtype=torch.int32)  # [B_max * max_pages]
        self.kv_last_page_len = buf(rows, dtype=torch.int32, fill=1)  # [B_max]
        # per-row stop state and sampling parameters
        self.done = buf(rows, dtype=torch.bool, fill=True)  # [B_max]: inert rows
        self.max_len = buf(rows, dtype=torch.int32)
        self.min_len = buf(rows, dtype=torch.int32)
        self.stop_ids = buf(rows, max_stop_ids, dtype=torch.int64, fill=-1)  # [B_max, S]
        self.temperature = buf(rows, dtype=torch.float32)
        self.top_p = buf(rows, dtype=torch.float32, fill=1.0)
        self.top_k = buf(rows, dtype=torch.int32)
        self.min_p = buf(rows, dtype=torch.float32)
        self.seed = buf(rows, dtype=torch.int64)
        # penalties (sampler.apply_penalties)
        self.penalized = buf(rows, dtype=torch.bool)
        self.repetition_penalty = buf(rows, dtype=torch.float32, fill=1.0)
        self.presence_penalty = buf(rows, dtype=torch.float32)
        self.frequency_penalty = buf(rows, dtype=torch.float32)
        self.token_counts = buf(rows, vocab_size, dtype=torch.int16)  # [B_max, V]: output count | PROMPT_BIT
        self.bias_ids = buf(rows, max_logit_bias, dtype=torch.int64, fill=-1)  # [B_max, L]
        self.bias_values = buf(rows, max_logit_bias, dtype=torch.float32)
        self.bad_words = buf(rows, bad_word_slots, max_bad_word_tokens, dtype=torch.int64, fill=-1)  # [B_max, W, T]
        self.recent = buf(rows, max_bad_word_tokens, dtype=torch.int64, fill=-1)  # [B_max, T]
        # structured outputs: a constrained row's automaton state (a global id into `structured`'s tables)
        self.constrained = buf(rows, dtype=torch.bool)
        self.struct_state = buf(rows, dtype=torch.int32)
        self.structured = None  # StructuredTables, made by the runner at the first constraint
        # outputs: column 0 = token sampled by prefill, columns 1..k = window steps
        self.out_tokens = buf(rows, width, dtype=torch.int64)  # [B_max, 1 + k (d + 1)]
        self.out_lp_sampled = buf(rows, width, dtype=torch.float32)
        self.out_lp_rank = buf(rows, width, dtype=torch.int64)
        self.out_lp_top_ids = buf(rows, width, max_logprobs, dtype=torch.int64)  # [B_max, width, N]
        self.out_lp_top = buf(rows, width, max_logprobs, dtype=torch.float32)
        self.out_count = buf(rows, dtype=torch.int32)  # [B_max]: window tokens written (columns 1..count)
        # speculative decoding
        self.spec_tokens = spec_tokens
        self.history = buf(rows, history_len, dtype=torch.int64) if spec_tokens else None  # [B_max, H]
        self.spec_drafted = buf(rows, dtype=torch.int32)  # [B_max]: drafts proposed in the last window
        self.spec_accepted = buf(rows, dtype=torch.int32)  # [B_max]: ... of which accepted
        self.spec_rounds = buf(rows, dtype=torch.int32)  # [B_max]: verify rounds the row was live in
        self.bounds = None  # BoundsCheck in the bounds-checked mode (device/bounds.py)

    @property
    def verify_pages(self) -> int:
        """Pages a verify's KV spans per row at most: a row's last query sits up to d (< page
        size) positions past its max_len, so one page more than a row's table (read as the
        scratch page)."""
        return self.max_pages + 1 if self.spec_tokens else self.max_pages

    def sampling_rows(self, rows, penalties: bool = False, structured: bool = False) -> SamplingRows:
        """`rows`: a slice (views, for the window) or an index tensor (gathers, for prefill).
        The penalty inputs only when `penalties` (a gather of token_counts is [R, V]), the automaton states and their masks only when
        `structured`."""
        names = ()
        if penalties:
            names += ("penalized", "repetition_penalty", "presence_penalty", "frequency_penalty", "token_counts",
                      "bias_ids", "bias_values", "bad_words", "recent")
        if structured:
            names += ("constrained", "struct_state")
        extra = {name: getattr(self, name)[rows] for name in names}
        if structured:
            extra.update(self.structured.row_inputs(extra["struct_state"]))
        return SamplingRows(
            temperature=self.temperature[rows],
            top_p=self.top_p[rows],
            top_k=self.top_k[rows],
            min_p=self.min_p[rows],
            seed=self.seed[rows],
            stop_ids=self.stop_ids[rows],
            min_len=self.min_len[rows],
            max_len=self.max_len[rows],
            **extra,
        )

    def record_penalty_tokens(self, rows, tokens: torch.Tensor, live: torch.Tensor) -> None:
        """After sampling `tokens` [R] for `rows` (slice or index): count them and push them on
        the recent-tokens ring, for rows that were live ([R] bool); others stay as they are.
        One token per row: a gather and a scatter of [R] entries, no [R, V] work."""
        index = tokens[:, None]
        if isinstance(rows, slice):
            counts = self.token_counts[rows]
            current = counts.gather(1, index)
        else:
            current = self.token_counts[rows[:, None], index]
        bumped = current + ((current & COUNT_MASK) < COUNT_MASK).to(current.dtype)
        updated = torch.where(live[:, None], bumped, current)
        if isinstance(rows, slice):
            counts.scatter_(1, index, updated)
        else:
            self.token_counts[rows[:, None], index] = updated
        recent = self.recent[rows]
        pushed = torch.cat([recent[:, 1:], index], dim=1)
        self.recent[rows] = torch.where(live[:, None], pushed, recent)

    def record_history(self, rows, positions: torch.Tensor, tokens: torch.Tensor, live: torch.Tensor) -> None:
        """history[row, position] = token for live rows (rows: a slice or an index tensor; all [R])."""
        index = positions.clamp(max=self.history.shape[1] - 1)[:, None]
        if isinstance(rows, slice):
            history = self.history[rows]
            history.scatter_(1, index, torch.where(live, tokens, history.gather(1, index)[:, 0])[:, None])
        else:
            current = self.history[rows[:, None], index][:, 0]
            self.history[rows[:, None], index] = torch.where(live, tokens, current)[:, None]

    def decode_metadata(self, bucket: int, kv_width: int, ragged: bool = False) -> DecodeMetadata:
        """Views for a bucket; the torch reference gathers kv_width pages per row (or, ragged,
        each row's own CSR pages)."""
        return DecodeMetadata(
            seq_lens=self.seq_lens[:bucket],
            block_table=self.block_table[:bucket, :kv_width],
            slot_mapping=self.slot_mapping[:bucket],
            kv_indptr=self.kv_indptr[: bucket + 1],
            kv_indices=self.kv_indices[: bucket * self.max_pages],
            kv_last_page_len=self.kv_last_page_len[:bucket],
            ragged=ragged,
        )

    def advance(self, bucket: int, sampled: torch.Tensor, page_size: int, advance: bool, csr: bool = True) -> None:
        """advance_step on the bucket's rows; csr=False (a CPU backend that reads block tables
        directly) leaves the CSR metadata alone and runs only the per-row part."""
        if not csr and self.block_table.device.type == "cpu":
            advance_rows_reference(sampled, self.done[:bucket], self.block_table[:bucket], self.input_ids[:bucket],
                                   self.positions[:bucket], self.seq_lens[:bucket], self.slot_mapping[:bucket],
                                   page_size, advance)
            return
        torch.ops.graphdecode.advance_step(
            sampled,
            self.done[:bucket],
            self.block_table[:bucket],
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.seq_lens[:bucket],
            self.slot_mapping[:bucket],
            self.kv_indptr[: bucket + 1],
            self.kv_indices[: bucket * self.max_pages],
            self.kv_last_page_len[:bucket],
            page_size,
            advance,
        )

    def apply_rows(self, index: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Scatter staged rows: index [n] int64, ints [n, len(INT_COLUMNS) + S], floats [n, 3]."""
        for col, name in enumerate(INT_COLUMNS):
            target = getattr(self, name)
            target.index_copy_(0, index, ints[:, col].to(target.dtype))
        self.stop_ids.index_copy_(0, index, ints[:, len(INT_COLUMNS) :])
        for col, name in enumerate(FLOAT_COLUMNS):
            getattr(self, name).index_copy_(0, index, floats[:, col])

    def apply_penalty_rows(self, index: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Rows with penalties: ints [n, L + W * T + T] (bias ids, bad words, recent), floats [n, L]."""
        n, (width, slots, tokens) = index.shape[0], (self.bias_ids.shape[1], *self.bad_words.shape[1:])
        self.bias_ids.index_copy_(0, index, ints[:, :width])
        self.bad_words.index_copy_(0, index, ints[:, width : width + slots * tokens].reshape(n, slots, tokens))
        self.recent.index_copy_(0, index, ints[:, width + slots * tokens :])
        self.bias_values.index_copy_(0, index, floats)

    def apply_token_counts(self, index: torch.Tensor, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Zero rows `index` [n] of token_counts, then set entries flat [m] (row * V + token) to values [m] int16."""
        self.token_counts.index_fill_(0, index, 0)
        self.token_counts.view(-1).index_copy_(0, flat, values)

    def apply_history(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Set history entries flat [m] (row * H + position) to values [m] (admitted rows' tokens)."""
        self.history.view(-1).index_copy_(0, flat, values)

    def apply_block_tables(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        self.block_table.index_copy_(0, index, rows)

    def record_logprobs(self, rows, column: int, logprobs) -> None:
        self.out_lp_sampled[rows, column] = logprobs.sampled
        self.out_lp_rank[rows, column] = logprobs.rank
        self.out_lp_top_ids[rows, column] = logprobs.top_ids
        self.out_lp_top[rows, column] = logprobs.top_logprobs

    def window_tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer of the state (a window may write any of them: device/window_writes.py)."""
        return {name: t for name, t in vars(self).items() if isinstance(t, torch.Tensor)}
