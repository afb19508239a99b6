// One decode step of the gated delta rule (models/gated_deltanet.py) on the CPU, in place on the state cache.
//
// For each row r whose slot s = slots[r] is not the scratch slot 0, and each of its heads h, with S the
// float32 matrix state[s, h] (Dk x Dv):
//   S *= exp(decay[r, h]);   delta = (v - S^T k) * beta[r, h];   S += k delta^T;   out[r, h] = S^T q
// Torch's form (gather the rows' states, a state-sized product per term, scatter back) passes over each state
// about ten times; here each head's state is read twice and written twice while it sits in cache (pass one:
// decay and S^T k; pass two: the rank-one update and S^T q). Rows with the scratch slot (padded or finished
// rows, whose outputs nothing reads) are skipped and get zeros, so no two threads write one state. (row, head)
// pairs go over OpenMP threads; a pair's arithmetic is the same on any thread. Float32 in and out.
//
// Same ABI conventions as cpu_attention.cpp (raw pointers, extern "C", ctypes).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace {

void delta_head(float* s, const float* q, const float* k, const float* v, float decay, float beta, float* out,
                int64_t dk, int64_t dv, float* delta) {
  const float g = std::exp(decay);
  for (int64_t j = 0; j < dv; ++j) delta[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {  // S *= g, and S^T k
    float* row = s + i * dv;
    const float ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= g;
      delta[j] += row[j] * ki;
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = (v[j] - delta[j]) * beta;
    out[j] = 0.0f;
  }
  for (int64_t i = 0; i < dk; ++i) {  // S += k delta^T, and S^T q
    float* row = s + i * dv;
    const float ki = k[i], qi = q[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * delta[j];
      out[j] += row[j] * qi;
    }
  }
}

}  // namespace

extern "C" {

// state [num_slots, heads, dk, dv] float32 (updated in place); slots [rows] int64; q, k [rows, heads, dk],
// v and out [rows, heads, dv], decay and beta [rows, heads]: float32, contiguous.
int graphdecode_cpu_delta_step(float* state, const int64_t* slots, const float* q, const float* k, const float* v,
                               const float* decay, const float* beta, float* out, int64_t rows, int64_t heads,
                               int64_t dk, int64_t dv, int64_t num_slots, int32_t threads) {
  if (rows < 0 || heads <= 0 || dk <= 0 || dv <= 0 || threads < 1) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    if (slots[r] < 0 || slots[r] >= num_slots) return 2;
  }
  const int64_t pairs = rows * heads;
#pragma omp parallel num_threads(threads) if (threads > 1 && pairs > 1)
  {
    std::vector<float> delta(dv);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t r = p / heads, h = p % heads;
      float* o = out + p * dv;
      if (slots[r] == 0) {
        std::memset(o, 0, sizeof(float) * dv);
        continue;
      }
      delta_head(state + (slots[r] * heads + h) * dk * dv, q + p * dk, k + p * dk, v + p * dv, decay[p], beta[p], o,
                 dk, dv, delta.data());
    }
  }
  return 0;
}

}  // extern "C"
