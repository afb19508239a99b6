// A float32 or bf16 linear for few rows, y = x W^T (+ b), over W laid out in column panels
// (graphdecode/models/cpu_linear.py: PanelWeight). bf16 panels are widened to float32 as they are
// read (exact) and summed in float32: half the bytes from memory for the same arithmetic.
//
// Decode multiplies a few rows by every weight of the model: at 1-16 rows neither aten's GEMM on
// the row- or column-major weight nor oneDNN's packed one reaches this CPU's memory bandwidth.
// Here W is stored once at load as panels of PANEL (64) output columns, each [K][PANEL]
// contiguous: the panels are one sequential stream from memory. A tile of up to MR (6) rows keeps
// its 6 x 64 sums in 24 vector registers while it walks K: per k, four vector loads of the panel,
// one broadcast of each row's x[k], 4 FMAs a row. K goes in blocks of KB (64) rows, 16 KB of fp32
// panel (8 of bf16), so that every tile of the rows reuses the block from L1; the sums wait in a small
// buffer between blocks (a prefill's many rows: blocks of 2 KB rows, half the sums' round trips). While a
// block's tiles run, the next block's bytes of the stream (the next block, or the next panel's first) are
// prefetched, its cache lines spread over all the tiles' k steps: memory and arithmetic overlap whatever the
// number of rows.
//
// A gated projection [gate | up] (gate and up each a whole number of panels) can end in its SwiGLU: a task then
// runs a gate panel and its up panel and writes silu(gate) * up of the two (graphdecode_cpu_panel_linear_swiglu),
// never the projection itself.
//
// The order of the sums over k is fixed (k ascending per output), so a result does not depend on
// the number of rows in the call: a row's outputs are the same bits alone, in a decode batch of any
// size or in a prefill of any chunking (EngineConfig.batch_invariant runs every row count here).
//
// bf16 on a CPU with avx512_bf16 (graphdecode_cpu_bf16_pairs() is 1): W is held in pair panels,
// [ceil(N / 64)][ceil(K / 2)][64][2], each column's k and k + 1 side by side, and the products go
// two k at a time through vdpbf16ps (twice the products per instruction of float32 FMAs over widened
// values; each row's k, k + 1 one broadcast from memory). k pairs ascend: the order is fixed here too.
//
// bf16 on a CPU with AMX (built with amx_bf16 and the kernel granting the tile state): the same pair panels with
// their k pairs padded to a multiple of 16 (graphdecode_cpu_bf16_pair_rows() is 16), and every row count runs
// tdpbf16ps: rows in tiles of 16 (the last one zero-padded) taken two at a time, 16 x 16 float32 sums in tile
// registers, K in steps of 32 ascending (panel_linear_amx). A row's sums do not depend on the other rows of its
// tile or on how many tiles there are: the same bits at any row count, at the throughput of the matrix unit
// rather than of vdpbf16ps (several times more products per cycle from 16 rows).

#include <cstdint>
#include <cstring>

#include "cpu_common.h"

