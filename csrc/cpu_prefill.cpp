// Causal prefill attention on the CPU over the paged cache, as register-tiled GEMMs with an online
// softmax (flash attention's recurrence), reading K and V from the pages in place.
//
// A prefill chunk of a sequence attends its queries (positions kv_len - q_len .. kv_len - 1) over the
// keys 0 .. kv_len - 1 already in the cache (this chunk's K/V are written before the call): fresh
// prompts, later chunks of a chunked prefill and prefix-cache hits take the same path, with no gather.
//
// Work: a sequence's K is first packed per KV head into blocks of KEYS (64) keys transposed,
// [D][64] (16 KB at D = 64), once per call, so that the score tile is a GEMM whose inner loop reads
// 64 contiguous keys. A work item is (sequence, KV head, block of QBLK query positions) with the G
// query heads of the KV head stacked as its rows, so every K and V block it reads serves G heads.
// For each key block the item visits, tiles of MR (6) rows compute their 6 x 64 scores in 24 vector
// registers (per d: four loads of the packed keys, one broadcast a row), mask the block's edge
// (causal diagonal, sliding window), update each row's running max and sum (with AVX-512: softmax_lazy, scores
// in log2 units, the max moved only when a block passes it by more than 8, 2^t by exp2_probability), and add
// P @ V into the row's output: 6 rows x 64 of D in 24 registers, per key four loads of its V row (widened from bf16
// where the cache is bf16) and one broadcast of each row's probability. Arithmetic is float32, except
// bf16 on a CPU with avx512_bf16: both GEMMs as vdpbf16ps over K and V packed in pairs, the queries and
// each tile's probabilities taken as bf16 (as transformers' bf16 attention rounds them), sums float32, the
// probabilities by a short exp2 polynomial (the bf16 rounding after it dominates its error); and with AMX
// (D a multiple of 32), tiles of 16 rows whose two GEMMs run as tdpbf16ps over the same packing.
//
// Each row's result depends only on its own keys, visited in blocks aligned at absolute key
// positions in ascending order: the same whatever the thread count, the other rows of the batch,
// and how the prompt was split into chunks (a chunk after cached keys computes what the whole
// prompt computes for those queries). Items go over torch's OpenMP threads, largest first.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define GRAPHDECODE_PREFILL_LAZY 1
#else
#define GRAPHDECODE_PREFILL_LAZY 0
#endif
#if defined(__AVX512BF16__)
#define GRAPHDECODE_PREFILL_DP 1
#else
#define GRAPHDECODE_PREFILL_DP 0
#endif

#include "cpu_common.h"

namespace {

using namespace graphdecode_cpu;

constexpr int64_t KEYS = 64;  // keys per block
constexpr int64_t QBLK = 64;  // query positions per work item
constexpr int MR = 6;         // rows per register tile
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float LOG2E = 1.44269504088896341f, LN2 = 0.693147180559945309f;

#if defined(__AVX512F__)
// s[R][64] = q[R][D] @ kt[D][64]
template <int R>
void qk_tile(const float* __restrict q, int64_t D, const float* __restrict kt, float* __restrict s) {
  f32x16 acc[R][4] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* k = kt + d * KEYS;
    const f32x16 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      const float a = q[m * D + d];
      acc[m][0] += a * k0;
      acc[m][1] += a * k1;
      acc[m][2] += a * k2;
      acc[m][3] += a * k3;
    }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) store16(s + m * KEYS + 16 * v, acc[m][v]);
}

