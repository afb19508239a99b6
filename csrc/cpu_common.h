// Shared by the CPU kernels (cpu_attention.cpp, cpu_fused.cpp, cpu_linear.cpp, cpu_prefill.cpp, cpu_layers.cpp,
// cpu_qlinear.cpp): their dtype codes, float32 / bf16 / FP8 E4M3 (the KV cache's) element access (bf16 stored as its 16 bits; stores round to
// nearest even, as torch does), the 16-float vector type (GCC / Clang vector types: SSE, AVX2 or AVX-512, whatever
// -march=native gives) with its unaligned load (of float32, or bf16 widened) and store, lane trees for its sum and
// maximum, a vectorised exp (exp16; exp1 for one value), and the column panels' register tile (panel_tile).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define GRAPHDECODE_AMX 1
#endif

namespace graphdecode_cpu {

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat8E4M3 = 2 };

// One FP8 E4M3 (fn: no infinities, 0x7f / 0xff NaN) value as its byte: the KV cache's 1-byte element. A type of
// its own so that load / load16 / store below pick its conversions.
struct e4m3 {
  uint8_t bits;
};

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {
  uint32_t bits = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = uint16_t((bits >> 16) | 0x40u);  // NaN stays NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = uint16_t(bits >> 16);
}

// E4M3 -> float32, exact, without float32 subnormals (E4M3's smallest values would be float32 subnormals in
// the bit-shift form, slow on x86): a normal's exponent rebiased (7 -> 127), a subnormal as its mantissa * 2^-9
inline float load(const e4m3* p) {
  const uint32_t b = p->bits, magnitude = b & 0x7fu, exponent = magnitude >> 3;
  float f;
  if (exponent == 0) {
    f = float(magnitude) * 0x1p-9f;
  } else {
    const uint32_t bits = ((exponent + 120u) << 23) | ((magnitude & 7u) << 20);
    std::memcpy(&f, &bits, sizeof f);
  }
  return b & 0x80u ? -f : f;
}

// float32 -> E4M3 rounded to nearest even and saturated at +-448 (the largest finite value); NaN stays NaN.
// The same byte torch's `.clamp(-448, 448).to(torch.float8_e4m3fn)` gives.
inline void store(e4m3* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) {
    p->bits = sign | 0x7fu;
  } else if (u >= 0x43e00000u) {  // >= 448 (and +-inf): saturated
    p->bits = sign | 0x7eu;
  } else if (u < 0x3c800000u) {  // below 2^-6: a subnormal, in units of 2^-9 (8 rounds up to the first normal)
    float f;
    std::memcpy(&f, &u, sizeof f);
    p->bits = sign | uint8_t(std::nearbyint(f * 512.f));
  } else {  // a normal: 3 mantissa bits kept, rounded to nearest even, then the exponent rebiased (127 -> 7)
    const uint32_t r = (u + 0x7ffffu + ((u >> 20) & 1u)) >> 20;
    p->bits = sign | uint8_t(std::min<uint32_t>(r - (120u << 3), 0x7eu));
  }
}

// v rounded to T's precision, as a float (identity for float)
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const uint16_t*) {
  uint16_t h;
  store(&h, v);
  return load(&h);
}

typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bf16 values widened to float32 (exact); with AVX-512 one vpmovzxwd from memory and a shift (GCC splits the
// generic conversion into 256-bit halves)
inline f32x16 load16(const uint16_t* p) {
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
#if defined(__AVX512F__)  // (the masked form: GCC 12's unmasked one trips -Wmaybe-uninitialized)
  return (f32x16)((u32x16)_mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                  << 16);
#endif
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 E4M3 values widened to float32 times 2^-8 (exact): each byte moved into a half's bits (the magnitude's 7
// bits at bit 7, the sign from bit 14 carried into bit 15), which read as its value * 2^-8, then converted.
// E4M3's subnormals land on the half's, which the conversion takes at full speed (no float32 subnormal on the
// way: those cost a microcode assist a vector at the next multiply). The quantized panels fold the 2^8 into
// their scales (cpu_qlinear.cpp); load16 multiplies it back.
inline f32x16 load16_over_256(const e4m3* p) {
#if defined(__AVX512F__)
  const __m256i shifted =
      _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
  const __m256i half = _mm256_add_epi16(shifted, _mm256_and_si256(shifted, _mm256_set1_epi16(0x4000)));
  const __m512 f = _mm512_maskz_cvtph_ps(0xffff, half);  // maskz: GCC 12 warns on the plain form
  f32x16 r;
  std::memcpy(&r, &f, sizeof r);
  return r;
#else
  f32x16 r;
  for (int i = 0; i < 16; ++i) r[i] = load(p + i) * 0x1p-8f;
  return r;
#endif
}

// 16 E4M3 values widened to float32 (exact)
inline f32x16 load16(const e4m3* p) { return load16_over_256(p) * 256.f; }

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 float32 lanes (their bits) rounded to bf16 as `store` rounds one, each lane's 16 bits in the low half of its
// int32. GCC writes the generic form (store16's #else) lane by lane on AVX2, which has no unsigned compare: the
// magnitude's bits fit an int32, so a signed one is the same NaN test.
inline __m256i bf16_bits8(__m256i bits) {
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), _mm256_and_si256(high, _mm256_set1_epi32(1))),
      16);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}
#endif

// 16 float32 values rounded to bf16 lane by lane as `store` rounds one (nearest even; NaN stays NaN); with
// avx512_bf16 in one vcvtneps2bf16, which also flushes float32 subnormals (below 1.2e-38) to zero
inline void store16(uint16_t* p, f32x16 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  // in two 8-lane halves (bf16_bits8), narrowed by vpackusdw (every value fits 16 bits: nothing saturates) and its
  // 128-bit lanes put back in order
  __m256i halves[2];
  std::memcpy(halves, &v, sizeof halves);
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(halves[0]), bf16_bits8(halves[1]));  // [0-3 8-11 | 4-7 12-15]
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xd8));
#else
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, nan = (bits >> 16) | 0x40u;
  const u16x16 h = __builtin_convertvector((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded, u16x16);
  std::memcpy(p, &h, sizeof h);
#endif
}

// n float32 sums into y (float32, or bf16 rounded), each plus its value in `add` where given: 16 at a time
template <typename T>
inline void store_sums(T* y, const float* sums, int64_t n, const float* add = nullptr) {
  int64_t j = 0;
  if (add) {
    for (; j + 16 <= n; j += 16) store16(y + j, load16(sums + j) + load16(add + j));
    for (; j < n; ++j) store(y + j, sums[j] + add[j]);
  } else {
    for (; j + 16 <= n; j += 16) store16(y + j, load16(sums + j));
    for (; j < n; ++j) store(y + j, sums[j]);
  }
}

// y[j] = round(round(sums[j]) + add[j]): an output as the projection alone rounds it, plus a residual, rounded again
// (y may be add itself: each element is read before it is written)
template <typename T>
inline void store_sums_plus(T* y, const float* sums, int64_t n, const T* add) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    alignas(64) T t[16];
    store16(t, load16(sums + j));
    store16(y + j, load16(t) + load16(add + j));
  }
  for (; j < n; ++j) store(y + j, round_to(sums[j], y) + load(add + j));
}

inline f32x16 max16(f32x16 a, f32x16 b) { return a > b ? a : b; }

