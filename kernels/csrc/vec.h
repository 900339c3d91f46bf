// ATen's vector types for the CPU ops, and the conversions they share. Include this first: the capability names
// which of ATen's inline vector implementations a file compiles (the one for the CPU it is built on), and exp and log
// are then ATen's own vector functions (Sleef on AVX2/AVX-512), as in torch's elementwise kernels.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

// ATen's headers one by one, not <ATen/ATen.h>: that one declares every operator (a third of each file's build)
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace k3 {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

template <typename F>
void by_compute_dtype(at::ScalarType dtype, const char* what, F f) {  // f(a value of the type): fp32, bf16 or fp16
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, what, ": fp32, bf16 or fp16, not ", dtype);
  }
}

inline float hsum(const Vec& v) {  // the lanes' sum, by at::vec's one fixed tree
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

template <typename F>
inline void vmap(float* x, int64_t n, F f) {  // x = f(x) in place, a vector at a time (a partial one at the end)
  for (int64_t j = 0; j < n; j += W) {
    const int64_t m = std::min<int64_t>(W, n - j);
    const Vec v = m == W ? Vec::loadu(x + j) : Vec::loadu(x + j, m);
    f(v).store(x + j, m);
  }
}

inline std::tuple<Vec, Vec> widen(const at::vec::Vectorized<c10::BFloat16>& v) {
  return at::vec::convert_bfloat16_float(v);
}
inline std::tuple<Vec, Vec> widen(const at::vec::Vectorized<c10::Half>& v) { return at::vec::convert_half_float(v); }
inline at::vec::Vectorized<c10::BFloat16> narrow(const Vec& a, const Vec& b, c10::BFloat16*) {
  return at::vec::convert_float_bfloat16(a, b);
}
inline at::vec::Vectorized<c10::Half> narrow(const Vec& a, const Vec& b, c10::Half*) {
  return at::vec::convert_float_half(a, b);
}

template <typename T>
constexpr bool wide = std::is_same_v<T, float> || std::is_same_v<T, double>;

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {  // exact widening, two float vectors per low-precision one
  if constexpr (wide<T>) {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
  } else {
    for (int64_t j = 0; j < n; j += 2 * W) {
      const int64_t m = std::min<int64_t>(2 * W, n - j);
      auto [a, b] = widen(at::vec::Vectorized<T>::loadu(src + j, m));
      a.store(dst + j, std::min<int64_t>(W, m));
      if (m > W) b.store(dst + j + W, m - W);
    }
  }
}

template <typename T>
void from_float(const float* src, T* dst, int64_t n) {  // round to nearest even, as torch's .to(dtype)
  if constexpr (wide<T>) {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(src[j]);
  } else {
    for (int64_t j = 0; j < n; j += 2 * W) {
      const int64_t m = std::min<int64_t>(2 * W, n - j);
      const Vec a = Vec::loadu(src + j, std::min<int64_t>(W, m));
      const Vec b = m > W ? Vec::loadu(src + j + W, m - W) : Vec(0.0f);
      narrow(a, b, static_cast<T*>(nullptr)).store(dst + j, m);
    }
  }
}

template <typename T>
void round_to(float* x, int64_t n) {  // x = float(T(x))
  if constexpr (!wide<T>) {
    T tmp[2 * W];
    for (int64_t j = 0; j < n; j += 2 * W) {
      const int64_t m = std::min<int64_t>(2 * W, n - j);
      from_float<T>(x + j, tmp, m);
      to_float<T>(tmp, x + j, m);
    }
  }
}

}  // namespace k3
