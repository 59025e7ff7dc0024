// RMSNorm over the last dim, float32 or bfloat16, CPU: y = weight * (x / sqrt(mean(x^2) + eps)).
// bfloat16 as Hugging Face computes it: x widened, the normalised row rounded to bfloat16, then
// multiplied by the bf16 weight and rounded again (the cast before the scale matters for parity).
//
// Shapes: x [..., D] with the last dim contiguous and any strides before it (q/k heads arrive as
// views into the fused qkv projection's output); weight [D]. Returns a contiguous [..., D].
// Same operation order as Hugging Face's RMSNorm for float32 (mean of squares, rsqrt, multiply
// by x, then by the weight); the sum of squares runs in 16 lanes, so results match torch's to
// float32 rounding, not bit for bit.
//
// Why: torch's F.rms_norm on the CPU runs as five separate passes, each a walk over the tensor
// and an op's fixed cost, even for a decode batch or the per-head q norm of the same step; one
// pass here (docs/benchmark_notes.md, "Model forward").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// One bf16 row: sum of squares in float32 (16 lanes, as the float32 path), then HF's two
// roundings.
void rms_row_bf16(const at::BFloat16* xr, const at::BFloat16* w, at::BFloat16* yr, int64_t size_d,
                  float epsilon) {
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= size_d; j += kLanes) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const float v = static_cast<float>(xr[j + lane]);
      acc[lane] += v * v;
    }
  }
  float sum = 0.0f;
  for (int64_t lane = 0; lane < kLanes; ++lane) sum += acc[lane];
  for (; j < size_d; ++j) sum += static_cast<float>(xr[j]) * static_cast<float>(xr[j]);
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(size_d) + epsilon);
  for (j = 0; j < size_d; ++j) {
    const at::BFloat16 normed = static_cast<float>(xr[j]) * scale;
    yr[j] = static_cast<float>(w[j]) * static_cast<float>(normed);
  }
}

}  // namespace

at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x and weight must be float32, or both bfloat16");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(-1),
              "rms_norm: need x [..., D] and a contiguous weight [D]; got x ", x.sizes(),
              ", weight ", weight.sizes());
  const int64_t size_d = x.size(-1);
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  TORCH_CHECK(x.stride(-1) == 1 || size_d == 1, "rms_norm: x's last dim must be contiguous");
  const int64_t num_rows = x.numel() / size_d;
  // Row r of the output is x at leading index unravel(r): mixed-radix over the leading dims.
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end() - 1);
  std::vector<int64_t> strides(x.strides().begin(), x.strides().end() - 1);
  const float epsilon = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 16384 / size_d);
  auto row_offset = [&](int64_t r) {
    int64_t offset = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1, rest = r; d >= 0; --d) {
      offset += (rest % sizes[d]) * strides[d];
      rest /= sizes[d];
    }
    return offset;
  };
  if (bf16) {
    const at::BFloat16* x_ptr = x.data_ptr<at::BFloat16>();
    const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
    at::BFloat16* y_ptr = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        rms_row_bf16(x_ptr + row_offset(r), w, y_ptr + r * size_d, size_d, epsilon);
      }
    });
    return out;
  }
  const float* x_ptr = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* y_ptr = out.data_ptr<float>();
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x_ptr + row_offset(r);
      float* yr = y_ptr + r * size_d;
      v16 acc = v16{};
      int64_t j = 0;
      for (; j + kLanes <= size_d; j += kLanes) {
        const v16 v = load16(xr + j);
        acc += v * v;
      }
      float sum = 0.0f;
      for (int64_t lane = 0; lane < kLanes; ++lane) sum += acc[lane];
      for (; j < size_d; ++j) sum += xr[j] * xr[j];
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(size_d) + epsilon);
      j = 0;
      for (; j + kLanes <= size_d; j += kLanes) {
        store16(yr + j, load16(w + j) * (load16(xr + j) * scale));
      }
      for (; j < size_d; ++j) yr[j] = w[j] * (xr[j] * scale);
    }
  });
  return out;
}