namespace {

using namespace graphdecode_cpu;

constexpr int64_t KB = 64;        // k rows per block: 16 KB of fp32 panel
constexpr int MR = PANEL_MR;      // rows per register tile: 24 accumulators
constexpr int64_t ROWS_MAX = 64;  // rows per pass: their sums for one panel are 16 KB

// k rows per block of panel_linear's float32 / bf16 panels: KB, or where vectors are 8 floats, 8 KB of panel (fp32:
// 32 k, bf16: 64). There the tile walks a block in up to four passes over its columns (panel_pass), so the block
// must stay in L1 beside the next one coming in by prefetch (16 KB blocks: 10-15% slower at 1-16 rows when every
// tile took four passes, 18m; with panel_pass 14% slower at 1 row and 9% at 4, 6% faster at 16, 18n).
template <typename T>
constexpr int64_t panel_block() {
#if defined(__AVX512F__)
  return KB;
#else
  return 8192 / (PANEL * int64_t(sizeof(T)));
#endif
}

// Where a linear's rows go: y (row stride ldy) with the bias's columns (or null); gated (up > 0: a [gate | up]
// projection, gate column c's up at column c + up * PANEL, no bias): silu(gate) * up of the two (swiglu_sums);
// add (or null, no bias, not gated): each output row plus the same row of `add` (row stride lda), both rounded as
// the projection and a separate add would round them (store_sums_plus).
template <typename T>
struct Out {
  T* y;
  int64_t ldy;
  const T* bias;
  int64_t up;
  const T* add;
  int64_t lda;
};

// row m's outputs of the panel at column col0 (cols of them) from its sums (gated: gate's g, up's u); start: what
// the sums still lack (the AMX units' bias) or null
template <typename T>
inline void emit(const Out<T>& out, int64_t m, int64_t col0, const float* g, const float* u, int64_t cols,
                 const float* start) {
  T* dst = out.y + m * out.ldy + col0;
  if (out.up)
    swiglu_sums(dst, g, u, cols);
  else if (out.add)
    store_sums_plus(dst, g, cols, out.add + m * out.lda + col0);
  else
    store_sums(dst, g, cols, start);
}

// The work of one linear over panels of `steps` k steps each (k, or k pairs), `step_elems` panel elements per step:
// units of (a block of up to ROWS_MAX rows, a panel) over `threads` threads (for_row_blocks: even row blocks, panels
// in L2-sized blocks); a task's sums start from the bias's columns,
// take tile(rows, row offset, s0, s1, sums, prefetch, lines, per step) for blocks of `block` steps and register
// tiles of MR rows (meanwhile the next block's panel bytes are prefetched, spread over the tiles' steps), and go
// to `out` (emit). Gated, a task runs a gate panel and its up panel, up * PANEL output columns in all.
template <typename T, typename Tile>
void panel_tasks(int64_t M, int64_t N, int64_t steps, int64_t block, int64_t step_elems, const T* panels,
                 const Out<T>& out, int32_t threads, Tile&& tile) {
  const T* bias = out.bias;
  const int64_t up = out.up;
  const int64_t num_panels = (N + PANEL - 1) / PANEL, outs = up ? up : num_panels, group = up ? 2 : 1;
  const int64_t panel_elems = steps * step_elems;
  for_row_blocks(M, ROWS_MAX, MR, outs, group * panel_elems * int64_t(sizeof(T)), threads,
                 [&](int64_t m0, int64_t rows, int64_t o) {
    alignas(64) float sums[2][ROWS_MAX * PANEL];
    const int64_t cols = N - o * PANEL < PANEL ? N - o * PANEL : PANEL;
    alignas(64) float start[PANEL];  // each output's sum starts at its bias (zero past N)
    for (int64_t j = 0; j < PANEL; ++j) start[j] = bias && j < cols ? load(bias + o * PANEL + j) : 0.f;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t p = o + g * up;
      const T* panel = panels + p * panel_elems;
      // the bytes read after this panel's: the next panel's (gated: the up panel, then the next task's gate panel)
      const T* after = panels + (g + 1 < group ? p + up : g ? o + 1 : p + 1) * panel_elems;
      float* acc = sums[g];
      for (int64_t m = 0; m < rows; ++m) std::memcpy(acc + m * PANEL, start, sizeof start);
      for (int64_t s0 = 0; s0 < steps; s0 += block) {
        const int64_t s1 = s0 + block < steps ? s0 + block : steps;
        // the next block of the stream comes in while this block's tiles run (prefetching past the panels' end
        // is harmless: a prefetch never faults)
        const int64_t count = ((rows + MR - 1) / MR) * (s1 - s0);
        int64_t lines = block * step_elems * int64_t(sizeof(T)) / LINE;
        const int64_t per = (lines + count - 1) / count;
        const char* pf = reinterpret_cast<const char*>(s1 < steps ? panel + s1 * step_elems : after);
        for (int64_t m = 0; m < rows; m += MR) {
          const int64_t r = rows - m < MR ? rows - m : MR;
          const int64_t mine = lines < per * (s1 - s0) ? lines : per * (s1 - s0);
          tile(r, m0 + m, panel, s0, s1, acc + m * PANEL, pf, mine, per);
          pf += mine * LINE;
          lines -= mine;
        }
      }
    }
    for (int64_t m = 0; m < rows; ++m)  // the bias is in the sums already
      emit(out, m0 + m, o * PANEL, sums[0] + m * PANEL, sums[1] + m * PANEL, up ? PANEL : cols, nullptr);
  });
}

template <typename T>
void panel_linear(const T* x, int64_t M, int64_t K, int64_t ldx, const T* panels, int64_t N, const Out<T>& out,
                  int32_t threads) {
  // more rows than one task's: twice the k a block, half the round trips of the sums through memory
  panel_tasks(M, N, K, M > ROWS_MAX ? 2 * panel_block<T>() : panel_block<T>(), PANEL, panels, out, threads,
              [=](int64_t r, int64_t m, const T* panel, int64_t k0, int64_t k1, float* sums, const char* pf,
                  int64_t lines, int64_t per_k) {
                panel_tile_rows(r, x + m * ldx, ldx, panel, k0, k1, sums, pf, lines, per_k);
              });
}

