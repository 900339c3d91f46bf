// MXFP4 rows widened to fp32 (compressed-tensors' mxfp4-pack-quantized: element 2i in a byte's low nibble, 2i+1 in
// its high one, one E8M0 scale per 32 elements), and the panel products of the CPU MoE kernels.
//
// Widening computes what weights/mxfp4.py's dequantize (ggml's) computes: the doubled E2M1 value times
// 2^(scale - 128) built from its bits, one fp32 multiply; code 8 reads as +0. Every value is exact in fp32, so a
// kernel that widens a packed row and then sums products in a fixed order gets the same bits as one that reads the
// dequantized row (bf16 or fp32) and sums in that order; every value is exact in bf16 too, so bf16 pairs of it are
// its fp32 bits' top halves.
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

// Panels: a block of output rows widened and stored input-major (panel[i * W + r], W rows a line), so that one
// vector holds one input's weights for LANES output rows. A task widens its rows a chunk of inputs at a time into a
// row-major buffer, then transposes LANES x LANES blocks into the panel.
#if defined(K3_LANES)
inline Vf vset1(float v) {
#if K3_LANES == 16
  return _mm512_set1_ps(v);
#else
  return _mm256_set1_ps(v);
#endif
}

// dst[c * dst_ld + r] = src[r * ld + c] for r, c < LANES
inline void transpose_block(const float* src, int64_t ld, float* dst, int64_t dst_ld) {
#if K3_LANES == 16
  __m512 s[16], t[16];
  for (int r = 0; r < 16; ++r) s[r] = _mm512_loadu_ps(src + r * ld);
  for (int q = 0; q < 16; q += 4) {  // 4 x 4 transposes inside each 128-bit lane, rows q..q+3
    const __m512 a = _mm512_unpacklo_ps(s[q], s[q + 1]), b = _mm512_unpackhi_ps(s[q], s[q + 1]);
    const __m512 c = _mm512_unpacklo_ps(s[q + 2], s[q + 3]), d = _mm512_unpackhi_ps(s[q + 2], s[q + 3]);
    t[q] = _mm512_shuffle_ps(a, c, 0x44);  // lane k: column 4k of rows q..q+3
    t[q + 1] = _mm512_shuffle_ps(a, c, 0xEE);  // 4k + 1
    t[q + 2] = _mm512_shuffle_ps(b, d, 0x44);  // 4k + 2
    t[q + 3] = _mm512_shuffle_ps(b, d, 0xEE);  // 4k + 3
  }
  for (int j = 0; j < 4; ++j) {  // then the lanes: column 4k + j takes lane k of t[j], t[4 + j], t[8 + j], t[12 + j]
    const __m512 x = _mm512_shuffle_f32x4(t[j], t[4 + j], 0x88), y = _mm512_shuffle_f32x4(t[j], t[4 + j], 0xDD);
    const __m512 u = _mm512_shuffle_f32x4(t[8 + j], t[12 + j], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(t[8 + j], t[12 + j], 0xDD);
    _mm512_storeu_ps(dst + j * dst_ld, _mm512_shuffle_f32x4(x, u, 0x88));
    _mm512_storeu_ps(dst + (8 + j) * dst_ld, _mm512_shuffle_f32x4(x, u, 0xDD));
    _mm512_storeu_ps(dst + (4 + j) * dst_ld, _mm512_shuffle_f32x4(y, w, 0x88));
    _mm512_storeu_ps(dst + (12 + j) * dst_ld, _mm512_shuffle_f32x4(y, w, 0xDD));
  }
#else
  __m256 s[8], t[8];
  for (int r = 0; r < 8; ++r) s[r] = _mm256_loadu_ps(src + r * ld);
  for (int q = 0; q < 8; q += 4) {
    const __m256 a = _mm256_unpacklo_ps(s[q], s[q + 1]), b = _mm256_unpackhi_ps(s[q], s[q + 1]);
    const __m256 c = _mm256_unpacklo_ps(s[q + 2], s[q + 3]), d = _mm256_unpackhi_ps(s[q + 2], s[q + 3]);
    t[q] = _mm256_shuffle_ps(a, c, 0x44);
    t[q + 1] = _mm256_shuffle_ps(a, c, 0xEE);
    t[q + 2] = _mm256_shuffle_ps(b, d, 0x44);
    t[q + 3] = _mm256_shuffle_ps(b, d, 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * dst_ld, _mm256_permute2f128_ps(t[j], t[4 + j], 0x20));
    _mm256_storeu_ps(dst + (4 + j) * dst_ld, _mm256_permute2f128_ps(t[j], t[4 + j], 0x31));
  }
#endif
}
constexpr int64_t PANEL_LANES = LANES;
#else
constexpr int64_t PANEL_LANES = 8;  // the portable build keeps the same geometry
#endif

#if K3_LANES == 16
// AVX-512: 16 packed rows' inputs k0 .. k0 + kb (whole groups) widened straight into a panel, fp32 panel[i * ld + r]
// or (PAIRS) bf16 pairs panel[i / 2 * ld + r] (inputs 2j and 2j + 1 of a row in one 32-bit word, as vdpbf16ps takes
// them): per group, the 16 rows' 16 bytes are transposed (byte j of every row in one register: elements 2j and
// 2j+1), then each register's low and high nibbles index the code table and are scaled by the 16 rows' scales.
// Twice as fast as widening rows and transposing the floats, with the same values.
template <bool PAIRS>
inline void widen_mxfp4_panel16(const uint8_t* const* q, const uint8_t* const* s, int64_t k0, int64_t kb, void* panel,
                                int64_t ld) {
  const __m512 table = _mm512_loadu_ps(MX_DOUBLED);
  const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2), tiny = _mm512_set1_epi32(0x00200000);
  for (int64_t b = k0 / 32; b < (k0 + kb) / 32; ++b) {
    __m128i a[16], t[16];
    alignas(16) uint8_t sc[16];
    for (int r = 0; r < 16; ++r) {
      a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[r] + b * 16));
      sc[r] = s[r][b];
    }
    for (int k = 0; k < 8; ++k) {
      t[2 * k] = _mm_unpacklo_epi8(a[2 * k], a[2 * k + 1]);
      t[2 * k + 1] = _mm_unpackhi_epi8(a[2 * k], a[2 * k + 1]);
    }
    for (int m = 0; m < 4; ++m) {
      a[4 * m] = _mm_unpacklo_epi16(t[4 * m], t[4 * m + 2]);
      a[4 * m + 1] = _mm_unpackhi_epi16(t[4 * m], t[4 * m + 2]);
      a[4 * m + 2] = _mm_unpacklo_epi16(t[4 * m + 1], t[4 * m + 3]);
      a[4 * m + 3] = _mm_unpackhi_epi16(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int p = 0; p < 2; ++p)
      for (int q4 = 0; q4 < 4; ++q4) {
        t[8 * p + 2 * q4] = _mm_unpacklo_epi32(a[8 * p + q4], a[8 * p + 4 + q4]);
        t[8 * p + 2 * q4 + 1] = _mm_unpackhi_epi32(a[8 * p + q4], a[8 * p + 4 + q4]);
      }
    for (int u = 0; u < 8; ++u) {
      a[2 * u] = _mm_unpacklo_epi64(t[u], t[8 + u]);
      a[2 * u + 1] = _mm_unpackhi_epi64(t[u], t[8 + u]);
    }
    const __m512i sv = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sc)));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(sv, one), 23);  // mx_half_scale, 16 rows at once
    const __m512i bits = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(sv, two), normal, _mm512_sllv_epi32(tiny, sv));
    const __m512 scale = _mm512_castsi512_ps(bits);
    for (int j = 0; j < 16; ++j) {
      const __m512i idx = _mm512_cvtepu8_epi32(a[j]);
      const __m512i high = _mm512_srli_epi32(idx, 4);  // (permutexvar reads the low 4 bits: the low nibble)
      const __m512 even = _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), scale);
      const __m512 odd = _mm512_mul_ps(_mm512_permutexvar_ps(high, table), scale);
      if constexpr (PAIRS) {  // a value's bf16 bits are its fp32 bits' top half (exact: at most 2 significant bits)
        const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(even), 16);
        const __m512i hi = _mm512_and_si512(_mm512_castps_si512(odd), _mm512_set1_epi32(~0xFFFF));
        const __m512i pair = _mm512_or_si512(lo, hi);
        _mm512_storeu_si512(static_cast<uint32_t*>(panel) + (b * 16 - k0 / 2 + j) * ld, pair);
      } else {
        float* out = static_cast<float*>(panel) + (b * 32 - k0) * ld;
        _mm512_storeu_ps(out + (2 * j) * ld, even);
        _mm512_storeu_ps(out + (2 * j + 1) * ld, odd);
      }
    }
  }
}

