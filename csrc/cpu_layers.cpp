// A decode step's decoder layers in one call: the Llama layer (RMSNorm, fused qkv, rotary, the step's K/V
// into the pages, paged attention, o_proj, residual add + RMSNorm, fused gate_up, SwiGLU, down, residual
// add), every layer, for the few rows whose projections run the panel kernel.
//
// At batch 1 a decode step reads every weight once at memory bandwidth in about 20 ms (SmolLM2 fp32); the
// eager forward around those reads, a dozen Python calls a layer, cost several more. This driver calls the
// same kernels the eager forward calls (cpu_fused.cpp's norm and rotary, cpu_linear.cpp's panels,
// cpu_attention.cpp's K/V write and paged attention) in the same order with the same arguments, so their
// results are the eager ones bit for bit; only SwiGLU and the last residual add, torch ops in eager, are
// computed here (silu with the vectorised exp below, products and sums rounded to the dtype as torch
// does). Scratch lives in the caller's buffer.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

extern "C" {
int graphdecode_cpu_add_rms_norm(const void* x, const void* residual, const void* weight, void* out, void* sum,
                                 int64_t rows, int64_t hidden, int64_t x_stride, float eps, int32_t dtype,
                                 int32_t threads);
int graphdecode_cpu_rope(const void* q, const void* k, void* q_out, void* k_out, const void* cos, const void* sin,
                         const int64_t* positions, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t dim,
                         int64_t q_stride, int64_t k_stride, int32_t dtype, int32_t threads);
int graphdecode_cpu_swiglu(const void* gate_up, int64_t rows, int64_t inter, void* out, int32_t dtype, int32_t threads);
int graphdecode_cpu_panel_linear(const void* x, int64_t M, int64_t K, int64_t ldx, const void* panels, int64_t N,
                                 const void* bias, void* y, int64_t ldy, int32_t threads, int32_t dtype);
int graphdecode_cpu_panel_linear_swiglu(const void* x, int64_t M, int64_t K, int64_t ldx, const void* panels,
                                        int64_t I, void* y, int64_t ldy, int32_t threads, int32_t dtype);
int graphdecode_cpu_qpanel_linear(const void* x, int64_t M, int64_t K, int64_t ldx, const void* panels, int32_t kind,
                                  const float* scales, const float* zs, int64_t group, int64_t N, const void* bias,
                                  void* y, int64_t ldy, int32_t threads, int32_t dtype);
int graphdecode_cpu_write_kv(void* kv, const void* k, const void* v, const int64_t* slots, int64_t tokens,
                             int64_t kv_heads, int64_t head_dim, int64_t k_stride, int64_t v_stride,
                             int64_t page_size, int64_t num_pages, int32_t dtype, int32_t kv_dtype, float k_mul,
                             float v_mul);
int graphdecode_cpu_paged_attention(const void* q, const void* kv, const int32_t* block_table, int64_t bt_stride,
                                    const int64_t* positions, const int32_t* seq_lens, void* out, int64_t rows,
                                    int64_t queries, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    int64_t page_size, int64_t width, int64_t num_pages, float scale,
                                    int64_t window_left, float soft_cap, const float* sinks, int32_t dtype,
                                    int32_t kv_dtype, float out_scale, int32_t threads);
}

namespace {

using namespace graphdecode_cpu;

// One layer's entries in the caller's int64 table (pointers as integers), and in its float table.
// SAVE, SAVE_LD: where x is copied before the layer runs (0: nowhere), its M rows SAVE_LD elements apart (0: hidden):
// the hidden states an EAGLE-3 head reads, each stop layer's columns of one [M, stops x hidden] array
// KV_DTYPE: the layer's cache's dtype code (x's, or FP8 E4M3 written as k * K_MUL, v * V_MUL, its attention's
// output times OUT_SCALE and SCALE the query's scale times the K scale)
// IN, IN_WIDTH: where the qkv projection reads its rows instead of the normed x ([M, IN_WIDTH], 0: the normed x; x
// stays the residual): an EAGLE-3 head's layer, whose q/k/v read [normed embedding | normed hidden state]
enum Word : int64_t {
  IN_NORM, QKV, QKV_BIAS, O, POST_NORM, GATE_UP, DOWN, KV, SINKS, WINDOW_LEFT, SAVE, KV_DTYPE, IN, IN_WIDTH, SAVE_LD, WORDS
};
enum Real : int64_t { SCALE, SOFT_CAP, K_MUL, V_MUL, OUT_SCALE, REALS };
// Each projection's (qkv, o, gate_up, down) entries in the caller's quantization table: KIND -1 for float panels
// (cpu_linear.cpp), else cpu_qlinear.cpp's kind with its scales, offsets (0: none) and group; then its LoRA
// adapters' update (graphdecode/lora/layers.py), LORA_A 0 for none: y += B ((A x) * mask), A and B float panels of
// LORA_COLS = max_loras x (the projection's shards x rank) columns, the mask keeping each row's own slot's columns
enum Projection : int64_t { P_QKV, P_O, P_GATE_UP, P_DOWN, PROJECTIONS };
enum Quant : int64_t { KIND, SCALES, OFFSETS, GROUP, LORA_A, LORA_B, LORA_COLS, QUANT_WORDS };

struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter, page_size, num_pages;
  float eps;
  int32_t dtype, threads;
};

