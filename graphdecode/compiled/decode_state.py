"""DecodeState: the static device buffers a decode window reads and writes.

Struct of arrays indexed by row (a sequence's slot), sized to the largest bucket
B_max. A bucket of B rows works on views [:B]; rows >= B and padded rows inside the
bucket are `done`, so they compute harmlessly against the scratch page. The host
never writes these buffers directly: row changes arrive as copies from pinned
staging (runtime/row_staging.py), ordered on the stream after the running window.
"""

from __future__ import annotations

import torch

from ..attention.metadata import DecodeMetadata
from . import advance_step as _advance_step  # noqa: F401  (registers the graphdecode::advance_step op)
from .sampler import SamplingRows

# Layout of the integer staging rows: these columns, then max_stop_ids stop ids.
INT_COLUMNS = ("positions", "seq_lens", "max_len", "min_len", "top_k", "seed", "done")
FLOAT_COLUMNS = ("temperature", "top_p", "min_p")


class DecodeState:
    def __init__(self, max_rows: int, max_pages: int, max_stop_ids: int, num_decode_steps: int, max_logprobs: int,
                 device):
        rows = max_rows

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
        # outputs: column 0 = token sampled by prefill, columns 1..k = window steps
        self.out_tokens = buf(rows, num_decode_steps + 1, dtype=torch.int64)  # [B_max, k + 1]
        self.out_lp_sampled = buf(rows, num_decode_steps + 1, dtype=torch.float32)
        self.out_lp_rank = buf(rows, num_decode_steps + 1, dtype=torch.int64)
        self.out_lp_top_ids = buf(rows, num_decode_steps + 1, max_logprobs, dtype=torch.int64)  # [B_max, k + 1, N]
        self.out_lp_top = buf(rows, num_decode_steps + 1, max_logprobs, dtype=torch.float32)

    def sampling_rows(self, rows) -> SamplingRows:
        """`rows`: a slice (views, for the window) or an index tensor (gathers, for prefill)."""
        return SamplingRows(
            temperature=self.temperature[rows],
            top_p=self.top_p[rows],
            top_k=self.top_k[rows],
            min_p=self.min_p[rows],
            seed=self.seed[rows],
            stop_ids=self.stop_ids[rows],
            min_len=self.min_len[rows],
            max_len=self.max_len[rows],
        )

    def decode_metadata(self, bucket: int, kv_width: int) -> DecodeMetadata:
        """Views for a bucket; the torch reference gathers kv_width pages per row."""
        return DecodeMetadata(
            seq_lens=self.seq_lens[:bucket],
            block_table=self.block_table[:bucket, :kv_width],
            slot_mapping=self.slot_mapping[:bucket],
            kv_indptr=self.kv_indptr[: bucket + 1],
            kv_indices=self.kv_indices[: bucket * self.max_pages],
            kv_last_page_len=self.kv_last_page_len[:bucket],
        )

    def advance(self, bucket: int, sampled: torch.Tensor, page_size: int, advance: bool) -> None:
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

    def record_logprobs(self, rows, column: int, logprobs) -> None:
        self.out_lp_sampled[rows, column] = logprobs.sampled
        self.out_lp_rank[rows, column] = logprobs.rank
        self.out_lp_top_ids[rows, column] = logprobs.top_ids
        self.out_lp_top[rows, column] = logprobs.top_logprobs

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in vars(self).items() if isinstance(t, torch.Tensor)}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, t in saved.items():
            getattr(self, name).copy_(t)