#endif

// rows [nr][ld] (nr a multiple of PANEL_LANES, the first n inputs of each) -> panel [n][nr]
inline void transpose_rows(const float* rows, int64_t nr, int64_t ld, int64_t n, float* panel) {
  for (int64_t r0 = 0; r0 < nr; r0 += PANEL_LANES) {
    int64_t c = 0;
#if defined(K3_LANES)
    for (; c + LANES <= n; c += LANES) transpose_block(rows + r0 * ld + c, ld, panel + c * nr + r0, nr);
#endif
    for (; c < n; ++c)
      for (int64_t r = r0; r < r0 + PANEL_LANES; ++r) panel[c * nr + r] = rows[r * ld + c];
  }
}

// acc[g * W + r] += sum_i panel[i * W + r] * x[g][i] for G vectors and W = RV * PANEL_LANES rows, each output one
// chain of FMAs over i in order, continued from acc (so a row's sum is the same sequence of roundings whatever G,
// RV or the chunking of i is: a token's result never depends on the tokens or rows computed with it)
template <int RV, int G>
inline void panel_fma(const float* panel, int64_t n, const float* const* x, float* acc) {
  constexpr int64_t W = RV * PANEL_LANES;
#if defined(K3_LANES)
  Vf a[G][RV];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int v = 0; v < RV; ++v) a[g][v] = vload(acc + g * W + v * LANES);
  for (int64_t i = 0; i < n; ++i) {
    Vf w[RV];
#pragma GCC unroll 8
    for (int v = 0; v < RV; ++v) w[v] = vload(panel + i * W + v * LANES);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const Vf b = vset1(x[g][i]);
#pragma GCC unroll 8
      for (int v = 0; v < RV; ++v) a[g][v] = vfma(w[v], b, a[g][v]);
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int v = 0; v < RV; ++v) vstore(acc + g * W + v * LANES, a[g][v]);
#else
  for (int64_t i = 0; i < n; ++i)
    for (int g = 0; g < G; ++g)
      for (int64_t r = 0; r < W; ++r) acc[g * W + r] += panel[i * W + r] * x[g][i];
