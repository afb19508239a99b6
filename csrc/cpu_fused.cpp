// Fused elementwise work of a decoder layer on the CPU: one pass where torch runs several ops.
//
// A decode step at batch 1-64 on a CPU spends a tenth of its time in small elementwise ops
// (RMSNorm is six, rotary ten), each a pass over memory plus a dispatch. These kernels do
// each in one pass, with torch's arithmetic and roundings, op for op, so they give torch's
// results up to the order of a sum (RMSNorm's mean of squares; rotary is bit for bit):
//   add_rms_norm  s = x (+ residual, rounded to the dtype); y = weight * round(s * rsqrt(mean(s^2) + eps))
//                 (transformers' LlamaRMSNorm: the normalised value rounded to the dtype, then
//                 multiplied by the weight and rounded again)
//   rope          out = round(round(x * cos) + round(rotate_half(x) * sin)) for q and k, the cos /
//                 sin rows of each token's position (full rotary: every dim rotates)
//   swiglu        out = round(round(silu(gate)) * up) over a fused [gate | up] row
// Rows (tokens) go over OpenMP threads (torch's pool, as in cpu_linear.cpp) once a call has
// PARALLEL_MIN elements: a row's arithmetic is the same on any thread, so its result is too.
// fp32 or bf16 tensors; float32 arithmetic in between. No fused multiply-add is formed
// (fp-contract off below): torch rounds each product.
//
// Also the structured-outputs step's two small pieces, where torch needs many small ops: a token
// mask from packed words (four passes in torch) and the automaton's advance (a 16-step binary
// search, ~110 ops in torch; here std::lower_bound per row).
//
// Same ABI conventions as cpu_attention.cpp (raw pointers, extern "C", ctypes).

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_common.h"

namespace {

using namespace graphdecode_cpu;

constexpr int64_t PARALLEL_MIN = 1 << 15;  // elements: below this a call stays on its thread (a fork costs µs)

// mode (NormMode): how the weight scales the normalised value (see graphdecode_cpu_rms_norm_variant)
enum NormMode : int32_t { kLlama = 0, kOffsetFloat = 1, kWeightFloat = 2 };

template <typename T>
void add_rms_norm(const T* x, const T* residual, const T* weight, T* out, T* sum, int64_t rows, int64_t hidden,
                  int64_t x_stride, float eps, int32_t threads, int32_t mode = kLlama) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * hidden >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    const T* rr = residual ? residual + r * hidden : nullptr;
    T* sr = sum ? sum + r * hidden : nullptr;
    T* orow = out + r * hidden;
    float acc = 0.f;
    if (rr) {
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < hidden; ++i) {
        const float s = round_to(load(xr + i) + load(rr + i), xr);
        store(sr + i, s);
        acc += s * s;
      }
    } else {
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < hidden; ++i) {
        const float s = load(xr + i);
        acc += s * s;
      }
    }
    const float inv = 1.f / std::sqrt(acc / float(hidden) + eps);
    const T* src = rr ? sr : xr;
    if (mode == kLlama) {
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) store(orow + i, load(weight + i) * round_to(load(src + i) * inv, src));
    } else {  // Gemma's (1 + w) and gpt-oss's w, times the float32 normalised value, rounded once
      const float offset = mode == kOffsetFloat ? 1.f : 0.f;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) store(orow + i, (load(src + i) * inv) * (offset + load(weight + i)));
    }
  }
}

template <typename T>
void rope_heads(const T* in, T* out, const T* cos, const T* sin, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = in + h * dim;
    T* y = out + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {  // first half: x * cos - x2 * sin (rotate_half: -x2)
      const float a = round_to(load(x + i) * load(cos + i), x);
      const float b = round_to(-load(x + half + i) * load(sin + i), x);
      store(y + i, a + b);
    }
#pragma omp simd
    for (int64_t i = half; i < dim; ++i) {  // second half: x * cos + x1 * sin
      const float a = round_to(load(x + i) * load(cos + i), x);
      const float b = round_to(load(x + i - half) * load(sin + i), x);
      store(y + i, a + b);
    }
  }
}

