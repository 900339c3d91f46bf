// MXFP4 rows widened for the CPU MoE kernels (compressed-tensors' mxfp4-pack-quantized: element 2i in a byte's low
// nibble, 2i+1 in its high one, one E8M0 scale per 32 elements), and the row-by-vector dot products they run.
//
// Widening computes what weights/mxfp4.py's dequantize (ggml's) computes: the doubled E2M1 value times
// 2^(scale - 128) built from its bits, one fp32 multiply; code 8 reads as +0. Every value is exact in fp32, and in
// bf16 too (at most 2 significant bits), so a kernel that widens a packed row and then sums products in a fixed
// order gets the same bits as one that reads the dequantized row (bf16 or fp32) and sums in that order.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gemv.h"  // the lanes' operations

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace k3 {

#if defined(K3_LANES)
inline void vstore(float* p, Vf v) {
#if K3_LANES == 16
  _mm512_storeu_ps(p, v);
#else
  _mm256_storeu_ps(p, v);
#endif
}
#endif

constexpr int64_t MX_GROUP = 32;  // elements per E8M0 scale
constexpr float MX_DOUBLED[16] = {0.f, 1.f,  2.f,  3.f,  4.f,  6.f,  8.f,  12.f,  // doubled E2M1 by code
                                  0.f, -1.f, -2.f, -3.f, -4.f, -6.f, -8.f, -12.f};

inline float mx_half_scale(uint8_t s) {  // 2^(s - 128), exact (subnormal for s = 0 and 1), as ggml builds it
  const uint32_t bits = s < 2 ? 0x00200000u << s : static_cast<uint32_t>(s - 1) << 23;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// One packed row of n elements (n a multiple of 32): bytes q [n/2], scales s [n/32] -> dst [n] fp32.
inline void widen_mxfp4(const uint8_t* q, const uint8_t* s, int64_t n, float* dst) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 table = _mm512_loadu_ps(MX_DOUBLED);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < n / MX_GROUP; ++b) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    const __m512 scale = _mm512_set1_ps(mx_half_scale(s[b]));
    const __m512i first = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));  // codes of elements 0..15
    const __m512i second = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));  // 16..31
    _mm512_storeu_ps(dst + b * 32, _mm512_mul_ps(_mm512_permutexvar_ps(first, table), scale));
    _mm512_storeu_ps(dst + b * 32 + 16, _mm512_mul_ps(_mm512_permutexvar_ps(second, table), scale));
  }
#elif defined(__AVX2__)
  const __m256 positive = _mm256_loadu_ps(MX_DOUBLED), negative = _mm256_loadu_ps(MX_DOUBLED + 8);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < n / MX_GROUP; ++b) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    const __m256 scale = _mm256_set1_ps(mx_half_scale(s[b]));
    const __m128i halves[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
    for (int h = 0; h < 2; ++h) {
      for (int e = 0; e < 2; ++e) {  // 8 codes at a time: the magnitude from bits 0-2, bit 3 picks the table
        const __m256i code = _mm256_cvtepu8_epi32(e ? _mm_srli_si128(halves[h], 8) : halves[h]);
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(code, 28));  // bit 3 to the sign bit
        const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(positive, code),
                                          _mm256_permutevar8x32_ps(negative, code), sign);
        _mm256_storeu_ps(dst + b * 32 + h * 16 + e * 8, _mm256_mul_ps(v, scale));
      }
    }
  }
#else
  for (int64_t b = 0; b < n / MX_GROUP; ++b) {
    const float scale = mx_half_scale(s[b]);
    for (int64_t j = 0; j < 16; ++j) {
      dst[b * 32 + 2 * j] = MX_DOUBLED[q[b * 16 + j] & 0x0F] * scale;
      dst[b * 32 + 2 * j + 1] = MX_DOUBLED[q[b * 16 + j] >> 4] * scale;
    }
  }
#endif
}

// A dense row in the compute dtype -> fp32, exact.
template <typename T>
inline void widen_row(const T* w, int64_t n, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, w, n * sizeof(float));
  } else {
    int64_t i = 0;
#if defined(K3_LANES)
    for (; i + LANES <= n; i += LANES) vstore(dst + i, widen(w + i));
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(w[i]);
  }
}

#if K3_LANES == 16
// The lane sums of four accumulators, [sum a0, sum a1, sum a2, sum a3]: within each 128-bit quarter
// (l0 + l2) + (l1 + l3), then (q0 + q2) + (q1 + q3), the same tree for each of the four whatever the others hold.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
  const __m512 h = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0x4E));  // quarters q0 + q2, q1 + q3
  return _mm512_castps512_ps128(_mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, 0xB1)));
}