#endif
}

// k.run<G>(g0) over vectors g0 .. nx, GMAX at a time (the last group as many as are left)
template <int GMAX, typename K>
inline void in_groups(const K& k, int64_t g0, int64_t nx) {
  for (; g0 + GMAX <= nx; g0 += GMAX) k.template run<GMAX>(g0);
  if constexpr (GMAX > 1) {
    if (g0 < nx) in_groups<GMAX / 2>(k, g0, nx);
  }
}

// bf16 pairs [n / 2][nrows] from an fp32 panel [n][nrows] (n even) of bf16 values (exact)
inline void pack_pairs(const float* panel, int64_t n, int64_t nrows, uint32_t* pairs) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(panel);
  for (int64_t j = 0; j < n / 2; ++j)
    for (int64_t r = 0; r < nrows; ++r)
      pairs[j * nrows + r] = (bits[2 * j * nrows + r] >> 16) | (bits[(2 * j + 1) * nrows + r] & 0xFFFF0000u);
}

#if defined(__AVX512BF16__)
// panel_fma's bf16 form: acc[g * W + r] accumulates panel pair j of row r times x[g]'s pair j with vdpbf16ps (two
// products a step, fp32 sums), one chain per output over j in order: the same sequence whatever G or RV is.
template <int RV, int G>
inline void panel_dpbf16(const uint32_t* panel, int64_t npairs, const uint32_t* const* x, float* acc) {
  constexpr int64_t W = RV * 16;
  __m512 a[G][RV];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int v = 0; v < RV; ++v) a[g][v] = _mm512_loadu_ps(acc + g * W + v * 16);
  for (int64_t j = 0; j < npairs; ++j) {
    __m512bh w[RV];
#pragma GCC unroll 8
    for (int v = 0; v < RV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + j * W + v * 16);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[g][j]));
#pragma GCC unroll 8
      for (int v = 0; v < RV; ++v) a[g][v] = _mm512_dpbf16_ps(a[g][v], w[v], b);
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(acc + g * W + v * 16, a[g][v]);
}

#endif

template <int RV, bool PAIRS>
struct PanelProducts {  // panel_fma, or (PAIRS: bf16 pairs) panel_dpbf16, over any number of vectors (in_groups)
  const void* panel;
  int64_t n;  // inputs
  const void* const* x;
  float* acc;
  template <int G>
  void run(int64_t g0) const {
    float* a = acc + g0 * RV * PANEL_LANES;
#if defined(__AVX512BF16__)
    if constexpr (PAIRS) {
      const auto* xp = reinterpret_cast<const uint32_t* const*>(x + g0);
      return panel_dpbf16<RV, G>(static_cast<const uint32_t*>(panel), n / 2, xp, a);
    }
#endif
    panel_fma<RV, G>(static_cast<const float*>(panel), n, reinterpret_cast<const float* const*>(x + g0), a);
  }
};

}  // namespace k3
