// Paged attention on the CPU, reading the KV pages in place (no per-step gather).
//
// Plain C++17 with an extern "C" ABI (raw pointers, no torch headers), built at first use by
// graphdecode/attention/cpu_kernels.py with the system C++ compiler for this machine
// (-O3 -march=native) and called through ctypes / the graphdecode::cpu_paged_attention op.
//
// One call attends Q queries per row for B rows: query j of row b sits at position
// positions[b, j] (or, given seq_lens instead, Q = 1 at seq_lens[b] - 1: a decode step
// after its own K/V is written) and sees the keys at positions [start, pos] of that row, where start is
// max(0, pos - window_left) (window_left < 0: 0), read through the row's block table from
// the cache [num_pages, 2, P, H_kv, D] (NHD, K then V per page). Decode is Q = 1 at the
// row's current position; speculative verify is Q = d + 1 consecutive positions; a prefill
// chunk is Q = its tokens. The variants are parameters, as the model families need them:
//   scale       scores = q.k * scale
//   soft_cap    > 0: scores = soft_cap * tanh(scores / soft_cap) (Gemma 2)
//   sinks       [H] float or null: a learned logit per query head in the softmax's
//               denominator, attending nothing (gpt-oss)
//   window_left >= 0: a sliding window of window_left + 1 keys ending at the query
// Arithmetic is float32 (scores, softmax, accumulation); q/out are float32 or bf16, K/V the same or FP8 E4M3
// (an FP8 cache's K / V scales folded into the query's scale and the output's; a bf16 or FP8 block of keys is
// widened to float32 once, into scratch, for every query head).
// Decode (Q = 1) goes over a row's keys once, in blocks, with an online softmax and the next block
// prefetched under the arithmetic (attend_decode_row); Q > 1 computes its scores once, a softmax per
// query, then one pass over V (attend_row), each query's arithmetic fixed by its own keys alone (lanes at
// absolute key positions), so a prefill chunk's or a verify's other queries never change its bits.
// Either way K and V are read once per call, straight from the pages, a key's KV heads together. Reductions (dots,
// softmax's max and sum) run in 16 vector lanes summed by a fixed tree (cpu_common.h's f32x16,
// the reductions below), and decode's output accumulates in registers (pv_group): 2-3x the
// earlier scalar-reduction loops at batch 1-64 (BENCHMARKS.md section 12c).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

#define GRAPHDECODE_CPU_ABI_VERSION 25  // 2: cpu_fused.cpp's kernels in the same library; 3: cpu_linear.cpp's; 4: its threads; 5: attention's; 6: the fused passes'; 7: write_kv; 8: bf16 panels; 9: prefill attention; 10: decoder layers; 11: their SAVE word; 12: quantized panels; 13: quantized projections in the decoder layers; 14: FP8 E4M3 KV caches; 15: the quantized panels' integer dot products; 16: the delta rule's decode step; 17: bf16 pair panels; 18: their AMX form; 19: swiglu; 20: the gated projection's one pass; 21: a projection plus its residual; 22: rows of packed panels; 23: the decoder layers' IN words; 24: Gumbel-max sampling; 25: the SAVE_LD word

namespace {

constexpr int64_t MAX_GENERIC_DIM = 1024;  // the widest head the decode kernel takes (kernels/cpu.py MAX_HEAD_DIM)

using namespace graphdecode_cpu;

// Reductions in LANES independent partial sums combined by a fixed tree, written with GCC /
// Clang vector types (SSE, AVX2 or AVX-512, whatever -march=native gives): a plain
// `omp simd reduction` over floats is folded left to right by GCC 12, one dependent add per
// element (16 serial adds for one 32-wide dot), and a tree over a stack array stalls on
// store forwarding. The order is the same on every call (cpu_common.h's tree_sum / tree_max).
constexpr int64_t LANES = 16;  // f32x16 (cpu_common.h)
constexpr int64_t AHEAD = 8;   // keys ahead whose K / V rows decode prefetches
// q . k over n floats (DIM > 0: n == DIM, known at compile time)
template <int DIM>
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t D = DIM > 0 ? DIM : n, full = D - D % LANES;
  f32x16 part = {};
  for (int64_t d0 = 0; d0 < full; d0 += LANES) part += load16(a + d0) * load16(b + d0);
  float tail = 0.f;
  for (int64_t d = full; d < D; ++d) tail += a[d] * b[d];
  return tree_sum(part) + tail;
}