// o[R][c0 : c0 + 16 NV] = o * alpha + p[R][0:nk] @ V[0:nk][c0 : c0 + 16 NV]
template <int R, int NV, typename T>
void pv_tile(const float* __restrict p, const T* const* __restrict v, int64_t nk, int64_t c0, float* __restrict o,
             int64_t D, const float* __restrict alpha) {
  f32x16 acc[R][NV];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < NV; ++c) acc[m][c] = load16(o + m * D + c0 + 16 * c) * alpha[m];
  for (int64_t j = 0; j < nk; ++j) {
    const T* row = v[j] + c0;
    f32x16 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load16(row + 16 * c);
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      const float a = p[m * KEYS + j];
      for (int c = 0; c < NV; ++c) acc[m][c] += a * vv[c];
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < NV; ++c) store16(o + m * D + c0 + 16 * c, acc[m][c]);
}
#else
// The same two tiles where vectors are 8 floats and 16 registers (AVX2), in native 8-float vectors (GCC lowers
// the 16-float type through memory there): 16 keys (of D) at a time, 2R accumulators (12 at R = 6) instead of 8R;
// each sum still runs over d (keys) in ascending order: the same bits. (The 64-key form ran about 10x slower than
// SDPA on a Zen 3.)
template <int R>
void qk_tile(const float* __restrict q, int64_t D, const float* __restrict kt, float* __restrict s) {
  for (int v = 0; v < 4; ++v) {
    f32x8 acc[R][2] = {};
    for (int64_t d = 0; d < D; ++d) {
      const f32x8 k0 = load8(kt + d * KEYS + 16 * v), k1 = load8(kt + d * KEYS + 16 * v + 8);
#pragma GCC unroll 6
      for (int m = 0; m < R; ++m) {
        const f32x8 a = splat8(q[m * D + d]);
        acc[m][0] = fma8(a, k0, acc[m][0]);
        acc[m][1] = fma8(a, k1, acc[m][1]);
      }
    }
    for (int m = 0; m < R; ++m) {
      store8(s + m * KEYS + 16 * v, acc[m][0]);
      store8(s + m * KEYS + 16 * v + 8, acc[m][1]);
    }
  }
}

template <int R, int NV, typename T>
void pv_tile(const float* __restrict p, const T* const* __restrict v, int64_t nk, int64_t c0, float* __restrict o,
             int64_t D, const float* __restrict alpha) {
  for (int c = 0; c < NV; ++c) {
    float* oc = o + c0 + 16 * c;
    f32x8 acc[R][2];
    for (int m = 0; m < R; ++m) {
      acc[m][0] = load8(oc + m * D) * alpha[m];
      acc[m][1] = load8(oc + m * D + 8) * alpha[m];
    }
    for (int64_t j = 0; j < nk; ++j) {
      const f32x8 v0 = load8(v[j] + c0 + 16 * c), v1 = load8(v[j] + c0 + 16 * c + 8);
#pragma GCC unroll 6
      for (int m = 0; m < R; ++m) {
        const f32x8 a = splat8(p[m * KEYS + j]);
        acc[m][0] = fma8(a, v0, acc[m][0]);
        acc[m][1] = fma8(a, v1, acc[m][1]);
      }
    }
    for (int m = 0; m < R; ++m) {
      store8(oc + m * D, acc[m][0]);
      store8(oc + m * D + 8, acc[m][1]);
    }
  }
}
#endif

// f(std::integral_constant<int, R>) for a tile of R (1..MR) rows: the tile templates' row count at compile time
template <typename F>
void by_rows(int R, F&& f) {
  switch (R) {
    case 6: return f(std::integral_constant<int, 6>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}
static_assert(MR == 6, "by_rows covers 1..MR rows");

// f(c0, std::integral_constant<int, NV>) over D in chunks of up to 64 columns, NV vectors of 16 each
template <typename F>
void by_columns(int64_t D, F&& f) {
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    switch ((D - c0) >= 64 ? 4 : (D - c0) / 16) {
      case 4: f(c0, std::integral_constant<int, 4>{}); break;
      case 3: f(c0, std::integral_constant<int, 3>{}); break;
      case 2: f(c0, std::integral_constant<int, 2>{}); break;
      default: f(c0, std::integral_constant<int, 1>{}); break;
    }
  }
}

#if GRAPHDECODE_PREFILL_LAZY
// 2^t lane by lane for the probabilities, t <= LAZY (up to rounding): 2^n (vscalefps) times 2^f, f = t - n in
// [-1/2, 1/2] by a polynomial: for float32 probabilities Cephes' exp2f minimax of degree 6 (relative error under
// 2e-7, about exp16's), for probabilities rounded to bf16 next the degree-5 Taylor one (under 3e-6, far below
// that rounding); 0 below -126, -inf included
template <bool Precise>
inline __m512 exp2_probability(__m512 t) {
  const __m512 n = _mm512_mask_roundscale_ps(t, 0xffff, t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p;
  if constexpr (Precise) {
    p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  } else {
    p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_GE_OQ), p, n);
}
#endif

#if GRAPHDECODE_PREFILL_DP
// bf16 with avx512_bf16: both GEMMs as vdpbf16ps over pairs, two products per lane per instruction.
// s[R][64] = q[R][D] @ K^T (unscaled: the softmax scales), K packed as [D / 2][64][2] (pairs of d), q bf16
// rows of D
template <int R>
void qk_tile_dp(const uint16_t* __restrict q, int64_t D, const uint16_t* __restrict kp, float* __restrict s) {
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const uint16_t* k = kp + d * KEYS;
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k), k1 = (__m512bh)_mm512_loadu_si512(k + 32);
    const __m512bh k2 = (__m512bh)_mm512_loadu_si512(k + 64), k3 = (__m512bh)_mm512_loadu_si512(k + 96);
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      uint32_t pair;
      std::memcpy(&pair, q + m * D + d, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(pair));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, k0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, k1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, k2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, k3);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(s + m * KEYS + 16 * v, acc[m][v]);
}

