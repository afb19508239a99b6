// Shared by the CPU kernels (cpu_attention.cpp, cpu_fused.cpp, cpu_linear.cpp): their dtype codes,
// float32 / bf16 element access (bf16 stored as its 16 bits; stores round to nearest even, as torch
// does), and the 16-float vector type (GCC / Clang vector types: SSE, AVX2 or AVX-512, whatever
// -march=native gives) with its unaligned load (of float32, or bf16 widened) and store.
#pragma once

#include <cstdint>
#include <cstring>

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

typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bf16 values widened to float32 (exact)
inline f32x16 load16(const uint16_t* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline f32x16 max16(f32x16 a, f32x16 b) { return a > b ? a : b; }

}  // namespace graphdecode_cpu