template <typename T>
void rope(const T* q, const T* k, T* q_out, T* k_out, const T* cos, const T* sin, const int64_t* positions,
          int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t dim, int64_t q_stride, int64_t k_stride,
          int32_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (threads > 1 && tokens * (q_heads + k_heads) * dim >= PARALLEL_MIN)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + positions[t] * dim;
    const T* s = sin + positions[t] * dim;
    rope_heads(q + t * q_stride, q_out + t * q_heads * dim, c, s, q_heads, dim);
    rope_heads(k + t * k_stride, k_out + t * k_heads * dim, c, s, k_heads, dim);
  }
}

// silu(gate) * up over rows [gate | up] of 2 * inter -> rows of inter (cpu_common.h's swiglu_row)
template <typename T>
void swiglu(const T* gate_up, T* out, int64_t rows, int64_t inter, int32_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * inter >= PARALLEL_MIN)
  for (int64_t m = 0; m < rows; ++m) swiglu_row(gate_up + m * 2 * inter, gate_up + m * 2 * inter + inter,
                                                out + m * inter, inter);
}

}  // namespace

extern "C" {

// Token masks (compiled/token_mask.py): logits [R, V] float32 (row stride logits_stride) get -inf at
// every token whose bit is clear in its row's packed words [R, W] int32, in the rows where active[r].
int graphdecode_cpu_mask_words(float* logits, const int32_t* words, const uint8_t* active, int64_t rows,
                               int64_t vocab, int64_t num_words, int64_t logits_stride) {
  if (rows < 0 || vocab <= 0 || num_words * 32 < vocab || logits_stride < vocab) return 1;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    if (!active[r]) continue;
    float* row = logits + r * logits_stride;
    const uint32_t* w = reinterpret_cast<const uint32_t*>(words + r * num_words);
    for (int64_t t = 0; t < vocab; ++t) {
      if (!((w[t >> 5] >> (t & 31)) & 1u)) row[t] = neg_inf;
    }
  }
  return 0;
}

// Constraint automata (compiled/structured_tables.py): each row's next state after its token, the
// state's exception for that token (exc_tokens sorted within a state's slice) or its default.
int graphdecode_cpu_automaton_advance(const int32_t* states, const int64_t* tokens, const int32_t* exc_start,
                                      const int32_t* exc_count, const int32_t* exc_tokens, const int32_t* exc_next,
                                      const int32_t* default_next, int32_t* out, int64_t rows, int64_t num_states,
                                      int64_t num_exceptions) {
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t state = states[r];
    if (state < 0 || state >= num_states) return 1;
    const int64_t start = exc_start[state], count = exc_count[state];
    if (start < 0 || count < 0 || start + count > num_exceptions) return 2;
    const int32_t* first = exc_tokens + start;
    const int32_t* at = std::lower_bound(first, first + count, int32_t(tokens[r]));
    out[r] = (at != first + count && *at == tokens[r]) ? exc_next[at - exc_tokens] : default_next[state];
  }
  return 0;
}

// add_rms_norm by mode: 0 LlamaRMSNorm; 1 Gemma's y = round(s * rsqrt(mean(s^2) + eps) * (1 + weight)); 2
// gpt-oss's y = round(s * rsqrt(...) * weight), the product in float32 (transformers' Gemma3RMSNorm and
// GptOssRMSNorm). Each row's sum runs in the same order whatever the rows.
int graphdecode_cpu_rms_norm_variant(const void* x, const void* residual, const void* weight, void* out, void* sum,
                                     int64_t rows, int64_t hidden, int64_t x_stride, float eps, int32_t mode,
                                     int32_t dtype, int32_t threads) {
  if (rows < 0 || hidden <= 0 || x_stride < hidden || (residual && !sum) || threads < 1 || mode < 0 || mode > 2)
    return 1;
  if (dtype == kFloat32) {
    add_rms_norm(static_cast<const float*>(x), static_cast<const float*>(residual), static_cast<const float*>(weight),
                 static_cast<float*>(out), static_cast<float*>(sum), rows, hidden, x_stride, eps, threads, mode);
  } else if (dtype == kBFloat16) {
    add_rms_norm(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
                 static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), static_cast<uint16_t*>(sum), rows,
                 hidden, x_stride, eps, threads, mode);
  } else {
    return 2;
  }
  return 0;
}

