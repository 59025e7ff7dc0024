// SwiGLU experts for routed rows, CPU: out[n] = sum_k weights[n, k] * expert_{slot[n, k]}(x[n])
// with expert_s(x) = (silu(x W_gate[s]) * x W_up[s]) W_down[s].
//
// Shapes: hidden [N, D] (rows may be strided: received byte rows are read in place);
// local_slots [N, K] int64, -1 where a choice is served elsewhere (or the row is padding);
// weights [N, K] float32; w13 [S, D, 2I] (gate columns, then up columns); w2 [S, I, D].
// Returns [N, D] contiguous in hidden's dtype, zero rows where nothing is served.
// Dtypes: float32, or bfloat16 hidden and weights (a decode step's experts stream all their
// weights for a few rows each, so bfloat16's half the bytes matter). In bfloat16, where the
// processor has AVX512_BF16, bf16 pairs are multiplied by `vdpbf16ps` and summed in float32,
// the activation between the two GEMMs rounded to bf16 (`dot_gemm` below), and on AMX tiles
// (`amx_gemm`) where it has AMX-BF16 and a slot has rows enough; elsewhere, or with
// LOCKSTEP_BF16_DOT=0, the arithmetic is float32's: rows widened as they are gathered, weights
// as they are loaded into registers (a shift), the output rounded to bfloat16 once. This is
// `moe.experts.LocalExperts.weighted_sum`'s contract: the whole expert side of a dispatch in one
// call, where the PyTorch path takes ~15 ops (nonzero, sort, gathers, scale, index_add).
//
// Steps: a counting sort of the (row, choice) pairs by slot; per slot, its rows gathered into a
// buffer, the two GEMMs with the activation between, results into a per-pair buffer; then each
// output row sums its pairs in k order (so the result does not depend on the thread count).
//
// Why not torch's GEMMs: one call per slot and projection costs a dispatch each, and a plain
// register-blocked loop compiled for the host (-march=native) is as fast or faster on these
// shapes where it was measured. On an AMD EPYC with AVX-512, one thread, it came close to a
// loop of nothing but FMAs, activation included, ahead of torch.mm on the gate/up GEMM alone,
// and the 6 x 64 blocking beat an 8 x 32 one most at decode sizes. On an AVX2 EPYC (8-lane
// blocks, below) it is well ahead of PyTorch at decode sizes with two threads and behind it
// with one thread at I = 512: `expert_backend: auto` times it on each host. The figures:
// docs/benchmark_notes.md, "MoE layer", "One MoE layer" and "Backends".
//
// Work is split by slot: slots are dealt to threads largest first, each to the least loaded
// thread, and a thread runs its slots' two GEMMs and the activation in between on its own
// buffers. Numerics: float32 accumulation in k order (not torch's summation order), and silu
// through a polynomial exp (relative error below 2e-7), so results match the PyTorch path to
// float32 rounding, not bit for bit.

// ATen only (not torch/extension.h): this file needs no Python, and compiles much faster
// (docs/benchmark_notes.md, "Start-up and failure detection").
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "vec16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using lockstep::kLanes;
using lockstep::load16;
using lockstep::splat;
using lockstep::store16;
using lockstep::v16;
using lockstep::vexp;
constexpr int64_t kPrefetchRows = 16;

// The GEMM's vector: the target's own register width. AVX-512: 16 lanes, 32 registers, so a
// 6 x 64 block (24 accumulators + 4 vectors of B). Otherwise 8 lanes (AVX2's 256-bit
// registers, 16 of them): a 6 x 16 block (12 + 2). A 16-lane vector there is two registers
// that GCC keeps in memory between operations: on an AVX2 host (two threads, bench_vs_vllm's
// model) that left the kernel behind PyTorch's ops, far behind on prefill; with 8-lane vectors
// it is ahead of them on both (docs/benchmark_notes.md, "MoE layer").
#if defined(__AVX512F__)
typedef float vgemm __attribute__((vector_size(64)));
constexpr int kBlockVectors = 4;
#else
typedef float vgemm __attribute__((vector_size(32)));
constexpr int kBlockVectors = 2;
#endif
constexpr int64_t kGemmLanes = sizeof(vgemm) / sizeof(float);

