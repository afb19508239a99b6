// Gumbel-max sampling in one pass on the CPU (device/sampler.py's Sampler.draw and rejection.py's residual
// draw). For each row r of logits [rows, vocab]:
//
//   token[r] = argmax_v  logits[r, v] - log(-log(u(r, v)))
//   u(r, v)  = ((lowbias32(key[r] ^ vocab_key[v]) >> 9) + 0.5) / 2^23
//
// with key[r] the row's 32-bit key of its (seed, position) and vocab_key[v] the token's (sampler.py's row_keys
// and make_vocab_keys). u is the sampler's to the bit; the two logarithms are Cephes' logf polynomial (within about
// an ulp of torch's), so a token differs from torch's form only where two tokens' perturbed logits are that
// close. Torch's form writes ten [rows, vocab] tensors; this reads the logits once and writes nothing else.
// Ties go to the lowest index and a NaN wins (the first one), as torch.argmax does. A row's vocabulary is cut
// into `threads` slices where there are fewer rows than threads; the answer is the same however it is cut.
//
// Same ABI conventions as cpu_attention.cpp (raw pointers, extern "C", ctypes).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace {

// 8 lanes: 256-bit vectors, native on AVX2 (GCC lowers 512-bit generic compares and selects lane by lane there)
using graphdecode_cpu::f32x8;
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// log(x) for positive normal x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(1 + f) by Cephes' logf polynomial
// in f = m - 1, e ln 2 added in two parts
inline f32x8 log8(f32x8 x) {
  i32x8 bits;
  std::memcpy(&bits, &x, sizeof bits);
  i32x8 e = ((bits >> 23) & 0xff) - 126;
  const i32x8 mbits = (bits & 0x807fffff) | 0x3f000000;  // m in [0.5, 1)
  f32x8 m;
  std::memcpy(&m, &mbits, sizeof m);
  const i32x8 small = m < 0.707106781186547524f;  // -1 where m < sqrt(1/2): 2m - 1, and one less e
  e += small;
  const f32x8 f = small ? m + m - 1.f : m - 1.f;
  const f32x8 ef = __builtin_convertvector(e, f32x8);
  const f32x8 z = f * f;
  f32x8 y = f32x8{} + 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z + ef * -2.12194440e-4f - z * 0.5f;
  return f + y + ef * 0.693359375f;
}

// 8 tokens' Gumbel noise from their vocabulary keys (u32) and the row's key
inline f32x8 gumbel8(uint32_t row_key, u32x8 vocab_keys) {
  u32x8 h = vocab_keys ^ row_key;
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  const i32x8 bits = reinterpret_cast<i32x8>(h >> 9);  // below 2^23: a signed conversion is exact (AVX2 has no
  const f32x8 u = (__builtin_convertvector(bits, f32x8) + 0.5f) * (1.f / 8388608.f);  // unsigned one)
  return -log8(-log8(u));
}

struct Best {
  float value;
  int64_t index;
  bool nan;  // a NaN was seen at `index` (the first): it wins
};

// argmax over tokens [v0, v1) of one row (vocab_keys: the sampler's, as u32)
Best best_of(const float* logits, uint32_t row_key, const uint32_t* vocab_keys, int64_t v0, int64_t v1) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  f32x8 best = f32x8{} + neg_inf;
  i32x8 at = i32x8{} - 1;
  i32x8 lane;
  for (int i = 0; i < 8; ++i) lane[i] = i;
  i32x8 nan = i32x8{};
  int64_t v = v0;
  for (; v + 8 <= v1; v += 8) {
    u32x8 keys;
    std::memcpy(&keys, vocab_keys + v, sizeof keys);
    f32x8 x;
    std::memcpy(&x, logits + v, sizeof x);
    const f32x8 value = x + gumbel8(row_key, keys);
    nan |= value != value;
    const i32x8 better = value > best;  // strict: a lane keeps its first (lowest) index of a tie
    best = better ? value : best;
    at = better ? lane + int32_t(v) : at;
  }
  for (int i = 0; i < 8; ++i)
    if (nan[i]) {  // rare: a NaN logit (the noise is finite); the first one
      for (int64_t w = v0;; ++w)
        if (logits[w] != logits[w]) return Best{0.f, w, true};
    }
  Best out{neg_inf, -1, false};
  for (int i = 0; i < 8; ++i)
    if (at[i] >= 0 && (best[i] > out.value || (best[i] == out.value && (out.index < 0 || at[i] < out.index)))) {
      out.value = best[i];
      out.index = at[i];
    }
  for (; v < v1; ++v) {  // the tail: each token through the same lanes (lane 0's bits)
    const float value = logits[v] + gumbel8(row_key, u32x8{} + vocab_keys[v])[0];
    if (value != value) return Best{0.f, v, true};
    if (value > out.value) {
      out.value = value;
      out.index = v;
    }
  }
  if (out.index < 0) out.index = v0;  // every logit -inf: the first token, as torch.argmax
  return out;
}

// the earlier slice's answer unless the later one's is larger (slices in vocabulary order)
Best join(const Best& a, const Best& b) {
  if (a.nan) return a;
  if (b.nan || b.value > a.value) return b;
  return a;
}

inline uint32_t hash32(uint32_t x) {  // lowbias32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// sampler.py's row_keys: a (seed, position) pair's 32-bit key
inline uint32_t row_key(int64_t seed, int64_t position) {
  const uint64_t s = uint64_t(seed);
  uint32_t key = hash32(uint32_t(s) ^ 0x9E3779B9u);
  key = hash32(key ^ uint32_t(s >> 32));
  return hash32(key ^ uint32_t(uint64_t(position)));
}

}  // namespace

extern "C" {

// logits [rows, vocab] float32 (row stride ld), seeds and positions [rows] int64, vocab_keys [vocab] int32 ->
// out [rows] int64. 0 on success; 1 on bad arguments.
int graphdecode_cpu_gumbel_argmax(const float* logits, int64_t rows, int64_t vocab, int64_t ld, const int64_t* seeds,
                                  const int64_t* positions, const int32_t* vocab_keys, int64_t* out,
                                  int32_t threads) {
  if (rows < 0 || vocab <= 0 || ld < vocab || !logits || !seeds || !positions || !vocab_keys || !out) return 1;
  if (rows == 0) return 0;
  const int64_t slices = rows < threads ? std::min<int64_t>(threads, (vocab + 4095) / 4096) : 1;
  const int64_t tasks = rows * slices;
  std::vector<Best> found(tasks);
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(vocab_keys);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r = t / slices, s = t % slices;
    const int64_t v0 = vocab * s / slices / 8 * 8, v1 = s + 1 == slices ? vocab : vocab * (s + 1) / slices / 8 * 8;
    found[t] = best_of(logits + r * ld, row_key(seeds[r], positions[r]), keys, v0, v1);
  }
  for (int64_t r = 0; r < rows; ++r) {
    Best best = found[r * slices];
    for (int64_t s = 1; s < slices; ++s) best = join(best, found[r * slices + s]);
    out[r] = best.index;
  }
  return 0;
}

}  // extern "C"
