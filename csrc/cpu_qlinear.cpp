// A quantized linear, y = x W^T (+ b), with W = (q - z) * s held quantized in column panels
// (graphdecode/models/quant/linear.py: the "panels" kernel): 8-bit integers, 4-bit integers or FP8 E4M3,
// one scale per (group of input columns, output column), zero points folded into per-group offsets.
//
// Decode reads every weight once per step, so the bytes read are the time: int8 and FP8 read a quarter of
// float32's, int4 an eighth. The panels are cpu_linear.cpp's ([ceil(N / 64)][K][64], one sequential stream
// each), of bytes: int8 and FP8 one byte a weight, int4 two k rows a byte (low nibble the even k, high the
// odd, unsigned: q + 8). Each weight is widened to float32 as it is read (int8: sign-extend and convert; int4:
// mask or shift; FP8: its exponent and mantissa moved into a float32's, scaled by 2^120, exact), scaled by its
// group's scale and offset, w = q s - zs (zs = (z + 8) s for int4's unsigned storage, z s for int8 with zero
// points, none otherwise), and summed in float32 in ascending k:
//
// * up to DIRECT_ROWS (3) rows: each k row's 64 weights dequantized in registers, once for all the rows;
// * more rows: blocks of KB (64) k rows dequantized once into an L1 buffer, then 6-row register tiles over it
//   as cpu_linear.cpp's float32 kernel runs them (the conversion's cost shared by every row).
//
// Both paths compute each weight by the same expression and add the products in the same order, so a result
// does not depend on the number of rows in the call, nor on the thread count. x and y are float32 or bf16.

#include <cstdint>
#include <cstring>

#include "cpu_common.h"

#if defined(__AVX512F__)
// GCC 12's own AVX-512 headers trip its -Wmaybe-uninitialized (their _mm512_undefined_* idiom)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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
// FP8 E4M3 (fn: no infinities; the loader refuses NaN weights) -> float32, exact: the 7 exponent and mantissa
// bits land in a float32's at bit 20, which reads as the value times 2^-120 (normals and subnormals alike;
// float32 keeps E4M3's subnormals as its own subnormals), then the sign
inline f32x16 widen_fp8(const uint8_t* p) {
  const __m512i u = _mm512_cvtepu8_epi32(load_bytes(p));
  const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7f)), 20);
  const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
  return as_f32x16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign)));
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
inline f32x16 widen_fp8(const uint8_t* p) {
  f32x16 r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = uint32_t(p[i] & 0x7f) << 20;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    r[i] = (p[i] & 0x80 ? -f : f) * 0x1p120f;
  }
  return r;
}
#endif

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

// Few rows: out[R][PANEL] += x[R][k0:k1] @ W[k0:k1], each k row's weights dequantized in registers once for
// the R rows (the group's scales held in registers too)
template <int R, int KIND, typename T>
void tile_direct(const T* __restrict x, int64_t ldx, const uint8_t* __restrict panel, int64_t k0, int64_t k1,
                 const float* __restrict scale, const float* __restrict zs, float* __restrict out) {
  f32x16 acc[R][4], s[4], z[4];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = load16(out + m * PANEL + 16 * v);
  for (int v = 0; v < 4; ++v) {
    s[v] = load16(scale + 16 * v);
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

template <int KIND, typename T>
void qpanel_linear(const T* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* panels, const float* scales,
                   const float* zs, int64_t group, int64_t N, const T* bias, T* y, int64_t ldy, int32_t threads) {
  const int64_t num_panels = (N + PANEL - 1) / PANEL;
  const int64_t groups = K / group;
  const int64_t panel_bytes = (KIND == kInt4 ? K / 2 : K) * PANEL;
  const int64_t blocks = (M + ROWS_MAX - 1) / ROWS_MAX;
  const int64_t tasks = blocks * num_panels;
  int64_t kb = KB;  // a block lies in one group
  while (group % kb) kb /= 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    alignas(64) float out[ROWS_MAX * PANEL];
    alignas(64) float block[KB * PANEL];
    const int64_t m0 = (t / num_panels) * ROWS_MAX, p = t % num_panels;
    const int64_t rows = M - m0 < ROWS_MAX ? M - m0 : ROWS_MAX;
    const uint8_t* panel = panels + p * panel_bytes;
    const int64_t cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < PANEL; ++j) out[m * PANEL + j] = bias && j < cols ? load(bias + p * PANEL + j) : 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float* scale = scales + (p * groups + g) * PANEL;
      const float* offsets = zs ? zs + (p * groups + g) * PANEL : nullptr;
      if (rows <= DIRECT_ROWS) {
        direct_rows<KIND>(rows, x + m0 * ldx, ldx, panel, g * group, (g + 1) * group, scale, offsets, out);
        continue;
      }
      f32x16 s[4], z[4];
      for (int v = 0; v < 4; ++v) {
        s[v] = load16(scale + 16 * v);
        z[v] = offsets ? load16(offsets + 16 * v) : f32x16{};
      }
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kb) {
        for (int64_t k = k0; k < k0 + kb; ++k) {
          f32x16 w[4];
          dequant_row<KIND>(row_bytes(panel, k, KIND == kInt4), k & 1, s, z, offsets != nullptr, w);
          for (int v = 0; v < 4; ++v) store16(block + (k - k0) * PANEL + 16 * v, w[v]);
        }
        for (int64_t m = 0; m < rows; m += MR) {
          const int64_t r = rows - m < MR ? rows - m : MR;
          // the float panels' tile over the block (its k rows 0..kb are x's k0..k0 + kb); nothing to prefetch
          panel_tile_rows(r, x + (m0 + m) * ldx + k0, ldx, block, int64_t(0), kb, out + m * PANEL, nullptr, 0, 0);
        }
      }
    }
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < cols; ++j) store(y + (m0 + m) * ldy + p * PANEL + j, out[m * PANEL + j]);
  }
}

template <typename T>
int dispatch(int32_t kind, const T* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* panels,
             const float* scales, const float* zs, int64_t group, int64_t N, const T* bias, T* y, int64_t ldy,
             int32_t threads) {
  switch (kind) {
    case kInt8: qpanel_linear<kInt8>(x, M, K, ldx, panels, scales, zs, group, N, bias, y, ldy, threads); return 0;
    case kInt4: qpanel_linear<kInt4>(x, M, K, ldx, panels, scales, zs, group, N, bias, y, ldy, threads); return 0;
    case kFp8: qpanel_linear<kFp8>(x, M, K, ldx, panels, scales, zs, group, N, bias, y, ldy, threads); return 0;
    default: return 1;
  }
}

}  // namespace

// x [M, K] (row stride ldx), panels [ceil(N / 64)][K (int4: K / 2)][64] bytes of `kind` (0 int8, 1 int4,
// 2 FP8 E4M3; columns past N zero), scales [ceil(N / 64)][K / group][64] float32, zs (the per-group offsets,
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