// o[R][c0 : c0 + 16 NV] = o * alpha + p[R][0:64] @ V[0:64][c0 : ...], p bf16 rows of 64 (0 past the block's
// keys), V packed as [32][D][2] (pairs of keys)
template <int R, int NV>
void pv_tile_dp(const uint16_t* __restrict p, const uint16_t* __restrict vp, int64_t c0, float* __restrict o,
                int64_t D, const float* __restrict alpha) {
  __m512 acc[R][NV];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < NV; ++c)
      acc[m][c] = _mm512_mul_ps(_mm512_loadu_ps(o + m * D + c0 + 16 * c), _mm512_set1_ps(alpha[m]));
  for (int64_t j = 0; j < KEYS; j += 2) {
    const uint16_t* row = vp + (j * D + 2 * c0);
    __m512bh vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(row + 32 * c);
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      uint32_t pair;
      std::memcpy(&pair, p + m * KEYS + j, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(pair));
      for (int c = 0; c < NV; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], a, vv[c]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + m * D + c0 + 16 * c, acc[m][c]);
}

#endif

#if defined(GRAPHDECODE_AMX)
// bf16 on AMX (D a multiple of 32): tiles of 16 rows, both GEMMs as tdpbf16ps over the same packing as the dp
// kernels (cpu_common.h's amx_rows_times: tmm0-3 the sums of 64 columns, tmm4 the rows' 32 k, tmm5-7 the
// packed side's 16 pairs of 16 columns).
// s[16][64] = q[16][D] @ K^T (unscaled), K packed [D / 2][64][2]; q rows past the tile's own are zeros
inline void qk_tile_amx(const uint16_t* q, int64_t D, const uint16_t* kp, float* s) {
  amx_zero();
  for (int64_t d = 0; d < D; d += 32) amx_rows_times(q + d, D * 2, kp + d * KEYS, KEYS * 4);  // pair rows d / 2..
  amx_store(s, KEYS * 4);
}

// o[16][c0 : c0 + 16 NV] += p[16][0:64] @ V[0:64][c0 : ...] in place (o's rows D floats apart, 16 of them
// however many the tile holds: the buffer is padded), V packed [32][D][2] (pairs of keys): o's columns are the
// sums' tiles, loaded, accumulated and stored back
template <int NV>
void pv_tile_amx(const uint16_t* p, const uint16_t* vp, int64_t c0, float* o, int64_t D) {
  amx_load<NV>(o + c0, D * 4);
  for (int64_t j = 0; j < KEYS; j += 32)  // key pair rows j / 2 .. j / 2 + 15, each [D][2] from column c0
    amx_rows_times<NV>(p + j, KEYS * 2, vp + j * D + 2 * c0, D * 4);
  amx_store<NV>(o + c0, D * 4);
}
#endif