// The sum and the maximum of a vector's 16 lanes by a fixed tree (the same order on every call)
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline float tree_sum(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float tree_max(f32x16 v) {
  const f32x8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x8 a = lo > hi ? lo : hi;
  const f32x4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f32x4 b = c > d ? c : d;
  return std::max(std::max(b[0], b[2]), std::max(b[1], b[3]));
}

// exp(x) lane by lane: 2^n * e^r with |r| <= ln2 / 2 and Cephes' expf polynomial (about 1 ulp), n by the
// 1.5 * 2^23 rounding trick; x clamped to 88 above, and 0 below -87 (-inf included). V a float vector type, I the
// int32 vector of its width: the same operations at any width (exp16, and exp8 on AVX2), the same bits a lane.
template <typename V, typename I>
inline V exp_lanes(V x) {
  const V lo = V{} - 87.f, hi = V{} + 88.f;
  const V c = x < lo ? lo : (x > hi ? hi : x);
  const V magic = V{} + 12582912.f;
  const V n = (c * 1.44269504088896341f + magic) - magic;
  const V r = c - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < lo ? V{} : p * scale;
}

inline f32x16 exp16(f32x16 x) {
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  return exp_lanes<f32x16, i32x16>(x);
}

// exp16 of one value (the same bits as its lanes)
inline float exp1(float x) { return exp16(f32x16{} + x)[0]; }

// Column panels (cpu_linear.cpp's float weights, cpu_qlinear.cpp's dequantized blocks): PANEL output columns,
// [K][PANEL] contiguous, walked by register tiles of up to PANEL_MR rows.
constexpr int64_t PANEL = 64;  // output columns per panel: 4 vectors of 16
constexpr int PANEL_MR = 6;    // rows per register tile: 24 accumulators
constexpr int64_t LINE = 64;   // bytes per cache line

// The work of a linear as units of (row block, panel), rows_blocks x num_panels of them, taken in blocks of about
// `per_block` panels (a block's panels stay in L2 while every row block runs over them: the weights are read from
// memory once, the rows once per block) and split evenly over the threads in that order:
// unit(row_block, panel) for each, inside an OpenMP parallel region (begin() and end() bracket each thread's
// units there).
template <typename Unit, typename Begin, typename End>
void for_units(int64_t row_blocks, int64_t num_panels, int64_t per_block, int32_t threads, Unit&& unit,
               Begin&& begin, End&& end) {
  const int64_t blocks = (num_panels + per_block - 1) / per_block, units = row_blocks * num_panels;
  auto block_start = [&](int64_t block) { return block * num_panels / blocks; };
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
  {
    begin();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < units; ++i) {
      int64_t block = i / row_blocks * blocks / num_panels;  // the block holding unit i: an estimate, corrected
      while (row_blocks * block_start(block + 1) <= i) ++block;
      while (row_blocks * block_start(block) > i) --block;
      const int64_t p0 = block_start(block), width = block_start(block + 1) - p0, j = i - row_blocks * p0;
      unit(j / width, p0 + j % width);
    }
    end();
  }
}

// Panels per block of for_units: about 1 MB of them (half the L2 of a core with AMX; an L3 slice elsewhere), at least
// one.
inline int64_t panels_per_block(int64_t panel_bytes) {
  return panel_bytes < (int64_t(1) << 20) ? (int64_t(1) << 20) / panel_bytes : 1;
}

// for_units over a linear's M rows and its panels of `panel_bytes` each: unit(m0, rows, panel) for every block of
// rows [m0, m0 + rows) and panel. The rows go in as few blocks of at most `most` as cover them, as even as register
// tiles of `tile` rows allow (80 rows as 42 + 38, not 64 + 16: the thread holding the 64 would take twice as long as
// the split needs); no block is empty. With more than one block, the panels go in L2-sized blocks (panels_per_block).
template <typename Unit>
void for_row_blocks(int64_t M, int64_t most, int64_t tile, int64_t num_panels, int64_t panel_bytes, int32_t threads,
                    Unit&& unit) {
  const int64_t count = (M + most - 1) / most;
  if (count == 0) return;
  const int64_t rows = std::min(most, ((M + count - 1) / count + tile - 1) / tile * tile);
  const int64_t per_block = count > 1 ? panels_per_block(panel_bytes) : 1;
  for_units(count, num_panels, per_block, threads, [&](int64_t b, int64_t p) {
    const int64_t m0 = b * rows;
    unit(m0, std::min(rows, M - m0), p);
  }, [] {}, [] {});
}