template <typename T>
const T* ptr(int64_t word) {
  return reinterpret_cast<const T*>(static_cast<intptr_t>(word));
}

// y = x W^T (+ b) with W a projection's panels, float or quantized (the quantization table's entry q)
int project(const int64_t* q, const void* x, int64_t M, int64_t K, const void* panels, int64_t N, const void* bias,
            void* y, int32_t threads, int32_t dtype) {
  if (q[KIND] < 0) return graphdecode_cpu_panel_linear(x, M, K, K, panels, N, bias, y, N, threads, dtype);
  return graphdecode_cpu_qpanel_linear(x, M, K, K, panels, int32_t(q[KIND]), ptr<float>(q[SCALES]),
                                       ptr<float>(q[OFFSETS]), q[GROUP], N, bias, y, N, threads, dtype);
}

template <typename T>
void add_into(T* h, const T* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(h + i, load(h + i) + load(d + i));
}

// The rows' LoRA adapters (slot 0: none) added to a projection's output y [M, N] of input in [M, K]: h = in A^T
// [M, C], each row's columns outside its slot's zeroed, y += h B^T. The bits of lora/layers.py's eager forward.
struct LoRA {
  const int64_t* slots;  // [M] each row's slot, or nullptr: no adapters
  int64_t loras;         // slots 1..loras
  void* h;               // [M, max C] and [M, max N] of the call's dtype
  void* d;
};

template <typename T>
int lora_update(const int64_t* q, const LoRA& lo, const void* in, int64_t M, int64_t K, int64_t N, T* y,
                int32_t threads, int32_t dtype) {
  if (!lo.slots || !q[LORA_A]) return 0;
  const int64_t C = q[LORA_COLS], per = C / lo.loras;
  T* h = static_cast<T*>(lo.h);
  T* d = static_cast<T*>(lo.d);
  int err = graphdecode_cpu_panel_linear(in, M, K, K, ptr<T>(q[LORA_A]), C, nullptr, h, C, threads, dtype);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t s = lo.slots[m], first = (s - 1) * per, last = s * per;
    for (int64_t c = 0; c < C; ++c)
      if (s == 0 || c < first || c >= last) h[m * C + c] = T(0);
  }
  err |= graphdecode_cpu_panel_linear(h, M, C, C, ptr<T>(q[LORA_B]), N, nullptr, d, N, threads, dtype);
  add_into(y, d, M * N);
  return err;
}

