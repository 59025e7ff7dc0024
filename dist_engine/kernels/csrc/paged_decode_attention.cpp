// Decode attention straight from the paged KV cache: one query token per sequence, no gather.
//
// Shapes: query [B, H, Dh]; key_cache, value_cache [NB, BS, Hkv, Dh] (any strides, Dh
// contiguous); block_tables [B, MB] int64; context_lens [B] int64. Returns [B, H, Dh].
// Query head h reads kv head h / (H / Hkv) (HF's GQA grouping). Softmax in the accumulation
// type (double for float64, float otherwise: float32, bfloat16, float16), with the usual max
// subtraction; the output is rounded to the input dtype once, at the end.
//
// Work is split over sequences; each walks its blocks once for the scores of all query heads and
// once more for the values. Compared with gathering the context into a padded tensor and
// calling SDPA, this reads each cached K and V row once and writes nothing but the output.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "paged_cache.h"
#include "vec16.h"

namespace {

using lockstep::fast_exp;  // float; the double overload below

inline double fast_exp(double x) { return std::exp(x); }

// kHeadDim > 0 fixes the head size at compile time (fully unrolled inner loops); 0 reads it from
// the tensors.
template <typename scalar_t, int64_t kHeadDim>
void decode_kernel(
    const torch::Tensor& query,
    const torch::Tensor& key_cache,
    const torch::Tensor& value_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& context_lens,
    double scale,
    torch::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_columns = block_tables.size(1);

  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t k_block = key_cache.stride(0), k_token = key_cache.stride(1),
                k_head = key_cache.stride(2);
  const int64_t v_block = value_cache.stride(0), v_token = value_cache.stride(1),
                v_head = value_cache.stride(2);
  const acc_t softmax_scale = static_cast<acc_t>(scale);

  // One sequence per task; inside it the cache is walked block by block, each block's rows in
  // memory order (token, then kv head), so every block is one sequential read; the next
  // block's pages are touched as one starts (lockstep::touch_pages).
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores;  // [H, L]
    std::vector<acc_t> q_scaled(num_heads * head_dim);
    std::vector<acc_t> acc(num_heads * head_dim);
    std::vector<acc_t> maxes(num_heads), sums(num_heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t length = lens[seq];
      const int64_t num_blocks = (length + block_size - 1) / block_size;
      const int64_t* table = tables + seq * num_columns;
      scores.resize(num_heads * length);
      const scalar_t* q_seq = q + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) {
        q_scaled[i] = static_cast<acc_t>(q_seq[i]) * softmax_scale;
      }
      std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<acc_t>::infinity());

      // visit(t, h, row) for every cached token t of this sequence and every query head h,
      // with `row` the Dh values of h's kv head at t. Rows come in memory order: block by
      // block, then token, then kv head.
      const auto walk = [&](const scalar_t* cache, int64_t block_stride, int64_t token_stride,
                            int64_t head_stride, auto&& visit) {
        for (int64_t c = 0; c < num_blocks; ++c) {
          const scalar_t* block = cache + table[c] * block_stride;
          if (c + 1 < num_blocks) {
            lockstep::touch_block(cache + table[c + 1] * block_stride, block_size, token_stride);
          }
          const int64_t first = c * block_size;
          const int64_t last = std::min(length, first + block_size);
          for (int64_t t = first; t < last; ++t) {
            for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
              const scalar_t* row = block + (t - first) * token_stride + kv * head_stride;
              for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
                visit(t, h, row);
              }
            }
          }
        }
      };

      // Pass 1: scores of every query head against every cached key.
      walk(k, k_block, k_token, k_head, [&](int64_t t, int64_t h, const scalar_t* k_row) {
        const acc_t* qh = q_scaled.data() + h * head_dim;
        acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) {
          dot += qh[d] * static_cast<acc_t>(k_row[d]);
        }
        scores[h * length + t] = dot;
        maxes[h] = std::max(maxes[h], dot);
      });
      for (int64_t h = 0; h < num_heads; ++h) {
        acc_t* s = scores.data() + h * length;
        const acc_t m = maxes[h];
        acc_t total = 0;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < length; ++t) {
          s[t] = fast_exp(s[t] - m);
          total += s[t];
        }
        sums[h] = total;
      }
      lockstep::touch_block(v + table[0] * v_block, block_size, v_token);
      if (seq + 1 < end) {
        lockstep::touch_block(k + tables[(seq + 1) * num_columns] * k_block, block_size, k_token);
      }

      // Pass 2: probability-weighted sum of the values, same walk.
      std::fill(acc.begin(), acc.end(), acc_t(0));
      walk(v, v_block, v_token, v_head, [&](int64_t t, int64_t h, const scalar_t* v_row) {
        const acc_t p = scores[h * length + t];
        acc_t* a = acc.data() + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) {
          a[d] += p * static_cast<acc_t>(v_row[d]);
        }
      });
      scalar_t* o_seq = o + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const acc_t inv = acc_t(1) / sums[h];
        for (int64_t d = 0; d < head_dim; ++d) {
          o_seq[h * head_dim + d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
        }
      }
    }
  });
}

