// Shared by the CPU kernels (cpu_attention.cpp, cpu_fused.cpp): their dtype codes, float32 /
// bf16 element access (bf16 stored as its 16 bits; stores round to nearest even, as torch does),
// a vectorisable exp, and 16-lane vectors for reductions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace graphdecode_cpu {

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

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

// v rounded to T's precision, as a float (identity for float)
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const uint16_t*) {
  uint16_t h;
  store(&h, v);
  return load(&h);
}

// exp(x): 2^n * e^r with |r| <= ln2 / 2 and Cephes' expf polynomial (about 1 ulp), branch-free
// so loops over it vectorise (std::nearbyint, not std::floor: GCC 12 vectorises no loop calling
// floor). Below -87.3, 0 (no denormals); above 88.7, inf. 2^n is two exponent-bit scales, so n
// may reach 128.
inline float exp_approx(float x) {
  const float c = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(c * 1.44269504088896341f);
  const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t n1 = static_cast<int32_t>(n) / 2, n2 = static_cast<int32_t>(n) - n1;
  float s1, s2;
  const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  const float y = p * s1 * s2;
  return x < -87.3f ? 0.f : (x > 88.7f ? std::numeric_limits<float>::infinity() : y);
}

// Reductions in LANES independent partial sums combined by a fixed tree, written with GCC /
// Clang vector types (SSE, AVX2 or AVX-512, whatever -march=native gives): a plain
// `omp simd reduction` over floats is folded left to right by GCC 12, one dependent add per
// element (16 serial adds for one 32-wide dot), and a tree over a stack array stalls on
// store forwarding. The order is the same on every call.
constexpr int64_t LANES = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline float tree_sum(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline f32x16 max16(f32x16 a, f32x16 b) { return a > b ? a : b; }

inline float tree_max(f32x16 v) {
  const f32x8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x8 a = lo > hi ? lo : hi;
  const f32x4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f32x4 b = c > d ? c : d;
  return std::max(std::max(b[0], b[2]), std::max(b[1], b[3]));
}

}  // namespace graphdecode_cpu
