"""advance_step: prepare the next decode step's inputs on the device, in place.

For every row b of a bucket (all tensors are views of the first B rows):

* advance=True, row active (not done): input_ids = sampled, positions += 1, seq_lens += 1
* always: slot_mapping = block_table[b, pos // P] * P + pos % P for active rows, the
  scratch slot 0 for done and padded rows
* always: FlashInfer's CSR metadata: kv_indptr = exclusive scan of pages per row
  (ceil(seq_len / P) for active rows, 1 for inert rows), kv_indices = each active row's
  block-table prefix (the scratch page 0 for inert rows), kv_last_page_len
  (seq_len - (pages - 1) * P, or 1). kv_indices past kv_indptr[B] are left as they are
  (FlashInfer never reads them).

advance=False only recomputes slot_mapping and the CSR metadata: the window runs it
once at its start, after the host may have admitted rows or grown block tables.

`advance_rows_reference` is the same step without the CSR metadata, for a backend that
reads block tables directly (the CPU kernel): on CPU the CSR scan over B x max_pages
entries was 13% of a small model's decode step.

This file holds the torch reference (what CPU runs and what the CUDA kernel in
csrc/advance_step.cu is tested against) and the `graphdecode::advance_step` custom
op, so torch.compile and graph capture see one opaque op; `use_cuda_kernel()` registers the
CUDA implementation (kernels/cuda.py, csrc/advance_step.cu) onto the same op.
"""

from __future__ import annotations

import functools

import torch

SCRATCH_SLOT = 0


def advance_step_reference(
    sampled: torch.Tensor,  # [B] int64
    done: torch.Tensor,  # [B] bool
    block_table: torch.Tensor,  # [B, max_pages] int32
    input_ids: torch.Tensor,  # [B] int64, updated
    positions: torch.Tensor,  # [B] int64, updated
    seq_lens: torch.Tensor,  # [B] int32, updated
    slot_mapping: torch.Tensor,  # [B] int64, written
    kv_indptr: torch.Tensor,  # [B + 1] int32, written
    kv_indices: torch.Tensor,  # [B * max_pages] int32, written
    kv_last_page_len: torch.Tensor,  # [B] int32, written
    page_size: int,
    advance: bool,
) -> None:
    advance_rows_reference(sampled, done, block_table, input_ids, positions, seq_lens, slot_mapping, page_size,
                           advance)
    rows, max_pages = block_table.shape
    active = ~done
    num_pages = torch.where(active, torch.div(seq_lens + page_size - 1, page_size, rounding_mode="floor"), 1)
    ends = torch.cumsum(num_pages, dim=0).to(torch.int32)  # [B]
    kv_indptr[:1].zero_()  # a device op (capturable); `kv_indptr[0] = 0` copies from the host
    kv_indptr[1:].copy_(ends)
    flat = torch.arange(kv_indices.shape[0], device=kv_indices.device, dtype=torch.int32)
    row = torch.searchsorted(ends, flat, right=True)  # [B * max_pages]: owning row, B past the end
    in_range = row < rows
    row = row.clamp(max=rows - 1)
    col = (flat - kv_indptr[row]).clamp(0, max_pages - 1)
    page_at = block_table[row, col]
    kv_indices.copy_(torch.where(in_range, torch.where(active[row], page_at, 0), kv_indices))
    kv_last_page_len.copy_(torch.where(active, seq_lens - (num_pages - 1) * page_size, 1))


def advance_rows_reference(sampled, done, block_table, input_ids, positions, seq_lens, slot_mapping,
                           page_size: int, advance: bool) -> None:
    """The per-row part: input_ids, positions, seq_lens (advance) and slot_mapping."""
    max_pages = block_table.shape[1]
    active = ~done
    if advance:
        input_ids.copy_(torch.where(active, sampled, input_ids))
        positions.add_(active.to(positions.dtype))
        seq_lens.add_(active.to(seq_lens.dtype))
    page_index = torch.div(positions, page_size, rounding_mode="floor").clamp(max=max_pages - 1)
    page = block_table.gather(1, page_index[:, None])[:, 0].to(torch.int64)
    slot = page * page_size + positions - page_index * page_size
    slot_mapping.copy_(torch.where(active, slot, SCRATCH_SLOT))


@torch.library.custom_op(
    "graphdecode::advance_step",
    mutates_args=("input_ids", "positions", "seq_lens", "slot_mapping", "kv_indptr", "kv_indices", "kv_last_page_len"),
)
def advance_step(
    sampled: torch.Tensor,
    done: torch.Tensor,
    block_table: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    advance: bool,
) -> None:
    advance_step_reference(
        sampled, done, block_table, input_ids, positions, seq_lens, slot_mapping,
        kv_indptr, kv_indices, kv_last_page_len, page_size, advance,
    )


# The meta/fake implementation is the reference too: on fake tensors it only checks shapes.
advance_step.register_fake(advance_step_reference)


@functools.cache
def use_cuda_kernel() -> bool:
    """Make `graphdecode::advance_step` run the CUDA kernel on CUDA tensors (idempotent). False
    (after one warning) when the library cannot be built or loaded: the op then keeps running its
    torch reference on CUDA tensors."""
    from ..kernels import cuda

    if not cuda.available():
        return False
    advance_step.register_kernel("cuda")(cuda.advance_step_cuda)
    return True