inline vgemm load_g(const float* p) {
  vgemm v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kGemmLanes bfloat16 values widened to float32: a bfloat16 is a float32's upper half.
typedef uint16_t vgemm_h __attribute__((vector_size(sizeof(vgemm) / 2)));
typedef uint32_t vgemm_u __attribute__((vector_size(sizeof(vgemm))));

inline vgemm load_g(const at::BFloat16* p) {
  vgemm_h h;
  std::memcpy(&h, p, sizeof(h));
  const vgemm_u bits = __builtin_convertvector(h, vgemm_u) << 16;
  vgemm v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

inline void store_g(float* p, vgemm v) { std::memcpy(p, &v, sizeof(v)); }

// On AVX2 (16 registers), how many vectors wide a block of MR < kRowBlock rows can be: MR * NV
// accumulators plus NV vectors of B, so that the few rows a decode step gives an expert walk B
// in wider contiguous pieces. At one row per expert, 16-column blocks read B 64 bytes per 6 KiB
// row stride and took twice the time of streaming the weights; now 64 columns (8 vectors) at
// one row, 40 at two. (AVX-512 keeps its measured 6 x 64 blocks for every row count.)
template <int MR>
constexpr int block_vectors() {
  return 16 / (MR + 1);
}

// C[MR, NV * L] = A[MR, K] @ B[K, NV * L] (L = kGemmLanes), row-major with leading dimensions
// lda, ldb, ldc: the MR x NV accumulator vectors stay in registers for the whole k loop.
// `next`, where not null, is the same block of the next column panel: its rows are prefetched
// into L2 along the k loop (see `gemm`).
template <int MR, int NV, typename TB>
inline void gemm_block(const float* A, int64_t lda, const TB* B, int64_t ldb, float* C,
                       int64_t ldc, int64_t K, const TB* next = nullptr) {
  vgemm acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = vgemm{};
  }
  const TB* b = B;
  const TB* n = next;
  for (int64_t k = 0; k < K; ++k, b += ldb) {
    // B is walked down a column block: ask for the piece kPrefetchRows rows ahead (faster than
    // leaving it to the hardware prefetcher, docs/benchmark_notes.md, "MoE layer"; a prefetch
    // past the end of B is a no-op, never a fault).
    vgemm bv[NV];
    for (int v = 0; v < NV; ++v) {
      __builtin_prefetch(b + kPrefetchRows * ldb + v * kGemmLanes);
      bv[v] = load_g(b + v * kGemmLanes);
    }
    if (n != nullptr) {
      for (int v = 0; v < NV; ++v) __builtin_prefetch(n + v * kGemmLanes, 0, 2);
      n += ldb;
    }
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * bv[v];
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) store_g(C + r * ldc + v * kGemmLanes, acc[r][v]);
  }
}

// C[MR, N] = A[MR, K] @ B[K, N] in blocks of NV vectors, the rest in blocks of NV / 2, and so on
// down to one vector, then one column at a time (the wide blocks of `block_vectors`).
template <int MR, int NV, typename TB>
void gemm_cols(const float* A, int64_t lda, const TB* B, int64_t ldb, float* C, int64_t ldc,
               int64_t K, int64_t N) {
  constexpr int64_t L = kGemmLanes;
  int64_t j = 0;
  for (; j + NV * L <= N; j += NV * L) gemm_block<MR, NV, TB>(A, lda, B + j, ldb, C + j, ldc, K);
  if constexpr (NV > 1) {
    if (j < N) gemm_cols<MR, NV / 2, TB>(A, lda, B + j, ldb, C + j, ldc, K, N - j);
  } else {
    for (; j < N; ++j) {
      for (int r = 0; r < MR; ++r) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) acc += A[r * lda + k] * widen(B[k * ldb + j]);
        C[r * ldc + j] = acc;
      }
    }
  }
}

// C[MR, N] = A[MR, K] @ B[K, N]: columns in blocks of kBlockVectors vectors, then narrower
// ones, then one at a time.
template <int MR, typename TB>
void gemm_rows(const float* A, int64_t lda, const TB* B, int64_t ldb, float* C, int64_t ldc,
               int64_t K, int64_t N, const TB* next = nullptr) {
  constexpr int64_t L = kGemmLanes;
  int64_t j = 0;
  auto ahead = [next](int64_t column) { return next == nullptr ? nullptr : next + column; };
  if constexpr (kBlockVectors >= 4) {
    for (; j + 4 * L <= N; j += 4 * L) {
      gemm_block<MR, 4, TB>(A, lda, B + j, ldb, C + j, ldc, K, ahead(j));
    }
  }
  for (; j + 2 * L <= N; j += 2 * L) {
    gemm_block<MR, 2, TB>(A, lda, B + j, ldb, C + j, ldc, K, ahead(j));
  }
  for (; j + L <= N; j += L) gemm_block<MR, 1, TB>(A, lda, B + j, ldb, C + j, ldc, K, ahead(j));
  for (; j < N; ++j) {
    for (int r = 0; r < MR; ++r) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[r * lda + k] * widen(B[k * ldb + j]);
      C[r * ldc + j] = acc;
    }
  }
}

// Register block: 6 rows x 64 columns is 24 accumulators plus 4 vectors of B, within AVX-512's
// 32 registers, and 4 FMAs per load of A (8 x 32 had 2). Column panel: all row blocks pass over
// kColumnPanel columns of B before the next, so the panel (K x 128 floats, 128-256 KiB here)
// stays in L2 instead of the whole of B streaming once per row block. On the AVX-512 machine
// that took GEMMs of the experts' shapes to about an FMA-only loop's peak, clearly ahead of
// 8 x 32 blocks with rows outermost (docs/benchmark_notes.md, "MoE layer").
constexpr int kRowBlock = 6;