#if defined(__AVX512BF16__)
// sums[R][PANEL] += x[R rows][2 j0 : 2 j1] @ W over pair panel rows j0..j1-1 ([PANEL][2] each: columns' k, k + 1)
template <int R>
inline void pair_tile(const uint16_t* __restrict x, int64_t ldx, int64_t K, const uint16_t* __restrict panel,
                      int64_t j0, int64_t j1, float* __restrict sums, const char* pf, int64_t lines, int64_t per_j) {
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_loadu_ps(sums + m * PANEL + 16 * v);
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* w = panel + j * 2 * PANEL;
    for (int64_t l = 0; l < per_j && lines > 0; ++l, --lines, pf += LINE) __builtin_prefetch(pf, 0, 3);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    const int64_t k = 2 * j;
    if (k + 1 < K) {
#pragma GCC unroll 6
      for (int m = 0; m < R; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + k, sizeof pair);  // the row's k, k + 1: one broadcast from memory
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, w0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, w1);
        acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, w2);
        acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, w3);
      }
    } else {  // an odd K's last k pairs with a zero
      for (int m = 0; m < R; ++m) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[m * ldx + k]));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, w0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, w1);
        acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, w2);
        acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, w3);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(sums + m * PANEL + 16 * v, acc[m][v]);
}

inline void pair_tile_rows(int64_t rows, const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* panel,
                           int64_t j0, int64_t j1, float* sums, const char* pf, int64_t lines, int64_t per_j) {
  switch (rows) {
    case 6: pair_tile<6>(x, ldx, K, panel, j0, j1, sums, pf, lines, per_j); break;
    case 5: pair_tile<5>(x, ldx, K, panel, j0, j1, sums, pf, lines, per_j); break;
    case 4: pair_tile<4>(x, ldx, K, panel, j0, j1, sums, pf, lines, per_j); break;
    case 3: pair_tile<3>(x, ldx, K, panel, j0, j1, sums, pf, lines, per_j); break;
    case 2: pair_tile<2>(x, ldx, K, panel, j0, j1, sums, pf, lines, per_j); break;
    default: pair_tile<1>(x, ldx, K, panel, j0, j1, sums, pf, lines, per_j); break;
  }
}

// panel_linear's bf16 form over vdpbf16ps, W in pair panels [ceil(N / 64)][ceil(K / 2)][64][2] (an odd K's
// last pair and the columns past N zero): the same tasks, blocks of KB k and prefetch, one k pair a step
void panel_linear_pairs(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* panels, int64_t N,
                        const Out<uint16_t>& out, int32_t threads) {
  panel_tasks(M, N, (K + 1) / 2, KB / 2, 2 * PANEL, panels, out, threads,
              [=](int64_t r, int64_t m, const uint16_t* panel, int64_t j0, int64_t j1, float* sums, const char* pf,
                  int64_t lines, int64_t per_j) {
                pair_tile_rows(r, x + m * ldx, ldx, K, panel, j0, j1, sums, pf, lines, per_j);
              });
}
#endif

#if defined(GRAPHDECODE_AMX)
constexpr int64_t AMX_PAIRS = 16;  // k pairs per step (32 k): one tile of x [16][32], four of the panel [16][16][2]

