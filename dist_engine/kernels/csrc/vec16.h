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

// The largest lane and the lanes' sum, by halving shuffles (4 steps, where a scalar walk over
// the lanes is 15 dependent steps).
inline v16 fold_halves(v16 x, bool take_max) {
  const v16i shifts[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                          {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                          {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                          {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
  for (const v16i& shift : shifts) {
    const v16 other = __builtin_shuffle(x, shift);
    x = take_max ? (other > x ? other : x) : x + other;
  }
  return x;
}

inline float hmax16(v16 x) { return fold_halves(x, true)[0]; }
inline float hsum16(v16 x) { return fold_halves(x, false)[0]; }

// 16 bfloat16 values (raw bits) widened to float32: a bfloat16 is a float32's upper half.
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16 load16_bf16(const uint16_t* p) {
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  const v16u bits = __builtin_convertvector(h, v16u) << 16;
  v16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// out[j] = the sum of x[kBitReverse16[j]]'s 16 lanes: four rounds, each adding two vectors'
// halves side by side (x + y's lower halves against their upper halves), so 16 dot products
// finish in 15 shuffle pairs and adds where a horizontal sum each takes 16 x 4 dependent
// steps. The rounds leave lane j holding input bit_reverse(j): callers store input j at
// kBitReverse16[j] to get sums in order.
inline constexpr int kBitReverse16[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline v16 sum_lanes16(const v16* x) {
  // Round with half width w: lane o of the result takes, from the 2w-lane segment i = o / 2w,
  // x's lower w lanes (o % 2w < w) or y's, each added to the w lanes above it.
  const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16i lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const v16i hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const v16i lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const v16i hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const v16i lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const v16i hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo8) +
           __builtin_shuffle(x[2 * i], x[2 * i + 1], hi8);
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
  }
  return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

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