// Overlapping the next column panel's fetch with a panel's later row blocks (`gemm`,
// `dot_gemm`). Without it a slot of 7+ rows is memory-bound in its first row block, compute-bound
// in the others, never both: on a 2-core AMD EPYC with AVX-512 (Zen 4) one Mixtral layer's
// experts at 12-16 rows per expert took 0.76-0.84x the time with it (float32), 0.69-0.75x in
// bf16 dot products, 0.91-0.94x at 128 rows, the same at 1-5 (docs/benchmark_notes.md); on a
// 2-core AMD EPYC with AVX2 only (8-lane blocks), 0.92-0.95x at 12-16 rows, 0.92-0.98x at 32,
// 0.94-1.01x at 4-8 and 128 (float32, three runs of six). So on by default for every build;
// LOCKSTEP_NEXT_PANEL=0 or 1, read at each call, turns it off or on (to measure it).
inline bool next_panel_enabled() {
  const char* value = std::getenv("LOCKSTEP_NEXT_PANEL");
  if (value == nullptr || *value == '\0') return true;
  return std::strcmp(value, "0") != 0;
}
constexpr int64_t kColumnPanel = 128;
constexpr int64_t kRowChunk = 20 * kRowBlock;

// C[M, N] = A[M, K] @ B[K, N], by column panels, then blocks of kRowBlock rows (a smaller
// template for the rest).
template <typename TB>
void gemm(const float* A, int64_t lda, const TB* B, int64_t ldb, float* C, int64_t ldc,
          int64_t M, int64_t K, int64_t N) {
  if constexpr (kGemmLanes == 8) {
    if (M < kRowBlock) {
      // AVX2, fewer rows than one block (a decode step's share of an expert): one pass over B
      // in wide blocks, no column panels (there is no second row block to reuse one).
      switch (M) {
        case 5: gemm_cols<5, block_vectors<5>(), TB>(A, lda, B, ldb, C, ldc, K, N); break;
        case 4: gemm_cols<4, block_vectors<4>(), TB>(A, lda, B, ldb, C, ldc, K, N); break;
        case 3: gemm_cols<3, block_vectors<3>(), TB>(A, lda, B, ldb, C, ldc, K, N); break;
        case 2: gemm_cols<2, block_vectors<2>(), TB>(A, lda, B, ldb, C, ldc, K, N); break;
        case 1: gemm_cols<1, block_vectors<1>(), TB>(A, lda, B, ldb, C, ldc, K, N); break;
        default: break;
      }
      return;
    }
  }
  const bool overlap = next_panel_enabled();
  for (int64_t j = 0; j < N; j += kColumnPanel) {
    const int64_t cols = std::min(kColumnPanel, N - j);
    // The first row block streams the panel from memory; the second, which finds it in L2,
    // prefetches the next panel meanwhile, so the next first block finds that in L2 too
    // (`next_panel_enabled`).
    const TB* next = overlap && j + kColumnPanel < N ? B + j + kColumnPanel : nullptr;
    int64_t i = 0;
    for (; i + kRowBlock <= M; i += kRowBlock) {
      gemm_rows<kRowBlock, TB>(A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, K, cols,
                               i == kRowBlock ? next : nullptr);
    }
    const float* a = A + i * lda;
    float* c = C + i * ldc + j;
    const TB* n = i == kRowBlock ? next : nullptr;
    switch (M - i) {
      case 5: gemm_rows<5, TB>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      case 4: gemm_rows<4, TB>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      case 3: gemm_rows<3, TB>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      case 2: gemm_rows<2, TB>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      case 1: gemm_rows<1, TB>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      default: break;
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16 x bfloat16 on a processor with AVX512_BF16: `vdpbf16ps` multiplies pairs of bf16
// along k and adds both products to a float32 lane, twice the multiply-adds per instruction
// of the widening path above. The pairs come from two rows of B (k, k + 1) interleaved in
// registers (`unpacklo/hi_epi16`), so the weights keep their layout; A's pair is one 32-bit
// broadcast. The interleave leaves each accumulator's columns permuted within 128-bit lanes
// (unpacklo: columns 8L + 0..3 of lane L, unpackhi: 8L + 4..7); the store undoes it.
constexpr bool kDotBf16 = true;

inline __m512 unpermute(__m512 lo, __m512 hi, int first) {
  // Output column c (first..first+15 of a 32-column block): lane L = c / 8, word w = c % 8;
  // w < 4 is lo's dword 4L + w, else hi's dword 4L + w - 4 (indices 16.. select hi).
  alignas(64) int32_t idx[16];
  for (int i = 0; i < 16; ++i) {
    const int c = first + i, lane = c / 8, w = c % 8;
    idx[i] = w < 4 ? 4 * lane + w : 16 + 4 * lane + (w - 4);
  }
  return _mm512_permutex2var_ps(lo, _mm512_load_si512(idx), hi);
}

// C[MR, NB * 32] = A[MR, K] @ B[K, NB * 32], all bf16 in, float32 out; K even.
// `next`: as in `gemm_block`.
template <int MR, int NB>
inline void dot_block(const at::BFloat16* A, int64_t lda, const at::BFloat16* B, int64_t ldb,
                      float* C, int64_t ldc, int64_t K, const at::BFloat16* next = nullptr) {
  __m512 acc[MR][2 * NB];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const at::BFloat16* b = B;
  const at::BFloat16* n = next;
  for (int64_t k = 0; k < K; k += 2, b += 2 * ldb) {
    __m512bh pairs[2 * NB];
    if (n != nullptr) {
      for (int h = 0; h < NB; ++h) {
        __builtin_prefetch(n + 32 * h, 0, 2);
        __builtin_prefetch(n + ldb + 32 * h, 0, 2);
      }
      n += 2 * ldb;
    }
    for (int h = 0; h < NB; ++h) {
      __builtin_prefetch(b + kPrefetchRows * ldb + 32 * h);
      __builtin_prefetch(b + (kPrefetchRows + 1) * ldb + 32 * h);
      const __m512i row0 = _mm512_loadu_si512(b + 32 * h);
      const __m512i row1 = _mm512_loadu_si512(b + ldb + 32 * h);
      pairs[2 * h] = (__m512bh)_mm512_unpacklo_epi16(row0, row1);
      pairs[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(row0, row1);
    }
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + k, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pairs[v], a);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < NB; ++h) {
      float* c = C + r * ldc + 32 * h;
      _mm512_storeu_ps(c, unpermute(acc[r][2 * h], acc[r][2 * h + 1], 0));
      _mm512_storeu_ps(c + 16, unpermute(acc[r][2 * h], acc[r][2 * h + 1], 16));
    }
  }
}

template <int MR>
void dot_rows(const at::BFloat16* A, int64_t lda, const at::BFloat16* B, int64_t ldb, float* C,
              int64_t ldc, int64_t K, int64_t N, const at::BFloat16* next = nullptr) {
  int64_t j = 0;
  auto ahead = [next](int64_t column) { return next == nullptr ? nullptr : next + column; };
  for (; j + 64 <= N; j += 64) dot_block<MR, 2>(A, lda, B + j, ldb, C + j, ldc, K, ahead(j));
  for (; j + 32 <= N; j += 32) dot_block<MR, 1>(A, lda, B + j, ldb, C + j, ldc, K, ahead(j));
  for (; j < N; ++j) {  // the last N % 32 columns
    for (int r = 0; r < MR; ++r) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        acc += static_cast<float>(A[r * lda + k]) * static_cast<float>(B[k * ldb + j]);
      }
      C[r * ldc + j] = acc;
    }
  }
}