// The vector path for float32 and bfloat16 with head dims of 16 x kVectors. As above, one
// sequence per task and its blocks walked in memory order, twice, but in chunks of up to 16
// tokens. For the scores, each query head takes the chunk's dot products as vector
// multiply-adds over the head dim (16 independent chains) and `sum_lanes16` folds them into one
// vector of 16 scores, where the scalar path reduces every (token, head) pair's dot product on
// its own. After a softmax over each head's scores, the second walk adds p x value row into the
// heads' accumulators. A bfloat16 chunk is widened into a float32 buffer once per kv head and
// read by every query head of its group (widening per head cost more than the products). Scores
// and sums in float32, exp by lockstep::vexp; the output is rounded once. Against the scalar path
// in one process on the AMX host (float32 and bfloat16; 64 x 192 tokens at 8 x 32 heads, up to
// 4 x 4,096 at 32 x 128): 0.56-0.92x its time on one or two threads. As a block starts, the
// next one's pages are touched (lockstep::touch_pages). (Prefetching every line of each chunk's
// span just before its reads was tried: slower in float32, even in bfloat16.)
template <typename scalar_t, int kVectors>
void decode_vectors(
    const torch::Tensor& query,
    const torch::Tensor& key_cache,
    const torch::Tensor& value_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& context_lens,
    double scale,
    torch::Tensor& out) {
  using lockstep::kBitReverse16;
  using lockstep::splat;
  using lockstep::store16;
  using lockstep::v16;
  constexpr int64_t kHeadDim = 16 * kVectors;
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_columns = block_tables.size(1);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t k_block = key_cache.stride(0), k_token = key_cache.stride(1),
                k_head = key_cache.stride(2);
  const int64_t v_block = value_cache.stride(0), v_token = value_cache.stride(1),
                v_head = value_cache.stride(2);
  const float softmax_scale = static_cast<float>(scale);
  constexpr bool kWide = std::is_same_v<scalar_t, float>;  // float32: rows read in place
  using lockstep::load16;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [H][length + 16]: a chunk stores 16 lanes
    std::vector<float> q_rows(num_heads * kHeadDim), acc(num_heads * kHeadDim), sums(num_heads);
    std::vector<float> widened(kWide ? 0 : 16 * kHeadDim);
    // kv head kv's rows of a chunk of n tokens at `first` as float32 rows `row_stride` apart.
    const auto rows_of = [&](const scalar_t* first, int64_t token_stride, int64_t n,
                             int64_t& row_stride) -> const float* {
      if constexpr (kWide) {
        row_stride = token_stride;
        return first;
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const auto* bits = reinterpret_cast<const uint16_t*>(first + j * token_stride);
          for (int c = 0; c < kVectors; ++c) {
            store16(widened.data() + j * kHeadDim + 16 * c, lockstep::load16_bf16(bits + 16 * c));
          }
        }
        row_stride = kHeadDim;
        return widened.data();
      }
    };
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t length = lens[seq];
      const int64_t stride = length + 16;
      scores.resize(num_heads * stride);
      const int64_t* table = tables + seq * num_columns;
      for (int64_t i = 0; i < num_heads * kHeadDim; ++i) {
        q_rows[i] = static_cast<float>(q[seq * num_heads * kHeadDim + i]) * softmax_scale;
      }
      // Chunks of at most 16 tokens, none crossing a block boundary: visit(t0, n, offset),
      // offset being the chunk's first row in the cache, in units of the block stride.
      const auto chunks = [&](const scalar_t* cache, int64_t bstride, int64_t tstride,
                              auto&& visit) {
        for (int64_t t0 = 0, n; t0 < length; t0 += n) {
          n = std::min({int64_t{16}, block_size - t0 % block_size, length - t0});
          const int64_t block = table[t0 / block_size], within = t0 % block_size;
          if (within == 0 && t0 + block_size < length) {
            const scalar_t* next = cache + table[t0 / block_size + 1] * bstride;
            lockstep::touch_block(next, block_size, tstride);
          }
          visit(t0, n, block, within);
        }
      };

      // Pass 1: scores, 16 tokens at a time per query head.
      chunks(k, k_block, k_token, [&](int64_t t0, int64_t n, int64_t block, int64_t within) {
        for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
          int64_t rs;
          const float* rows =
              rows_of(k + block * k_block + within * k_token + kv * k_head, k_token, n, rs);
          for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
            v16 qv[kVectors];
            for (int c = 0; c < kVectors; ++c) qv[c] = load16(q_rows.data() + h * kHeadDim + 16 * c);
            const auto dot = [&](int64_t j) {
              const float* row = rows + j * rs;
              v16 s = qv[0] * load16(row);
              for (int c = 1; c < kVectors; ++c) s += qv[c] * load16(row + 16 * c);
              return s;
            };
            v16 dots[16];
            if (n == 16) {
              for (int j = 0; j < 16; ++j) dots[kBitReverse16[j]] = dot(j);
            } else {
              for (int j = 0; j < 16; ++j) dots[j] = v16{};
              for (int64_t j = 0; j < n; ++j) dots[kBitReverse16[j]] = dot(j);
            }
            store16(scores.data() + h * stride + t0, lockstep::sum_lanes16(dots));
          }
        }
      });
      // The values' first block and the next sequence's first keys, ahead of their walks.
      lockstep::touch_block(v + table[0] * v_block, block_size, v_token);
      if (seq + 1 < end) {
        lockstep::touch_block(k + tables[(seq + 1) * num_columns] * k_block, block_size, k_token);
      }
      // Softmax numerators and sums, per query head.
      const int64_t full = length / 16 * 16;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * stride;
        float m = -std::numeric_limits<float>::infinity();
        if (full > 0) {
          v16 mv = load16(s);
          for (int64_t t = 16; t < full; t += 16) {
            const v16 x = load16(s + t);
            mv = x > mv ? x : mv;
          }
          m = lockstep::hmax16(mv);
        }
        for (int64_t t = full; t < length; ++t) m = std::max(m, s[t]);
        v16 total = v16{};
        for (int64_t t = 0; t < full; t += 16) {
          const v16 p = lockstep::vexp(load16(s + t) - m);
          store16(s + t, p);
          total += p;
        }
        float tail = 0.0f;
        for (int64_t t = full; t < length; ++t) {
          s[t] = lockstep::fast_exp(s[t] - m);
          tail += s[t];
        }
        sums[h] = lockstep::hsum16(total) + tail;
      }
      // Pass 2: probability-weighted values, a head's accumulator in registers for a chunk.
      std::fill(acc.begin(), acc.end(), 0.0f);
      chunks(v, v_block, v_token, [&](int64_t t0, int64_t n, int64_t block, int64_t within) {
        for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
          int64_t rs;
          const float* rows =
              rows_of(v + block * v_block + within * v_token + kv * v_head, v_token, n, rs);
          for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
            const float* p = scores.data() + h * stride + t0;
            float* a = acc.data() + h * kHeadDim;
            v16 sum[kVectors];
            for (int c = 0; c < kVectors; ++c) sum[c] = load16(a + 16 * c);
            for (int64_t j = 0; j < n; ++j) {
              const v16 pj = splat(p[j]);
              for (int c = 0; c < kVectors; ++c) sum[c] += pj * load16(rows + j * rs + 16 * c);
            }
            for (int c = 0; c < kVectors; ++c) store16(a + 16 * c, sum[c]);
          }
        }
      });
      scalar_t* o_seq = o + seq * num_heads * kHeadDim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.0f / sums[h];
        for (int64_t d = 0; d < kHeadDim; ++d) {
          o_seq[h * kHeadDim + d] = static_cast<scalar_t>(acc[h * kHeadDim + d] * inv);
        }
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(
    torch::Tensor query,
    torch::Tensor key_cache,
    torch::Tensor value_cache,
    torch::Tensor block_tables,
    torch::Tensor context_lens,
    double scale) {
  TORCH_CHECK(query.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be contiguous [B, H, Dh]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, "caches must be [NB, BS, Hkv, Dh]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "Dh must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0),
              "block_tables must be contiguous int64 [B, MB]");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous() &&
                  context_lens.numel() == query.size(0),
              "context_lens must be contiguous int64 [B]");
  // The kernel reads raw pointers: every block it will touch must exist.
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t num_columns = block_tables.size(1);
  for (int64_t b = 0; b < query.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1, "paged_decode_attention: context length ", lens[b],
                " of sequence ", b, " outside its block table");
    lockstep::check_context_blocks("paged_decode_attention", b, tables + b * num_columns,
                                   num_columns, lens[b], key_cache.size(1), key_cache.size(0));
  }
  auto out = torch::empty_like(query);
  const auto dtype = query.scalar_type();
  // The vector path on AVX-512 only: built for AVX2 (a v16 is two registers there, and the
  // two-input shuffles of sum_lanes16 become sequences of permutes), it took 2-4x the scalar
  // path's time in a one-process A/B on the AMX host (-march=haswell build), so AVX2 keeps it.