template <typename T, typename KV>
struct Args {
  const T* q;
  int64_t ldq;
  const KV* kv;
  const int32_t* block_table;
  int64_t bt_stride;
  T* out;
  int64_t ldo;
  const int64_t* q_starts;
  const int64_t* q_lens;
  const int64_t* kv_lens;
  int64_t seqs, heads, kv_heads, head_dim, page_size;
  float scale;
  int64_t window_left;
  const float* sinks;
  float out_scale;  // the output's factor: an FP8 cache's V scale (1 otherwise)
};

// A K / V element as bf16 bits (dp()'s packing): bf16 as it is, FP8 E4M3 widened (exact)
inline uint16_t bf16_bits(const uint16_t* p) { return *p; }
inline uint16_t bf16_bits(const e4m3* p) {
  uint16_t h;
  store(&h, load(p));
  return h;
}

struct Item {
  int64_t seq, head, q0, cost;  // cost: the key blocks it visits
};

template <typename T, typename KV>
class Prefill {
 public:
  explicit Prefill(const Args<T, KV>& a) : a_(a), G_(a.heads / a.kv_heads), D_(a.head_dim) {
    first_block_.resize(a.seqs);
    block_base_.resize(a.seqs + 1, 0);
    for (int64_t b = 0; b < a.seqs; ++b) {
      const int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, first_pos(b) - a.window_left) : 0;
      first_block_[b] = lo / KEYS;
      block_base_[b + 1] = block_base_[b] + (a.kv_lens[b] + KEYS - 1) / KEYS - first_block_[b];
    }
    const int64_t packed = block_base_[a.seqs] * a.kv_heads * D_ * KEYS;
    if (dp())
      kp_.assign(2 * packed, 0);  // K then V pairs
    else
      kt_.assign(packed, 0.f);
#if defined(GRAPHDECODE_AMX)
    amx_ = dp() && D_ % 32 == 0 && amx_ready();
#endif
  }

  void run(int32_t threads) {
    pack_keys(threads);
    std::vector<Item> items;
    for (int64_t b = 0; b < a_.seqs; ++b)
      for (int64_t q0 = 0; q0 < a_.q_lens[b]; q0 += QBLK) {
        const int64_t last = first_pos(b) + std::min(a_.q_lens[b], q0 + QBLK) - 1;
        for (int64_t h = 0; h < a_.kv_heads; ++h) items.push_back({b, h, q0, last / KEYS - block_lo(b, q0)});
      }
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
    const int64_t n = int64_t(items.size());
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1)
    {
      Scratch w;
#if defined(GRAPHDECODE_AMX)
      if (amx_) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i) attend(items[i], w);
#if defined(GRAPHDECODE_AMX)
      if (amx_) _tile_release();
#endif
    }
  }

 private:
  struct Scratch {
    std::vector<float> q, o, m, l, alpha, s;
    std::vector<const KV*> v;
    std::vector<uint16_t> q16, p16;  // dp(): the rows' bf16 queries (unscaled), a tile's bf16 probabilities
  };

  // bf16 on a CPU with avx512_bf16: both GEMMs by vdpbf16ps (qk_tile_dp, pv_tile_dp) over K and V packed in
  // pairs: the queries and the probabilities rounded to bf16 first, as transformers' bf16 attention rounds
  // them (its scores and probabilities are bf16 tensors), the sums float32
  static constexpr bool dp() { return GRAPHDECODE_PREFILL_DP && sizeof(T) == 2; }
  // AVX-512: softmax_lazy over scores in log2 units (the queries unscaled); else exp16 over the scaled queries'
  // scores
  static constexpr bool lazy() { return GRAPHDECODE_PREFILL_LAZY; }

  int64_t first_pos(int64_t b) const { return a_.kv_lens[b] - a_.q_lens[b]; }