// C[M, N] = A[M, K] @ B[K, N] in bf16 (K even), by column panels and row blocks as `gemm`.
void dot_gemm(const at::BFloat16* A, int64_t lda, const at::BFloat16* B, int64_t ldb, float* C,
              int64_t ldc, int64_t M, int64_t K, int64_t N) {
  const bool overlap = next_panel_enabled();
  for (int64_t j = 0; j < N; j += kColumnPanel) {
    const int64_t cols = std::min(kColumnPanel, N - j);
    const at::BFloat16* next = overlap && j + kColumnPanel < N ? B + j + kColumnPanel : nullptr;
    int64_t i = 0;
    for (; i + kRowBlock <= M; i += kRowBlock) {
      dot_rows<kRowBlock>(A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, K, cols,
                          i == kRowBlock ? next : nullptr);
    }
    const at::BFloat16* a = A + i * lda;
    float* c = C + i * ldc + j;
    const at::BFloat16* n = i == kRowBlock ? next : nullptr;
    switch (M - i) {
      case 5: dot_rows<5>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      case 4: dot_rows<4>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      case 3: dot_rows<3>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      case 2: dot_rows<2>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      case 1: dot_rows<1>(a, lda, B + j, ldb, c, ldc, K, cols, n); break;
      default: break;
    }
  }
}
// dst[e] = bf16(src[e]) for e < n, rounding to nearest even: 32 at a time by the processor's
// own conversion (a scalar conversion loop cost a quarter of a decode layer's expert time).
void narrow_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t e = 0;
  for (; e + 32 <= n; e += 32) {
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + e + 16), _mm512_loadu_ps(src + e));
    _mm512_storeu_si512(dst + e, (__m512i)both);
  }
  for (; e < n; ++e) dst[e] = src[e];
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bfloat16 GEMMs on AMX's tiles (Intel's Advanced Matrix Extensions): one `tdpbf16ps` takes a
// 16 x 32 tile of A's bf16 and a tile of 16 k-pairs x 16 columns of B, adding a 16 x 16 float32
// tile, 8,192 multiply-adds in one instruction where `vdpbf16ps` does 32. B's tile holds each
// column's (k, k + 1) pair side by side, which is what `dot_block` builds in registers, so the
// same interleave (`unpacklo/hi_epi16` of two rows of B) packs it, a 32 x 64 block of B at a
// time into a 4 KiB buffer; the weights keep their layout (nothing packed at load, nothing to
// repack when EPLB or a reshard writes them). The interleave's column order within 128-bit
// lanes carries into C's tiles and `unpermute` undoes it as C is stored, as in `dot_block`.
// Linux grants a process the tiles' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
constexpr bool kAmxBf16 = true;

bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kTileB = 16 * 32;  // bf16 in one B tile
// How far ahead of the k loop B's rows are prefetched. AMX host, 8 Mixtral-shaped slots of 16
// rows, weights cycled through 680 MB so they come from memory: 0.98 ms a call without, 0.79
// at 32 rows ahead, 0.75 at 64, 0.90 at 128; bf16 decode_heavy profile (three alternations):
// 4,640-4,871 tok/s with it, 4,405-4,839 without.
constexpr int64_t kAmxPrefetchRows = 64;

// Tiles 0-3: C, m rows x 16 float32 each, 64 columns of C (two 32-column groups, each as its
// unpacklo then its unpackhi columns); 4: A, m rows x 32 bf16; 5 and 6: B, 16 k-pairs x 16
// columns (two, so a load can overlap the previous product).
inline void configure_tiles(int m) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) config.rows[t] = static_cast<uint8_t>(m);
  config.rows[5] = config.rows[6] = 16;
  for (int t = 0; t < 7; ++t) config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
}

// B[0..32, 0..64) into the 4 B tiles at `tiles`: column group g's (of 32) unpacklo pairs in
// tile 2 g, its unpackhi pairs in tile 2 g + 1, row p holding B's rows 2 p and 2 p + 1.
inline void pack_b_block(const at::BFloat16* B, int64_t ldb, at::BFloat16* tiles) {
  for (int p = 0; p < 16; ++p) {
    const at::BFloat16* row = B + 2 * p * ldb;
    for (int g = 0; g < 2; ++g) {
      const __m512i row0 = _mm512_loadu_si512(row + 32 * g);
      const __m512i row1 = _mm512_loadu_si512(row + ldb + 32 * g);
      _mm512_store_si512(tiles + 2 * g * kTileB + 32 * p, _mm512_unpacklo_epi16(row0, row1));
      _mm512_store_si512(tiles + (2 * g + 1) * kTileB + 32 * p,
                         _mm512_unpackhi_epi16(row0, row1));
    }
  }
}

// One 32-column group's two C tiles (its unpacklo, its unpackhi columns), stored to `out`,
// into C[m, 32] with the columns back in order.
inline void store_group(float* C, int64_t ldc, int m, float (*out)[16][16]) {
  for (int r = 0; r < m; ++r) {
    const __m512 lo = _mm512_load_ps(out[0][r]), hi = _mm512_load_ps(out[1][r]);
    _mm512_storeu_ps(C + r * ldc, unpermute(lo, hi, 0));
    _mm512_storeu_ps(C + r * ldc + 16, unpermute(lo, hi, 16));
  }
}

// One k step of a row block: C's 4 tiles += A[m, k..k+32) (tile 4) @ the 4 B tiles at `tiles`
// (alternating tiles 5 and 6, so a load can overlap the previous product).
inline void multiply_tiles(const at::BFloat16* A, int64_t lda, const at::BFloat16* tiles) {
  _tile_loadd(4, A, lda * sizeof(at::BFloat16));
  _tile_loadd(5, tiles, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, tiles + kTileB, 64);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(5, tiles + 2 * kTileB, 64);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(6, tiles + 3 * kTileB, 64);
  _tile_dpbf16ps(3, 4, 6);
}

inline void zero_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// C's 4 tiles into C[m, 64], the columns back in order.
inline void store_tiles(float* C, int64_t ldc, int m) {
  alignas(64) float out[4][16][16];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  _tile_stored(3, out[3], 64);
  store_group(C, ldc, m, out);
  store_group(C + 32, ldc, m, out + 2);
}

// C[m, 64] = A[m, K] @ B[K, 64], m <= 16 (one row block). `next`: the next block's B (the
// next 64 columns), or null.
void amx_block(const at::BFloat16* A, int64_t lda, const at::BFloat16* B, int64_t ldb, float* C,
               int64_t ldc, int m, int64_t K, at::BFloat16* tiles, const at::BFloat16* next) {
  zero_tiles();
  for (int64_t k = 0; k < K; k += 32) {
    // Ask for the rows kAmxPrefetchRows ahead (into the next block's columns past the last
    // k): each row's 128 bytes lie a row of B apart (3 KiB for Mixtral's gate/up), a stride
    // the hardware's prefetchers did not follow here. (A prefetch never faults, so one past
    // B's last row is harmless.)
    const int64_t row = k + kAmxPrefetchRows;
    const at::BFloat16* ahead = row < K            ? B + row * ldb
                                : next != nullptr ? next + (row - K) * ldb
                                                  : nullptr;
    if (ahead != nullptr) {
      for (int r = 0; r < 32; ++r) {
        __builtin_prefetch(ahead + r * ldb, 0, 3);
        __builtin_prefetch(ahead + r * ldb + 32, 0, 3);
      }
    }
    pack_b_block(B + k * ldb, ldb, tiles);
    multiply_tiles(A + k, lda, tiles);
  }
  store_tiles(C, ldc, m);
}

