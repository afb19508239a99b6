// A quantized linear, y = x W^T (+ b), with W = (q - z) * s held quantized in column panels
// (graphdecode/models/quant/linear.py: the "panels" kernel): 8-bit integers, 4-bit integers or FP8 E4M3,
// one scale per (group of input columns, output column), zero points folded into per-group offsets.
//
// Decode reads every weight once per step, so the bytes read are the time: int8 and FP8 read a quarter of
// float32's, int4 an eighth. The panels are cpu_linear.cpp's ([ceil(N / 64)][K][64], one sequential stream
// each), of bytes: int8 and FP8 one byte a weight, int4 two k rows a byte (low nibble the even k, high the
// odd, unsigned: q + 8). Each weight is widened to float32 as it is read (int8: sign-extend and convert; int4:
// mask or shift; FP8: its bits moved into a half's and converted, exact, the half's 2^-8 undone by the scale),
// scaled by its group's scale and offset, w = q s - zs (zs = (z + 8) s for int4's unsigned storage, z s for int8
// with zero points, none otherwise), and summed in float32 in ascending k:
//
// * up to DIRECT_ROWS (3) rows: each k row's 64 weights dequantized in registers, once for all the rows;
// * more rows: blocks of KB (64) k rows dequantized once into an L1 buffer, then 6-row register tiles over it
//   as cpu_linear.cpp's float32 kernel runs them (the conversion's cost shared by every row).
//
// Both paths compute each weight by the same expression and add the products in the same order, so a result
// does not depend on the number of rows in the call, nor on the thread count. x and y are float32 or bf16.

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

#if defined(__AVX512F__)
// GCC 12's own AVX-512 headers trip its -Wmaybe-uninitialized (their _mm512_undefined_* idiom)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#elif defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace graphdecode_cpu;

constexpr int64_t ROWS_MAX = 64;  // rows per pass

enum QKind : int32_t { kInt8 = 0, kInt4 = 1, kFp8 = 2 };

#if defined(__AVX512F__)
// GCC scalarises vector-extension conversions from bytes to floats: these use the instructions directly
inline f32x16 as_f32x16(__m512 v) {
  f32x16 r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}
inline __m128i load_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline f32x16 widen_int8(const uint8_t* p) {
  return as_f32x16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes(p))));
}
inline f32x16 widen_u8(__m128i b) { return as_f32x16(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))); }
inline void widen_int4(const uint8_t* p, f32x16& lo, f32x16& hi) {
  const __m128i b = load_bytes(p), mask = _mm_set1_epi8(0x0f);
  lo = widen_u8(_mm_and_si128(b, mask));
  hi = widen_u8(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
}
#else
inline f32x16 widen_int8(const uint8_t* p) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) r[i] = float(int8_t(p[i]));
  return r;
}
inline void widen_int4(const uint8_t* p, f32x16& lo, f32x16& hi) {
  for (int i = 0; i < 16; ++i) {
    lo[i] = float(p[i] & 0x0f);
    hi[i] = float(p[i] >> 4);
  }
}
#endif
// FP8 E4M3 (fn: no infinities; the loader refuses NaN weights) -> float32 times 2^-8, exact (cpu_common.h's
// load16_over_256); the 2^8 goes into the scales (FP8_SCALE): q 2^-8 (s 2^8) is q s.
constexpr float FP8_SCALE = 256.f;
inline f32x16 widen_fp8(const uint8_t* p) { return load16_over_256(reinterpret_cast<const e4m3*>(p)); }

