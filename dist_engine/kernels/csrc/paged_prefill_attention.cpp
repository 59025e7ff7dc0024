// Prefill attention straight from the paged KV cache, float32 or bfloat16, CPU: every query of a
// step's prompt chunks against its sequence's cached prefix and the chunk itself, causally.
//
// Shapes: query [T, H, Dh] contiguous (sequences' rows back to back); key_cache, value_cache
// [NB, BS, Hkv, Dh] contiguous, already holding the step's keys and values; block_tables
// [B, MB] int64; query_start_loc [B + 1] int64 (sequence b's rows are query_start_loc[b] ..
// query_start_loc[b + 1]); num_cached [B] int64 (its context before the step). Query i of
// sequence b sits at position num_cached[b] + i and sees keys 0 ..= that position. Query head h
// reads kv head h / (H / Hkv). Returns [T, H, Dh].
//
// Work is split into tasks of (sequence, kv head, up to 32 consecutive queries with all the
// query heads of that kv head), handed out largest first from a shared counter so the threads
// stay busy. A task walks the key blocks its last query can see, once: each block's keys are
// transposed into a small buffer (the task's one scalar pass over the block, which is why a
// task takes 32 queries: 16 spent about as long transposing as multiplying), then up to 8 query
// rows at a time take their scores against the block's keys as vector multiply-adds and an
// online softmax (running max and sum per query row, as in FlashAttention) folds the block's
// values into their accumulators. Nothing above the diagonal
// is computed and no padding exists, unlike the batched SDPA path, which pads every sequence of
// a group to the group's longest.
//
// Numerics: float32 throughout, exp through lockstep::fast_exp (relative error below 2e-7), a
// different summation order than SDPA: equal to it to float32 rounding. bfloat16 query and
// caches are widened to float32 as they are read (a block's keys as they are transposed, its
// values into a float32 copy of the block), and the output is rounded to bfloat16 once, as
// PyTorch's CPU flash attention does with bfloat16 inputs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "paged_cache.h"
#include "vec16.h"

namespace {

constexpr int64_t kQueriesPerTask = 32;

struct Task {
  int64_t seq, kv_head, first, count, cost;
};

using lockstep::hmax16;
using lockstep::hsum16;
using lockstep::load16;
using lockstep::splat;
using lockstep::store16;
using lockstep::v16;
using lockstep::v16i;

// kRows consecutive query rows (q and acc rows 16 * kVectors apart) against one block of 16
// keys (keys_t: the block transposed, [Dh][16]; v_block: its value rows, v_stride apart); row
// r sees the block's first visible[r] keys (at least 1). Folds the block into each row's
// running max, sum and accumulator (online softmax, as in FlashAttention).
//
// The rows go together: each key or value vector read once serves every row, and the rows'
// sums are independent chains of multiply-adds, where one row alone waits on its single
// chain's latency at every step. Values are folded in column chunks of a few vectors, so the
// accumulators (rows x chunk) stay in registers.
template <int kVectors, int kRows>
inline void fold_rows16(const float* q, const float* keys_t, const float* v_block,
                        int64_t v_stride, const int64_t* visible, float* row_max, float* row_sum,
                        float* acc) {
  constexpr int64_t kHeadDim = 16 * kVectors;
  constexpr int kWidest = kRows > 4 ? 2 : 4;  // rows x chunk accumulators stay at 16 or fewer
  constexpr int kChunk = kVectors < kWidest ? kVectors : kWidest;
  v16 scores[kRows];
  for (int r = 0; r < kRows; ++r) scores[r] = v16{};
  for (int64_t d = 0; d < kHeadDim; ++d) {
    const v16 kd = load16(keys_t + d * 16);
    for (int r = 0; r < kRows; ++r) scores[r] += q[r * kHeadDim + d] * kd;
  }
  const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(64) float p[kRows][16];
  float correction[kRows];
  int64_t most = 0;
  for (int r = 0; r < kRows; ++r) {
    const v16i seen = lanes < static_cast<int32_t>(visible[r]);
    const v16 masked = seen ? scores[r] : splat(neg_inf);
    const float block_max = hmax16(masked);
    const float new_max = std::max(row_max[r], block_max);
    correction[r] = lockstep::fast_exp(row_max[r] - new_max);
    v16 pr = lockstep::vexp(masked - new_max);
    pr = seen ? pr : v16{};  // 0 past visible[r]: the shared value loop below may run past it
    row_sum[r] = row_sum[r] * correction[r] + hsum16(pr);
    row_max[r] = new_max;
    store16(p[r], pr);
    most = std::max(most, visible[r]);
  }
  for (int c = 0; c < kVectors; c += kChunk) {
    v16 out[kRows][kChunk];
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kChunk; ++v) {
        out[r][v] = load16(acc + r * kHeadDim + 16 * (c + v)) * correction[r];
      }
    }
    for (int64_t j = 0; j < most; ++j) {
      const float* vj = v_block + j * v_stride + 16 * c;
      for (int v = 0; v < kChunk; ++v) {
        const v16 value = load16(vj + 16 * v);
        for (int r = 0; r < kRows; ++r) out[r][v] += p[r][j] * value;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kChunk; ++v) store16(acc + r * kHeadDim + 16 * (c + v), out[r][v]);
    }
  }
}

