// One token per row drawn from softmax(logits / temperature), CPU, float32: the sampler's
// unfiltered rows (top_k, top_p and min_p off, vLLM's default sampling) in one pass per row.
//
// The draw is the sampler's (dist_engine/engine/sampler.py, `_draw`): the row's uniform u picks
// the first token whose running weight reaches u times the row's total, first a block of
// `block` tokens by the blocks' float64 prefix sums, then the token inside that block by its
// float64 prefix sums. The weights need no normalising for that, so a row is three walks: its
// maximum, then exp(s - max) summed per block (float32 within a block, float64 across blocks),
// then the one chosen block again. PyTorch's path takes a softmax (max, exp and sum, divide),
// a threshold, the block sums and the prefix sums, each a pass over [R, V] of its own: ~1.2 ms
// at [64, 32000] on two cores, against well under a tenth of that here.
//
// Weights are exp(s - max) by the kernels' polynomial exp (relative error below 2e-7), 0 where
// s - max < -87 (exp below float32's smallest normal: PyTorch's path drops those too, as
// probabilities under the smallest normal). Each row is its own: the token depends on the
// row's logits, temperature and uniform only, never on the other rows or the thread count.
// A row with a NaN, or no finite maximum (every token masked, or +inf), gets -1: the caller
// samples it the PyTorch way, which says what such a row gives.
//
// Shapes: logits [R, V] float32 with contiguous rows; temperatures [R] float32 (> 0);
// uniforms [R] float64 in (0, 1). Returns [R] int64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec16.h"

namespace {

using lockstep::kLanes;
using lockstep::load16;
using lockstep::splat;
using lockstep::store16;
using lockstep::v16;
using lockstep::v16i;
using lockstep::vexp;

constexpr float kUnderflow = -87.0f;

// w[i] = exp(s[i] - max) (0 below kUnderflow) for i < n, s = x / t (x itself when t == 1), into
// `out` when given; returns their float32 sum, 16 lanes then in lane order.
float weights(const float* x, int64_t n, float t, float max, float* out) {
  v16 total = splat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    v16 s = load16(x + i);
    if (t != 1.0f) s = s / t;
    const v16 d = s - max;
    const v16 w = d < splat(kUnderflow) ? splat(0.0f) : vexp(d);
    if (out != nullptr) store16(out + i, w);
    total += w;
  }
  float sum = 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) sum += total[lane];
  for (; i < n; ++i) {
    const float s = t != 1.0f ? x[i] / t : x[i];
    const float d = s - max;
    const float w = d < kUnderflow ? 0.0f : lockstep::fast_exp(d);
    if (out != nullptr) out[i] = w;
    sum += w;
  }
  return sum;
}

int64_t sample_row(const float* x, int64_t vocab, float t, double u, int64_t block,
                   std::vector<double>& prefix, std::vector<float>& inside) {
  // The maximum, 16 lanes at a time (a NaN anywhere is remembered, not compared).
  const float lowest = -std::numeric_limits<float>::infinity();
  v16 lanes = splat(lowest);
  v16i nan_lanes = v16i{};
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes) {
    v16 s = load16(x + i);
    if (t != 1.0f) s = s / t;
    nan_lanes |= s != s;
    lanes = s > lanes ? s : lanes;
  }
  float max = lowest;
  bool nan = false;
  for (int lane = 0; lane < kLanes; ++lane) {
    max = lanes[lane] > max ? lanes[lane] : max;
    nan |= nan_lanes[lane] != 0;
  }
  for (; i < vocab; ++i) {
    const float s = t != 1.0f ? x[i] / t : x[i];
    nan |= s != s;
    max = s > max ? s : max;
  }
  if (nan || !std::isfinite(max)) return -1;
  const int64_t num_blocks = (vocab + block - 1) / block;
  prefix.resize(num_blocks);
  double running = 0.0;
  int64_t last_positive = -1;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * block;
    const double mass = weights(x + first, std::min(block, vocab - first), t, max, nullptr);
    running += mass;
    prefix[b] = running;
    if (mass > 0.0) last_positive = b;
  }
  const double target = u * prefix[last_positive];
  int64_t chosen = last_positive;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const double before = b > 0 ? prefix[b - 1] : 0.0;
    if (prefix[b] > before && prefix[b] >= target) {
      chosen = b;
      break;
    }
  }
  const int64_t first = chosen * block;
  const int64_t size = std::min(block, vocab - first);
  inside.resize(size);
  weights(x + first, size, t, max, inside.data());
  const double before = chosen > 0 ? prefix[chosen - 1] : 0.0;
  double total = 0.0;
  for (int64_t i = 0; i < size; ++i) total += inside[i];
  const double residual = std::min(target - before, total);
  double cumulative = 0.0;
  int64_t token = -1;
  for (int64_t i = 0; i < size; ++i) {
    if (inside[i] <= 0.0f) continue;
    cumulative += inside[i];
    token = first + i;
    if (cumulative >= residual) break;
  }
  return token;
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures,
                       const at::Tensor& uniforms, int64_t block) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "sample_rows: logits must be float32 [R, V] on the CPU with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous() &&
                  temperatures.numel() == rows,
              "sample_rows: temperatures must be contiguous float32 [R]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() &&
                  uniforms.numel() == rows,
              "sample_rows: uniforms must be contiguous float64 [R]");
  TORCH_CHECK(block > 0 && vocab > 0, "sample_rows: need block > 0 and a vocabulary");
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* t = temperatures.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t ldx = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> prefix;
    std::vector<float> inside;
    for (int64_t r = begin; r < end; ++r) {
      out[r] = sample_row(x + r * ldx, vocab, t[r], u[r], block, prefix, inside);
    }
  });
  return tokens;
}