// One k row's 64 weights (4 vectors) as float32 with their group's scale and offset applied: w = q s - zs.
// Both paths below compute every weight by this one expression and add x w in ascending k, so a result does
// not depend on which path (or how many rows) ran it.
template <int KIND>
inline void dequant_row(const uint8_t* bytes, bool high, const f32x16* s, const f32x16* z, bool offsets,
                        f32x16* w) {
  for (int v = 0; v < 4; ++v) {
    f32x16 q;
    if (KIND == kInt4) {
      f32x16 lo, hi;
      widen_int4(bytes + 16 * v, lo, hi);
      q = high ? hi : lo;
    } else {
      q = KIND == kInt8 ? widen_int8(bytes + 16 * v) : widen_fp8(bytes + 16 * v);
    }
    w[v] = offsets ? q * s[v] - z[v] : q * s[v];
  }
}

inline const uint8_t* row_bytes(const uint8_t* panel, int64_t k, bool int4) {
  return panel + (int4 ? k / 2 : k) * PANEL;
}

#if defined(__AVX512F__) || !defined(__AVX2__)
// Few rows: out[R][PANEL] += x[R][k0:k1] @ W[k0:k1], each k row's weights dequantized in registers once for
// the R rows (the group's scales held in registers too)
template <int R, int KIND, typename T>
void tile_direct(const T* __restrict x, int64_t ldx, const uint8_t* __restrict panel, int64_t k0, int64_t k1,
                 const float* __restrict scale, const float* __restrict zs, float* __restrict out) {
  f32x16 acc[R][4], s[4], z[4];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = load16(out + m * PANEL + 16 * v);
  for (int v = 0; v < 4; ++v) {
    s[v] = load16(scale + 16 * v) * (KIND == kFp8 ? FP8_SCALE : 1.f);
    z[v] = zs ? load16(zs + 16 * v) : f32x16{};
  }
  for (int64_t k = k0; k < k1; ++k) {
    const uint8_t* row = row_bytes(panel, k, KIND == kInt4);
    if (KIND != kInt4 || !(k & 1)) __builtin_prefetch(row + 8 * PANEL, 0, 3);
    f32x16 w[4];
    dequant_row<KIND>(row, k & 1, s, z, zs != nullptr, w);
#pragma GCC unroll 4
    for (int m = 0; m < R; ++m) {
      const float a = load(x + m * ldx + k);
      for (int v = 0; v < 4; ++v) acc[m][v] += a * w[v];
    }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) store16(out + m * PANEL + 16 * v, acc[m][v]);
}
#else
// The same with AVX2 (16 registers of 8 floats; GCC lowers the 16-float vector type through memory there): the
// panel's eight 8-column strips one after another, R accumulators, the strip's scale, offset and weights (R + 4
// registers), each weight dequantized as q s - zs (q exact) by strip_weights, which the dequantized blocks use too,
// and summed in ascending k by written-out FMAs, as the panel tile sums: the direct and block paths give the same
// bits.
template <int KIND>
inline f32x8 widen8(const uint8_t* row, int64_t strip, bool high) {
  if (KIND == kInt4) {  // row: 64 bytes, k even in the low nibbles, k odd in the high ones
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * strip));
    const __m128i nibbles = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0f));
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles));
  } else if (KIND == kInt8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * strip));
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else {
    return load8_over_256(reinterpret_cast<const e4m3*>(row) + 8 * strip);  // as widen_fp8: q 2^-8, exact
  }
}

// a strip's 8 scales, FP8's with the 2^8 its widening leaves out
template <int KIND>
inline f32x8 strip_scale(const float* scale, int64_t strip) {
  return load8(scale + 8 * strip) * (KIND == kFp8 ? FP8_SCALE : 1.f);
}

// a strip's 8 weights, q s - zs (q exact; the FMA written out, as the panel tile's)
template <int KIND>
inline f32x8 strip_weights(const uint8_t* row, int64_t strip, bool high, f32x8 s, f32x8 z, bool offsets) {
  const f32x8 q = widen8<KIND>(row, strip, high);
  return offsets ? fma8(q, s, -z) : q * s;
}