#if defined(__AVX512F__)
// sums[R][PANEL] += x[R rows][k0:k1] @ panel[k0:k1][PANEL]; meanwhile `lines` cache lines from pf on are
// prefetched, `per_k` of them at each of the first k steps (the steps that prefetch run as a loop of their own,
// one line a step where per_k is 1: the steps after them carry no prefetch bookkeeping)
template <int R, typename TW>
inline void panel_tile_f32(const float* __restrict x, int64_t ldx, const TW* __restrict panel, int64_t k0,
                           int64_t k1, float* __restrict sums, const char* pf, int64_t lines, int64_t per_k) {
  f32x16 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = load16(sums + m * PANEL + 16 * v);
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    const TW* w = panel + k * PANEL;
    const f32x16 w0 = load16(w), w1 = load16(w + 16), w2 = load16(w + 32), w3 = load16(w + 48);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const float a = load(x + m * ldx + k);
      acc[m][0] += a * w0;
      acc[m][1] += a * w1;
      acc[m][2] += a * w2;
      acc[m][3] += a * w3;
    }
  };
  int64_t k = k0;
  if (lines > 0 && per_k > 0) {
    const int64_t prefetching = std::min(k1 - k0, (lines + per_k - 1) / per_k);
    if (per_k == 1) {
      for (; k < k0 + prefetching; ++k, pf += LINE) {
        __builtin_prefetch(pf, 0, 3);
        step(k);
      }
    } else {
      for (; k < k0 + prefetching; ++k) {
        for (int64_t l = 0; l < per_k && lines > 0; ++l, --lines, pf += LINE) __builtin_prefetch(pf, 0, 3);
        step(k);
      }
    }
  }
  for (; k < k1; ++k) step(k);
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) store16(sums + m * PANEL + 16 * v, acc[m][v]);
}
#else
// The same tile where vectors are 8 floats and 16 registers (AVX2, SSE): R rows x 8 G columns at a time, in passes
// over the panel's columns (panel_pass: G = 8 at one row, 4 at two (and three, fp32), else 2; 12 accumulators at
// R = 3 and 6, with the weight vectors and the broadcast 15-17), in native 8-float vectors: GCC lowers the 16-float
// vector type without AVX-512 through memory, piece by piece, and a tile of 64 columns would need 8R accumulators
// anyway (that form ran 5-20x slower than oneDNN on a 2-core Zen 3). Each output still sums its k in order from the
// same start: the same bits at any row count. (f32x8, load8 and store8 serve the other kernels' tiles without
// AVX-512 too.)
typedef float f32x8 __attribute__((vector_size(32)));

// a * b + c rounded once where the CPU has FMA (written out: whether GCC contracts a * b + c depends on the
// context it inlines into, and two tiles that must give the same bits must not differ in it)
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) {
#if defined(__FMA__)
  const __m256 r = _mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
  return (f32x8)r;
#else
  return a * b + c;
#endif
}