// C[M, N] = A[M, K] @ B[K, N] in bf16 on AMX; K % 32 == 0 and N % 64 == 0 (`amx_fits`).
// 64 columns at a time. A slot of one row block (M <= 16, decode's usual share) packs B on the
// way through the k loop, a 32 x 64 block (4 KiB, in L1) at a time, with the rows ahead
// prefetched (`amx_block`). More rows pack the 64-column panel once (K / 32 blocks of 4 KiB)
// and run every row block over it (`amx_block_packed`). Measured on an AMX host, the two
// alternated in one process over the autotune's expert workload (random routing, medians of
// 7): the panel took 0.64x the time at 32 rows per slot (D 4096, I 1792), 0.43x at 256, 0.65x
// at 128 (D 2048, I 768), 0.85x at 64 (D 256, I 128), and about the same at 16 or fewer
// (hence the fused path there, whose prefetch matters when weights come from memory).
inline bool amx_fits(int64_t K, int64_t N) { return K % 32 == 0 && N % 64 == 0; }

// C[m, 64] = A[m, K] @ (a 64-column panel of B packed by pack_b_block, 32 rows of B per 4 KiB).
void amx_block_packed(const at::BFloat16* A, int64_t lda, const at::BFloat16* panel, float* C,
                      int64_t ldc, int m, int64_t K) {
  zero_tiles();
  for (int64_t k = 0; k < K; k += 32) multiply_tiles(A + k, lda, panel + (k / 32) * 4 * kTileB);
  store_tiles(C, ldc, m);
}

constexpr int64_t kAmxPanelRows = 16;  // more rows than this: the packed panel

void amx_gemm(const at::BFloat16* A, int64_t lda, const at::BFloat16* B, int64_t ldb, float* C,
              int64_t ldc, int64_t M, int64_t K, int64_t N) {
  alignas(64) at::BFloat16 tiles[4 * kTileB];  // the fused path's one packed k step
  const bool by_panel = M > kAmxPanelRows;
  thread_local std::vector<at::BFloat16> storage;  // the panel: K / 32 packed k steps
  at::BFloat16* panel = nullptr;
  if (by_panel) {
    storage.resize((K / 32) * 4 * kTileB + 32);  // + 64 bytes to align the start to 64
    panel = reinterpret_cast<at::BFloat16*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  }
  int configured = -1;
  for (int64_t j = 0; j < N; j += 64) {
    if (by_panel) {
      for (int64_t k = 0; k < K; k += 32) {
        pack_b_block(B + k * ldb + j, ldb, panel + (k / 32) * 4 * kTileB);
      }
    }
    const at::BFloat16* next = j + 64 < N ? B + j + 64 : nullptr;
    for (int64_t i = 0; i < M; i += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, M - i));
      if (m != configured) {
        configure_tiles(m);
        configured = m;
      }
      if (by_panel) {
        amx_block_packed(A + i * lda, lda, panel, C + i * ldc + j, ldc, m, K);
      } else {
        amx_block(A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, m, K, tiles, next);
      }
    }
  }
  _tile_release();
}
#endif
#else
constexpr bool kDotBf16 = false;
void narrow_bf16(const float*, at::BFloat16*, int64_t) {}
void dot_gemm(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, float*, int64_t,
              int64_t, int64_t, int64_t) {}
#endif
#if !(defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__))
constexpr bool kAmxBf16 = false;
bool amx_permitted() { return false; }
inline bool amx_fits(int64_t, int64_t) { return false; }
void amx_gemm(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, float*, int64_t,
              int64_t, int64_t, int64_t) {}
#endif

// act[r, j] = silu(gate_up[r, j]) * gate_up[r, I + j] for r < M, j < I.
void swiglu_rows(const float* gate_up, float* act, int64_t M, int64_t I) {
  for (int64_t r = 0; r < M; ++r) {
    const float* gate = gate_up + r * 2 * I;
    const float* up = gate + I;
    float* out = act + r * I;
    int64_t j = 0;
    for (; j + kLanes <= I; j += kLanes) {
      const v16 g = load16(gate + j);
      store16(out + j, g / (1.0f + vexp(-g)) * load16(up + j));
    }
    if (j < I) {  // the last I % 16 columns, through a zero-padded vector
      float g_tail[kLanes] = {}, u_tail[kLanes] = {}, o_tail[kLanes];
      std::memcpy(g_tail, gate + j, (I - j) * sizeof(float));
      std::memcpy(u_tail, up + j, (I - j) * sizeof(float));
      const v16 g = load16(g_tail);
      store16(o_tail, g / (1.0f + vexp(-g)) * load16(u_tail));
      std::memcpy(out + j, o_tail, (I - j) * sizeof(float));
    }
  }
}

