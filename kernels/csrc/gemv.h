// Dot products of a weight row (compute dtype, or int8) with an fp32 vector, for the CPU kernels. bf16 and int8 rows
// are widened 16 at a time on AVX-512, 8 at a time on AVX2 (exact: a bf16 is the top half of an fp32); products sum in
// fp32, 4 lanes of accumulators, so the order differs from oneDNN's by rounding only.
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

#if defined(__AVX512F__)
inline __m512 widen(const c10::BFloat16* p) {  // 16 bf16 -> fp32, exact
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 widen(const int8_t* p) {  // 16 int8 -> fp32, exact
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// w . x with the weight widened 16 at a time, in four FMA chains (their throughput, not one chain's latency)
template <typename T>
inline float dot_widened(const T* w, const float* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_fmadd_ps(widen(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(widen(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(widen(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(widen(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
  }
  for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(widen(w + i), _mm512_loadu_ps(x + i), a0);
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
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
inline float dot<float>(const float* w, const float* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (; i < n; ++i) acc += w[i] * x[i];
  return acc;
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 widen(const c10::BFloat16* p) {  // 8 bf16 -> fp32, exact
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 widen(const int8_t* p) {  // 8 int8 -> fp32, exact
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 widen(const float* p) { return _mm256_loadu_ps(p); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// w . x with the weight widened 8 at a time, in four FMA chains (their throughput, not one chain's latency)
template <typename T>
inline float dot_widened(const T* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(widen(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(widen(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(widen(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(widen(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(widen(w + i), _mm256_loadu_ps(x + i), a0);
  float acc = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
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
inline float dot<float>(const float* w, const float* x, int64_t n) {
  return dot_widened(w, x, n);
}
#endif

template <typename T>
inline float rnd(float x) {  // round to the compute dtype and back, as the torch reference's .to(dtype) does
  return static_cast<float>(static_cast<T>(x));
}

}  // namespace k3
