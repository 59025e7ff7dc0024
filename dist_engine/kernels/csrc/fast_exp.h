// Shared by the CPU kernels: a float exp the compiler can vectorise, and its polynomial.
#pragma once

#include <cstdint>
#include <cstring>

namespace lockstep {

// exp(r) for |r| <= ln2/2: the degree-6 Taylor polynomial in Horner form, for a float or a
// vector of floats (vec16.h's exp uses it too).
template <typename T>
inline T exp_polynomial(T r) {
  T p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

// exp(x) for x <= 0 (softmax after max subtraction), written so the compiler can vectorise the
// loop that calls it (std::exp is a scalar library call): Cody-Waite range reduction
// x = n ln2 + r, |r| <= ln2/2, a degree-6 Taylor polynomial for exp(r) (error below 2e-7
// relative, about float32's rounding), and 2^n put into the exponent bits. Inputs below
// -87 (exp underflows to 0 in float32 anyway) give 0.
inline float fast_exp(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = __builtin_rintf(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  const float p = exp_polynomial(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

}  // namespace lockstep