template <int R, int KIND, typename T>
void tile_direct(const T* __restrict x, int64_t ldx, const uint8_t* __restrict panel, int64_t k0, int64_t k1,
                 const float* __restrict scale, const float* __restrict zs, float* __restrict out) {
  for (int64_t v = 0; v < PANEL / 8; ++v) {
    f32x8 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = load8(out + m * PANEL + 8 * v);
    const f32x8 s = strip_scale<KIND>(scale, v);
    const f32x8 z = zs ? load8(zs + 8 * v) : f32x8{};
    for (int64_t k = k0; k < k1; ++k) {
      const uint8_t* row = row_bytes(panel, k, KIND == kInt4);
      if (v == 0 && (KIND != kInt4 || !(k & 1))) __builtin_prefetch(row + 8 * PANEL, 0, 3);
      const f32x8 w = strip_weights<KIND>(row, v, k & 1, s, z, zs != nullptr);
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) acc[m] = fma8(splat8(load(x + m * ldx + k)), w, acc[m]);
    }
    for (int m = 0; m < R; ++m) store8(out + m * PANEL + 8 * v, acc[m]);
  }
}
#endif

constexpr int DIRECT_ROWS = 3;  // up to this many rows: dequantize in registers; more: into an L1 block
constexpr int MR = PANEL_MR;    // rows per register tile over a dequantized block (cpu_common.h's panel tile)
constexpr int64_t KB = 64;      // k rows per dequantized block (16 KB of float32)

template <int KIND, typename T>
void direct_rows(int64_t rows, const T* x, int64_t ldx, const uint8_t* panel, int64_t k0, int64_t k1,
                 const float* scale, const float* zs, float* out) {
  switch (rows) {
    case 3: tile_direct<3, KIND>(x, ldx, panel, k0, k1, scale, zs, out); break;
    case 2: tile_direct<2, KIND>(x, ldx, panel, k0, k1, scale, zs, out); break;
    default: tile_direct<1, KIND>(x, ldx, panel, k0, k1, scale, zs, out); break;
  }
}

// The work of one linear: units of (a block of up to ROWS_MAX rows, a panel) over `threads` threads
// (for_row_blocks: even row blocks in multiples of `tile` rows, panels of `panel_bytes` in L2-sized blocks). A
// unit's output rows start from the bias's columns (0 without one), body(out, m0, rows, p) adds the panel's products
// into them, then their first columns are stored to y.
template <typename T, typename Body>
void for_each_panel(int64_t M, int64_t N, const T* bias, T* y, int64_t ldy, int64_t tile, int64_t panel_bytes,
                    int32_t threads, Body&& body) {
  const int64_t num_panels = (N + PANEL - 1) / PANEL;
  for_row_blocks(M, ROWS_MAX, tile, num_panels, panel_bytes, threads, [&](int64_t m0, int64_t rows, int64_t p) {
    alignas(64) float out[ROWS_MAX * PANEL];
    const int64_t cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    alignas(64) float start[PANEL];
    for (int64_t j = 0; j < PANEL; ++j) start[j] = bias && j < cols ? load(bias + p * PANEL + j) : 0.f;
    for (int64_t m = 0; m < rows; ++m) std::memcpy(out + m * PANEL, start, sizeof start);
    body(out, m0, rows, p);
    for (int64_t m = 0; m < rows; ++m) store_sums(y + (m0 + m) * ldy + p * PANEL, out + m * PANEL, cols);
  });
}