#if defined(__AVX512F__)
  if ((dtype == at::kFloat || dtype == at::kBFloat16) &&
      (query.size(2) == 32 || query.size(2) == 64 || query.size(2) == 128)) {
    const auto run = [&](auto tag) {
      using T = decltype(tag);
      const auto size = query.size(2);
      if (size == 32) decode_vectors<T, 2>(query, key_cache, value_cache, block_tables,
                                           context_lens, scale, out);
      if (size == 64) decode_vectors<T, 4>(query, key_cache, value_cache, block_tables,
                                           context_lens, scale, out);
      if (size == 128) decode_vectors<T, 8>(query, key_cache, value_cache, block_tables,
                                            context_lens, scale, out);
    };
    if (dtype == at::kFloat) {
      run(float{});
    } else {
      run(at::BFloat16{});
    }
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_decode_attention", [&] {
    const auto run = [&](auto head_dim) {
      decode_kernel<scalar_t, decltype(head_dim)::value>(
          query, key_cache, value_cache, block_tables, context_lens, scale, out);
    };
    switch (query.size(2)) {
      case 32: run(std::integral_constant<int64_t, 32>{}); break;
      case 64: run(std::integral_constant<int64_t, 64>{}); break;
      case 128: run(std::integral_constant<int64_t, 128>{}); break;
      default: run(std::integral_constant<int64_t, 0>{}); break;
    }
  });
  return out;
}