// pv_group's columns past the last whole vector, one at a time
template <int NG>
void pv_tail(const float* const* p, const float* const* rows, int64_t offset, int64_t lo, int64_t hi,
             float* const* o, int64_t full, int64_t D) {
  for (int64_t d = full; d < D; ++d)
    for (int g = 0; g < NG; ++g) {
      float acc = 0.f;
      for (int64_t t = lo; t <= hi; ++t) acc += p[g][t] * rows[t][offset + d];
      o[g][d] = acc;
    }
}

// The output of a KV head's few queries (decode: its G query heads): o[g][0:D] = sum over
// t in [lo, hi] of p[g][t] * rows[t][offset : offset + D] (p is 0 where query g does not see
// key t). 32 floats of D at a time are held in registers for all NG queries, so each V row is
// read once; with fewer than four queries, KEYS keys at a time go to separate accumulators
// (added in a fixed order at the end) to keep the FMA pipes busy.
#if defined(__AVX512F__)
template <int NG>
void pv_group(const float* const* p, const float* const* rows, int64_t offset, int64_t lo, int64_t hi,
              float* const* o, int64_t D) {
  constexpr int KEYS = NG >= 4 ? 1 : (NG >= 2 ? 2 : 4);
  const int64_t full = D - D % LANES;
  for (int64_t c0 = 0; c0 < full; c0 += 2 * LANES) {
    const bool two = c0 + LANES < full;
    f32x16 acc[KEYS][NG][2] = {};
    int64_t t = lo;
    for (; t + KEYS - 1 <= hi; t += KEYS)
      for (int k = 0; k < KEYS; ++k) {
        if (t + k + AHEAD <= hi) {  // this chunk of a V row AHEAD keys on (its page may be anywhere)
          __builtin_prefetch(rows[t + k + AHEAD] + offset + c0, 0, 3);
          __builtin_prefetch(rows[t + k + AHEAD] + offset + c0 + LANES, 0, 3);
        }
        const float* v = rows[t + k] + offset + c0;
        const f32x16 v0 = load16(v), v1 = two ? load16(v + LANES) : f32x16{};
        for (int g = 0; g < NG; ++g) {
          const float pg = p[g][t + k];
          acc[k][g][0] += pg * v0;
          acc[k][g][1] += pg * v1;
        }
      }
    for (; t <= hi; ++t) {
      const float* v = rows[t] + offset + c0;
      const f32x16 v0 = load16(v), v1 = two ? load16(v + LANES) : f32x16{};
      for (int g = 0; g < NG; ++g) {
        acc[0][g][0] += p[g][t] * v0;
        acc[0][g][1] += p[g][t] * v1;
      }
    }
    for (int g = 0; g < NG; ++g) {
      f32x16 r0 = acc[0][g][0], r1 = acc[0][g][1];
      for (int k = 1; k < KEYS; ++k) {
        r0 += acc[k][g][0];
        r1 += acc[k][g][1];
      }
      store16(o[g] + c0, r0);
      if (two) store16(o[g] + c0 + LANES, r1);
    }
  }
  pv_tail<NG>(p, rows, offset, lo, hi, o, full, D);
}
#else
// The same sums with 8-float vectors (AVX2: GCC lowers the 16-float type through memory there, and 2 x 16 floats
// for NG queries and KEYS keys spilled): 16 floats of D at a time, each element summed as above (per key slot,
// then the slots in the same order), the FMAs written out.
template <int NG>
void pv_group(const float* const* p, const float* const* rows, int64_t offset, int64_t lo, int64_t hi,
              float* const* o, int64_t D) {
  constexpr int KEYS = NG >= 4 ? 1 : (NG >= 2 ? 2 : 4);
  const int64_t full = D - D % LANES;
  for (int64_t c0 = 0; c0 < full; c0 += LANES) {
    f32x8 acc[KEYS][NG][2] = {};
    int64_t t = lo;
    for (; t + KEYS - 1 <= hi; t += KEYS)
      for (int k = 0; k < KEYS; ++k) {
        if (t + k + AHEAD <= hi) __builtin_prefetch(rows[t + k + AHEAD] + offset + c0, 0, 3);
        const float* v = rows[t + k] + offset + c0;
        const f32x8 v0 = load8(v), v1 = load8(v + 8);
        for (int g = 0; g < NG; ++g) {
          const f32x8 pg = splat8(p[g][t + k]);
          acc[k][g][0] = fma8(pg, v0, acc[k][g][0]);
          acc[k][g][1] = fma8(pg, v1, acc[k][g][1]);
        }
      }
    for (; t <= hi; ++t) {
      const float* v = rows[t] + offset + c0;
      const f32x8 v0 = load8(v), v1 = load8(v + 8);
      for (int g = 0; g < NG; ++g) {
        const f32x8 pg = splat8(p[g][t]);
        acc[0][g][0] = fma8(pg, v0, acc[0][g][0]);
        acc[0][g][1] = fma8(pg, v1, acc[0][g][1]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      f32x8 r0 = acc[0][g][0], r1 = acc[0][g][1];
      for (int k = 1; k < KEYS; ++k) {
        r0 += acc[k][g][0];
        r1 += acc[k][g][1];
      }
      store8(o[g] + c0, r0);
      store8(o[g] + c0 + 8, r1);
    }
  }
  pv_tail<NG>(p, rows, offset, lo, hi, o, full, D);
}
#endif

struct Args {
  const void* q;
  const void* kv;
  const int32_t* block_table;
  const int64_t* positions;
  const int32_t* seq_lens;
  void* out;
  int64_t rows, queries, heads, kv_heads, head_dim, page_size, width, num_pages, bt_stride;
  float scale;
  int64_t window_left;
  float soft_cap;
  const float* sinks;
  float out_scale;  // the output's factor: an FP8 cache's V scale (1 otherwise)
};

// Per-call scratch, grown as needed and reused row after row: the visible key range of each
// query, the scaled queries, each key's K and V rows (all KV heads; bf16 converted once),
// the scores and the output accumulators.
struct Scratch {
  std::vector<int64_t> lo, hi;
  std::vector<float> q, keys, values, scores, acc;
  std::vector<float> block_out, state;  // the one-pass decode form's (attend_decode_row)
  std::vector<const float*> k_rows, v_rows;
};

// One row b, every head: keys are visited in position order and each key's K (then V) row of
// all KV heads is read once, contiguously, for all the row's queries (the page layout holds a
// token's KV heads side by side). DIM > 0: head_dim known at compile time (32, 64, 80, 96,
// 128, 256), so the per-query loops unroll; DIM == 0: any head_dim up to MAX_GENERIC_DIM (1024: an MLA latent, 576).
template <typename T, typename KV, int DIM>
void attend_row(const Args& a, int64_t b, Scratch& w) {
  const int64_t D = DIM > 0 ? DIM : a.head_dim;
  const int64_t P = a.page_size, H = a.heads, HKV = a.kv_heads, G = H / HKV, Q = a.queries, NQ = Q * H;
  const int64_t max_keys = a.width * P;
  const T* q = static_cast<const T*>(a.q);
  const KV* kv = static_cast<const KV*>(a.kv);
  T* out = static_cast<T*>(a.out);
  const int64_t token_stride = HKV * D, page_stride = 2 * P * token_stride, v_offset = P * token_stride;

  int64_t first = max_keys, last = -1;
  for (int64_t j = 0; j < Q; ++j) {
    const int64_t at = a.positions ? a.positions[b * Q + j] : int64_t(a.seq_lens[b]) - 1;
    const int64_t pos = std::min<int64_t>(std::max<int64_t>(at, 0), max_keys - 1);
    w.lo[j] = a.window_left >= 0 ? std::max<int64_t>(0, pos - a.window_left) : 0;
    w.hi[j] = pos;
    first = std::min(first, w.lo[j]);
    last = std::max(last, pos);
  }
  const int64_t span = last - first + 1;
  // query n = j * H + head (head = kv_head * G + g), scaled, as float32
  for (int64_t n = 0; n < NQ; ++n) {
    const T* src = q + (b * NQ + n) * D;
    float* dst = w.q.data() + n * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = load(src + d) * a.scale;
  }
  // each key's K and V rows of all KV heads: straight from the page (float32) or converted once (bf16, FP8)
  w.k_rows.resize(span);
  w.v_rows.resize(span);
  if (!std::is_same<KV, float>::value) {
    w.keys.resize(span * token_stride);
    w.values.resize(span * token_stride);
  }
  for (int64_t t = 0; t < span; ++t) {
    const int64_t pos = first + t;
    int64_t page = a.block_table[b * a.bt_stride + pos / P];
    if (page < 0 || page >= a.num_pages) page = 0;  // a stale or bad entry reads the scratch page
    const KV* k = kv + page * page_stride + (pos % P) * token_stride;
    const KV* v = k + v_offset;
    if (std::is_same<KV, float>::value) {
      w.k_rows[t] = reinterpret_cast<const float*>(k);
      w.v_rows[t] = reinterpret_cast<const float*>(v);
    } else {
      float* kf = w.keys.data() + t * token_stride;
      float* vf = w.values.data() + t * token_stride;
      widen(k, kf, token_stride);
      widen(v, vf, token_stride);
      w.k_rows[t] = kf;
      w.v_rows[t] = vf;
    }
  }
  // Every query's arithmetic is fixed by its own keys, whatever the other queries of the call (a prefill
  // chunk's, a verify's): its dots over d in order, its softmax's 16 lanes at absolute key positions mod 16
  // (the scores sit at pre + t, pre = first % 16, the span padded with -inf to whole groups: a hidden key's
  // exp is an exact 0, which no sum or max feels), and its output key by key in position order.
  // raw dots [NQ, span_a]: TILE keys at a time, transposed once into a tile, each query's TILE dots D
  // broadcast multiply-adds across it.
  constexpr int64_t TILE = 16;
  const int64_t pre = first % LANES, span_a = (pre + span + LANES - 1) / LANES * LANES;
  w.scores.resize(NQ * span_a);
  {
    float tile[(DIM > 0 ? DIM : MAX_GENERIC_DIM) * TILE];
    for (int64_t h = 0; h < HKV; ++h)
      for (int64_t t0 = 0; t0 < span; t0 += TILE) {
        const int64_t keys = std::min<int64_t>(TILE, span - t0);
        for (int64_t i = 0; i < TILE; ++i) {
          const float* k = i < keys ? w.k_rows[t0 + i] + h * D : nullptr;
          for (int64_t d = 0; d < D; ++d) tile[d * TILE + i] = k ? k[d] : 0.f;
        }
        for (int64_t j = 0; j < Q; ++j)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t n = j * H + h * G + g;
            const float* qv = w.q.data() + n * D;
            float dots[TILE] = {};
            for (int64_t d = 0; d < D; ++d) {
              const float qd = qv[d];
              const float* row = tile + d * TILE;
#pragma omp simd
              for (int64_t i = 0; i < TILE; ++i) dots[i] += qd * row[i];
            }
            float* s = w.scores.data() + n * span_a + pre + t0;
            for (int64_t i = 0; i < keys; ++i) s[i] = dots[i];
          }
      }
  }
  // per query: hide what it does not see, soft-cap, softmax (its head's sink in the denominator)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t n = 0; n < NQ; ++n) {
    const int64_t j = n / H, head = n % H;
    float* s = w.scores.data() + n * span_a;
    const int64_t lo = pre + w.lo[j] - first, hi = pre + w.hi[j] - first;  // this query's keys: [lo, hi]
    std::fill(s, s + lo, neg_inf);
    std::fill(s + hi + 1, s + span_a, neg_inf);
    if (a.soft_cap > 0.f)
      for (int64_t t = lo; t <= hi; ++t) s[t] = a.soft_cap * std::tanh(s[t] / a.soft_cap);
    const float sink = a.sinks ? a.sinks[head] : neg_inf;
    f32x16 part = sink - f32x16{};  // every lane the sink (-inf without); the hidden keys are -inf already
    for (int64_t t0 = 0; t0 < span_a; t0 += LANES) part = max16(part, load16(s + t0));
    const float peak = tree_max(part);
    for (int64_t t0 = 0; t0 < span_a; t0 += LANES) store16(s + t0, exp16(load16(s + t0) - peak));
    part = f32x16{};
    for (int64_t t0 = 0; t0 < span_a; t0 += LANES) part += load16(s + t0);
    float total = tree_sum(part);
    if (a.sinks) total += exp1(sink - peak);
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < span_a; ++t) s[t] *= inv;
  }
  // out = probs @ V, key by key in position order, each key's V rows read once for every query
  w.acc.resize(NQ * D);
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for (int64_t t = 0; t < span; ++t)
    for (int64_t h = 0; h < HKV; ++h) {
      const float* v = w.v_rows[t] + h * D;
      for (int64_t j = 0; j < Q; ++j)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t n = j * H + h * G + g;
          const float p = w.scores[n * span_a + pre + t];
          if (p == 0.f) continue;
          float* o = w.acc.data() + n * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
        }
    }
  for (int64_t n = 0; n < NQ; ++n) {
    T* dst = out + (b * NQ + n) * D;
    const float* src = w.acc.data() + n * D;
    for (int64_t d = 0; d < D; ++d) store(dst + d, src[d] * a.out_scale);
  }
}