template <int KIND, typename T>
void qpanel_linear(const T* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* panels, const float* scales,
                   const float* zs, int64_t group, int64_t N, const T* bias, T* y, int64_t ldy, int32_t threads) {
  const int64_t groups = K / group;
  const int64_t panel_bytes = (KIND == kInt4 ? K / 2 : K) * PANEL;
  int64_t kb = KB;  // a block lies in one group
  while (group % kb) kb /= 2;
  for_each_panel(M, N, bias, y, ldy, MR, panel_bytes, threads, [&](float* out, int64_t m0, int64_t rows, int64_t p) {
    alignas(64) float block[KB * PANEL];
    const uint8_t* panel = panels + p * panel_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const float* scale = scales + (p * groups + g) * PANEL;
      const float* offsets = zs ? zs + (p * groups + g) * PANEL : nullptr;
      if (rows <= DIRECT_ROWS) {
        direct_rows<KIND>(rows, x + m0 * ldx, ldx, panel, g * group, (g + 1) * group, scale, offsets, out);
        continue;
      }
#if defined(__AVX512F__) || !defined(__AVX2__)
      f32x16 s[4], z[4];
      for (int v = 0; v < 4; ++v) {
        s[v] = load16(scale + 16 * v) * (KIND == kFp8 ? FP8_SCALE : 1.f);
        z[v] = offsets ? load16(offsets + 16 * v) : f32x16{};
      }
#else
      f32x8 s[PANEL / 8], z[PANEL / 8];
      for (int64_t v = 0; v < PANEL / 8; ++v) {
        s[v] = strip_scale<KIND>(scale, v);
        z[v] = offsets ? load8(offsets + 8 * v) : f32x8{};
      }
#endif
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kb) {
        for (int64_t k = k0; k < k0 + kb; ++k) {
#if defined(__AVX512F__) || !defined(__AVX2__)
          f32x16 w[4];
          dequant_row<KIND>(row_bytes(panel, k, KIND == kInt4), k & 1, s, z, offsets != nullptr, w);
          for (int v = 0; v < 4; ++v) store16(block + (k - k0) * PANEL + 16 * v, w[v]);
#else  // AVX2: tile_direct's strips and expression, so that both paths give the same weights
          const uint8_t* row = row_bytes(panel, k, KIND == kInt4);
          for (int64_t v = 0; v < PANEL / 8; ++v)
            store8(block + (k - k0) * PANEL + 8 * v,
                   strip_weights<KIND>(row, v, k & 1, s[v], z[v], offsets != nullptr));
#endif
        }
        for (int64_t m = 0; m < rows; m += MR) {
          const int64_t r = rows - m < MR ? rows - m : MR;
          // the float panels' tile over the block (its k rows 0..kb are x's k0..k0 + kb); nothing to prefetch
          panel_tile_rows(r, x + (m0 + m) * ldx + k0, ldx, block, int64_t(0), kb, out + m * PANEL, nullptr, 0, 0);
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------------------
// Integer dot products (AVX-512 VNNI, vpdpbusd): int8 / int4 weights times activations quantized to int8 per row
// and block of 32 input columns, as llama.cpp's Q8_0 / Q4_0 kernels compute. The panels are laid out for the
// instruction: each 32-bit lane holds one output column's 4 consecutive k (int8: [K / 4][64][4] bytes, q + 128;
// int4: [K / 8][64][4] bytes, the low nibbles k..k+3 and the high nibbles k+4..k+7, q + 8). With the weights
// unsigned u and w = u s - zs (zs = (128 + z) s, or (8 + z) s), an activation block x ~ a xq (a = max|x| / 127,
// xq = round(x / a) to nearest even) gives x . w = a (s (xq . u) - zs sum(xq)): xq . u exactly in int32, then one
// float step per block and column. Every row's activations are quantized alone, so a result does not depend on
// the rows beside it; blocks are added in ascending k. With AMX's int8 tiles, row tiles of 8 rows or more take the
// same exact int32 sums from them (amx_rows below) and the same float step: the same bits.
#if defined(__AVX512VNNI__)
#define GRAPHDECODE_QLINEAR_VNNI 1

constexpr int64_t QBLOCK = 32;  // input columns per activation scale
constexpr int VNNI_MR = 4;      // rows per register tile: 16 int32 accumulators

enum VnniKind : int32_t { kInt8Vnni = 3, kInt4Vnni = 4 };

// row x[0:K] -> xq[0:K] int8, a[K / 32] (the blocks' scales) and sums[K / 32] (each block's sum of xq)
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* xq, float* a, int32_t* sums) {
  for (int64_t b = 0; b < K / QBLOCK; ++b) {
    f32x16 v0 = load16(x + b * QBLOCK), v1 = load16(x + b * QBLOCK + 16);
    const f32x16 m0 = v0 < 0 ? -v0 : v0, m1 = v1 < 0 ? -v1 : v1;
    const float peak = tree_max(max16(m0, m1));
    const float inv = peak > 0.f ? 127.f / peak : 0.f;
    a[b] = peak / 127.f;
    __m512i q0, q1;
    __m512 f0, f1;
    std::memcpy(&f0, &v0, sizeof f0);
    std::memcpy(&f1, &v1, sizeof f1);
    q0 = _mm512_cvtps_epi32(_mm512_mul_ps(f0, _mm512_set1_ps(inv)));  // to nearest even (MXCSR's default)
    q1 = _mm512_cvtps_epi32(_mm512_mul_ps(f1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * QBLOCK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * QBLOCK + 16), _mm512_cvtsepi32_epi8(q1));
    sums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// out[R][64] += the blocks b0..b1 (one scale group: s, zs [64]) of R rows' quantized activations @ the panel
template <int R, int KIND>
void vnni_tile(const int8_t* __restrict xq, int64_t ldq, const float* __restrict a, const int32_t* __restrict sums,
               int64_t lda, const uint8_t* __restrict panel, int64_t b0, int64_t b1, const float* __restrict s,
               const float* __restrict zs, float* __restrict out) {
  __m512 sv[4], zv[4];
  for (int v = 0; v < 4; ++v) {
    sv[v] = _mm512_loadu_ps(s + 16 * v);
    zv[v] = _mm512_loadu_ps(zs + 16 * v);
  }
  for (int64_t b = b0; b < b1; ++b) {
    __m512i acc[R][4];
    for (int m = 0; m < R; ++m)
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_si512();
    if (KIND == kInt8Vnni) {
      const uint8_t* w = panel + b * QBLOCK * PANEL;  // 8 steps of 4 k: 256 bytes each
      for (int64_t step = 0; step < QBLOCK / 4; ++step) {
        __m512i wv[4];
        for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(w + step * 4 * PANEL + 64 * v);
        for (int m = 0; m < R; ++m) {
          int32_t word;
          std::memcpy(&word, xq + m * ldq + b * QBLOCK + 4 * step, 4);
          const __m512i xv = _mm512_set1_epi32(word);
          for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], wv[v], xv);
        }
      }
    } else {
      const uint8_t* w = panel + b * (QBLOCK / 2) * PANEL;  // 4 steps of 8 k: 256 bytes each
      const __m512i low = _mm512_set1_epi8(0x0f);
      for (int64_t step = 0; step < QBLOCK / 8; ++step) {
        __m512i lo[4], hi[4];
        for (int v = 0; v < 4; ++v) {
          const __m512i raw = _mm512_loadu_si512(w + step * 4 * PANEL + 64 * v);
          lo[v] = _mm512_and_si512(raw, low);
          hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        for (int m = 0; m < R; ++m) {
          int32_t w0, w1;
          std::memcpy(&w0, xq + m * ldq + b * QBLOCK + 8 * step, 4);
          std::memcpy(&w1, xq + m * ldq + b * QBLOCK + 8 * step + 4, 4);
          const __m512i x0 = _mm512_set1_epi32(w0), x1 = _mm512_set1_epi32(w1);
          for (int v = 0; v < 4; ++v)
            acc[m][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[m][v], lo[v], x0), hi[v], x1);
        }
      }
    }
    for (int m = 0; m < R; ++m) {  // out += a (s (xq . u) - zs sum(xq))
      const __m512 am = _mm512_set1_ps(a[m * lda + b]);
      const __m512 sm = _mm512_set1_ps(float(sums[m * lda + b]));
      for (int v = 0; v < 4; ++v) {
        const __m512 t = _mm512_fnmadd_ps(zv[v], sm, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[m][v]), sv[v]));
        _mm512_storeu_ps(out + m * PANEL + 16 * v, _mm512_fmadd_ps(t, am, _mm512_loadu_ps(out + m * PANEL + 16 * v)));
      }
    }
  }
}

template <int KIND>
void vnni_rows(int64_t rows, const int8_t* xq, int64_t ldq, const float* a, const int32_t* sums, int64_t lda,
               const uint8_t* panel, int64_t b0, int64_t b1, const float* s, const float* zs, float* out) {
  switch (rows) {
    case 4: vnni_tile<4, KIND>(xq, ldq, a, sums, lda, panel, b0, b1, s, zs, out); break;
    case 3: vnni_tile<3, KIND>(xq, ldq, a, sums, lda, panel, b0, b1, s, zs, out); break;
    case 2: vnni_tile<2, KIND>(xq, ldq, a, sums, lda, panel, b0, b1, s, zs, out); break;
    default: vnni_tile<1, KIND>(xq, ldq, a, sums, lda, panel, b0, b1, s, zs, out); break;
  }
}

#if defined(GRAPHDECODE_AMX) && defined(__AMX_INT8__)
#define GRAPHDECODE_QLINEAR_AMX 1
// The same products on AMX's int8 tiles (tdpbsud: signed activations times unsigned weights): a block of 32 k of
// 16 rows (tmm4, 16 rows of 32 bytes) times the panel's block (tmm5-7, 8 rows of 4 k for 16 columns each) into
// four 16 x 16 int32 sums (tmm0-3), zeroed each block; then the vnni tiles' float step, the same expression on the
// same exact int32 sums, so the bits are theirs whichever kernel runs a row. int4's block is unpacked once into
// bytes (low nibbles k-quad 2s, high 2s + 1) for every row tile of the task.
constexpr int64_t AMX_MIN_ROWS = 8;  // a row tile runs on AMX from this many rows (fewer: vnni tiles)

inline void amx_configure_int8() {
  alignas(64) static const TileConfig config = {
      1, 0, {}, {64, 64, 64, 64, 32, 64, 64, 64}, {16, 16, 16, 16, 16, 8, 8, 8}};
  _tile_loadconfig(&config);
}

// out[rows][64] += blocks b0..b1 of the quantized rows xq (16 * tiles rows, zeros past `rows`) times the panel
template <int KIND>
void amx_rows(int64_t rows, const int8_t* xq, int64_t ldq, const float* a, const int32_t* sums, int64_t lda,
              const uint8_t* panel, int64_t b0, int64_t b1, const float* s, const float* zs, float* out) {
  alignas(64) uint8_t unpacked[QBLOCK / 4 * 4 * PANEL];  // int4: the block's 8 k-quad rows of 64 columns
  alignas(64) int32_t acc[16 * PANEL];
  __m512 sv[4], zv[4];
  for (int v = 0; v < 4; ++v) {
    sv[v] = _mm512_loadu_ps(s + 16 * v);
    zv[v] = _mm512_loadu_ps(zs + 16 * v);
  }
  constexpr int64_t LDW = 4 * PANEL;  // bytes between k-quad rows
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* w;
    if (KIND == kInt8Vnni) {
      w = panel + b * QBLOCK * PANEL;
    } else {
      const uint8_t* raw = panel + b * (QBLOCK / 2) * PANEL;
      const __m512i low = _mm512_set1_epi8(0x0f);
      for (int64_t step = 0; step < QBLOCK / 8; ++step)
        for (int v = 0; v < 4; ++v) {
          const __m512i r = _mm512_loadu_si512(raw + step * LDW + 64 * v);
          _mm512_store_si512(unpacked + (2 * step) * LDW + 64 * v, _mm512_and_si512(r, low));
          _mm512_store_si512(unpacked + (2 * step + 1) * LDW + 64 * v,
                             _mm512_and_si512(_mm512_srli_epi16(r, 4), low));
        }
      w = unpacked;
    }
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
      _tile_loadd(4, xq + m0 * ldq + b * QBLOCK, ldq);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(5, w, LDW);
      _tile_dpbsud(0, 4, 5);
      _tile_loadd(6, w + 64, LDW);
      _tile_dpbsud(1, 4, 6);
      _tile_loadd(7, w + 128, LDW);
      _tile_dpbsud(2, 4, 7);
      _tile_loadd(5, w + 192, LDW);
      _tile_dpbsud(3, 4, 5);
      _tile_stored(0, acc, PANEL * 4);
      _tile_stored(1, acc + 16, PANEL * 4);
      _tile_stored(2, acc + 32, PANEL * 4);
      _tile_stored(3, acc + 48, PANEL * 4);
      const int64_t valid = rows - m0 < 16 ? rows - m0 : 16;
      for (int64_t m = 0; m < valid; ++m) {  // out += a (s (xq . u) - zs sum(xq)), as vnni_tile
        const __m512 am = _mm512_set1_ps(a[(m0 + m) * lda + b]);
        const __m512 sm = _mm512_set1_ps(float(sums[(m0 + m) * lda + b]));
        float* o = out + (m0 + m) * PANEL;
        for (int v = 0; v < 4; ++v) {
          const __m512 t = _mm512_fnmadd_ps(zv[v], sm, _mm512_mul_ps(_mm512_cvtepi32_ps(
              _mm512_load_si512(acc + m * PANEL + 16 * v)), sv[v]));
          _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(t, am, _mm512_loadu_ps(o + 16 * v)));
        }
      }
    }
  }
}
#endif