template <typename T>
int layers(const Dims& s, const int64_t* words, const int64_t* quant, const float* reals, int64_t num_layers, T* x,
           int64_t M,
           const int64_t* positions, const int32_t* seq_lens, const int64_t* slots, const int32_t* block_table,
           int64_t bt_stride, int64_t width, const T* cos, const T* sin, T* scratch, const LoRA& lo) {
  const int64_t H = s.hidden, HD = s.head_dim, qn = s.heads * HD, kn = s.kv_heads * HD, qkv_n = qn + 2 * kn;
  T* normed = scratch;
  T* total = normed + M * H;
  T* qkv = total + M * H;
  T* q = qkv + M * qkv_n;
  T* k = q + M * qn;
  T* attn = k + M * kn;
  T* o = attn + M * qn;
  T* gate_up = o + M * H;
  T* act = gate_up + M * 2 * s.inter;
  T* down = act + M * s.inter;
  int err = 0;
  for (int64_t l = 0; l < num_layers && !err; ++l) {
    const int64_t* w = words + l * WORDS;
    const int64_t* qt = quant + l * PROJECTIONS * QUANT_WORDS;
    const float* r = reals + l * REALS;
    if (w[SAVE]) {
      T* saved = reinterpret_cast<T*>(static_cast<intptr_t>(w[SAVE]));
      const int64_t ld = w[SAVE_LD] ? w[SAVE_LD] : H;
      if (ld == H) std::memcpy(saved, x, M * H * sizeof(T));
      else for (int64_t i = 0; i < M; ++i) std::memcpy(saved + i * ld, x + i * H, H * sizeof(T));
    }
    if (!w[IN])
      err |= graphdecode_cpu_add_rms_norm(x, nullptr, ptr<T>(w[IN_NORM]), normed, nullptr, M, H, H, s.eps, s.dtype,
                                          s.threads);
    err |= project(qt + P_QKV * QUANT_WORDS, w[IN] ? ptr<T>(w[IN]) : normed, M, w[IN] ? w[IN_WIDTH] : H,
                   ptr<T>(w[QKV]), qkv_n, ptr<T>(w[QKV_BIAS]), qkv, s.threads, s.dtype);
    err |= lora_update(qt + P_QKV * QUANT_WORDS, lo, w[IN] ? ptr<T>(w[IN]) : normed, M, w[IN] ? w[IN_WIDTH] : H,
                       qkv_n, qkv, s.threads, s.dtype);
    err |= graphdecode_cpu_rope(qkv, qkv + qn, q, k, cos, sin, positions, M, s.heads, s.kv_heads, HD, qkv_n, qkv_n,
                                s.dtype, s.threads);
    void* kv = reinterpret_cast<void*>(static_cast<intptr_t>(w[KV]));
    const int32_t kv_dtype = int32_t(w[KV_DTYPE]);
    err |= graphdecode_cpu_write_kv(kv, k, qkv + qn + kn, slots, M, s.kv_heads, HD, kn, qkv_n, s.page_size,
                                    s.num_pages, s.dtype, kv_dtype, r[K_MUL], r[V_MUL]);
    err |= graphdecode_cpu_paged_attention(q, kv, block_table, bt_stride, nullptr, seq_lens, attn, M, 1, s.heads,
                                           s.kv_heads, HD, s.page_size, width, s.num_pages, r[SCALE],
                                           w[WINDOW_LEFT], r[SOFT_CAP], ptr<float>(w[SINKS]), s.dtype, kv_dtype,
                                           r[OUT_SCALE], s.threads);
    err |= project(qt + P_O * QUANT_WORDS, attn, M, qn, ptr<T>(w[O]), H, nullptr, o, s.threads, s.dtype);
    err |= lora_update(qt + P_O * QUANT_WORDS, lo, attn, M, qn, H, o, s.threads, s.dtype);
    err |= graphdecode_cpu_add_rms_norm(x, o, ptr<T>(w[POST_NORM]), normed, total, M, H, H, s.eps, s.dtype,
                                        s.threads);
    const int64_t* gu = qt + P_GATE_UP * QUANT_WORDS;
    if (gu[KIND] < 0 && s.inter % PANEL == 0 && !(lo.slots && gu[LORA_A])) {  // panels: projection and SwiGLU at once
      err |= graphdecode_cpu_panel_linear_swiglu(normed, M, H, H, ptr<T>(w[GATE_UP]), s.inter, act, s.inter,
                                                 s.threads, s.dtype);
    } else {
      err |= project(gu, normed, M, H, ptr<T>(w[GATE_UP]), 2 * s.inter, nullptr, gate_up, s.threads, s.dtype);
      err |= lora_update(gu, lo, normed, M, H, 2 * s.inter, gate_up, s.threads, s.dtype);
      err |= graphdecode_cpu_swiglu(gate_up, M, s.inter, act, s.dtype, 1);  // decode's few rows: one thread
    }
    err |= project(qt + P_DOWN * QUANT_WORDS, act, M, s.inter, ptr<T>(w[DOWN]), H, nullptr, down, s.threads,
                   s.dtype);
    err |= lora_update(qt + P_DOWN * QUANT_WORDS, lo, act, M, s.inter, H, down, s.threads, s.dtype);
    std::memcpy(x, total, M * H * sizeof(T));
    add_into(x, down, M * H);
  }
  return err;
}

}  // namespace