// The bf16 dot-product path can be turned off (LOCKSTEP_BF16_DOT=0, read at each call) to
// measure it against the widening one, and to test both; it is on wherever the processor has it.
inline bool dot_enabled() {
  const char* value = std::getenv("LOCKSTEP_BF16_DOT");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// The AMX path likewise (LOCKSTEP_BF16_AMX=0), where the processor and the kernel have it. It
// runs a slot's GEMMs when the slot has at least kAmxMinRows rows: below that, packing B's
// blocks for the tiles costs more than the products save (AMX host, 8 Mixtral-shaped slots of
// r rows each: 0.39 against 0.33 ms at r = 3, even at 4, 0.40 against 0.49 at 6, 0.45
// against 1.24 at 16).
inline bool amx_enabled() {
  const char* value = std::getenv("LOCKSTEP_BF16_AMX");
  return kAmxBf16 && (value == nullptr || std::strcmp(value, "0") != 0) && amx_permitted();
}
constexpr int64_t kAmxMinRows = 5;

inline void bf16_gemm(bool amx, const at::BFloat16* A, int64_t lda, const at::BFloat16* B,
                      int64_t ldb, float* C, int64_t ldc, int64_t M, int64_t K, int64_t N) {
  if (amx && M >= kAmxMinRows && amx_fits(K, N)) {
    amx_gemm(A, lda, B, ldb, C, ldc, M, K, N);
  } else {
    dot_gemm(A, lda, B, ldb, C, ldc, M, K, N);
  }
}

// One gathered row, widened to float32.
inline void gather_row(float* dst, const float* src, int64_t size) {
  std::memcpy(dst, src, size * sizeof(float));
}

inline void gather_row(float* dst, const at::BFloat16* src, int64_t size) {
  for (int64_t j = 0; j < size; ++j) dst[j] = static_cast<float>(src[j]);
}

template <typename T>
at::Tensor routed_swiglu_typed(const at::Tensor& hidden, const at::Tensor& local_slots,
                               const at::Tensor& weights, const at::Tensor& w13,
                               const at::Tensor& w2);

}  // namespace

// Whether routed_swiglu multiplies bfloat16 on AMX tiles in this process (compiled for a processor
// with them, granted by the kernel, not turned off by LOCKSTEP_BF16_DOT=0 or LOCKSTEP_BF16_AMX=0).
bool routed_swiglu_amx() { return kDotBf16 && dot_enabled() && amx_enabled(); }

at::Tensor routed_swiglu(const at::Tensor& hidden, const at::Tensor& local_slots,
                         const at::Tensor& weights, const at::Tensor& w13, const at::Tensor& w2) {
  TORCH_CHECK(hidden.device().is_cpu() && local_slots.device().is_cpu() &&
                  weights.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu(),
              "routed_swiglu: every tensor must be on the CPU");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weights.scalar_type() == at::kFloat &&
                  w13.scalar_type() == dtype && w2.scalar_type() == dtype,
              "routed_swiglu: hidden, w13 and w2 must be float32, or all three bfloat16; "
              "weights float32");
  TORCH_CHECK(local_slots.scalar_type() == at::kLong,
              "routed_swiglu: local_slots must be int64");
  TORCH_CHECK(hidden.dim() == 2 && local_slots.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
              "routed_swiglu: need hidden [N, D], local_slots and weights [N, K], "
              "w13 [S, D, 2I], w2 [S, I, D]");
  TORCH_CHECK(hidden.stride(1) == 1 && local_slots.is_contiguous() && weights.is_contiguous() &&
                  w13.is_contiguous() && w2.is_contiguous(),
              "routed_swiglu: hidden's rows must be contiguous; local_slots, weights, w13 and w2 "
              "must be contiguous");
  const int64_t num_rows = hidden.size(0), size_d = hidden.size(1), top_k = local_slots.size(1);
  const int64_t num_slots = w13.size(0), size_i = w2.size(1);
  TORCH_CHECK(local_slots.size(0) == num_rows && weights.sizes() == local_slots.sizes() &&
                  w13.size(1) == size_d && w13.size(2) == 2 * size_i &&
                  w2.size(0) == num_slots && w2.size(2) == size_d,
              "routed_swiglu: shapes disagree: hidden ", hidden.sizes(), ", local_slots ",
              local_slots.sizes(), ", weights ", weights.sizes(), ", w13 ", w13.sizes(), ", w2 ",
              w2.sizes());
  if (dtype == at::kBFloat16) {
    return routed_swiglu_typed<at::BFloat16>(hidden, local_slots, weights, w13, w2);
  }
  return routed_swiglu_typed<float>(hidden, local_slots, weights, w13, w2);
}

