// 16-lane float vectors for the CPU kernels (GCC/Clang vector extensions), and exp on them.
#pragma once

#include <cstdint>
#include <cstring>

#include "fast_exp.h"

namespace lockstep {

// GCC/Clang vector extensions: the compiler maps these onto the widest vectors -march=native
// offers (one AVX-512 register, or two AVX2 ones).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline v16 splat(float x) { return v16{} + x; }

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// exp on 16 lanes: Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for exp(r), 2^n in
// the exponent bits; inputs are clamped to [-87, 88], where float32 exp neither under- nor
// overflows.
inline v16 vexp(v16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  const v16 t = x * 1.44269504088896341f;
  const v16 half = t >= splat(0.0f) ? splat(0.5f) : splat(-0.5f);
  const v16i ni = __builtin_convertvector(t + half, v16i);  // round half away from zero
  const v16 n = __builtin_convertvector(ni, v16);
  const v16 r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  const v16 p = exp_polynomial(r);
  const v16i bits = (ni + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace lockstep