#if GRAPHDECODE_PREFILL_LAZY
  // One row's block of 64 unscaled scores (-inf where masked) -> its probabilities p (float32: in place of the
  // scores; bf16 for dp()), with its running max m (log2 units: scale * log2(e) * score), its running sum l (16
  // lanes) and the factor alpha its output so far takes. The max moves lazily: while no score of the block is
  // more than LAZY above m, m stays (the probabilities up to 2^LAZY, alpha 1: no rescale of the output); past
  // it, m becomes the exact max. The sum is of the probabilities before any bf16 rounding, as transformers'
  // float32 softmax normalises them. Every step depends on this row's scores alone.
  template <typename P>
  static void softmax_lazy(const float* row, P* p, float unit, float& m, float* l, float& alpha) {
    constexpr float LAZY = 8.f;
    const __m512 u = _mm512_set1_ps(unit);
    __m512 t[4] = {};
    bool move = m == NEG_INF;
    if (!move) {
      const __m512 shift = _mm512_set1_ps(-m), lazy = _mm512_set1_ps(LAZY);
      __mmask16 over = 0;
      for (int v = 0; v < 4; ++v) {
        t[v] = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * v), u, shift);
        over |= _mm512_cmp_ps_mask(t[v], lazy, _CMP_GT_OQ);
      }
      move = over != 0;
    }
    alpha = 1.f;
    if (move) {
      const f32x16 mx = max16(max16(load16(row), load16(row + 16)), max16(load16(row + 32), load16(row + 48)));
      const float m_new = std::max(m, tree_max(mx) * unit);
      if (m_new == NEG_INF) {  // nothing seen yet: this block adds nothing either
        std::memset(p, 0, KEYS * sizeof(P));
        return;
      }
      alpha = m == NEG_INF ? 0.f : std::exp2(m - m_new);
      m = m_new;
      const __m512 shift = _mm512_set1_ps(-m);
      for (int v = 0; v < 4; ++v) t[v] = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * v), u, shift);
    }
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha));
    for (int v = 0; v < 4; ++v) {
      const __m512 e = exp2_probability<std::is_same_v<P, float>>(t[v]);
      if constexpr (std::is_same_v<P, float>)
        _mm512_storeu_ps(p + 16 * v, e);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * v), (__m256i)_mm512_cvtneps_pbh(e));
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(l, sum);
  }