template <int KIND, typename T>
void vnni_linear(const T* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* panels, const float* scales,
                 const float* zs, int64_t group, int64_t N, const T* bias, T* y, int64_t ldy, int32_t threads) {
  const int64_t groups = K / group, blocks = K / QBLOCK;
  const int64_t per_group = group / QBLOCK;
  const int64_t panel_bytes = (KIND == kInt4Vnni ? K / 2 : K) * PANEL;
  std::vector<int8_t> xq((M + 15) / 16 * 16 * K);  // rows past M zero (AMX's row tiles read 16 rows)
  std::vector<float> a(M * blocks);
  std::vector<int32_t> sums(M * blocks);
#if defined(GRAPHDECODE_QLINEAR_AMX)
  const bool amx = M >= AMX_MIN_ROWS && amx_ready();
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, K, xq.data() + m * K, a.data() + m * blocks,
                                               sums.data() + m * blocks);
  for_each_panel(M, N, bias, y, ldy, 16, panel_bytes, threads,
                 [&](float* out, int64_t m0, int64_t rows, int64_t p) {
    const uint8_t* panel = panels + p * panel_bytes;
    int64_t tiled = 0;  // the task's first rows that run on AMX: whole tiles of 16, and a last one of 8 or more
#if defined(GRAPHDECODE_QLINEAR_AMX)
    if (amx) {
      tiled = rows / 16 * 16 + (rows % 16 >= AMX_MIN_ROWS ? rows % 16 : 0);
      if (tiled) amx_configure_int8();
    }
#endif
    for (int64_t g = 0; g < groups; ++g) {
      const float* s = scales + (p * groups + g) * PANEL;
      const float* z = zs + (p * groups + g) * PANEL;
#if defined(GRAPHDECODE_QLINEAR_AMX)
      if (tiled)
        amx_rows<KIND>(tiled, xq.data() + m0 * K, K, a.data() + m0 * blocks, sums.data() + m0 * blocks, blocks,
                       panel, g * per_group, (g + 1) * per_group, s, z, out);
#endif
      for (int64_t m = tiled; m < rows; m += VNNI_MR) {
        const int64_t r = rows - m < VNNI_MR ? rows - m : VNNI_MR;
        vnni_rows<KIND>(r, xq.data() + (m0 + m) * K, K, a.data() + (m0 + m) * blocks, sums.data() + (m0 + m) * blocks,
                        blocks, panel, g * per_group, (g + 1) * per_group, s, z, out + m * PANEL);
      }
    }
#if defined(GRAPHDECODE_QLINEAR_AMX)
    if (tiled) _tile_release();
#endif
  });
}
#else
#define GRAPHDECODE_QLINEAR_VNNI 0
#endif