inline f32x8 splat8(float a) { return f32x8{a, a, a, a, a, a, a, a}; }

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x8 load8(const uint16_t* p) {  // 8 bf16 values widened to float32 (exact)
#if defined(__AVX2__)
  // one vpmovzxwd from memory and a shift (GCC writes the generic form below as two 128-bit widenings, a byte shift
  // and an insert: 4 instructions where this is 2, in every bf16 panel step)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (f32x8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 bits = __builtin_convertvector(h, u32x8) << 16;
  f32x8 f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// 8 E4M3 values widened to float32 times 2^-8 (exact), as load16_over_256: with F16C each byte moved into a
// half's bits and converted by vcvtph2ps (0x7f / 0xff, E4M3's NaN, read as 480 x 2^-8 there, as with AVX-512)
inline f32x8 load8_over_256(const e4m3* p) {
#if defined(__F16C__)
  const __m128i shifted = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
  const __m128i half = _mm_add_epi16(shifted, _mm_and_si128(shifted, _mm_set1_epi16(0x4000)));
  return (f32x8)_mm256_cvtph_ps(half);
#else
  f32x8 f;
  for (int i = 0; i < 8; ++i) f[i] = load(p + i) * 0x1p-8f;
  return f;
#endif
}

inline f32x8 load8(const e4m3* p) { return load8_over_256(p) * 256.f; }  // 8 E4M3 values as float32 (exact)

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

#if defined(__AVX2__)
inline void store8(uint16_t* p, f32x8 v) {  // 8 values rounded to bf16 as store16 rounds them
  const __m256i bits = bf16_bits8((__m256i)v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// a value rounded to the dtype and read back, 8 lanes (bf16: what store8 then load8 give)
inline f32x8 round8(f32x8 v, const uint16_t*) { return (f32x8)_mm256_slli_epi32(bf16_bits8((__m256i)v), 16); }
inline f32x8 round8(f32x8 v, const float*) { return v; }

// exp16 on 8 lanes: the same operations, lane for lane
inline f32x8 exp8(f32x8 x) {
  typedef int32_t i32x8 __attribute__((vector_size(32)));
  return exp_lanes<f32x8, i32x8>(x);
}
#endif

// an 8-float vector held in a register from here on (the compiler folds a vector it can reload into each FMA that
// uses it as a memory operand)
inline void pin8(f32x8& v) {
#if defined(__AVX__)
  __asm__("" : "+x"(v));
#else
  (void)v;
#endif
}

// R rows x 8 G columns a pass (R G accumulators), 8 / G passes over the panel: G = 8 at one row (the whole panel in
// one pass: eight independent FMA chains, where one 16-column quarter's two chains would wait on the FMA's latency),
// 4 at two rows and at three of float32 weights (three rows at G = 2 ran six chains; G = 4, 12 accumulators beside
// the 4 weight vectors and the broadcast, made an fp32 decode step at batch 3 1.07x faster, a bf16 one, whose
// weights widen in registers too, 0.88x), 2 from four on (four rows at G = 4: the same decode, 0.92x prefill).
// Where R > 1 each step loads its G weight vectors into registers once (pin8): folded into every row's FMA they
// would cost 3 R loads a step for 2 R FMAs at R = 2-4, more than the two 256-bit loads a cycle a Zen 3 takes.
template <int R, int G, typename TW>
inline void panel_pass(const float* __restrict x, int64_t ldx, const TW* __restrict panel, int64_t k0, int64_t k1,
                       float* __restrict sums, int64_t col, const char* pf, int64_t lines, int64_t per_k) {
  static_assert((R == 1 && G == 8) || (R > 1 && (G == 2 || G == 4)), "a pass shape panel_tile_f32 chooses");
  f32x8 acc[R][G];
  for (int m = 0; m < R; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = load8(sums + m * PANEL + col + 8 * g);
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    const TW* w = panel + k * PANEL + col;
    if constexpr (G == 8) {
      const f32x8 a = splat8(load(x + k));
      for (int g = 0; g < 8; ++g) acc[0][g] = fma8(a, load8(w + 8 * g), acc[0][g]);
    } else if constexpr (G == 4) {
      f32x8 w0 = load8(w), w1 = load8(w + 8), w2 = load8(w + 16), w3 = load8(w + 24);
      pin8(w0), pin8(w1), pin8(w2), pin8(w3);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        const f32x8 a = splat8(load(x + m * ldx + k));
        acc[m][0] = fma8(a, w0, acc[m][0]);
        acc[m][1] = fma8(a, w1, acc[m][1]);
        acc[m][2] = fma8(a, w2, acc[m][2]);
        acc[m][3] = fma8(a, w3, acc[m][3]);
      }
    } else {
      f32x8 w0 = load8(w), w1 = load8(w + 8);
      pin8(w0), pin8(w1);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        const f32x8 a = splat8(load(x + m * ldx + k));
        acc[m][0] = fma8(a, w0, acc[m][0]);
        acc[m][1] = fma8(a, w1, acc[m][1]);
      }
    }
  };
  int64_t k = k0;
  if (lines > 0 && per_k > 0) {
    const int64_t prefetching = std::min(k1 - k0, (lines + per_k - 1) / per_k);
    for (; k < k0 + prefetching; ++k) {
      for (int64_t l = 0; l < per_k && lines > 0; ++l, --lines, pf += LINE) __builtin_prefetch(pf, 0, 3);
      step(k);
    }
  }
  for (; k < k1; ++k) step(k);
  for (int m = 0; m < R; ++m)
    for (int g = 0; g < G; ++g) store8(sums + m * PANEL + col + 8 * g, acc[m][g]);
}

template <int R, typename TW>
inline void panel_tile_f32(const float* __restrict x, int64_t ldx, const TW* __restrict panel, int64_t k0,
                           int64_t k1, float* __restrict sums, const char* pf, int64_t lines, int64_t per_k) {
  constexpr int G = R == 1 ? 8 : R == 2 || (R == 3 && std::is_same<TW, float>::value) ? 4 : 2, PASSES = 8 / G;
  // the tile's prefetches spread over every pass's steps (all in the first pass, they held up its FMAs: 4 rows
  // took a third longer than 1)
  const int64_t share = (lines + PASSES - 1) / PASSES, steps = std::max<int64_t>(k1 - k0, 1);
  (void)per_k;
  for (int64_t col = 0; col < PANEL; col += 8 * G) {
    const int64_t mine = std::min(lines, share);
    panel_pass<R, G>(x, ldx, panel, k0, k1, sums, col, pf, mine, (mine + steps - 1) / steps);
    pf += mine * LINE;
    lines -= mine;
  }
}
#endif

// o[0:n] = silu(g) * u, torch's roundings (transformers' SwiGLU in the dtype): silu in float rounded to T, the
// product rounded to T; silu(x) = x / (1 + exp(-x)) with exp16 (about 1 ulp from torch's). Elementwise: a
// value's bits depend on nothing else. Never inlined nor specialised: every caller (cpu_fused.cpp's pass,
// cpu_linear.cpp's gated projection) runs this one copy, so the compiler's contractions cannot differ with the
// caller's context.
#if defined(__clang__)
#define GRAPHDECODE_ONE_COPY __attribute__((noinline))
#else
#define GRAPHDECODE_ONE_COPY __attribute__((noipa))
#endif
template <typename T>
GRAPHDECODE_ONE_COPY void swiglu_row(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // 8 lanes a step in AVX2's own vectors, the same operations lane for lane (exp8, round8): the 16-float type's
  // silu went through the stack there (a bf16 decode at batch 16 spent 5-6% of its time in this loop)
  for (; i + 8 <= n; i += 8) {
    const f32x8 x = load8(g + i);
    store8(o + i, round8(x / (1.f + exp8(-x)), o) * load8(u + i));
  }
#else
  for (; i + 16 <= n; i += 16) {
    const f32x16 x = load16(g + i);
    alignas(64) T silu[16];
    store16(silu, x / (1.f + exp16(-x)));
    store16(o + i, load16(silu) * load16(u + i));
  }
#endif
  for (; i < n; ++i) {
    const float x = load(g + i);
    store(o + i, round_to(x / (1.f + exp1(-x)), o) * load(u + i));
  }
}

// swiglu_row over float32 sums of a gated projection's gate and up columns (n <= 64), each first rounded to T as
// the projection's own output would be: the same bits as the projection written out, then swiglu_row
template <typename T>
inline void swiglu_sums(T* o, const float* g, const float* u, int64_t n) {
  alignas(64) T gt[64], ut[64];
  store_sums(gt, g, n);
  store_sums(ut, u, n);
  swiglu_row(gt, ut, o, n);
}

// n elements of a bf16 or FP8 row as float32 (exact), a vector at a time: 16 with AVX-512, else 8 (load8; GCC
// writes a 16-float widening there in 128-bit pieces through the stack)
template <typename TX>
inline void widen(const TX* src, float* dst, int64_t n) {
#if defined(__AVX512F__)
  constexpr int64_t W = 16;
  auto vector = [&](int64_t i) { store16(dst + i, load16(src + i)); };
#else
  constexpr int64_t W = 8;
  auto vector = [&](int64_t i) { store8(dst + i, load8(src + i)); };
#endif
  const int64_t full = n - n % W;
  for (int64_t i = 0; i < full; i += W) vector(i);
  for (int64_t i = full; i < n; ++i) dst[i] = load(src + i);
}

// panel_tile_f32 over rows of float32, or of bf16 widened to float32 once per k block (exact: the same bits); read
// inside the tile, a bf16 x[k] costs a load, a shift and a broadcast for every two FMAs (AVX2: per k, 16-column
// quarter and row) or four (AVX-512), more instructions than the FMAs themselves.
template <int R, typename TX, typename TW>
inline void panel_tile(const TX* __restrict x, int64_t ldx, const TW* __restrict panel, int64_t k0, int64_t k1,
                       float* __restrict sums, const char* pf, int64_t lines, int64_t per_k) {
  if constexpr (std::is_same<TX, float>::value) {
    panel_tile_f32<R>(x, ldx, panel, k0, k1, sums, pf, lines, per_k);
  } else {
    constexpr int64_t CHUNK = 128;  // k a pass (panel_linear's blocks are 64 or 128): R x 512 bytes of stack
    alignas(64) float wide[R * CHUNK];
    for (int64_t c0 = k0; c0 < k1; c0 += CHUNK) {
      const int64_t n = std::min(CHUNK, k1 - c0);
      for (int m = 0; m < R; ++m) widen(x + m * ldx + c0, wide + m * CHUNK, n);
      // the prefetches go out with the first pass's steps
      panel_tile_f32<R>(wide, CHUNK, panel + c0 * PANEL, 0, n, sums, pf, c0 == k0 ? lines : 0, per_k);
    }
  }
}

template <typename TX, typename TW>
inline void panel_tile_rows(int64_t rows, const TX* x, int64_t ldx, const TW* panel, int64_t k0, int64_t k1,
                            float* sums, const char* pf, int64_t lines, int64_t per_k) {
  switch (rows) {
    case 6: panel_tile<6>(x, ldx, panel, k0, k1, sums, pf, lines, per_k); break;
    case 5: panel_tile<5>(x, ldx, panel, k0, k1, sums, pf, lines, per_k); break;
    case 4: panel_tile<4>(x, ldx, panel, k0, k1, sums, pf, lines, per_k); break;
    case 3: panel_tile<3>(x, ldx, panel, k0, k1, sums, pf, lines, per_k); break;
    case 2: panel_tile<2>(x, ldx, panel, k0, k1, sums, pf, lines, per_k); break;
    default: panel_tile<1>(x, ldx, panel, k0, k1, sums, pf, lines, per_k); break;
  }
}

#if defined(GRAPHDECODE_AMX)
// Whether this process may use the tile registers: Linux grants the AMX state on request (ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA), once per process; refused (an old kernel), the bf16 kernels run vdpbf16ps instead.
inline bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ready;
}

