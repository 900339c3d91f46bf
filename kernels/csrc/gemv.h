// Dot products of a weight row (compute dtype, or int8) with an fp32 vector, for the CPU kernels. bf16, fp16 and
// int8 rows are widened 16 at a time on AVX-512, 8 at a time on AVX2 (exact: a bf16 is the top half of an fp32);
// products sum in fp32, 4 chains of accumulators, so the order differs from oneDNN's by rounding only.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace k3 {

template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<float>(w[i]) * x[i];
  return acc;
}

// The vector width's few operations, so that each dot product below is written once for AVX-512 and AVX2.
#if defined(__AVX512F__)
#define K3_LANES 16
using Vf = __m512;
inline Vf vzero() { return _mm512_setzero_ps(); }
inline Vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vf vfma(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }
inline Vf vadd(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline float vsum(Vf v) { return _mm512_reduce_add_ps(v); }

inline Vf widen(const c10::BFloat16* p) {  // 16 bf16 -> fp32, exact
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline Vf widen(const c10::Half* p) {  // 16 fp16 -> fp32, exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline Vf widen(const int8_t* p) {  // 16 int8 -> fp32, exact
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define K3_LANES 8
using Vf = __m256;
inline Vf vzero() { return _mm256_setzero_ps(); }
inline Vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vf vfma(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
inline Vf vadd(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline float vsum(Vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

inline Vf widen(const c10::BFloat16* p) {  // 8 bf16 -> fp32, exact
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline Vf widen(const c10::Half* p) {  // 8 fp16 -> fp32, exact (F16C comes with every AVX2 CPU)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline Vf widen(const int8_t* p) {  // 8 int8 -> fp32, exact
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if defined(K3_LANES)
constexpr int64_t LANES = K3_LANES;

// w . x with the weight widened a vector at a time, in four FMA chains (their throughput, not one chain's latency)
template <typename T>
inline float dot_widened(const T* w, const float* x, int64_t n) {
  Vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  int64_t i = 0;
  for (; i + 4 * LANES <= n; i += 4 * LANES) {
    a0 = vfma(widen(w + i), vload(x + i), a0);
    a1 = vfma(widen(w + i + LANES), vload(x + i + LANES), a1);
    a2 = vfma(widen(w + i + 2 * LANES), vload(x + i + 2 * LANES), a2);
    a3 = vfma(widen(w + i + 3 * LANES), vload(x + i + 3 * LANES), a3);
  }
  for (; i + LANES <= n; i += LANES) a0 = vfma(widen(w + i), vload(x + i), a0);
  float acc = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
  for (; i < n; ++i) acc += static_cast<float>(w[i]) * x[i];
  return acc;
}

// G dot products of one weight row with G vectors x + g * x_s, each widened vector of the row used for all G: each
// result is summed exactly as dot_widened sums it (the same chains, the same order), so it is bit-identical to it
// whatever G is. Four chains per vector: G = 4 fits AVX-512's 32 registers, G = 2 AVX2's 16.
constexpr int GROUP = LANES == 16 ? 4 : 2;

template <int G, typename T>
inline void dots_widened(const T* w, const float* x, int64_t x_s, int64_t n, float* out, int64_t out_s) {
  Vf a[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = vzero();
  int64_t i = 0;
  for (; i + 4 * LANES <= n; i += 4 * LANES) {
    Vf v[4];
    for (int c = 0; c < 4; ++c) v[c] = widen(w + i + c * LANES);
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) a[g][c] = vfma(v[c], vload(x + g * x_s + i + c * LANES), a[g][c]);
  }
  for (; i + LANES <= n; i += LANES) {
    const Vf v = widen(w + i);
    for (int g = 0; g < G; ++g) a[g][0] = vfma(v, vload(x + g * x_s + i), a[g][0]);
  }
  for (int g = 0; g < G; ++g) {
    float acc = vsum(vadd(vadd(a[g][0], a[g][1]), vadd(a[g][2], a[g][3])));
    for (int64_t j = i; j < n; ++j) acc += static_cast<float>(w[j]) * x[g * x_s + j];
    out[g * out_s] = acc;
  }
}

template <>
inline float dot<c10::BFloat16>(const c10::BFloat16* w, const float* x, int64_t n) {
  return dot_widened(w, x, n);
}

template <>
inline float dot<c10::Half>(const c10::Half* w, const float* x, int64_t n) {
  return dot_widened(w, x, n);
}

template <>
inline float dot<int8_t>(const int8_t* w, const float* x, int64_t n) {
  return dot_widened(w, x, n);
}

template <>
inline float dot<float>(const float* w, const float* x, int64_t n) {  // two chains: loads, not widening, bound it
  Vf a0 = vzero(), a1 = vzero();
  int64_t i = 0;
  for (; i + 2 * LANES <= n; i += 2 * LANES) {
    a0 = vfma(vload(w + i), vload(x + i), a0);
    a1 = vfma(vload(w + i + LANES), vload(x + i + LANES), a1);
  }
  for (; i + LANES <= n; i += LANES) a0 = vfma(vload(w + i), vload(x + i), a0);
  float acc = vsum(vadd(a0, a1));
  for (; i < n; ++i) acc += w[i] * x[i];
  return acc;
}
#endif

template <typename T>
inline float rnd(float x) {  // round to the compute dtype and back, as the torch reference's .to(dtype) does
  return static_cast<float>(static_cast<T>(x));
}

}  // namespace k3
