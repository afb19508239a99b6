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
// (pos / P is clamped to max_pages - 1 too.) The domain is that of the engine's states:
// positions >= 0 and seq_lens >= 0, where C's and torch's integer divisions agree.
//
// The per-row work is two __host__ __device__ functions, `advance_row` (the row's scalars; returns
// its page count) and `fill_row_indices` (the row's slice of kv_indices, from its begin offset).
// On the device two kernels call them: one block updates the per-row scalars and scans the page
// counts (B <= 1024); then one block per row copies that row's pages into kv_indices, coalesced.
// On the host `graphdecode_advance_step_host` calls the same two functions from a plain loop with
// a serial scan: CPU tests run the kernels' per-row logic against the torch reference.
//
// Plain CUDA + extern "C" entry points with raw pointers: no torch headers, so it builds with nvcc
// alone and survives torch upgrades. Without nvcc the host part builds as C++ (g++ -x c++): the
// CUDA-only parts are under __CUDACC__ and the execution-space keywords are defined away.

#include <cstdint>

#ifdef __CUDACC__
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>
#else
#define __host__
#define __device__
#endif

namespace {

constexpr int kInvalidValue = 1;  // cudaErrorInvalidValue, also what the host entry point answers
#ifdef __CUDACC__
static_assert(kInvalidValue == static_cast<int>(cudaErrorInvalidValue), "error code mismatch");
#endif

bool valid_arguments(int num_rows, int max_pages, int page_size, int64_t table_stride) {
  return num_rows >= 1 && max_pages >= 1 && page_size >= 1 && table_stride >= max_pages;
}

// Updates row `row`'s scalars (input_ids, positions, seq_lens when advancing; slot_mapping and
// kv_last_page_len always) and returns the number of pages the row attends.
__host__ __device__ inline int32_t advance_row(int row, const int64_t* sampled, const bool* done,
                                               const int32_t* block_table, int64_t table_stride,
                                               int64_t* input_ids, int64_t* positions, int32_t* seq_lens,
                                               int64_t* slot_mapping, int32_t* kv_last_page_len, int max_pages,
                                               int page_size, int advance) {
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
  if (!active) {
    slot_mapping[row] = 0;  // the scratch slot
    kv_last_page_len[row] = 1;
    return 1;  // one token of the scratch page
  }
  int64_t page_index = pos / page_size;
  if (page_index > max_pages - 1) page_index = max_pages - 1;
  const int64_t page = block_table[row * table_stride + page_index];
  slot_mapping[row] = page * page_size + (pos - page_index * page_size);
  const int32_t pages = (len + page_size - 1) / page_size;
  kv_last_page_len[row] = len - (pages - 1) * page_size;
  return pages;
}

// Writes entries first, first + step, ... of row `row`'s `count` pages, which start at kv_indices[begin]:
// the block-table prefix (column clamped to max_pages - 1), or the scratch page 0 for an inert row.
// Stops at `capacity` (B * max_pages): never writes past the bucket's share of kv_indices.
__host__ __device__ inline void fill_row_indices(int row, const bool* done, const int32_t* block_table,
                                                 int64_t table_stride, int32_t begin, int32_t count,
                                                 int32_t* kv_indices, int max_pages, int64_t capacity,
                                                 int32_t first, int32_t step) {
  const bool active = !done[row];
  const int32_t* table_row = block_table + row * table_stride;
  for (int32_t i = first; i < count; i += step) {
    const int64_t dst = static_cast<int64_t>(begin) + i;
    if (dst >= capacity) break;
    const int32_t col = i < max_pages ? i : max_pages - 1;
    kv_indices[dst] = active ? table_row[col] : 0;
  }
}

#ifdef __CUDACC__

constexpr int kMaxRows = 1024;     // advance_rows_kernel's block: one thread per row
constexpr int kIndexThreads = 128;  // fill_indices_kernel's block: one block per row

// __launch_bounds__ caps the registers ptxas may give a thread so that a block of this size fits one
// SM's register file (65536 / 1024 = 64 per thread): without it a launch of 1024 threads may fail.
__global__ void __launch_bounds__(kMaxRows)
    advance_rows_kernel(const int64_t* __restrict__ sampled, const bool* __restrict__ done,
                        const int32_t* __restrict__ block_table, int64_t table_stride,
                        int64_t* __restrict__ input_ids, int64_t* __restrict__ positions,
                        int32_t* __restrict__ seq_lens, int64_t* __restrict__ slot_mapping,
                        int32_t* __restrict__ kv_indptr, int32_t* __restrict__ kv_last_page_len, int num_rows,
                        int max_pages, int page_size, int advance) {
  using Scan = cub::BlockScan<int32_t, kMaxRows>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int row = threadIdx.x;
  int32_t pages = 0;
  if (row < num_rows) {
    pages = advance_row(row, sampled, done, block_table, table_stride, input_ids, positions, seq_lens,
                        slot_mapping, kv_last_page_len, max_pages, page_size, advance);
  }
  int32_t start = 0;
  int32_t total = 0;
  Scan(scan_storage).ExclusiveSum(pages, start, total);
  if (row < num_rows) kv_indptr[row + 1] = start + pages;
  if (row == 0) kv_indptr[0] = 0;
}

__global__ void __launch_bounds__(kIndexThreads)
    fill_indices_kernel(const bool* __restrict__ done, const int32_t* __restrict__ block_table,
                        int64_t table_stride, const int32_t* __restrict__ kv_indptr,
                        int32_t* __restrict__ kv_indices, int max_pages, int64_t capacity) {
  const int row = blockIdx.x;
  const int32_t begin = kv_indptr[row];
  const int32_t count = kv_indptr[row + 1] - begin;
  fill_row_indices(row, done, block_table, table_stride, begin, count, kv_indices, max_pages, capacity,
                   static_cast<int32_t>(threadIdx.x), static_cast<int32_t>(blockDim.x));
}

#endif  // __CUDACC__

}  // namespace

