// Dot products of a weight row (compute dtype, or int8) with an fp32 vector, for the CPU kernels. bf16 and int8 rows
// are widened 16 at a time on AVX-512, 8 at a time on AVX2 (exact: a bf16 is the top half of an fp32); products sum in
// fp32, 4 chains of accumulators, so the order differs from oneDNN's by rounding only.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

inline Vf widen(const int8_t* p) {  // 16 int8 -> fp32, exact
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
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

template <>
inline float dot<c10::BFloat16>(const c10::BFloat16* w, const float* x, int64_t n) {
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