// `count` consecutive rows, 8 at a time, the rest as 4, 2 and 1 (fold_rows16).
template <int kVectors>
inline void fold_rows(int64_t count, const float* q, const float* keys_t, const float* v_block,
                      int64_t v_stride, const int64_t* visible, float* row_max, float* row_sum,
                      float* acc) {
  constexpr int64_t kHeadDim = 16 * kVectors;
  int64_t r = 0;
  for (; r + 8 <= count; r += 8) {
    fold_rows16<kVectors, 8>(q + r * kHeadDim, keys_t, v_block, v_stride, visible + r,
                             row_max + r, row_sum + r, acc + r * kHeadDim);
  }
  if (r + 4 <= count) {
    fold_rows16<kVectors, 4>(q + r * kHeadDim, keys_t, v_block, v_stride, visible + r,
                             row_max + r, row_sum + r, acc + r * kHeadDim);
    r += 4;
  }
  if (r + 2 <= count) {
    fold_rows16<kVectors, 2>(q + r * kHeadDim, keys_t, v_block, v_stride, visible + r,
                             row_max + r, row_sum + r, acc + r * kHeadDim);
    r += 2;
  }
  if (r < count) {
    fold_rows16<kVectors, 1>(q + r * kHeadDim, keys_t, v_block, v_stride, visible + r,
                             row_max + r, row_sum + r, acc + r * kHeadDim);
  }
}

// What every task reads: the shapes, the step's sequences and the softmax scale.
struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, num_columns;
  const int64_t* starts;  // query_start_loc
  const int64_t* cached;  // num_cached
  const int64_t* tables;  // block_tables
  float scale;
};