// A decode row (one query per head) in one pass over its keys, in blocks of up to BLOCK keys (never
// across a page) in position order: the block's scores, an online softmax (each head's running
// maximum and denominator, its accumulator rescaled when the maximum rises), P @ V through
// pv_group. The next block's K and V rows are prefetched a few lines at a time while this block is
// computed, so the loads stream under the arithmetic (the two-pass form above, and a burst of
// prefetches per block, waited for memory instead: 18 GB/s of the box's 30 at batch 64).
constexpr int64_t BLOCK = 16;
static_assert(BLOCK == LANES, "sums16 reduces one f32x16 per key of a block");

// The 16 sums of 16 vectors' lanes, sum i in lane i, by a fixed tree of pairwise shuffles and adds
// (45 instructions for what 16 tree_sums do in about 110)
inline f32x16 sums16(const f32x16* v) {
  f32x16 u[8], w4[4], x[2];
  for (int j = 0; j < 8; ++j)
    u[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  for (int k = 0; k < 4; ++k)
    w4[k] = __builtin_shufflevector(u[2 * k], u[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(u[2 * k], u[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int m = 0; m < 2; ++m)
    x[m] = __builtin_shufflevector(w4[2 * m], w4[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(w4[2 * m], w4[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Prefetches (into L2) two contiguous ranges of `bytes`, a block's K rows and its V rows, `slice` bytes of
// each per call
struct Prefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0, slice = 0, done = 0;
  void step() {
    const int64_t end = std::min(bytes, done + slice);
    for (int64_t at = done; at < end; at += 64) {
      __builtin_prefetch(k + at, 0, 2);
      __builtin_prefetch(v + at, 0, 2);
    }
    done = end;
  }
};

template <typename T, typename KV, int DIM>
void attend_decode_row(const Args& a, int64_t b, Scratch& w) {
  const int64_t D = DIM > 0 ? DIM : a.head_dim;
  const int64_t P = a.page_size, H = a.heads, HKV = a.kv_heads, G = H / HKV;
  const int64_t max_keys = a.width * P;
  const T* q = static_cast<const T*>(a.q);
  const KV* kv = static_cast<const KV*>(a.kv);
  T* out = static_cast<T*>(a.out);
  const int64_t token_stride = HKV * D, page_stride = 2 * P * token_stride, v_offset = P * token_stride;
  const int64_t row_bytes = token_stride * int64_t(sizeof(KV));
  const int64_t at = a.positions ? a.positions[b] : int64_t(a.seq_lens[b]) - 1;
  const int64_t hi = std::min<int64_t>(std::max<int64_t>(at, 0), max_keys - 1);
  const int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, hi - a.window_left) : 0;
  for (int64_t n = 0; n < H; ++n) {
    const T* src = q + (b * H + n) * D;
    float* dst = w.q.data() + n * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = load(src + d) * a.scale;
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  w.scores.resize(H * BLOCK);
  w.acc.assign(H * D, 0.f);
  w.block_out.resize(H * D);  // one block's P @ V before it joins acc
  // per head: running maximum, then denominator (a sink starts them: exp(sink - sink) = 1)
  w.state.resize(2 * H);
  float* peak = w.state.data();
  float* denom = peak + H;
  for (int64_t n = 0; n < H; ++n) {
    peak[n] = a.sinks ? a.sinks[n] : neg_inf;
    denom[n] = a.sinks ? 1.f : 0.f;
  }
  auto block_at = [&](int64_t t0, int64_t& keys) {  // block from t0: its first K row and its key count
    int64_t page = a.block_table[b * a.bt_stride + t0 / P];
    if (page < 0 || page >= a.num_pages) page = 0;  // a stale or bad entry reads the scratch page
    keys = std::min({hi, t0 + BLOCK - 1, (t0 / P + 1) * P - 1}) - t0 + 1;
    return kv + page * page_stride + (t0 % P) * token_stride;
  };
  int64_t keys = 0;
  const KV* k = block_at(lo, keys);
  Prefetcher first{reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(k + v_offset), keys * row_bytes,
                   keys * row_bytes};
  first.step();
  // a block's K / V rows as float32: read in place from a float32 cache; widened once per block from a bf16 or FP8
  // one (into the scratch), not once per query head
  constexpr bool widened = !std::is_same<KV, float>::value;
  if (widened) {
    w.keys.resize(BLOCK * token_stride);
    w.values.resize(BLOCK * token_stride);
  }
  const float* kr[BLOCK];
  const float* vr[BLOCK];
  const float* p[8];
  float* o[8];
  for (int64_t t0 = lo; t0 <= hi; t0 += keys, k = t0 <= hi ? block_at(t0, keys) : k) {
    Prefetcher next;
    if (t0 + keys <= hi) {
      int64_t next_keys = 0;
      const KV* nk = block_at(t0 + keys, next_keys);
      const int64_t bytes = next_keys * row_bytes;  // a slice while each head's scores run, in whole lines
      next = {reinterpret_cast<const char*>(nk), reinterpret_cast<const char*>(nk + v_offset), bytes,
              (bytes / 64 + H - 1) / H * 64};
    }
    for (int64_t i = 0; i < keys; ++i) {  // K / V rows read in place (bf16, FP8 widened as they are loaded)
      const KV* kk = k + i * token_stride;
      const KV* vv = kk + v_offset;
      if constexpr (widened) {
        float* kf = w.keys.data() + i * token_stride;
        float* vf = w.values.data() + i * token_stride;
        widen(kk, kf, token_stride);
        widen(vv, vf, token_stride);
        kr[i] = kf;
        vr[i] = vf;
      } else {
        kr[i] = reinterpret_cast<const float*>(kk);
        vr[i] = reinterpret_cast<const float*>(vv);
      }
    }
    // each head's scores over the block, its online softmax step: the new maximum, the old terms
    // rescaled, this block's probabilities (keys past the block: -inf, probability 0)
    for (int64_t n = 0; n < H; ++n) {
      next.step();
      const float* qv = w.q.data() + n * D;
      const float* kh[BLOCK];  // past the block's keys: its first key again, the score discarded
      for (int64_t i = 0; i < BLOCK; ++i) kh[i] = kr[i < keys ? i : 0] + n / G * D;
      float* s = w.scores.data() + n * BLOCK;
      if (D % LANES == 0) {  // 16 keys' partial dots side by side in registers, then their 16 sums at once
        f32x16 part[BLOCK] = {};
        for (int64_t d0 = 0; d0 < D; d0 += LANES) {
          const f32x16 qd = load16(qv + d0);
          for (int64_t i = 0; i < BLOCK; ++i) part[i] += qd * load16(kh[i] + d0);
        }
        store16(s, sums16(part));
      } else {
        for (int64_t i = 0; i < keys; ++i) s[i] = dot<DIM>(qv, kh[i], D);
      }
      if (a.soft_cap > 0.f)
        for (int64_t i = 0; i < keys; ++i) s[i] = a.soft_cap * std::tanh(s[i] / a.soft_cap);
      for (int64_t i = keys; i < BLOCK; ++i) s[i] = neg_inf;
      const f32x16 sv = load16(s);
      const float top = std::max(peak[n], tree_max(sv));
      const float alpha = top > peak[n] ? exp1(peak[n] - top) : 1.f;
      const f32x16 pv = exp16(sv - top);
      store16(s, pv);
      denom[n] = denom[n] * alpha + tree_sum(pv);
      peak[n] = top;
      if (alpha != 1.f) {
        float* acc = w.acc.data() + n * D;
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
      }
    }
    // P @ V of this block, up to 7 queries of a KV head at a time, then added to the accumulators
    for (int64_t h = 0; h < HKV; ++h)
      for (int64_t g0 = 0; g0 < G; g0 += 7) {
        const int64_t ng = std::min<int64_t>(7, G - g0);
        for (int64_t g = 0; g < ng; ++g) {
          p[g] = w.scores.data() + (h * G + g0 + g) * BLOCK;
          o[g] = w.block_out.data() + (h * G + g0 + g) * D;
        }
        switch (ng) {
          case 1: pv_group<1>(p, vr, h * D, 0, keys - 1, o, D); break;
          case 2: pv_group<2>(p, vr, h * D, 0, keys - 1, o, D); break;
          case 3: pv_group<3>(p, vr, h * D, 0, keys - 1, o, D); break;
          case 4: pv_group<4>(p, vr, h * D, 0, keys - 1, o, D); break;
          case 5: pv_group<5>(p, vr, h * D, 0, keys - 1, o, D); break;
          case 6: pv_group<6>(p, vr, h * D, 0, keys - 1, o, D); break;
          default: pv_group<7>(p, vr, h * D, 0, keys - 1, o, D); break;
        }
      }
    for (int64_t e = 0; e < H * D; ++e) w.acc[e] += w.block_out[e];
  }
  for (int64_t n = 0; n < H; ++n) {
    T* dst = out + (b * H + n) * D;
    const float* src = w.acc.data() + n * D;
    const float inv = a.out_scale / denom[n];
    for (int64_t d = 0; d < D; ++d) store(dst + d, src[d] * inv);
  }
}

// Rows are independent: on `threads` OpenMP threads (torch's pool) each thread takes whole rows
// with a scratch of its own, so a row's result does not depend on the thread count. Rows differ
// in length, so they are handed out one at a time.
template <typename T, typename KV, int DIM>
void attend(const Args& a, int32_t threads) {
#pragma omp parallel num_threads(threads) if (threads > 1 && a.rows > 1)
  {
    Scratch w;
    w.lo.resize(a.queries);
    w.hi.resize(a.queries);
    w.q.resize(a.queries * a.heads * a.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < a.rows; ++b) {
      if (a.queries == 1)
        attend_decode_row<T, KV, DIM>(a, b, w);
      else
        attend_row<T, KV, DIM>(a, b, w);
    }
  }
}

template <typename T, typename KV>
void attend_any(const Args& a, int32_t threads) {
  switch (a.head_dim) {  // the common head sizes unrolled; any other through the generic loop
    case 32: return attend<T, KV, 32>(a, threads);
    case 64: return attend<T, KV, 64>(a, threads);
    case 80: return attend<T, KV, 80>(a, threads);
    case 96: return attend<T, KV, 96>(a, threads);
    case 128: return attend<T, KV, 128>(a, threads);
    case 256: return attend<T, KV, 256>(a, threads);
    default: return attend<T, KV, 0>(a, threads);
  }
}

}  // namespace

extern "C" {

int graphdecode_cpu_abi_version() { return GRAPHDECODE_CPU_ABI_VERSION; }

// q [rows, queries, heads, head_dim] and out (same shape) contiguous, of `dtype`; kv of `kv_dtype` (dtype's, or
// FP8 E4M3 holding K / k_scale and V / v_scale: pass scale * k_scale and out_scale = v_scale; 1 otherwise);
// block_table [rows, >= width] with row stride bt_stride; positions [rows, queries] int64, or null and seq_lens
// [rows] int32 with queries == 1; threads: OpenMP threads over the rows (>= 1). Returns 0, or 1 for arguments it
// cannot take (nothing is written then).
int graphdecode_cpu_paged_attention(const void* q, const void* kv, const int32_t* block_table, int64_t bt_stride,
                                    const int64_t* positions, const int32_t* seq_lens, void* out, int64_t rows,
                                    int64_t queries, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    int64_t page_size, int64_t width, int64_t num_pages, float scale,
                                    int64_t window_left, float soft_cap, const float* sinks, int32_t dtype,
                                    int32_t kv_dtype, float out_scale, int32_t threads) {
  if (!q || !kv || !block_table || !out || (!positions && (!seq_lens || queries != 1)) || rows < 0 ||
      queries < 1 || kv_heads < 1 ||
      heads < kv_heads || heads % kv_heads != 0 || head_dim < 1 || head_dim > MAX_GENERIC_DIM || page_size < 1 ||
      width < 1 || num_pages < 1 || bt_stride < width || !(scale > 0.f) || soft_cap < 0.f || !(out_scale > 0.f) ||
      threads < 1 || (kv_dtype != dtype && kv_dtype != kFloat8E4M3))
    return 1;
  Args a{q, kv, block_table, positions, seq_lens, out, rows, queries, heads, kv_heads, head_dim, page_size,
         width, num_pages, bt_stride, scale, window_left, soft_cap, sinks, out_scale};
  const bool fp8 = kv_dtype == kFloat8E4M3;
  if (dtype == kFloat32) {
    fp8 ? attend_any<float, e4m3>(a, threads) : attend_any<float, float>(a, threads);
  } else if (dtype == kBFloat16) {
    fp8 ? attend_any<uint16_t, e4m3>(a, threads) : attend_any<uint16_t, uint16_t>(a, threads);
  } else {
    return 1;
  }
  return 0;
}

// This step's K and V into the cache, one call for what torch does in eight ops (the slots' pages and
// offsets, two indexed writes): kv [num_pages, 2, page_size, kv_heads, head_dim] contiguous, of kv_dtype; k, v
// [tokens, kv_heads, head_dim] of dtype with their heads contiguous and token strides k_stride / v_stride (in
// elements: the fused qkv projection's views); slots [tokens] int64 (page * page_size + offset). kv_dtype is
// dtype (copied as they are) or FP8 E4M3 (stored as k * k_mul, v * v_mul: the reciprocals of the layer's
// scales, rounded to nearest even, saturated at +-448). Returns 1, writing nothing, when a slot is outside the
// cache or an argument is bad.
int graphdecode_cpu_write_kv(void* kv, const void* k, const void* v, const int64_t* slots, int64_t tokens,
                             int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride,
                             int64_t page_size, int64_t num_pages, int32_t dtype, int32_t kv_dtype, float k_mul,
                             float v_mul) {
  const int64_t elem = dtype == kFloat32 ? 4 : dtype == kBFloat16 ? 2 : 0;
  const bool fp8 = kv_dtype == kFloat8E4M3;
  const int64_t row = kv_heads * head_dim;
  if (!kv || tokens < 0 || (tokens > 0 && (!k || !v || !slots)) || elem == 0 || kv_heads < 1 || head_dim < 1 ||
      k_stride < row || v_stride < row || page_size < 1 || num_pages < 1 || (kv_dtype != dtype && !fp8) ||
      !(k_mul > 0.f) || !(v_mul > 0.f))
    return 1;
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] >= num_pages * page_size) return 1;
  if (fp8) {
    e4m3* cache = static_cast<e4m3*>(kv);
    auto put = [&](e4m3* dst, const void* src, float mul) {
      if (dtype == kFloat32)
        for (int64_t i = 0; i < row; ++i) store(dst + i, static_cast<const float*>(src)[i] * mul);
      else
        for (int64_t i = 0; i < row; ++i) store(dst + i, load(static_cast<const uint16_t*>(src) + i) * mul);
    };
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t page = slots[t] / page_size, offset = slots[t] % page_size;
      put(cache + ((page * 2 + 0) * page_size + offset) * row, static_cast<const char*>(k) + t * k_stride * elem,
          k_mul);
      put(cache + ((page * 2 + 1) * page_size + offset) * row, static_cast<const char*>(v) + t * v_stride * elem,
          v_mul);
    }
    return 0;
  }
  char* cache = static_cast<char*>(kv);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t page = slots[t] / page_size, offset = slots[t] % page_size;
    std::memcpy(cache + ((page * 2 + 0) * page_size + offset) * row * elem,
                static_cast<const char*>(k) + t * k_stride * elem, row * elem);
    std::memcpy(cache + ((page * 2 + 1) * page_size + offset) * row * elem,
                static_cast<const char*>(v) + t * v_stride * elem, row * elem);
  }
  return 0;
}

}  // extern "C"