#endif

  // the first key block the queries from q0 on may see
  int64_t block_lo(int64_t b, int64_t q0) const {
    if (a_.window_left < 0) return first_block_[b];
    return std::max<int64_t>(0, first_pos(b) + q0 - a_.window_left) / KEYS;
  }

  const KV* key_row(int64_t b, int64_t t, int64_t which) const {  // which: 0 K, 1 V
    const int64_t page = a_.block_table[b * a_.bt_stride + t / a_.page_size];
    return a_.kv + ((page * 2 + which) * a_.page_size + t % a_.page_size) * a_.kv_heads * D_;
  }

  // the packed blocks' index of KV head h's key block `block` of sequence b
  int64_t block_slot(int64_t b, int64_t block, int64_t h) const {
    return (block_base_[b] + block - first_block_[b]) * a_.kv_heads + h;
  }

  float* kt_block(int64_t b, int64_t block, int64_t h) { return kt_.data() + block_slot(b, block, h) * D_ * KEYS; }

  // dp(): block's K as [D / 2][64][2] (pairs of d), which 0; its V as [32][D][2] (pairs of keys), which 1
  uint16_t* packed_block(int64_t b, int64_t block, int64_t h, int64_t which) {
    const int64_t size = D_ * KEYS;
    return kp_.data() + (which * block_base_[a_.seqs] * a_.kv_heads + block_slot(b, block, h)) * size;
  }

  void pack_keys(int32_t threads) {
    const int64_t blocks = block_base_[a_.seqs];
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t b = std::upper_bound(block_base_.begin(), block_base_.end(), i) - block_base_.begin() - 1;
      const int64_t block = first_block_[b] + i - block_base_[b];
      const int64_t t0 = block * KEYS, t1 = std::min(a_.kv_lens[b], t0 + KEYS);
      for (int64_t t = t0; t < t1; ++t) {
        const KV* k = key_row(b, t, 0);
        if constexpr (dp()) {
          const KV* v = key_row(b, t, 1);
          const int64_t j = t - t0;
          for (int64_t h = 0; h < a_.kv_heads; ++h) {
            uint16_t* kd = packed_block(b, block, h, 0) + 2 * j;
            uint16_t* vd = packed_block(b, block, h, 1) + (j / 2) * 2 * D_ + j % 2;
            for (int64_t d = 0; d < D_; ++d) {
              kd[(d / 2) * 2 * KEYS + d % 2] = bf16_bits(k + h * D_ + d);
              vd[2 * d] = bf16_bits(v + h * D_ + d);
            }
          }
        } else {
          for (int64_t h = 0; h < a_.kv_heads; ++h) {
            float* dst = kt_block(b, block, h) + (t - t0);
            for (int64_t d = 0; d < D_; ++d) dst[d * KEYS] = load(k + h * D_ + d);
          }
        }
      }
    }
  }

  void attend(const Item& it, Scratch& w) {
    const int64_t b = it.seq, h = it.head, nq = std::min(QBLK, a_.q_lens[b] - it.q0);
    const int64_t rows = G_ * nq, D = D_, kv_len = a_.kv_lens[b];
    const int64_t pos0 = first_pos(b) + it.q0;  // row r: query head h * G + r / nq at position pos0 + r % nq
    [[maybe_unused]] const float unit = a_.scale * LOG2E;  // lazy(): a score's factor into exp2's units
    w.q.resize(rows * D);
    w.o.assign((rows + 15) / 16 * 16 * D, 0.f);  // AMX: whole tiles of rows
    w.m.assign(rows, NEG_INF);
    w.l.assign(rows * 16, 0.f);  // each row's running sum as 16 lanes, added up at the end
    w.alpha.resize(rows);
    const int tile_rows = amx_ ? 16 : MR;  // AMX: rows past the last tile's own are zero queries, never read back
    w.s.resize(tile_rows * KEYS);
    w.v.resize(KEYS);
    if (dp()) {
      w.q16.assign((rows + tile_rows - 1) / tile_rows * tile_rows * D, 0);
      w.p16.assign(tile_rows * KEYS, 0);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = a_.q + (a_.q_starts[b] + it.q0 + r % nq) * a_.ldq + (h * G_ + r / nq) * D;
      if constexpr (dp())
        std::memcpy(w.q16.data() + r * D, src, D * sizeof(uint16_t));
      else
        for (int64_t d = 0; d < D; ++d) w.q[r * D + d] = lazy() ? load(src + d) : load(src + d) * a_.scale;
    }
    const int64_t last = pos0 + nq - 1;
    for (int64_t block = block_lo(b, it.q0); block <= last / KEYS; ++block) {
      const int64_t t0 = block * KEYS, nk = std::min(KEYS, kv_len - t0);
      // every row sees all 64 keys of the block: no mask
      const bool whole = nk == KEYS && t0 + nk - 1 <= pos0 && (a_.window_left < 0 || t0 >= last - a_.window_left);
      const float* kt = dp() ? nullptr : kt_block(b, block, h);
      if (!dp())
        for (int64_t j = 0; j < nk; ++j) w.v[j] = key_row(b, t0 + j, 1) + h * D;
      for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
        const int R = int(std::min<int64_t>(tile_rows, rows - r0));
        float* s = w.s.data();
#if defined(GRAPHDECODE_AMX)
        if (amx_) qk_tile_amx(w.q16.data() + r0 * D, D, packed_block(b, block, h, 0), s);
#endif
        if (!amx_) by_rows(R, [&](auto rows_c) {
          constexpr int RR = decltype(rows_c)::value;
#if GRAPHDECODE_PREFILL_DP
          if constexpr (dp()) {
            qk_tile_dp<RR>(w.q16.data() + r0 * D, D, packed_block(b, block, h, 0), s);
            return;
          }
#endif
          qk_tile<RR>(w.q.data() + r0 * D, D, kt, s);
        });
        for (int m = 0; m < R; ++m) {
          const int64_t r = r0 + m, pos = pos0 + r % nq;
          float* row = s + m * KEYS;
          if (!whole) {  // keys j_lo <= j < j_hi of the block are visible to this row
            typedef int32_t i32x16 __attribute__((vector_size(64)));
            const int64_t lo = a_.window_left >= 0 ? pos - a_.window_left : 0;
            const int32_t j_lo = int32_t(std::clamp<int64_t>(lo - t0, 0, KEYS));
            const int32_t j_hi = int32_t(std::clamp<int64_t>(std::min(pos - t0 + 1, nk), 0, KEYS));
            const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
            const f32x16 neg = f32x16{} + NEG_INF;
            for (int v = 0; v < 4; ++v) {
              const i32x16 j = iota + 16 * v;
              store16(row + 16 * v, (j < j_lo) | (j >= j_hi) ? neg : load16(row + 16 * v));
            }
          }
#if GRAPHDECODE_PREFILL_LAZY
          if constexpr (dp())
            softmax_lazy(row, w.p16.data() + m * KEYS, unit, w.m[r], w.l.data() + 16 * r, w.alpha[r]);
          else
            softmax_lazy(row, row, unit, w.m[r], w.l.data() + 16 * r, w.alpha[r]);
          continue;
#endif
          f32x16 mx = max16(max16(load16(row), load16(row + 16)), max16(load16(row + 32), load16(row + 48)));
          const float m_new = std::max(w.m[r], tree_max(mx));
          if (m_new == NEG_INF) {  // nothing seen yet: this block adds nothing either
            std::memset(row, 0, KEYS * sizeof(float));
            w.alpha[r] = 1.f;
            continue;
          }
          f32x16 sum = {};
          for (int v = 0; v < 4; ++v) {
            const f32x16 p = exp16(load16(row + 16 * v) - m_new);
            store16(row + 16 * v, p);
            sum += p;
          }
          // the running max mostly stays put after the first blocks: then the rescale is exactly 1
          const float alpha = w.m[r] == m_new ? 1.f : w.m[r] == NEG_INF ? 0.f : std::exp(w.m[r] - m_new);
          store16(w.l.data() + 16 * r, load16(w.l.data() + 16 * r) * alpha + sum);
          w.m[r] = m_new;
          w.alpha[r] = alpha;
        }
        float* o = w.o.data() + r0 * D;
        const KV* const* v = w.v.data();
        const float* alpha = w.alpha.data() + r0;
#if defined(GRAPHDECODE_AMX)
        if (amx_) {
          const uint16_t* vp = packed_block(b, block, h, 1);
          for (int m = 0; m < R; ++m)  // rows whose running max moved: their sums so far rescaled first
            if (alpha[m] != 1.f)
              for (int64_t d = 0; d < D; d += 16) store16(o + m * D + d, load16(o + m * D + d) * alpha[m]);
          for (int64_t c0 = 0; c0 < D; c0 += 64) {
            if (D - c0 >= 64)
              pv_tile_amx<4>(w.p16.data(), vp, c0, o, D);
            else
              pv_tile_amx<2>(w.p16.data(), vp, c0, o, D);
          }
          continue;
        }
#endif
        by_rows(R, [&](auto rows_c) {
          constexpr int RR = decltype(rows_c)::value;
          by_columns(D, [&](int64_t c0, auto cols_c) {
            constexpr int NV = decltype(cols_c)::value;
#if GRAPHDECODE_PREFILL_DP
            if constexpr (dp()) {
              pv_tile_dp<RR, NV>(w.p16.data(), packed_block(b, block, h, 1), c0, o, D, alpha);
              return;
            }
#endif
            pv_tile<RR, NV>(s, v, nk, c0, o, D, alpha);
          });
        });
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head = h * G_ + r / nq;
      float m = lazy() ? w.m[r] * LN2 : w.m[r], l = tree_sum(load16(w.l.data() + 16 * r)), factor = 1.f;
      if (a_.sinks) {  // the sink's logit joins the denominator and attends nothing
        const float sink = a_.sinks[head], m2 = std::max(m, sink);
        factor = std::exp(m - m2);
        l = l * factor + std::exp(sink - m2);
      }
      factor = l > 0.f ? factor / l * a_.out_scale : 0.f;
      T* dst = a_.out + (a_.q_starts[b] + it.q0 + r % nq) * a_.ldo + head * D;
      for (int64_t d = 0; d < D; ++d) store(dst + d, w.o[r * D + d] * factor);
    }
  }

  const Args<T, KV>& a_;
  const int64_t G_, D_;
  bool amx_ = false;  // dp() on the tile unit: 16-row tiles, both GEMMs by tdpbf16ps
  std::vector<int64_t> first_block_, block_base_;
  std::vector<float> kt_;
  std::vector<uint16_t> kp_;
};