// The tasks on torch's threads, largest first from a shared counter; T is float or BFloat16.
template <typename T>
void attend(const Geometry& g, const std::vector<Task>& tasks, const T* q, const T* k_cache,
            const T* v_cache, T* o) {
  const int64_t num_heads = g.num_heads, num_kv_heads = g.num_kv_heads, head_dim = g.head_dim;
  const int64_t block_size = g.block_size, num_columns = g.num_columns;
  const int64_t* starts = g.starts;
  const int64_t* cached = g.cached;
  const int64_t* tables = g.tables;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // between a block's token rows
  const float q_scale = g.scale;
  constexpr bool kWide = std::is_same_v<T, float>;  // float32: values read in place
  const int64_t max_rows = kQueriesPerTask * group;
  // The vector path: blocks of 16 keys and head dims of 32, 64 or 128 (else 0: scalar loops).
  const int64_t vectors =
      (block_size == 16 && (head_dim == 32 || head_dim == 64 || head_dim == 128)) ? head_dim / 16
                                                                                  : 0;
  std::atomic<int64_t> next{0};
  const int64_t num_workers =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    std::vector<float> q_rows(max_rows * head_dim), acc(max_rows * head_dim);
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    std::vector<int64_t> visible_rows(max_rows);
    std::vector<float> keys_t(head_dim * block_size), scores(block_size);
    std::vector<float> values(kWide ? 0 : block_size * head_dim);  // a bf16 block, widened
    for (int64_t index = next++; index < static_cast<int64_t>(tasks.size()); index = next++) {
      const Task& task = tasks[index];
      const int64_t rows = task.count * group;
      const int64_t first_row = starts[task.seq] + task.first;
      const int64_t first_pos = cached[task.seq] + task.first;
      for (int64_t i = 0; i < task.count; ++i) {
        for (int64_t hh = 0; hh < group; ++hh) {
          const T* src = q + ((first_row + i) * num_heads + task.kv_head * group + hh) * head_dim;
          float* dst = q_rows.data() + (i * group + hh) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * q_scale;
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.0f);
      std::fill(row_max.begin(), row_max.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + rows, 0.0f);
      const int64_t num_keys = first_pos + task.count;  // the last query sees this many keys
      const int64_t* table = tables + task.seq * num_columns;
      for (int64_t key0 = 0; key0 < num_keys; key0 += block_size) {
        const int64_t in_block = std::min(block_size, num_keys - key0);
        const int64_t base = (table[key0 / block_size] * block_size) * row_stride +
                             task.kv_head * head_dim;
        const T* k_block = k_cache + base;
        for (int64_t j = 0; j < in_block; ++j) {
          for (int64_t d = 0; d < head_dim; ++d) {
            keys_t[d * block_size + j] = static_cast<float>(k_block[j * row_stride + d]);
          }
        }
        const float* v_block;
        int64_t v_stride;
        if constexpr (kWide) {
          v_block = v_cache + base;
          v_stride = row_stride;
        } else {
          for (int64_t j = 0; j < in_block; ++j) {
            const T* src = v_cache + base + j * row_stride;
            float* dst = values.data() + j * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]);
          }
          v_block = values.data();
          v_stride = head_dim;
        }
        if (vectors > 0) {  // block of 16, head dim 32/64/128: the vector path, rows together
          // Rows are (query i, head hh) at i * group + hh; query i sees the block's first
          // min(in_block, first_pos + i - key0 + 1) keys, none for the queries before it.
          const int64_t first_i = std::max<int64_t>(0, key0 - first_pos);
          for (int64_t r = first_i * group; r < rows; ++r) {
            visible_rows[r] = std::min(in_block, first_pos + r / group - key0 + 1);
          }
          const auto fold = vectors == 2   ? fold_rows<2>
                            : vectors == 4 ? fold_rows<4>
                                           : fold_rows<8>;
          const int64_t r = first_i * group;
          fold(rows - r, q_rows.data() + r * head_dim, keys_t.data(), v_block, v_stride,
               visible_rows.data() + r, row_max.data() + r, row_sum.data() + r,
               acc.data() + r * head_dim);
          continue;
        }
        for (int64_t i = 0; i < task.count; ++i) {
          const int64_t visible = std::min(in_block, first_pos + i - key0 + 1);
          if (visible <= 0) continue;  // this block lies wholly after query i
          for (int64_t hh = 0; hh < group; ++hh) {
            const int64_t r = i * group + hh;
            const float* qr = q_rows.data() + r * head_dim;
            float* ar = acc.data() + r * head_dim;
            for (int64_t j = 0; j < visible; ++j) scores[j] = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) {
              const float qd = qr[d];
              const float* kd = keys_t.data() + d * block_size;
              for (int64_t j = 0; j < visible; ++j) scores[j] += qd * kd[j];
            }
            float block_max = scores[0];
            for (int64_t j = 1; j < visible; ++j) block_max = std::max(block_max, scores[j]);
            const float new_max = std::max(row_max[r], block_max);
            const float correction = lockstep::fast_exp(row_max[r] - new_max);
            float sum = 0.0f;
            for (int64_t j = 0; j < visible; ++j) {
              scores[j] = lockstep::fast_exp(scores[j] - new_max);
              sum += scores[j];
            }
            row_sum[r] = row_sum[r] * correction + sum;
            row_max[r] = new_max;
            for (int64_t d = 0; d < head_dim; ++d) ar[d] *= correction;
            for (int64_t j = 0; j < visible; ++j) {
              const float p = scores[j];
              const float* vj = v_block + j * v_stride;
              for (int64_t d = 0; d < head_dim; ++d) ar[d] += p * vj[d];
            }
          }
        }
      }
      for (int64_t i = 0; i < task.count; ++i) {
        for (int64_t hh = 0; hh < group; ++hh) {
          const int64_t r = i * group + hh;
          const float inv = 1.0f / row_sum[r];
          const float* ar = acc.data() + r * head_dim;
          T* dst = o + ((first_row + i) * num_heads + task.kv_head * group + hh) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(ar[d] * inv);
        }
      }
    }
  });
}

}  // namespace

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                                   const at::Tensor& query_start_loc,
                                   const at::Tensor& num_cached, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() &&
                  value_cache.device().is_cpu(),
              "paged_prefill_attention: CPU tensors only");
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "paged_prefill_attention: query and caches must be all float32 or all bfloat16");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(),
              "paged_prefill_attention: query must be contiguous [T, H, Dh]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_prefill_attention: caches must be contiguous [NB, BS, Hkv, Dh]");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "paged_prefill_attention: head dims differ, or H is not a multiple of Hkv");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &num_cached}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_prefill_attention: block_tables, query_start_loc and num_cached must be "
                "contiguous int64 CPU tensors");
  }
  const int64_t num_seqs = block_tables.size(0), num_columns = block_tables.size(1);
  TORCH_CHECK(block_tables.dim() == 2 && query_start_loc.numel() == num_seqs + 1 &&
                  num_cached.numel() == num_seqs,
              "paged_prefill_attention: need block_tables [B, MB], query_start_loc [B + 1], "
              "num_cached [B]");
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* cached = num_cached.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0),
              "paged_prefill_attention: query_start_loc must run from 0 to T = ", query.size(0));
  // The kernel reads raw pointers: every block it will touch must exist.
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t count = starts[b + 1] - starts[b];
    TORCH_CHECK(count >= 0 && cached[b] >= 0, "paged_prefill_attention: sequence ", b,
                " has a negative query length or cached length");
    lockstep::check_context_blocks("paged_prefill_attention", b, tables + b * num_columns,
                                   num_columns, cached[b] + count, block_size, num_blocks);
  }

  std::vector<Task> tasks;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t count = starts[b + 1] - starts[b];
    for (int64_t first = 0; first < count; first += kQueriesPerTask) {
      const int64_t n = std::min(kQueriesPerTask, count - first);
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        tasks.push_back({b, g, first, n, n * (cached[b] + first + n)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });

  auto out = at::empty_like(query);
  const Geometry geometry{num_heads, num_kv_heads, head_dim, block_size, num_columns, starts,
                          cached, tables, static_cast<float>(scale)};
  if (query.scalar_type() == at::kFloat) {
    attend(geometry, tasks, query.data_ptr<float>(), key_cache.data_ptr<float>(),
           value_cache.data_ptr<float>(), out.data_ptr<float>());
  } else {
    attend(geometry, tasks, query.data_ptr<at::BFloat16>(), key_cache.data_ptr<at::BFloat16>(),
           value_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
  return out;
}