// The extension module of Lockstep's CPU compute kernels (dist_engine/kernels/compute.py builds
// it). It lives here rather than in a file of its own: every translation unit that includes
// torch/extension.h adds a long compile of its own (docs/benchmark_notes.md, "Start-up and
// failure detection"). The shared-memory transport is a library of its own (shm_exchange.cpp),
// so a failed kernel build never costs the transport.
torch::Tensor routed_swiglu(const torch::Tensor& hidden, const torch::Tensor& local_slots,
                            const torch::Tensor& weights, const torch::Tensor& w13,
                            const torch::Tensor& w2);
bool routed_swiglu_amx();
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperatures,
                          const torch::Tensor& uniforms, int64_t block);
torch::Tensor rms_norm_f32(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor paged_prefill_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                                      const torch::Tensor& value_cache,
                                      const torch::Tensor& block_tables,
                                      const torch::Tensor& query_start_loc,
                                      const torch::Tensor& num_cached, double scale);
torch::Tensor rope_write_kv(const torch::Tensor& query, const torch::Tensor& key,
                            const torch::Tensor& value, const torch::Tensor& cos,
                            const torch::Tensor& sin, const torch::Tensor& slot_mapping,
                            torch::Tensor key_cache, torch::Tensor value_cache);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (CPU)");
  m.def("routed_swiglu", &routed_swiglu,
        "Weighted sum of SwiGLU experts over routed rows, float32 (grouped_swiglu.cpp)");
  m.def("routed_swiglu_amx", &routed_swiglu_amx,
        "Whether routed_swiglu multiplies bfloat16 on AMX tiles here (grouped_swiglu.cpp)");
  m.def("sample_rows", &sample_rows,
        "One token per row from softmax(logits / t), unfiltered, float32 (sample_rows.cpp)");
  m.def("rms_norm", &rms_norm_f32, "RMSNorm over the last dim, float32 or bfloat16 (rms_norm.cpp)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal prefill attention over a paged KV cache, float32 or bfloat16 "
        "(paged_prefill_attention.cpp)");
  m.def("rope_write_kv", &rope_write_kv,
        "Rotary q/k and the paged KV cache write in one pass, float32 (rope_cache.cpp)");
}
