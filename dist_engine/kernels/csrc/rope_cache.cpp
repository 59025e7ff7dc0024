// Rotary embedding of a step's queries and keys, and the write of its keys and values into the
// paged KV cache, in one pass over the step's rows (float32 or bfloat16, CPU).
//
// Shapes: query [T, H, Dh]; key, value [T, Hkv, Dh] (any strides with the last dim contiguous:
// they are views into the fused qkv projection's output); cos, sin [T, Dh] contiguous;
// slot_mapping [T] int64, each in [0, NB * BS); key_cache, value_cache [NB, BS, Hkv, Dh]
// contiguous. Writes rope(key) and value into the cache rows of slot_mapping and returns
// rope(query) as a contiguous [T, H, Dh] tensor (what the decode kernel reads).
//
// rope(x)[j] = x[j] cos[j] - x[j + Dh/2] sin[j] for j < Dh/2, x[j] cos[j] + x[j - Dh/2] sin[j]
// above: HF's rotate_half convention. Results equal the PyTorch path (apply_rotary, then
// index_copy_ into the cache) to float32 rounding in float32 (the compiler may fuse a multiply
// and an add), and bit for bit in bfloat16: there each product and the sum are rounded to
// bfloat16 as PyTorch's three bf16 ops (two multiplies, an add) round them.
//
// Why: the PyTorch path is eight ops per layer (neg, cat, two multiplies and an add for each of
// q and k) plus two index_copy_ calls, each a separate pass over small tensors.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace {

// out[0:Dh] = rope(x) with this row's cos, sin.
inline void rope_row(const float* x, const float* cos, const float* sin, float* out,
                     int64_t half) {
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] - x[j + half] * sin[j];
  for (int64_t j = half; j < 2 * half; ++j) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

// The same in bfloat16, rounding where PyTorch's ops round: bf16(bf16(x c) +- bf16(x' s)).
inline void rope_row(const c10::BFloat16* x, const c10::BFloat16* cos,
                     const c10::BFloat16* sin, c10::BFloat16* out, int64_t half) {
  auto product = [](c10::BFloat16 a, c10::BFloat16 b) {
    return static_cast<float>(c10::BFloat16(static_cast<float>(a) * static_cast<float>(b)));
  };
  for (int64_t j = 0; j < half; ++j) {
    out[j] = c10::BFloat16(product(x[j], cos[j]) - product(x[j + half], sin[j]));
  }
  for (int64_t j = half; j < 2 * half; ++j) {
    out[j] = c10::BFloat16(product(x[j], cos[j]) + product(x[j - half], sin[j]));
  }
}

template <typename T>
void rope_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& cos, const at::Tensor& sin, const int64_t* slots,
               at::Tensor& key_cache, at::Tensor& value_cache, at::Tensor& out) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key.size(1);
  const int64_t half = head_dim / 2, row = num_kv_heads * head_dim;
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  T* q_out = out.data_ptr<T>();
  T* k_cache = key_cache.data_ptr<T>();
  T* v_cache = value_cache.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 8192 / ((num_heads + 2 * num_kv_heads) * head_dim));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = c + t * head_dim;
      const T* st = s + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        rope_row(q + t * query.stride(0) + h * query.stride(1), ct, st,
                 q_out + (t * num_heads + h) * head_dim, half);
      }
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        rope_row(k + t * key.stride(0) + g * key.stride(1), ct, st,
                 k_cache + slots[t] * row + g * head_dim, half);
        std::memcpy(v_cache + slots[t] * row + g * head_dim,
                    v + t * value.stride(0) + g * value.stride(1), head_dim * sizeof(T));
      }
    }
  });
}

}  // namespace

at::Tensor rope_write_kv(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, at::Tensor key_cache,
                         at::Tensor value_cache) {
  const auto dtype = query.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &query, &key, &value, &cos, &sin, &key_cache, &value_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype &&
                    (dtype == at::kFloat || dtype == at::kBFloat16),
                "rope_write_kv: query, key, value, cos, sin and the caches must be CPU tensors "
                "of one dtype (float32 or bfloat16)");
  }
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(),
              "rope_write_kv: need query [T, H, Dh], key and value [T, Hkv, Dh]; got ",
              query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key.size(1);
  TORCH_CHECK(key.size(0) == num_tokens && key.size(2) == head_dim && head_dim % 2 == 0,
              "rope_write_kv: query and key disagree, or the head dim is odd: ", query.sizes(),
              ", ", key.sizes());
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "rope_write_kv: query, key and value need a contiguous last dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(0) == num_tokens &&
                  cos.size(1) == head_dim,
              "rope_write_kv: cos and sin must be contiguous [T, Dh]; got ", cos.sizes());
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == num_tokens,
              "rope_write_kv: slot_mapping must be a contiguous int64 [T]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.size(2) == num_kv_heads && key_cache.size(3) == head_dim,
              "rope_write_kv: caches must be contiguous [NB, BS, Hkv, Dh] matching key; got ",
              key_cache.sizes());
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rope_write_kv: slot_mapping[", t,
                "] = ", slots[t], " is outside the cache's ", num_slots, " slots");
  }

  auto out = at::empty({num_tokens, num_heads, head_dim}, query.options());
  if (dtype == at::kFloat) {
    rope_rows<float>(query, key, value, cos, sin, slots, key_cache, value_cache, out);
  } else {
    rope_rows<c10::BFloat16>(query, key, value, cos, sin, slots, key_cache, value_cache, out);
  }
  return out;
}