template <typename T>
int dispatch(int32_t kind, const T* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* panels,
             const float* scales, const float* zs, int64_t group, int64_t N, const T* bias, T* y, int64_t ldy,
             int32_t threads) {
  switch (kind) {
    case kInt8: qpanel_linear<kInt8>(x, M, K, ldx, panels, scales, zs, group, N, bias, y, ldy, threads); return 0;
    case kInt4: qpanel_linear<kInt4>(x, M, K, ldx, panels, scales, zs, group, N, bias, y, ldy, threads); return 0;
    case kFp8: qpanel_linear<kFp8>(x, M, K, ldx, panels, scales, zs, group, N, bias, y, ldy, threads); return 0;
#if GRAPHDECODE_QLINEAR_VNNI
    case kInt8Vnni:
    case kInt4Vnni:
      if (!zs || group % QBLOCK) return 1;
      if (kind == kInt8Vnni)
        vnni_linear<kInt8Vnni>(x, M, K, ldx, panels, scales, zs, group, N, bias, y, ldy, threads);
      else
        vnni_linear<kInt4Vnni>(x, M, K, ldx, panels, scales, zs, group, N, bias, y, ldy, threads);
      return 0;
#endif
    default: return 1;
  }
}

}  // namespace

// Whether this build has the integer dot-product kinds (3 int8, 4 int4: AVX-512 VNNI)
extern "C" int graphdecode_cpu_qlinear_vnni() { return GRAPHDECODE_QLINEAR_VNNI; }