// The one tile shape of the AMX kernels (cpu_linear.cpp, cpu_prefill.cpp), loaded by each thread before its
// first tile instruction (and _tile_release() after its last): all 8 tiles 16 rows of 64 bytes, 16 float32
// sums, 32 bf16 of a row, or 16 pairs of bf16 of a k-pair row. The configuration lives in static memory: the
// compiler does not see ldtilecfg read it, and could drop the stores of one built on the stack.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline void amx_configure() {
  alignas(64) static const TileConfig config = {
      1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
  _tile_loadconfig(&config);
}

// The kernels' common step, 16 rows against 16 NV columns (NV 4 or 2): tmm0..NV-1 += tmm4 (16 rows of 32 bf16 at
// a, rows lda bytes apart) times NV tiles of 16 pairs of 16 columns (at b, b + 32, ..., pair rows ldb bytes apart)
template <int NV = 4>
inline void amx_rows_times(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb) {
  static_assert(NV == 2 || NV == 4, "64 or 32 columns");
  _tile_loadd(4, a, lda);
  _tile_loadd(5, b, ldb);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, b + 32, ldb);
  _tile_dpbf16ps(1, 4, 6);
  if constexpr (NV == 4) {
    _tile_loadd(7, b + 64, ldb);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 96, ldb);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// tmm0..NV-1 from / to 16 NV float32 columns of 16 rows at p (rows ld bytes apart), or zeroed
template <int NV = 4>
inline void amx_load(const float* p, int64_t ld) {
  _tile_loadd(0, p, ld);
  _tile_loadd(1, p + 16, ld);
  if constexpr (NV == 4) {
    _tile_loadd(2, p + 32, ld);
    _tile_loadd(3, p + 48, ld);
  }
}

template <int NV = 4>
inline void amx_store(float* p, int64_t ld) {
  _tile_stored(0, p, ld);
  _tile_stored(1, p + 16, ld);
  if constexpr (NV == 4) {
    _tile_stored(2, p + 32, ld);
    _tile_stored(3, p + 48, ld);
  }
}

inline void amx_zero() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
#endif

}  // namespace graphdecode_cpu