// out[r] = the lane sum of a[r][g] for r < R (reduce4, four rows at a time, zeros beside the last ones)
template <int R, int G>
inline void store_sums(const __m512 (&a)[R][G], int g, float* out) {
  for (int r0 = 0; r0 < R; r0 += 4) {
    __m512 v[4];
    for (int j = 0; j < 4; ++j) v[j] = r0 + j < R ? a[r0 + j][g] : _mm512_setzero_ps();
    alignas(16) float sums[4];
    _mm_store_ps(sums, reduce4(v[0], v[1], v[2], v[3]));
    for (int j = 0; j < 4 && r0 + j < R; ++j) out[r0 + j] = sums[j];
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// One group of a packed row (16 bytes, scale sc) -> 16 bf16 pairs (element 2i in the low half of word i, as
// vdpbf16ps takes them), the values widen_mxfp4 gives (every one exact in bf16, subnormal and infinite products as
// their top halves): the codes index the group's scale's table of them.
struct ScaledTables {
  alignas(64) uint16_t t[256][32];
  ScaledTables() {
    for (int sc = 0; sc < 256; ++sc)
      for (int c = 0; c < 32; ++c) {
        const float v = MX_DOUBLED[c % 16] * mx_half_scale(static_cast<uint8_t>(sc));
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        t[sc][c] = static_cast<uint16_t>(bits >> 16);
      }
  }
};

inline const ScaledTables SCALED_TABLES;

inline __m512i mxfp4_pairs(const uint8_t* q, uint8_t sc) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  // word 2i: the low nibble of byte i; word 2i + 1: its high nibble ((bytes | bytes << 12) & 0x000F000F)
  const __m512i codes = _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  return _mm512_permutexvar_epi16(codes, _mm512_load_si512(SCALED_TABLES.t[sc]));
}

// One packed row of n elements -> n / 2 bf16 pairs
inline void widen_mxfp4_pairs(const uint8_t* q, const uint8_t* s, int64_t n, uint32_t* dst) {
  for (int64_t b = 0; b < n / MX_GROUP; ++b) _mm512_storeu_si512(dst + b * 16, mxfp4_pairs(q + b * 16, s[b]));
}

// out[g * ld + r] = rows[r] . x[g] over np bf16 pairs, for R rows and G vectors, with vdpbf16ps: lane l of each
// accumulator sums pairs l, l + 16, ... in order (a zero-padded partial vector at the end), then the 16 lanes are
// added by reduce4's tree. Each output is summed the same way whatever R, G, or the rows and vectors beside it.
template <int R, int G>
inline void dots_pairs(const uint32_t* const* rows, const uint32_t* const* x, int64_t np, float* out, int64_t ld) {
  __m512 a[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) a[r][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < np; j += 16) {
    const __mmask16 m = np - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (np - j)) - 1);
    __m512bh w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = (__m512bh)_mm512_maskz_loadu_epi32(m, rows[r] + j);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi32(m, x[g] + j);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r][g] = _mm512_dpbf16_ps(a[r][g], w[r], v);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) store_sums<R, G>(a, g, out + g * ld);
}

// dots_pairs over R packed rows of n elements (codes q[r], scales s[r]), each group widened in a register as it is
// used: the same sums, in the same order, as widening the rows first and calling dots_pairs (for a few vectors,
// where a widened row would serve one block of them only)
template <int R, int G>
inline void dots_mxfp4_pairs(const uint8_t* const* q, const uint8_t* const* s, const uint32_t* const* x, int64_t n,
                             float* out, int64_t ld) {
  __m512 a[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) a[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < n / MX_GROUP; ++b) {
    __m512bh w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = (__m512bh)mxfp4_pairs(q[r] + b * 16, s[r][b]);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(x[g] + b * 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r][g] = _mm512_dpbf16_ps(a[r][g], w[r], v);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) store_sums<R, G>(a, g, out + g * ld);
}
#endif

// out[g * ld + r] = rows[r] . x[g] over n fp32 inputs, for R rows and G vectors: lane l of each accumulator sums
// inputs l, l + LANES, ... in order with FMAs, the lanes are added (reduce4's tree on AVX-512, vsum's on AVX2), then
// the inputs past the last whole vector one by one. Each output is summed the same way whatever R, G, or the rows and
// vectors beside it.
template <int R, int G>
inline void dots_f32(const float* const* rows, const float* const* x, int64_t n, float* out, int64_t ld) {
#if defined(K3_LANES)
  Vf a[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) a[r][g] = vzero();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    Vf w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = vload(rows[r] + i);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const Vf v = vload(x[g] + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r][g] = vfma(w[r], v, a[r][g]);
    }
  }
  for (int g = 0; g < G; ++g) {
#if K3_LANES == 16
    store_sums<R, G>(a, g, out + g * ld);
#else
    for (int r = 0; r < R; ++r) out[g * ld + r] = vsum(a[r][g]);
#endif
    for (int r = 0; r < R; ++r)
      for (int64_t j = i; j < n; ++j) out[g * ld + r] += rows[r][j] * x[g][j];
  }
#else
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t j = 0; j < n; ++j) acc += rows[r][j] * x[g][j];
      out[g * ld + r] = acc;
    }
#endif
}

}  // namespace k3