namespace {

template <typename T>
at::Tensor routed_swiglu_typed(const at::Tensor& hidden, const at::Tensor& local_slots,
                               const at::Tensor& weights, const at::Tensor& w13,
                               const at::Tensor& w2) {
  const int64_t num_rows = hidden.size(0), size_d = hidden.size(1), top_k = local_slots.size(1);
  const int64_t num_slots = w13.size(0), size_i = w2.size(1);
  const int64_t num_choices = num_rows * top_k, ldx = hidden.stride(0);
  const int64_t* slot_of = local_slots.data_ptr<int64_t>();

  // Counting sort of the (row, choice) pairs by slot: pairs of slot s are first[s]..first[s+1).
  std::vector<int64_t> count(num_slots, 0);
  for (int64_t c = 0; c < num_choices; ++c) {
    const int64_t s = slot_of[c];
    TORCH_CHECK(s >= -1 && s < num_slots, "routed_swiglu: local_slots[", c / top_k, ", ",
                c % top_k, "] = ", s, " is outside [-1, ", num_slots, ")");
    if (s >= 0) ++count[s];
  }
  std::vector<int64_t> first(num_slots + 1, 0);
  for (int64_t s = 0; s < num_slots; ++s) first[s + 1] = first[s] + count[s];
  std::vector<int64_t> pair_row(first[num_slots]), pair_of(num_choices, -1);
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t c = 0; c < num_choices; ++c) {
      if (slot_of[c] < 0) continue;
      const int64_t pair = next[slot_of[c]]++;
      pair_row[pair] = c / top_k;
      pair_of[c] = pair;
    }
  }

  // Deal the non-empty slots to threads, largest first, each to the least loaded thread.
  std::vector<int64_t> order(num_slots);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return count[a] > count[b]; });
  const int64_t busy = std::count_if(count.begin(), count.end(), [](int64_t c) { return c > 0; });
  const int64_t num_tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), busy));
  std::vector<std::vector<int64_t>> slots_of(num_tasks);
  std::vector<int64_t> load(num_tasks, 0);
  for (int64_t s : order) {
    if (count[s] == 0) break;
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    slots_of[t].push_back(s);
    load[t] += count[s];
  }

  // Each pair's expert output, pairs grouped by slot: [P, D].
  // (at::empty, not std::vector: every row is written, so no zero fill.)
  const auto float_options = hidden.options().dtype(at::kFloat);
  const at::Tensor pair_out = at::empty({first[num_slots], size_d}, float_options);
  float* expert_out = pair_out.data_ptr<float>();
  const T* x = hidden.data_ptr<T>();
  const T* w_gate_up = w13.data_ptr<T>();
  const T* w_down = w2.data_ptr<T>();
  // bf16 on a processor with bf16 dot products: rows stay bf16, the activation between the
  // GEMMs is rounded to bf16 (as PyTorch's bf16 path rounds it), sums in float32.
  const bool dot = std::is_same_v<T, at::BFloat16> && kDotBf16 && size_d % 2 == 0 &&
                   size_i % 2 == 0 && dot_enabled();
  const bool amx = dot && amx_enabled();
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows_in, gate_up, act;
    std::vector<at::BFloat16> rows_bf16, act_bf16;
    for (int64_t task = begin; task < end; ++task) {
      for (int64_t s : slots_of[task]) {
        // In chunks of rows, so a chunk's inputs and intermediates stay in L2 between the two
        // GEMMs however many rows the slot has.
        for (int64_t start = first[s]; start < first[s + 1]; start += kRowChunk) {
          const int64_t rows = std::min(kRowChunk, first[s + 1] - start);
          if constexpr (std::is_same_v<T, at::BFloat16>) {
            if (dot) {
              rows_bf16.resize(rows * size_d);
              gate_up.resize(rows * 2 * size_i);
              act.resize(rows * size_i);
              act_bf16.resize(rows * size_i);
              for (int64_t r = 0; r < rows; ++r) {
                std::memcpy(rows_bf16.data() + r * size_d, x + pair_row[start + r] * ldx,
                            size_d * sizeof(T));
              }
              bf16_gemm(amx, rows_bf16.data(), size_d, w_gate_up + s * size_d * 2 * size_i,
                        2 * size_i, gate_up.data(), 2 * size_i, rows, size_d, 2 * size_i);
              swiglu_rows(gate_up.data(), act.data(), rows, size_i);
              narrow_bf16(act.data(), act_bf16.data(), rows * size_i);
              bf16_gemm(amx, act_bf16.data(), size_i, w_down + s * size_i * size_d, size_d,
                        expert_out + start * size_d, size_d, rows, size_i, size_d);
              continue;
            }
          }
          rows_in.resize(rows * size_d);
          gate_up.resize(rows * 2 * size_i);
          act.resize(rows * size_i);
          for (int64_t r = 0; r < rows; ++r) {
            gather_row(rows_in.data() + r * size_d, x + pair_row[start + r] * ldx, size_d);
          }
          gemm(rows_in.data(), size_d, w_gate_up + s * size_d * 2 * size_i, 2 * size_i,
               gate_up.data(), 2 * size_i, rows, size_d, 2 * size_i);
          swiglu_rows(gate_up.data(), act.data(), rows, size_i);
          gemm(act.data(), size_i, w_down + s * size_i * size_d, size_d,
               expert_out + start * size_d, size_d, rows, size_i, size_d);
        }
      }
    }
  });

  // out[n] = sum over k, in k order, of weights[n, k] * that pair's expert output.
  auto out = at::empty({num_rows, size_d}, float_options);
  const float* weight = weights.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* row = y + n * size_d;
      std::fill(row, row + size_d, 0.0f);
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t pair = pair_of[n * top_k + k];
        if (pair < 0) continue;
        const float w = weight[n * top_k + k];
        const float* src = expert_out + pair * size_d;
        for (int64_t j = 0; j < size_d; ++j) row[j] += w * src[j];
      }
    }
  });
  return std::is_same_v<T, float> ? out : out.to(hidden.scalar_type());
}

}  // namespace