// panel_linear's bf16 form on AMX, W in pair panels [ceil(N / 64)][P][64][2] with P = ceil(K / 2) rounded up to
// 16 (zero past K and past N), its units (32 rows, panel) over for_units. A unit runs its panel in halves of 32
// columns, so that each step of 32 k takes two tiles of x (tmm4, tmm5) and two of the panel (tmm6, tmm7) into four
// 16 x 16 sums (tmm0-3): every tile loaded serves two products. A last lone row tile runs all 64 columns at once
// (tmm0-3 its sums, tmm4 its x, tmm5-7 the panel's). Each output is one tile's sum over the k steps in ascending
// order, so a row's bits do not depend on the other rows of its tile, on its tile's partner, or on the split.
void panel_linear_amx(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* panels, int64_t N,
                      const Out<uint16_t>& out, int32_t threads) {
  const uint16_t* bias = out.bias;
  const int64_t up = out.up;
  const int64_t num_panels = (N + PANEL - 1) / PANEL, outs = up ? up : num_panels, group = up ? 2 : 1;
  const int64_t pairs = ((K + 1) / 2 + AMX_PAIRS - 1) / AMX_PAIRS * AMX_PAIRS, steps = pairs / AMX_PAIRS;
  constexpr int64_t B_STRIDE = 2 * PANEL * 2;  // bytes between a panel's k pair rows
  // decode's few rows: each panel's row pairs one after the other (the panel comes from memory once, then from
  // L1); a prefill's many rows: blocks of panels held in L2 while every row pair runs over them
  const int64_t per_block = M <= 64 ? 1 : panels_per_block(group * pairs * B_STRIDE);
  for_units((M + 31) / 32, outs, per_block, threads, [&](int64_t duo, int64_t o) {
    alignas(64) float sums[2][32 * PANEL];
    alignas(64) uint16_t part[2][16 * 32];  // tiles of x with rows past M or k past K: zeros there
    // x's tile of rows m0.. (up to 16) at step s, as a pointer and a row stride in bytes
    auto x_tile = [&](int64_t m0, int64_t s, uint16_t* buffer, const uint16_t** ptr, int64_t* stride) {
      const int64_t rows = M - m0 < 16 ? M - m0 : 16, k0 = s * 2 * AMX_PAIRS;
      if (rows == 16 && k0 + 32 <= K) {
        *ptr = x + m0 * ldx + k0, *stride = ldx * 2;
        return;
      }
      std::memset(buffer, 0, 16 * 32 * 2);
      const int64_t width = K - k0 < 32 ? K - k0 : 32;
      for (int64_t m = 0; m < rows; ++m) std::memcpy(buffer + m * 32, x + (m0 + m) * ldx + k0, width * 2);
      *ptr = buffer, *stride = 64;
    };
    const int64_t cols = N - o * PANEL < PANEL ? N - o * PANEL : PANEL;
    alignas(64) float start[PANEL];  // added to each output's sum: its bias (zero past N)
    if (bias)
      for (int64_t c = 0; c < PANEL; ++c) start[c] = c < cols ? load(bias + o * PANEL + c) : 0.f;
    const int64_t m0 = duo * 32, rows = M - m0 < 32 ? M - m0 : 32;
    const uint16_t* a;
    const uint16_t* a2;
    int64_t sa, sa2;
    for (int64_t g = 0; g < group; ++g) {  // the output's panel (gated: its gate panel, then its up panel)
      const uint16_t* panel = panels + (o + g * up) * pairs * 2 * PANEL;
      float* acc = sums[g];
      if (rows > 16) {
        for (int64_t half = 0; half < 2; ++half) {
          amx_zero();
          for (int64_t s = 0; s < steps; ++s) {
            x_tile(m0, s, part[0], &a, &sa);
            x_tile(m0 + 16, s, part[1], &a2, &sa2);
            const uint16_t* b = panel + s * AMX_PAIRS * 2 * PANEL + half * 64;  // [16 pairs][32 columns][2]
            _tile_loadd(4, a, sa);
            _tile_loadd(6, b, B_STRIDE);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 32, B_STRIDE);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a2, sa2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, acc + half * 32, PANEL * 4);
          _tile_stored(1, acc + half * 32 + 16, PANEL * 4);
          _tile_stored(2, acc + 16 * PANEL + half * 32, PANEL * 4);
          _tile_stored(3, acc + 16 * PANEL + half * 32 + 16, PANEL * 4);
        }
      } else {
        amx_zero();
        for (int64_t s = 0; s < steps; ++s) {
          x_tile(m0, s, part[0], &a, &sa);
          amx_rows_times(a, sa, panel + s * AMX_PAIRS * 2 * PANEL, B_STRIDE);  // [16 pairs][64 columns][2]
        }
        amx_store(acc, PANEL * 4);
      }
    }
    for (int64_t m = 0; m < rows; ++m)
      emit(out, m0 + m, o * PANEL, sums[0] + m * PANEL, sums[1] + m * PANEL, up ? PANEL : cols, bias ? start : nullptr);
  }, amx_configure, [] { _tile_release(); });
}
#endif

}  // namespace

// Whether bf16 panels are pair panels (this library was built for a CPU with avx512_bf16).
extern "C" int graphdecode_cpu_bf16_pairs() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// The multiple the k pairs of a bf16 pair panel are padded to: 16 where the AMX kernel runs them, else 1.
extern "C" int graphdecode_cpu_bf16_pair_rows() {
#if defined(GRAPHDECODE_AMX)
  return amx_ready() ? int(AMX_PAIRS) : 1;
#else
  return 1;
#endif
}