extern "C" {

// Scratch elements a call with M rows needs (in the model's dtype).
int64_t graphdecode_cpu_layers_scratch(int64_t M, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t inter) {
  return M * (3 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim + kv_heads * head_dim +
              3 * inter + hidden);
}

// x [M, hidden] contiguous: the embeddings in, the last layer's output (before the final norm) out.
// words [num_layers, WORDS] int64 and reals [num_layers, REALS] float: each layer's weights (qkv and
// gate_up as panels, qkv_bias 0 for none; IN, where set, the qkv projection's rows [M, IN_WIDTH]); quant
// [num_layers, PROJECTIONS, QUANT_WORDS] int64: how each projection's panels hold it (KIND -1: float panels;
// else quantized panels, cpu_qlinear.cpp); KV cache [num_pages, 2, page_size, kv_heads, head_dim], sinks (0:
// none), window_left, scale, soft_cap (0: none). positions [M] int64 (rotary table rows, each checked against
// max_positions), seq_lens [M] int32 and slots [M] int64 as the paged kernels take them; cos / sin
// [max_positions, head_dim]. lora_slots [M] int64 (nullptr: no adapters): each row's LoRA slot, 0..max_loras, for
// the projections whose quant entries name LoRA panels; lora_scratch [M, lora_scratch_cols] of x's dtype, at least
// the widest LORA_COLS plus the widest projection output per row. Returns 0, or nonzero (x then undefined) for bad
// arguments; positions, slots and LoRA slots are checked before any work.
int graphdecode_cpu_decoder_layers(const int64_t* words, const int64_t* quant, const float* reals, int64_t num_layers,
                                   void* x, int64_t M,
                                   const int64_t* positions, const int32_t* seq_lens, const int64_t* slots,
                                   const int32_t* block_table, int64_t bt_stride, int64_t width, const void* cos,
                                   const void* sin, void* scratch, int64_t hidden, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, int64_t inter, int64_t page_size, int64_t num_pages,
                                   int64_t max_positions, float eps, int32_t dtype, int32_t threads,
                                   const int64_t* lora_slots, int64_t max_loras, void* lora_scratch,
                                   int64_t lora_scratch_cols) {
  if (!words || !quant || !reals || !x || !positions || !seq_lens || !slots || !block_table || !cos || !sin || !scratch ||
      num_layers < 1 || M < 1 || hidden < 1 || kv_heads < 1 || heads % kv_heads || head_dim < 2 || inter < 1 ||
      threads < 1 || (lora_slots && (max_loras < 1 || !lora_scratch)))
    return 1;
  const int64_t qkv_cols = (heads + 2 * kv_heads) * head_dim;
  int64_t widest_out = qkv_cols > 2 * inter ? qkv_cols : 2 * inter, widest_lora = 0;
  if (hidden > widest_out) widest_out = hidden;
  if (lora_slots) {
    for (int64_t m = 0; m < M; ++m)
      if (lora_slots[m] < 0 || lora_slots[m] > max_loras) return 1;
    for (int64_t i = 0; i < num_layers * PROJECTIONS; ++i) {
      const int64_t* q = quant + i * QUANT_WORDS;
      if (q[LORA_A] && (q[LORA_COLS] < 1 || q[LORA_COLS] % max_loras || !q[LORA_B])) return 1;
      if (q[LORA_COLS] > widest_lora) widest_lora = q[LORA_COLS];
    }
    if (lora_scratch_cols < widest_lora + widest_out) return 1;  // [M, C] then [M, N] in the caller's scratch
  }
  for (int64_t m = 0; m < M; ++m)
    if (positions[m] < 0 || positions[m] >= max_positions || slots[m] < 0 || slots[m] >= num_pages * page_size)
      return 1;
  for (int64_t l = 0; l < num_layers; ++l)
    if (words[l * WORDS + IN] && words[l * WORDS + IN_WIDTH] < 1) return 1;
  const Dims s{hidden, heads, kv_heads, head_dim, inter, page_size, num_pages, eps, dtype, threads};
  const int64_t element = dtype == kFloat32 ? 4 : 2;
  char* lora_h = static_cast<char*>(lora_scratch);
  bool adapted = false;  // rows without an adapter gain exact zeros: with none in the call, nothing is computed
  for (int64_t m = 0; lora_slots && m < M; ++m) adapted |= lora_slots[m] != 0;
  const LoRA lo{adapted ? lora_slots : nullptr, max_loras, lora_h,
                lora_h ? lora_h + M * widest_lora * element : nullptr};
  if (dtype == kFloat32)
    return layers(s, words, quant, reals, num_layers, static_cast<float*>(x), M, positions, seq_lens, slots, block_table,
                  bt_stride, width, static_cast<const float*>(cos), static_cast<const float*>(sin),
                  static_cast<float*>(scratch), lo);
  if (dtype == kBFloat16)
    return layers(s, words, quant, reals, num_layers, static_cast<uint16_t*>(x), M, positions, seq_lens, slots,
                  block_table, bt_stride, width, static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin),
                  static_cast<uint16_t*>(scratch), lo);
  return 1;
}

}  // extern "C"
