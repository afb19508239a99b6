"""DecodeState: the static device buffers a decode window reads and writes.

Struct of arrays indexed by row (a sequence's slot), sized to the largest bucket
B_max. A bucket of B rows works on views [:B]; rows >= B and padded rows inside the
bucket are `done`, so they compute harmlessly against the scratch page. The host
never writes these buffers directly: row changes arrive as copies from pinned
staging (device/row_staging.py), ordered on the stream after the running window.

Here: what every row needs (model inputs, attention metadata, stop state, the plain
sampling parameters, the output tokens). Each feature's own rows live in its object
(device/features/): `penalties`, `constraints`, `logprobs`, and `speculation` (None
without speculative decoding); `features` lists the ones with host staging.

Outputs: `out_tokens` [B_max, 1 + k (d + 1)]: column 0 the token a prefill sampled,
columns 1.. the window's; `out_count` [B_max] says how many window tokens each row
wrote (k in a plain window, up to k (d + 1) in a speculative one).
"""

from __future__ import annotations

import torch

from ..attention.metadata import DecodeMetadata
from . import advance_step as _advance_step  # noqa: F401  (registers the graphdecode::advance_step op)
from .advance_step import advance_rows_reference
from .features.constraints import Constraints
from .features.logprobs import LogprobColumns
from .features.penalties import Penalties
from .features.speculation import SpeculationRows
from .sampler import SamplingRows

# Layout of the integer staging rows: these columns, then max_stop_ids stop ids.
INT_COLUMNS = ("positions", "seq_lens", "max_len", "min_len", "top_k", "seed", "seeded", "done", "state_slot",
               "lora_slot")
FLOAT_COLUMNS = ("temperature", "top_p", "min_p")


class DecodeState:
    def __init__(self, max_rows: int, max_pages: int, max_stop_ids: int, num_decode_steps: int, max_logprobs: int,
                 device, *, vocab_size: int = 1, max_logit_bias: int = 1, bad_word_slots: int = 1,
                 max_bad_word_tokens: int = 1, spec_tokens: int = 0, history_len: int = 0,
                 structured_max_states: int = 1, structured_max_exceptions: int = 1, lora: bool = False):
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
        self.state_slot = buf(rows, dtype=torch.int64)  # [B_max]: a hybrid's recurrent-state slot (0: scratch)
        self.lora_slot = buf(rows, dtype=torch.int64)  # [B_max]: its LoRA adapter's slot (0: none)
        self.lora = lora  # a LoRA engine: decode metadata carries the rows' adapter slots
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
        self.seeded = buf(rows, dtype=torch.bool)  # [B_max]: the request gave its seed (speculative.py: exact match)
        # outputs
        self.out_tokens = buf(rows, width, dtype=torch.int64)  # [B_max, 1 + k (d + 1)]
        self.out_count = buf(rows, dtype=torch.int32)  # [B_max]: window tokens written (columns 1..count)
        # the features' rows
        self.penalties = Penalties(rows, vocab_size, max_logit_bias, bad_word_slots, max_bad_word_tokens, device)
        self.constraints = Constraints(rows, structured_max_states, structured_max_exceptions, vocab_size, device)
        self.logprobs = LogprobColumns(rows, width, max_logprobs, device)
        self.spec_tokens = spec_tokens
        self.speculation = SpeculationRows(rows, history_len, device, spec_tokens) if spec_tokens else None
        self.features = tuple(f for f in (self.penalties, self.constraints, self.speculation) if f is not None)
        self.bounds = None  # BoundsCheck in the bounds-checked mode (device/bounds.py)

    @property
    def verify_pages(self) -> int:
        """Pages a verify's KV spans per row at most: a row's last query sits up to d (< page
        size) positions past its max_len, so one page more than a row's table (read as the
        scratch page)."""
        return self.max_pages + 1 if self.spec_tokens else self.max_pages

    def sampling_rows(self, rows, penalties: bool = False, structured: bool = False) -> SamplingRows:
        """`rows`: a slice (views, for the window) or an index tensor (gathers, for prefill). The
        penalty inputs only when `penalties` (a gather of token_counts is [R, V]), the
        constraint inputs only when `structured`."""
        return SamplingRows(
            temperature=self.temperature[rows],
            top_p=self.top_p[rows],
            top_k=self.top_k[rows],
            min_p=self.min_p[rows],
            seed=self.seed[rows],
            stop_ids=self.stop_ids[rows],
            min_len=self.min_len[rows],
            max_len=self.max_len[rows],
            penalties=self.penalties.rows(rows) if penalties else None,
            constraint=self.constraints.rows(rows) if structured else None,
        )

    def decode_metadata(self, bucket: int, kv_width: int, ragged: bool = False) -> DecodeMetadata:
        """Views for a bucket; the torch reference gathers kv_width pages per row (or, ragged,
        each row's own CSR pages)."""
        return self.decode_rows(0, bucket, kv_width, ragged)

    def decode_rows(self, r0: int, r1: int, kv_width: int, ragged: bool = False) -> DecodeMetadata:
        """Views of rows r0..r1-1: a bucket (r0 = 0), or a pipeline's micro-batch (device/pipeline_window.py), for a
        backend that reads block tables directly (the CSR views are a bucket's, from row 0)."""
        return DecodeMetadata(
            seq_lens=self.seq_lens[r0:r1],
            block_table=self.block_table[r0:r1, :kv_width],
            slot_mapping=self.slot_mapping[r0:r1],
            kv_indptr=self.kv_indptr[: r1 - r0 + 1],
            kv_indices=self.kv_indices[: (r1 - r0) * self.max_pages],
            kv_last_page_len=self.kv_last_page_len[r0:r1],
            ragged=ragged,
            state_slots=self.state_slot[r0:r1],
            lora_slots=self.lora_slot[r0:r1] if self.lora else None,
        )

    def advance_rows(self, r0: int, r1: int, sampled: torch.Tensor, page_size: int, advance: bool = True) -> None:
        """advance_step's per-row part on rows r0..r1-1 (a bucket, or a micro-batch), without CSR metadata."""
        advance_rows_reference(sampled, self.done[r0:r1], self.block_table[r0:r1], self.input_ids[r0:r1],
                               self.positions[r0:r1], self.seq_lens[r0:r1], self.slot_mapping[r0:r1], page_size,
                               advance)

    def advance(self, bucket: int, sampled: torch.Tensor, page_size: int, advance: bool, csr: bool = True) -> None:
        """advance_step on the bucket's rows; csr=False (a CPU backend that reads block tables
        directly) leaves the CSR metadata alone and runs only the per-row part."""
        if not csr and self.block_table.device.type == "cpu":
            self.advance_rows(0, bucket, sampled, page_size, advance)
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

    def apply_block_tables(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        self.block_table.index_copy_(0, index, rows)

    def output_tensors(self, logprobs: bool, speculative: bool) -> dict[str, torch.Tensor]:
        """What a window's outputs are read from: tokens and counts, with logprobs and draft counts
        when asked."""
        out = {"out_tokens": self.out_tokens, "out_count": self.out_count}
        if logprobs:
            out.update(self.logprobs.tensors())
        if speculative:
            out.update(self.speculation.counters())
        return out

    def window_tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer a window may write (device/window_writes.py): the state's and its features'."""
        out = {name: t for name, t in vars(self).items() if isinstance(t, torch.Tensor)}
        for feature in (self.penalties, self.constraints, self.logprobs, self.speculation):
            if feature is not None:
                out.update(feature.tensors())
        return out