// x [M, K] (row stride ldx), panels [ceil(N / 64)][K (int4: K / 2)][64] bytes of `kind` (0 int8, 1 int4,
// 2 FP8 E4M3; 3 int8 and 4 int4 in the integer dot products' layout above, their offsets required and group a
// multiple of 32; columns past N zero), scales [ceil(N / 64)][K / group][64] float32, zs (the per-group offsets,
// or null) likewise, bias [N] or null, y [M, N] (row stride ldy); x, bias and y float32 or bf16 (dtype);
// threads: OpenMP threads over (row block, panel) pairs. group divides K (and is even for int4). Returns
// nonzero on bad arguments.
extern "C" int graphdecode_cpu_qpanel_linear(const void* x, int64_t M, int64_t K, int64_t ldx, const void* panels,
                                             int32_t kind, const float* scales, const float* zs, int64_t group,
                                             int64_t N, const void* bias, void* y, int64_t ldy, int32_t threads,
                                             int32_t dtype) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N || threads < 1 || group <= 0 || K % group ||
      (kind == kInt4 && group % 2) || (M > 0 && (!x || !panels || !scales || !y)))
    return 1;
  const uint8_t* q = static_cast<const uint8_t*>(panels);
  if (dtype == kFloat32)
    return dispatch(kind, static_cast<const float*>(x), M, K, ldx, q, scales, zs, group, N,
                    static_cast<const float*>(bias), static_cast<float*>(y), ldy, threads);
  if (dtype == kBFloat16)
    return dispatch(kind, static_cast<const uint16_t*>(x), M, K, ldx, q, scales, zs, group, N,
                    static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), ldy, threads);
  return 1;
}
