"""Logprob outputs: per row and output column, the sampled token's logprob and rank and the
top N (N = the engine's max_logprobs width). Written only by variants with logprobs and
copied to the host only for windows that asked (device/pythonizer.py)."""

from __future__ import annotations

import torch

from . import RowFeature, buffer


class LogprobColumns(RowFeature):
    def __init__(self, rows: int, width: int, max_logprobs: int, device):
        super().__init__(device)
        self.out_lp_sampled = buffer(rows, width, dtype=torch.float32, device=device)
        self.out_lp_rank = buffer(rows, width, dtype=torch.int64, device=device)
        self.out_lp_top_ids = buffer(rows, width, max_logprobs, dtype=torch.int64, device=device)  # [B_max, width, N]
        self.out_lp_top = buffer(rows, width, max_logprobs, dtype=torch.float32, device=device)

    def record(self, rows, column: int, logprobs) -> None:
        """One column of R rows (a slice or an index tensor)."""
        self.out_lp_sampled[rows, column] = logprobs.sampled
        self.out_lp_rank[rows, column] = logprobs.rank
        self.out_lp_top_ids[rows, column] = logprobs.top_ids
        self.out_lp_top[rows, column] = logprobs.top_logprobs

    def record_columns(self, bucket: int, queries: int, columns, written, logprobs) -> None:
        """A verify's B x Q positions: each written one ([B, Q] bool) into its column ([B, Q])."""
        def put(target, values):
            values = values.view(bucket, queries, *values.shape[1:])
            view = target[:bucket]
            index = columns.view(bucket, queries, *([1] * (values.dim() - 2))).expand_as(values)
            mask = written.view(bucket, queries, *([1] * (values.dim() - 2)))
            view.scatter_(1, index, torch.where(mask, values, view.gather(1, index)))

        put(self.out_lp_sampled, logprobs.sampled)
        put(self.out_lp_rank, logprobs.rank)
        put(self.out_lp_top_ids, logprobs.top_ids)
        put(self.out_lp_top, logprobs.top_logprobs)