#ifdef __CUDACC__

extern "C" int graphdecode_advance_step(const int64_t* sampled, const bool* done, const int32_t* block_table,
                                        int64_t table_stride, int64_t* input_ids, int64_t* positions,
                                        int32_t* seq_lens, int64_t* slot_mapping, int32_t* kv_indptr,
                                        int32_t* kv_indices, int32_t* kv_last_page_len, int num_rows,
                                        int max_pages, int page_size, int advance, cudaStream_t stream) {
  if (!valid_arguments(num_rows, max_pages, page_size, table_stride) || num_rows > kMaxRows) {
    return cudaErrorInvalidValue;  // checked before any CUDA call: safe to probe without a GPU
  }
  advance_rows_kernel<<<1, kMaxRows, 0, stream>>>(sampled, done, block_table, table_stride, input_ids, positions,
                                                   seq_lens, slot_mapping, kv_indptr, kv_last_page_len, num_rows,
                                                   max_pages, page_size, advance);
  const int64_t capacity = static_cast<int64_t>(num_rows) * max_pages;
  fill_indices_kernel<<<num_rows, kIndexThreads, 0, stream>>>(done, block_table, table_stride, kv_indptr,
                                                              kv_indices, max_pages, capacity);
  return static_cast<int>(cudaGetLastError());
}

#endif  // __CUDACC__

// The same step on host memory, serially: the device kernels' per-row functions called from a loop
// (rows, then the exclusive scan, then each row's indices). Makes no CUDA call, so it runs on a
// machine without a driver, from the nvcc library or a g++ build of this file. No row limit.
// Returns 0, or kInvalidValue (1, cudaErrorInvalidValue) for bad sizes, before touching any pointer.
extern "C" int graphdecode_advance_step_host(const int64_t* sampled, const bool* done, const int32_t* block_table,
                                             int64_t table_stride, int64_t* input_ids, int64_t* positions,
                                             int32_t* seq_lens, int64_t* slot_mapping, int32_t* kv_indptr,
                                             int32_t* kv_indices, int32_t* kv_last_page_len, int num_rows,
                                             int max_pages, int page_size, int advance) {
  if (!valid_arguments(num_rows, max_pages, page_size, table_stride)) return kInvalidValue;
  int32_t start = 0;
  kv_indptr[0] = 0;
  for (int row = 0; row < num_rows; ++row) {
    start += advance_row(row, sampled, done, block_table, table_stride, input_ids, positions, seq_lens,
                         slot_mapping, kv_last_page_len, max_pages, page_size, advance);
    kv_indptr[row + 1] = start;
  }
  const int64_t capacity = static_cast<int64_t>(num_rows) * max_pages;
  for (int row = 0; row < num_rows; ++row) {
    const int32_t begin = kv_indptr[row];
    fill_row_indices(row, done, block_table, table_stride, begin, kv_indptr[row + 1] - begin, kv_indices,
                     max_pages, capacity, 0, 1);
  }
  return 0;
}

extern "C" int graphdecode_kernels_abi_version() { return 2; }
