// advance_step: prepare the next decode step's inputs in place, on the device.
//
// Semantics (identical to graphdecode/compiled/advance_step.py, the torch reference):
//   advance && active row: input_ids = sampled, positions += 1, seq_lens += 1
//   slot_mapping   = block_table[b, pos / P] * P + pos % P   (active)   | 0 (scratch slot)
//   pages          = ceil(seq_len / P)                         (active)   | 1 (scratch page)
//   kv_indptr      = exclusive scan of pages over the bucket (B + 1 entries)
//   kv_indices     = each active row's block-table prefix (column clamped to max_pages - 1), or the
//                    scratch page 0; entries past kv_indptr[B] or past B * max_pages are left as they are
//   kv_last_page_len = seq_len - (pages - 1) * P               (active)   | 1
//
// Two kernels: one block updates the per-row scalars and scans the page counts (B <= 1024);
// then one block per row copies that row's pages into kv_indices, coalesced.
// Plain CUDA + an extern "C" launcher with raw pointers and a stream: no torch headers, so it
// builds with nvcc alone and survives torch upgrades.

#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

namespace {

constexpr int kMaxRows = 1024;

__global__ void advance_rows_kernel(const int64_t* __restrict__ sampled, const bool* __restrict__ done,
                                    const int32_t* __restrict__ block_table, int64_t table_stride,
                                    int64_t* __restrict__ input_ids, int64_t* __restrict__ positions,
                                    int32_t* __restrict__ seq_lens, int64_t* __restrict__ slot_mapping,
                                    int32_t* __restrict__ kv_indptr, int32_t* __restrict__ kv_last_page_len,
                                    int num_rows, int max_pages, int page_size, int advance) {
  using Scan = cub::BlockScan<int32_t, kMaxRows>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int row = threadIdx.x;
  int32_t pages = 0;
  if (row < num_rows) {
    const bool active = !done[row];
    int64_t pos = positions[row];
    int32_t len = seq_lens[row];
    if (advance && active) {
      input_ids[row] = sampled[row];
      pos += 1;
      len += 1;
      positions[row] = pos;
      seq_lens[row] = len;
    }
    if (active) {
      int64_t page_index = pos / page_size;
      if (page_index > max_pages - 1) page_index = max_pages - 1;
      const int64_t page = block_table[row * table_stride + page_index];
      slot_mapping[row] = page * page_size + (pos - page_index * page_size);
      pages = (len + page_size - 1) / page_size;
      kv_last_page_len[row] = len - (pages - 1) * page_size;
    } else {
      slot_mapping[row] = 0;
      pages = 1;
      kv_last_page_len[row] = 1;
    }
  }
  int32_t start = 0;
  int32_t total = 0;
  Scan(scan_storage).ExclusiveSum(pages, start, total);
  if (row < num_rows) kv_indptr[row + 1] = start + pages;
  if (row == 0) kv_indptr[0] = 0;
}

__global__ void fill_indices_kernel(const bool* __restrict__ done, const int32_t* __restrict__ block_table,
                                    int64_t table_stride, const int32_t* __restrict__ kv_indptr,
                                    int32_t* __restrict__ kv_indices, int max_pages, int64_t capacity) {
  const int row = blockIdx.x;
  const int32_t begin = kv_indptr[row];
  const int32_t count = kv_indptr[row + 1] - begin;
  const bool active = !done[row];
  const int32_t* table_row = block_table + row * table_stride;
  for (int32_t i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t dst = static_cast<int64_t>(begin) + i;
    if (dst >= capacity) break;  // never write past the bucket's B * max_pages entries
    const int32_t col = i < max_pages ? i : max_pages - 1;
    kv_indices[dst] = active ? table_row[col] : 0;
  }
}

}  // namespace

extern "C" int graphdecode_advance_step(const int64_t* sampled, const bool* done, const int32_t* block_table,
                                        int64_t table_stride, int64_t* input_ids, int64_t* positions,
                                        int32_t* seq_lens, int64_t* slot_mapping, int32_t* kv_indptr,
                                        int32_t* kv_indices, int32_t* kv_last_page_len, int num_rows,
                                        int max_pages, int page_size, int advance, cudaStream_t stream) {
  if (num_rows < 1 || num_rows > kMaxRows || max_pages < 1 || page_size < 1 || table_stride < max_pages) {
    return cudaErrorInvalidValue;  // checked before any CUDA call: safe to probe without a GPU
  }
  advance_rows_kernel<<<1, kMaxRows, 0, stream>>>(sampled, done, block_table, table_stride, input_ids, positions,
                                                   seq_lens, slot_mapping, kv_indptr, kv_last_page_len, num_rows,
                                                   max_pages, page_size, advance);
  const int64_t capacity = static_cast<int64_t>(num_rows) * max_pages;
  fill_indices_kernel<<<num_rows, 128, 0, stream>>>(done, block_table, table_stride, kv_indptr, kv_indices,
                                                    max_pages, capacity);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int graphdecode_kernels_abi_version() { return 1; }