template <typename T, typename KV>
int prefill(const Args<T, KV>& a, int64_t tokens, int64_t width, int64_t num_pages, int32_t threads) {
  for (int64_t b = 0; b < a.seqs; ++b) {  // every argument and page checked before any work
    if (a.q_lens[b] < 1 || a.kv_lens[b] < a.q_lens[b] || a.q_starts[b] < 0 || a.q_starts[b] + a.q_lens[b] > tokens)
      return 1;
    const int64_t pages = (a.kv_lens[b] + a.page_size - 1) / a.page_size;
    if (pages > width) return 1;
    for (int64_t i = 0; i < pages; ++i) {
      const int32_t page = a.block_table[b * a.bt_stride + i];
      if (page < 0 || page >= num_pages) return 1;
    }
  }
  Prefill<T, KV>(a).run(threads);
  return 0;
}

}  // namespace

// q [tokens, heads, head_dim] (token stride ldq, heads and dims packed) and out (token stride ldo), of dtype;
// kv [num_pages, 2, page_size, kv_heads, head_dim] contiguous (this chunk's K/V already written), of kv_dtype:
// dtype, or FP8 E4M3 holding K / k_scale and V / v_scale (pass scale * k_scale and out_scale = v_scale; else 1);
// block_table [seqs, >= width] int32 with row stride bt_stride; for each sequence b its queries are
// rows q_starts[b] .. + q_lens[b] of q at positions kv_lens[b] - q_lens[b] .. kv_lens[b] - 1;
// window_left < 0: no window; sinks [heads] float or null; threads: OpenMP threads. head_dim must be a
// multiple of 16. Returns 0, or 1 (nothing written) for bad arguments or a page outside the cache.
extern "C" int graphdecode_cpu_prefill_attention(const void* q, int64_t tokens, int64_t ldq, const void* kv,
                                                 const int32_t* block_table, int64_t bt_stride, int64_t width,
                                                 int64_t num_pages, void* out, int64_t ldo, const int64_t* q_starts,
                                                 const int64_t* q_lens, const int64_t* kv_lens, int64_t seqs,
                                                 int64_t heads, int64_t kv_heads, int64_t head_dim,
                                                 int64_t page_size, float scale, int64_t window_left,
                                                 const float* sinks, int32_t dtype, int32_t kv_dtype,
                                                 float out_scale, int32_t threads) {
  if (!q || !kv || !block_table || !out || !q_starts || !q_lens || !kv_lens || seqs < 0 || kv_heads < 1 ||
      heads < kv_heads || heads % kv_heads != 0 || head_dim < 16 || head_dim % 16 != 0 || head_dim > 512 ||
      ldq < heads * head_dim || ldo < heads * head_dim || page_size < 1 || width < 1 || bt_stride < width ||
      num_pages < 1 || !(scale > 0.f) || !(out_scale > 0.f) || threads < 1 ||
      (kv_dtype != dtype && kv_dtype != kFloat8E4M3))
    return 1;
  auto run = [&](auto t, auto k) {
    using T = decltype(t);
    using KV = decltype(k);
    const Args<T, KV> a{static_cast<const T*>(q), ldq, static_cast<const KV*>(kv), block_table, bt_stride,
                        static_cast<T*>(out), ldo, q_starts, q_lens, kv_lens, seqs, heads, kv_heads, head_dim,
                        page_size, scale, window_left, sinks, out_scale};
    return prefill(a, tokens, width, num_pages, threads);
  };
  const bool fp8 = kv_dtype == kFloat8E4M3;
  if (dtype == kFloat32) return fp8 ? run(float{}, e4m3{}) : run(float{}, float{});
  if (dtype == kBFloat16) return fp8 ? run(uint16_t{}, e4m3{}) : run(uint16_t{}, uint16_t{});
  return 1;
}