// The Llama form (mode 0 of the variants above), which the decoder layers' one call (cpu_layers.cpp) runs.
int graphdecode_cpu_add_rms_norm(const void* x, const void* residual, const void* weight, void* out, void* sum,
                                 int64_t rows, int64_t hidden, int64_t x_stride, float eps, int32_t dtype,
                                 int32_t threads) {
  return graphdecode_cpu_rms_norm_variant(x, residual, weight, out, sum, rows, hidden, x_stride, eps, kLlama, dtype,
                                          threads);
}

// out [rows, inter] = silu(gate) * up of gate_up [rows, 2 * inter] (both contiguous), torch's roundings.
int graphdecode_cpu_swiglu(const void* gate_up, int64_t rows, int64_t inter, void* out, int32_t dtype,
                           int32_t threads) {
  if (rows < 0 || inter <= 0 || threads < 1 || (rows > 0 && (!gate_up || !out))) return 1;
  if (dtype == kFloat32)
    swiglu(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter, threads);
  else if (dtype == kBFloat16)
    swiglu(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, inter, threads);
  else
    return 2;
  return 0;
}

int graphdecode_cpu_rope(const void* q, const void* k, void* q_out, void* k_out, const void* cos, const void* sin,
                         const int64_t* positions, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t dim,
                         int64_t q_stride, int64_t k_stride, int32_t dtype, int32_t threads) {
  if (tokens < 0 || dim <= 0 || dim % 2 || q_stride < q_heads * dim || k_stride < k_heads * dim || threads < 1)
    return 1;
  if (dtype == kFloat32) {
    rope(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<float*>(q_out),
         static_cast<float*>(k_out), static_cast<const float*>(cos), static_cast<const float*>(sin), positions, tokens,
         q_heads, k_heads, dim, q_stride, k_stride, threads);
  } else if (dtype == kBFloat16) {
    rope(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k), static_cast<uint16_t*>(q_out),
         static_cast<uint16_t*>(k_out), static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin),
         positions, tokens, q_heads, k_heads, dim, q_stride, k_stride, threads);
  } else {
    return 2;
  }
  return 0;
}

// out [n, row_bytes] = rows ids[i] of a weight packed in column panels (cpu_linear.cpp: [P][R][64] units of `unit`
// bytes, a bf16 pair or a float32 / bf16 element; a row's units 64 apart): an embedding lookup in a tied LM head's
// panels, where torch's strided gather runs element by element on one thread. The first row_bytes bytes of each
// row's units (pairs padded past K: the padding is not copied). 3: an id outside the panels' rows.
int graphdecode_cpu_panel_rows(const void* panels, int64_t num_panels, int64_t rows_per_panel, int64_t unit,
                               const int64_t* ids, int64_t n, void* out, int64_t row_bytes, int32_t threads) {
  if ((unit != 2 && unit != 4) || n < 0 || row_bytes <= 0 || row_bytes > rows_per_panel * unit || threads < 1 ||
      (n > 0 && (!panels || !ids || !out)))
    return 1;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= num_panels * PANEL) return 3;
  const char* src = static_cast<const char*>(panels);
  char* dst = static_cast<char*>(out);
  const int64_t whole = row_bytes / unit, tail = row_bytes - whole * unit, stride = PANEL * unit;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n * whole >= PARALLEL_MIN)
  for (int64_t i = 0; i < n; ++i) {
    const char* s = src + ((ids[i] / PANEL) * rows_per_panel * PANEL + ids[i] % PANEL) * unit;
    char* d = dst + i * row_bytes;
    if (unit == 4)
      for (int64_t r = 0; r < whole; ++r) std::memcpy(d + 4 * r, s + r * stride, 4);
    else
      for (int64_t r = 0; r < whole; ++r) std::memcpy(d + 2 * r, s + r * stride, 2);
    if (tail) std::memcpy(d + whole * unit, s + whole * stride, tail);
  }
  return 0;
}

}  // extern "C"