namespace {

// panel_linear in the dtype's kernel (see graphdecode_cpu_panel_linear), its rows to out (Out: y, bias, up, add
// untyped)
int linear(const void* x, int64_t M, int64_t K, int64_t ldx, const void* panels, int64_t N, const Out<void>& out,
           int32_t threads, int32_t dtype) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K || threads < 1 || (M > 0 && (!x || !panels || !out.y))) return 1;
  if (dtype == kFloat32) {
    const Out<float> o{static_cast<float*>(out.y), out.ldy, static_cast<const float*>(out.bias), out.up,
                       static_cast<const float*>(out.add), out.lda};
    panel_linear(static_cast<const float*>(x), M, K, ldx, static_cast<const float*>(panels), N, o, threads);
  } else if (dtype == kBFloat16) {
    const auto* xb = static_cast<const uint16_t*>(x);
    const auto* pb = static_cast<const uint16_t*>(panels);
    const Out<uint16_t> o{static_cast<uint16_t*>(out.y), out.ldy, static_cast<const uint16_t*>(out.bias), out.up,
                          static_cast<const uint16_t*>(out.add), out.lda};
#if defined(GRAPHDECODE_AMX)
    if (amx_ready()) {
      panel_linear_amx(xb, M, K, ldx, pb, N, o, threads);
      return 0;
    }
#endif
#if defined(__AVX512BF16__)
    panel_linear_pairs(xb, M, K, ldx, pb, N, o, threads);
#else
    panel_linear(xb, M, K, ldx, pb, N, o, threads);
#endif
  } else {
    return 1;
  }
  return 0;
}

}  // namespace

// x [M, K] (row stride ldx), panels [ceil(N / 64)][K][64] (bf16 pair panels: see above; columns past N zero),
// bias [N] or null,
// y [M, N] (row stride ldy), all float32 or all bf16 (dtype; bf16: float32 sums, each output rounded
// once, as oneDNN's bf16 GEMM does); threads: OpenMP threads (torch's own pool: the library binds to
// the libgomp torch loaded) over the (row block, panel) pairs, each pair's sums in its thread's
// buffer, so a result does not depend on the thread count either. Returns nonzero on bad arguments.
extern "C" int graphdecode_cpu_panel_linear(const void* x, int64_t M, int64_t K, int64_t ldx, const void* panels,
                                            int64_t N, const void* bias, void* y, int64_t ldy, int32_t threads,
                                            int32_t dtype) {
  if (ldy < N) return 1;
  return linear(x, M, K, ldx, panels, N, Out<void>{y, ldy, bias, 0, nullptr, 0}, threads, dtype);
}

// A gated projection and its SwiGLU in one pass: y [M, I] = silu(gate) * up of x @ [gate | up]^T, panels those of
// the [2 I, K] projection (graphdecode_cpu_panel_linear's layout), I a multiple of 64 (gate panel p's up is panel
// p + I / 64). The same bits as graphdecode_cpu_panel_linear then graphdecode_cpu_swiglu: the projection's
// outputs rounded to the dtype, then swiglu_row; the [M, 2 I] projection is never written.
extern "C" int graphdecode_cpu_panel_linear_swiglu(const void* x, int64_t M, int64_t K, int64_t ldx,
                                                   const void* panels, int64_t I, void* y, int64_t ldy,
                                                   int32_t threads, int32_t dtype) {
  if (I <= 0 || I % PANEL || ldy < I) return 1;
  return linear(x, M, K, ldx, panels, 2 * I, Out<void>{y, ldy, nullptr, I / PANEL, nullptr, 0}, threads, dtype);
}

// A projection plus a residual in one pass: y [M, N] = x @ W^T + add, add [M, N] (row stride lda; y may be add
// itself), no bias: the projection's outputs rounded to the dtype, then the add rounded again, as the projection
// and a separate add round them (transformers' residual after a layer's last projection).
extern "C" int graphdecode_cpu_panel_linear_add(const void* x, int64_t M, int64_t K, int64_t ldx, const void* panels,
                                                int64_t N, const void* add, int64_t lda, void* y, int64_t ldy,
                                                int32_t threads, int32_t dtype) {
  if (ldy < N || lda < N || (M > 0 && !add)) return 1;
  return linear(x, M, K, ldx, panels, N, Out<void>{y, ldy, nullptr, 0, add, lda}, threads, dtype);
}
