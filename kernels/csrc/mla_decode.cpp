// MLA's absorbed decode for the CPU as one op, after the projection and the cache write: q_nope folded through
// kv_b's key rows, scores against the cached latent rows, softmax, the weighted latent, and kv_b's value rows. The
// torch path runs this as two bmm's around kernels/mla.py's mla_decode, about fifteen small ops a layer. Roundings
// follow the torch path: q_abs, the scores, the scaled scores, the probabilities, the context and the output each
// round to the compute dtype; sums and the softmax are fp32.
//
// Why it is laid out this way (docs/decode.md has the profile): at depth the op is all arithmetic over the rows,
// 2 x heads x (r + dr) multiply-adds a row, so it must run at the vector units' rate on both threads whatever the
// batch. Each sequence's rows are cut into pieces (up to 64 of 256 rows or more); a piece reads a block of rows once
// for every head (rows read twice per layer, not twice per head) in register-blocked kernels (below). The softmax needs
// the whole row of scores before a probability is rounded, as torch's does, so the op runs in four passes: scores
// and each piece's maxima; exp and each piece's sums; the context of each piece; the pieces' contexts summed,
// rounded and taken through kv_b's value rows. Buffers are kept between calls (they only grow).
//
// The multiply-adds of scores and context take one of three kernels, by what the CPU has: AMX tiles (16 rows x all
// heads x 32 values an instruction, bf16 rows as cached, at most 16 heads, r and r + dr multiples of 32), AVX-512
// BF16 dot products (32 values an instruction, rows never widened), or the widened fp32 kernels (any dtype). All
// three sum exact products of the same rounded values in fp32, in different orders (the tests bound the difference
// as for the torch path); which one runs depends only on the CPU and the shapes, never on the batch or the threads.
#include "vec.h"  // first: it names the CPU capability ATen's vector functions compile for

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"

namespace {

using k3::Vec;
using k3::W;

constexpr int64_t SUB = 32;  // rows widened to fp32 at a time (32 x 160 floats: 20 KiB, in L1); a multiple of 2 W
constexpr int64_t PIECE = 256;  // fewest rows a piece holds (fewer: the split costs more than it gains)
constexpr int64_t AHEAD = 2 * SUB;  // rows ahead of the one widened that are asked of the memory already
constexpr int64_t PIECES = 64;  // most pieces a sequence is cut into (their partial contexts are summed at the end)

inline int64_t pad(int64_t n) { return (n + W - 1) / W * W; }

using k3::hsum;

#if defined(CPU_CAPABILITY_AVX512)
// s[n] = hsum(a[n]) for 8 vectors at once, each summed by hsum's own tree (halves, quarters, pairs, lanes), so the
// values are bit for bit hsum's; about a third of the shuffles of eight separate reductions.
inline void hsum8(const __m512* a, float* s) {
  __m512 half[4];  // a[2k] and a[2k + 1], each folded to 8 lanes: quarters 0 + 2 and 1 + 3
  for (int k = 0; k < 4; ++k) {
    const __m512 x = a[2 * k], y = a[2 * k + 1];
    half[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  __m512 quad[2];  // quarter q of quad[j]: a[4j + q] folded to 4 lanes
  for (int j = 0; j < 2; ++j) {
    const __m512 x = half[2 * j], y = half[2 * j + 1];
    quad[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  // within each quarter: lanes 0 + 2 and 1 + 3, then their sum; lane 0 of quarter q holds a[q], lane 1 a[4 + q]
  const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(quad[0], quad[1]), _mm512_unpackhi_ps(quad[0], quad[1]));
  alignas(64) float t[16];
  _mm512_store_ps(t, _mm512_add_ps(w, _mm512_shuffle_ps(w, w, 0x4E)));
  for (int q = 0; q < 4; ++q) s[q] = t[4 * q], s[4 + q] = t[4 * q + 1];
}
#endif

// s[i][c] = rows[i] . q[c] for R rows and C heads, each of K (a multiple of W) floats: R x C vector accumulators
template <int R, int C>
inline void scores_block(const float* rows, int64_t row_s, const float* q, int64_t q_s, int64_t K, float* s) {
  Vec acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = Vec(0.f);
  for (int64_t k = 0; k < K; k += W) {
    Vec x[R];
    for (int i = 0; i < R; ++i) x[i] = Vec::loadu(rows + i * row_s + k);
    for (int c = 0; c < C; ++c) {
      const Vec y = Vec::loadu(q + c * q_s + k);
      for (int i = 0; i < R; ++i) acc[i][c] = at::vec::fmadd(x[i], y, acc[i][c]);
    }
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (R * C == 8) {
    __m512 v[8];
    for (int j = 0; j < 8; ++j) v[j] = acc[j / C][j % C];
    hsum8(v, s);
    return;
  }
#endif
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) s[i * C + c] = hsum(acc[i][c]);
}

// R rows' scores for H heads, C heads a call of `block(h, out)` (its out [R][C]) and the rest one at a time
// (`one(h, out)`), stored head-major: s [H][s_s], each head's R scores at s[h * s_s ..]. Both kernel families share it.
template <int R, int C, typename Block, typename One>
inline void scores_by_heads(int64_t H, float* s, int64_t s_s, Block block, One one) {
  float tmp[R * C];
  int64_t h = 0;
  for (; h + C <= H; h += C) {
    block(h, tmp);
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) s[(h + c) * s_s + i] = tmp[C * i + c];
  }
  for (; h < H; ++h) {
    one(h, tmp);
    for (int i = 0; i < R; ++i) s[h * s_s + i] = tmp[i];
  }
}

template <int R>
inline void scores_rows(const float* rows, int64_t row_s, const float* q, int64_t q_s, int64_t K, int64_t H,
                        float* s, int64_t s_s) {
  scores_by_heads<R, 2>(
      H, s, s_s, [&](int64_t h, float* out) { scores_block<R, 2>(rows, row_s, q + h * q_s, q_s, K, out); },
      [&](int64_t h, float* out) { scores_block<R, 1>(rows, row_s, q + h * q_s, q_s, K, out); });
}

// acc[c][0 .. V*W) += p[c][t] * rows[t][off ..] for every row t of a block of m rows, C heads, V vectors
template <int C, int V>
inline void context_block(const float* rows, int64_t row_s, int64_t m, const float* p, int64_t p_s, float* acc,
                          int64_t acc_s, int64_t off) {
  Vec a[C][V];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) a[c][v] = Vec::loadu(acc + c * acc_s + off + v * W);
  for (int64_t t = 0; t < m; ++t) {
    Vec x[V];
    for (int v = 0; v < V; ++v) x[v] = Vec::loadu(rows + t * row_s + off + v * W);
    for (int c = 0; c < C; ++c) {
      const Vec pt(p[c * p_s + t]);
      for (int v = 0; v < V; ++v) a[c][v] = at::vec::fmadd(pt, x[v], a[c][v]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) a[c][v].store(acc + c * acc_s + off + v * W);
}

template <int C>
inline void context_heads(const float* rows, int64_t row_s, int64_t m, const float* p, int64_t p_s, float* acc,
                          int64_t acc_s, int64_t rp) {
  int64_t off = 0;
  for (; off + 4 * W <= rp; off += 4 * W) context_block<C, 4>(rows, row_s, m, p, p_s, acc, acc_s, off);
  for (; off < rp; off += W) context_block<C, 1>(rows, row_s, m, p, p_s, acc, acc_s, off);
}

#if defined(__AVX512BF16__)
// bf16 rows on a CPU with AVX-512 BF16: the rows are multiplied as they are cached, 32 values a register, by the
// dot-product instruction (fp32 sums of exact products, as the widened kernels' sums, in another order), so no row
// is ever widened. Scores: R rows x C heads of dot products, q in bf16 (q_abs is rounded to bf16 before, q_pe is
// bf16: exact). Context: two rows interleaved value by value, so that one instruction adds p[t] row[t] + p[t+1]
// row[t+1] for 16 values of C heads; the accumulators then hold the values in the interleaved order (`natural`).
constexpr int64_t BW = 32;  // bf16 values in a register
using Bf = c10::BFloat16;

inline int64_t pad_bf(int64_t n) { return (n + BW - 1) / BW * BW; }
inline __mmask32 first(int64_t m) { return m >= BW ? ~__mmask32(0) : (__mmask32(1) << m) - 1; }

template <int R, int C>
inline void scores_bf(const Bf* rows, int64_t row_s, const Bf* q, int64_t q_s, int64_t K, float* s) {
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += BW) {
    const __mmask32 mask = first(K - k);
    __m512bh x[R];
    for (int i = 0; i < R; ++i) x[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows + i * row_s + k);
    for (int c = 0; c < C; ++c) {
      const __m512bh y = (__m512bh)_mm512_loadu_si512(q + c * q_s + k);  // zero past K
      for (int i = 0; i < R; ++i) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], x[i], y);
    }
  }
  if constexpr (R * C % 8 == 0) {
    for (int j = 0; j < R * C; j += 8) {
      __m512 v[8];
      for (int u = 0; u < 8; ++u) v[u] = acc[(j + u) / C][(j + u) % C];
      hsum8(v, s + j);
    }
  } else {
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) s[i * C + c] = _mm512_reduce_add_ps(acc[i][c]);
  }
}

template <int R>
inline void scores_rows_bf(const Bf* rows, int64_t row_s, const Bf* q, int64_t q_s, int64_t K, int64_t H, float* s,
                           int64_t s_s) {
  scores_by_heads<R, 4>(
      H, s, s_s, [&](int64_t h, float* out) { scores_bf<R, 4>(rows, row_s, q + h * q_s, q_s, K, out); },
      [&](int64_t h, float* out) { scores_bf<R, 1>(rows, row_s, q + h * q_s, q_s, K, out); });
}

// rows t and t + 1 (t + 1 < m, else zeros) interleaved: pair j of `out` holds n / 16 registers of 16 (row t, row
// t + 1) value pairs each, for every 32 values a low and a high one (the instruction's halves of each 128 bits)
inline void interleave(const Bf* rows, int64_t row_s, int64_t m, int64_t n, __m512i* out) {
  const int64_t per_pair = pad_bf(n) / 16;
  for (int64_t t = 0; t < m; t += 2) {
    __m512i* o = out + t / 2 * per_pair;
    for (int64_t k = 0; k < n; k += BW) {
      const __mmask32 mask = first(n - k);
      const __m512i a = _mm512_maskz_loadu_epi16(mask, rows + t * row_s + k);
      const __m512i b = t + 1 < m ? _mm512_maskz_loadu_epi16(mask, rows + (t + 1) * row_s + k) : _mm512_setzero_si512();
      o[k / 16] = _mm512_unpacklo_epi16(a, b);
      o[k / 16 + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
}

// the column of accumulator lane `i` (interleave's order): in each 32 values, register lo then hi; in each, lane
// 4 q + u is value 8 q + u (lo) or 8 q + 4 + u (hi)
inline int64_t natural(int64_t i) {
  const int64_t base = i / BW * BW, w = i % BW, hi = w / 16, q = w % 16 / 4, u = w % 4;
  return base + 8 * q + 4 * hi + u;
}

// acc[c][0 .. V*16) += the pairs' rows times their probabilities pp[c][j] (two bf16 in 32 bits), C heads, V registers
template <int C, int V>
inline void context_bf(const __m512i* pairs, int64_t per_pair, int64_t n_pairs, const uint32_t* pp, int64_t pp_s,
                       float* acc, int64_t acc_s, int64_t off) {
  __m512 a[C][V];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) a[c][v] = _mm512_loadu_ps(acc + c * acc_s + (off + v) * 16);
  for (int64_t j = 0; j < n_pairs; ++j) {
    __m512bh x[V];
    for (int v = 0; v < V; ++v) x[v] = (__m512bh)_mm512_load_si512(pairs + j * per_pair + off + v);
    for (int c = 0; c < C; ++c) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[c * pp_s + j]));
      for (int v = 0; v < V; ++v) a[c][v] = _mm512_dpbf16_ps(a[c][v], x[v], p);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + c * acc_s + (off + v) * 16, a[c][v]);
}

template <int C>
inline void context_heads_bf(const __m512i* pairs, int64_t per_pair, int64_t n_pairs, const uint32_t* pp,
                             int64_t pp_s, float* acc, int64_t acc_s) {
  int64_t off = 0;
  for (; off + 8 <= per_pair; off += 8) context_bf<C, 8>(pairs, per_pair, n_pairs, pp, pp_s, acc, acc_s, off);
  for (; off < per_pair; off += 2) context_bf<C, 2>(pairs, per_pair, n_pairs, pp, pp_s, acc, acc_s, off);
}

// probabilities p[0 .. SUB) (each a bf16 value held as fp32) as SUB / 2 pairs (p[2j], p[2j + 1]) of bf16
inline void pair_up(const float* p, uint32_t* pp) {
  for (int64_t j = 0; j < SUB; j += 2 * W)
    _mm512_storeu_si512(pp + j / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + j + W), _mm512_loadu_ps(p + j)));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX tiles where the CPU has them (and Linux lets this process use them): the same dot products of exact bf16
// products summed in fp32, 16 rows x all heads x 32 values an instruction. Scores: the rows as they are cached times
// q laid out in pairs; context: each head's 32 probabilities of a block of rows times the block's interleaved rows.
// A tail of fewer than 16 rows, and shapes the tiles do not fit (more than 16 heads, K or r not a multiple of 32),
// take the dot-product kernels above.
using k3::TILE_ROWS;

// tiles 0-2: scores C [16 rows][H], rows A [16][32 values], q B [16 pairs][H pairs]; 3-5: context A [H][32
// probabilities], rows B [16 pairs][16 value pairs], C [H][16 values]
inline void configure_tiles(int64_t H) {
  const uint16_t colsb[6] = {static_cast<uint16_t>(H * 4), 64, static_cast<uint16_t>(H * 4), 64, 64, 64};
  const uint8_t rows[6] = {16, 16, 16, static_cast<uint8_t>(H), 16, static_cast<uint8_t>(H)};
  k3::configure_tiles(6, rows, colsb);
}

// q [H][Kq] (bf16, zero past K) as K / 32 B tiles: tile k, row j, head h holds q_h[32 k + 2 j], q_h[32 k + 2 j + 1]
inline void q_pairs(const Bf* q, int64_t q_s, int64_t H, int64_t K, uint32_t* out) {
  for (int64_t k = 0; k < K; k += BW)
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t h = 0; h < H; ++h) {
        uint32_t lo = c10::bit_cast<uint16_t>(q[h * q_s + k + 2 * j]), hi = c10::bit_cast<uint16_t>(q[h * q_s + k + 2 * j + 1]);
        out[(k / BW * 16 + j) * H + h] = lo | hi << 16;
      }
}

// s[i][h] for 16 rows (row stride row_s values), K a multiple of 32
inline void scores_tile(const Bf* rows, int64_t row_s, const uint32_t* qp, int64_t H, int64_t K, float* s) {
  _tile_zero(0);
  for (int64_t k = 0; k < K; k += BW) {
    _tile_loadd(1, rows + k, row_s * sizeof(Bf));
    _tile_loadd(2, qp + k / BW * 16 * H, H * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, s, H * 4);
}

// acc[h][..] (interleave's order) += the block's 16 pairs of rows times probabilities pp [H][16 pairs]
inline void context_tile(const __m512i* pairs, int64_t per_pair, const uint32_t* pp, int64_t pp_s, float* acc,
                         int64_t acc_s) {
  _tile_loadd(3, pp, pp_s * 4);
  for (int64_t v = 0; v < per_pair; ++v) {
    _tile_loadd(5, acc + v * 16, acc_s * 4);
    _tile_loadd(4, pairs + v, per_pair * 64);
    _tile_dpbf16ps(5, 3, 4);
    _tile_stored(5, acc + v * 16, acc_s * 4);
  }
}
#endif
#endif

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {  // exact; full vectors only, then the tail one by one
  int64_t j = 0;
  if constexpr (!k3::wide<T>) {  // (k3::to_float's partial loads copy through the stack: 3x slower here)
    for (; j + 2 * W <= n; j += 2 * W) {
      auto [a, b] = k3::widen(at::vec::Vectorized<T>::loadu(src + j));
      a.store(dst + j);
      b.store(dst + j + W);
    }
  }
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

template <typename T>
inline void round_block(float* x) {  // x[0 .. SUB) = float(T(x)) in whole vectors (k3::round_to's partial ones copy)
  static_assert(SUB % (2 * W) == 0);
  if constexpr (!k3::wide<T>) {
    for (int64_t j = 0; j < SUB; j += 2 * W) {
      auto [a, b] = k3::widen(k3::narrow(Vec::loadu(x + j), Vec::loadu(x + j + W), static_cast<T*>(nullptr)));
      a.store(x + j);
      b.store(x + j + W);
    }
  }
}

template <typename T>
void widen_rows(const T* src, int64_t src_s, int64_t m, int64_t n, float* dst, int64_t dst_s) {
  for (int64_t i = 0; i < m; ++i) {  // n values of each row, then zeros to dst_s (the padding adds nothing)
    const char* ahead = reinterpret_cast<const char*>(src + (i + AHEAD) * src_s);  // a hint: never faults
    for (int64_t c = 0; c < static_cast<int64_t>(n * sizeof(T)); c += 64) __builtin_prefetch(ahead + c);
    widen<T>(src + i * src_s, dst + i * dst_s, n);
    for (int64_t j = n; j < dst_s; ++j) dst[i * dst_s + j] = 0.f;
  }
}

constexpr int64_t Q_SEQS = 4;  // sequences whose q_abs share each loaded vector of the key rows (batches of 4 or more)

constexpr int64_t VALUE_SEQS = 4;  // sequences whose contexts share each widened value row

// y[u] = w . x_u for NB <= VALUE_SEQS vectors x_u (x + u * x_s) of n values, w widened: each sum one chain of FMAs
// over the vectors, then hsum, then the tail one by one (a sequence's sums do not depend on its neighbours), the
// chains interleaved
template <int NB>
inline void dots_of(const float* w, const float* x, int64_t x_s, int64_t n, float* y) {
  Vec acc[NB];
  for (int u = 0; u < NB; ++u) acc[u] = Vec(0.f);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const Vec wj = Vec::loadu(w + j);
    for (int u = 0; u < NB; ++u) acc[u] = at::vec::fmadd(wj, Vec::loadu(x + u * x_s + j), acc[u]);
  }
  for (int u = 0; u < NB; ++u) {
    y[u] = hsum(acc[u]);
    for (int64_t i = j; i < n; ++i) y[u] += w[i] * x[u * x_s + i];
  }
}

inline void dots_of(const float* w, const float* x, int64_t x_s, int64_t nb, int64_t n, float* y) {
  static_assert(VALUE_SEQS == 4, "one case per count");
  switch (nb) {
    case 4: return dots_of<4>(w, x, x_s, n, y);
    case 3: return dots_of<3>(w, x, x_s, n, y);
    case 2: return dots_of<2>(w, x, x_s, n, y);
    default: return dots_of<1>(w, x, x_s, n, y);
  }
}

struct Piece {
  int64_t b, t0, t1;
};

struct Buffers {  // kept between calls, grown when a call needs more
  std::vector<float> qc, scores, stat, ctx;
  std::vector<c10::BFloat16> qb;  // q in bf16 for the dot-product kernels
  std::vector<uint32_t> qp;        // and in pairs for the tiles
  template <typename V>
  static typename V::value_type* at_least(V& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

// q [B, H, dn + dr]; latent [B, L, r + dr] (rows contiguous); lengths [B]; w_kb [H, dn, r]; w_vb [H, dv, r]
// (views of kv_b, rows contiguous). Returns [B, H * dv].
at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& lengths, const at::Tensor& w_kb,
                      const at::Tensor& w_vb, double scale) {
  const int64_t B = q.size(0), H = q.size(1), dn = w_kb.size(1), r = w_kb.size(2), dv = w_vb.size(1);
  const int64_t dr = q.size(2) - dn, L = latent.size(1), K = r + dr, Kp = pad(K), rp = pad(r);
  TORCH_CHECK(q.is_contiguous() && latent.stride(2) == 1 && latent.size(2) == r + dr, "mla_decode: q, latent layout");
  TORCH_CHECK(w_kb.stride(2) == 1 && w_vb.stride(2) == 1 && w_vb.size(2) == r, "mla_decode: kv_b layout");
  TORCH_CHECK(w_kb.scalar_type() == q.scalar_type() && latent.scalar_type() == q.scalar_type(), "mla_decode: dtypes");
  auto len = lengths.to(at::kLong).contiguous();
  auto out = at::empty({B, H * dv}, q.options());
  if (B == 0 || H == 0) return out;

  // the pieces: each sequence's rows cut so that every thread gets a few at depth (one piece for an empty sequence)
  const int64_t* np = len.data_ptr<int64_t>();
  std::vector<int64_t> n(B), first(B + 1), offset(B + 1, 0);  // rows, first piece, offset in the score buffers
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += n[b] = std::min<int64_t>(std::max<int64_t>(np[b], 0), L);
  std::vector<Piece> pieces;
  for (int64_t b = 0; b < B; ++b) {  // a piece's size depends on its sequence's length alone, never on the threads:
    first[b] = pieces.size();        // the sums then run in one order, and the values do not change with them
    offset[b + 1] = offset[b] + n[b];
    const int64_t size = std::max<int64_t>(PIECE, (n[b] + PIECES - 1) / PIECES / SUB * SUB + SUB);
    for (int64_t t = 0; t < std::max<int64_t>(n[b], 1); t += size) pieces.push_back({b, t, std::min(t + size, n[b])});
  }
  first[B] = pieces.size();
  const int64_t P = pieces.size();

#if defined(__AVX512BF16__)
  const bool dots = q.scalar_type() == at::kBFloat16;  // the dot-product kernels: bf16 rows, never widened
  const int64_t Kq = pad_bf(K), rc = dots ? pad_bf(r) : rp;  // q's and a context's values (padded)
#else
  const bool dots = false;
  const int64_t Kq = Kp, rc = rp;
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const bool tiles = dots && H <= 16 && K % BW == 0 && r % BW == 0 && k3::amx_permitted();
#else
  const bool tiles = false;
#endif
  static thread_local Buffers buf;
  float* qc = Buffers::at_least(buf.qc, B * H * Kp);            // q_abs and q_pe per (sequence, head), padded
  float* sc = Buffers::at_least(buf.scores, H * total + SUB);   // [H][total]: scores, then exp (+ a block read past)
  float* stat = Buffers::at_least(buf.stat, 2 * P * H);         // per piece and head: its max, then its sum
  float* ctx = Buffers::at_least(buf.ctx, P * H * rc);          // per piece: [H][rc] partial contexts
  c10::BFloat16* qbf = Buffers::at_least(buf.qb, dots ? B * H * Kq : 1);  // (the dot-product kernels) qc in bf16, zero past K
  uint32_t* qpairs = Buffers::at_least(buf.qp, tiles ? B * H * Kq / 2 : 1);  // (the tiles) qbf in B tiles
  const float fscale = static_cast<float>(scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mla_decode", [&] {
    using T = scalar_t;
    const T* qp = q.data_ptr<T>();
    const T* lp = latent.data_ptr<T>();
    const T* kb = w_kb.data_ptr<T>();
    const T* vb = w_vb.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t lat_b = latent.stride(0), lat_t = latent.stride(1);

    // q_abs = W_kb^T q_nope (rounded), then q_pe: a task per head, its rows widened once for every sequence; blocks
    // of Q_SEQS sequences in registers (context_heads), the rest a row of W_kb at a time, vectorised over r (each
    // sequence's sums run in the same order either way, and as alone)
    at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
      const int64_t blocked = B / Q_SEQS * Q_SEQS;  // sequences taken Q_SEQS at a time; the rest a row at a time
      std::vector<float> w((blocked ? dn : 1) * rp, 0.f), qf(Q_SEQS * dn);
      for (int64_t h = begin; h < end; ++h) {
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i < Kp; ++i) qc[(b * H + h) * Kp + i] = 0.f;
        if (blocked)  // the head's key rows widened once, for every block of sequences
          for (int64_t j = 0; j < dn; ++j) widen<T>(kb + h * w_kb.stride(0) + j * w_kb.stride(1), w.data() + j * rp, r);
        for (int64_t b = 0; b < blocked; b += Q_SEQS) {
          for (int64_t g = 0; g < Q_SEQS; ++g)
            for (int64_t j = 0; j < dn; ++j) qf[g * dn + j] = static_cast<float>(qp[((b + g) * H + h) * (dn + dr) + j]);
          // q_abs_g[i] = sum over j of q_g[j] w[j][i]: context_heads' FMA chains, in j's order from the zeroed qc
          context_heads<Q_SEQS>(w.data(), rp, dn, qf.data(), dn, qc + (b * H + h) * Kp, H * Kp, rp);
        }
        for (int64_t j = 0; j < dn && blocked < B; ++j) {
          const float* wj = w.data() + (blocked ? j * rp : 0);
          if (!blocked) widen<T>(kb + h * w_kb.stride(0) + j * w_kb.stride(1), w.data(), r);
          for (int64_t b = blocked; b < B; ++b) {
            const Vec qj(static_cast<float>(qp[(b * H + h) * (dn + dr) + j]));
            float* out_q = qc + (b * H + h) * Kp;
            for (int64_t i = 0; i < rp; i += W) {
              const int64_t m = std::min<int64_t>(W, r - i);
              at::vec::fmadd(qj, Vec::loadu(wj + i, m), Vec::loadu(out_q + i, m)).store(out_q + i, m);
            }
          }
        }
        for (int64_t b = 0; b < B; ++b) {
          const int64_t task = b * H + h;
          const T* qh = qp + task * (dn + dr);
          float* out_q = qc + task * Kp;
          k3::round_to<T>(out_q, r);
          for (int64_t i = 0; i < dr; ++i) out_q[r + i] = static_cast<float>(qh[dn + i]);
          if (dots)
            for (int64_t i = 0; i < Kq; ++i) qbf[task * Kq + i] = static_cast<c10::BFloat16>(i < K ? out_q[i] : 0.f);
        }
      }
    });
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles)
      for (int64_t b = 0; b < B; ++b) q_pairs(qbf + b * H * Kq, Kq, H, K, qpairs + b * H * Kq / 2);
#endif

    // pass 1: scores [H][rows] of each piece, rounded as torch's, and the piece's maximum per head
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> rows(dots ? 0 : SUB * Kp), s(SUB * H);  // rows: the widened kernels' (bf16 rows never are)
      const Vec vscale(fscale);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      float tile_s[TILE_ROWS * 16];
      if (tiles) configure_tiles(H);  // (a thread's own state)
#endif
      for (int64_t pi = begin; pi < end; ++pi) {
        const Piece pc = pieces[pi];
        const float* qb = qc + pc.b * H * Kp;
        float* top = stat + pi * H;
        for (int64_t h = 0; h < H; ++h) top[h] = -std::numeric_limits<float>::infinity();
        for (int64_t t = pc.t0; t < pc.t1; t += SUB) {
          const int64_t m = std::min(SUB, pc.t1 - t);
          const T* block = lp + pc.b * lat_b + t * lat_t;
#if defined(__AVX512BF16__)
          if (dots) {
            const Bf* rows_bf = reinterpret_cast<const Bf*>(block);
            const Bf* q16 = qbf + pc.b * H * Kq;
            for (int64_t i = 0; i < m; ++i) {  // the memory asked for the rows AHEAD on (a hint: never faults)
              const char* ahead = reinterpret_cast<const char*>(rows_bf + (i + AHEAD) * lat_t);
              for (int64_t c = 0; c < static_cast<int64_t>(K * sizeof(Bf)); c += 64) __builtin_prefetch(ahead + c);
            }
            int64_t i = 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            for (; tiles && i + TILE_ROWS <= m; i += TILE_ROWS) {
              scores_tile(rows_bf + i * lat_t, lat_t, qpairs + pc.b * H * Kq / 2, H, K, tile_s);
              for (int64_t u = 0; u < TILE_ROWS; ++u)
                for (int64_t h = 0; h < H; ++h) s[h * SUB + i + u] = tile_s[u * H + h];
            }
#endif
            for (; i + 4 <= m; i += 4) scores_rows_bf<4>(rows_bf + i * lat_t, lat_t, q16, Kq, K, H, s.data() + i, SUB);
            for (; i < m; ++i) scores_rows_bf<1>(rows_bf + i * lat_t, lat_t, q16, Kq, K, H, s.data() + i, SUB);
          } else
#endif
          {
            widen_rows<T>(block, lat_t, m, K, rows.data(), Kp);
            int64_t i = 0;
            for (; i + 4 <= m; i += 4) scores_rows<4>(rows.data() + i * Kp, Kp, qb, Kp, Kp, H, s.data() + i, SUB);
            for (; i < m; ++i) scores_rows<1>(rows.data() + i * Kp, Kp, qb, Kp, Kp, H, s.data() + i, SUB);
          }
          for (int64_t h = 0; h < H; ++h) {  // the score, then the scaled score, each rounded (a vector at a time)
            float* dst = sc + h * total + offset[pc.b] + t;
            float* x = s.data() + h * SUB;
            round_block<T>(x);
            for (int64_t j = 0; j < SUB; j += W) (Vec::loadu(x + j) * vscale).store(x + j);
            round_block<T>(x);
            Vec best(top[h]);  // the block's rows copied out and their maximum, a vector at a time
            int64_t j = 0;
            for (; j + W <= m; j += W) {
              const Vec v = Vec::loadu(x + j);
              v.store(dst + j);
              best = at::vec::maximum(best, v);
            }
            float top_h = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, best);
            for (; j < m; ++j) dst[j] = x[j], top_h = std::max(top_h, x[j]);
            top[h] = top_h;
          }
        }
      }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (tiles) _tile_release();
#endif
    });

    // pass 2: exp(score - the sequence's max) in place, and each piece's sum per head
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t pi = begin; pi < end; ++pi) {
        const Piece pc = pieces[pi];
        for (int64_t h = 0; h < H; ++h) {
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t pj = first[pc.b]; pj < first[pc.b + 1]; ++pj) top = std::max(top, stat[pj * H + h]);
          float* e = sc + h * total + offset[pc.b] + pc.t0;
          const int64_t m = pc.t1 - pc.t0;
          const Vec vtop(top);
          k3::vmap(e, m, [&](Vec x) { return (x - vtop).exp(); });
          Vec acc(0.f);
          int64_t j = 0;
          for (; j + W <= m; j += W) acc = acc + Vec::loadu(e + j);
          float sum = hsum(acc);
          for (; j < m; ++j) sum += e[j];
          stat[P * H + pi * H + h] = sum;
        }
      }
    });

    // pass 3: each piece's context [H][rc], with the probabilities rounded as torch's
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> rows(dots ? 0 : SUB * rp), p(H * SUB), sums(H);
#if defined(__AVX512BF16__)
      const int64_t per_pair = rc / 16;
      std::vector<__m512i> pairs(dots ? SUB / 2 * per_pair : 0);  // zeros: a tile reads all 16 pairs
      std::vector<uint32_t> pp(dots ? H * SUB / 2 : 0);
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (tiles) configure_tiles(H);
#endif
      for (int64_t pi = begin; pi < end; ++pi) {
        const Piece pc = pieces[pi];
        float* acc = ctx + pi * H * rc;
        for (int64_t i = 0; i < H * rc; ++i) acc[i] = 0.f;
        for (int64_t h = 0; h < H; ++h) {
          float sum = 0.f;
          for (int64_t pj = first[pc.b]; pj < first[pc.b + 1]; ++pj) sum += stat[P * H + pj * H + h];
          sums[h] = sum;
        }
        for (int64_t t = pc.t0; t < pc.t1; t += SUB) {
          const int64_t m = std::min(SUB, pc.t1 - t);
          const T* block = lp + pc.b * lat_b + t * lat_t;
          for (int64_t h = 0; h < H; ++h) {  // p = e / sum, rounded (a vector at a time)
            const float* e = sc + h * total + offset[pc.b] + t;
            const Vec vsum(sums[h]);
            for (int64_t j = 0; j < SUB; j += W) (Vec::loadu(e + j) / vsum).store(p.data() + h * SUB + j);
            round_block<T>(p.data() + h * SUB);  // (whole blocks: the values past m are unused or zeroed)
          }
#if defined(__AVX512BF16__)
          if (dots) {
            interleave(reinterpret_cast<const Bf*>(block), lat_t, m, r, pairs.data());
            for (int64_t h = 0; h < H; ++h) {  // past m: a zero row pairs with a zero probability
              for (int64_t j = m; j < SUB; ++j) p[h * SUB + j] = 0.f;
              pair_up(p.data() + h * SUB, pp.data() + h * SUB / 2);
            }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (tiles) {  // (the pairs past the block's rows zeroed: a zero probability times a zero row)
              std::fill(pairs.begin() + (m + 1) / 2 * per_pair, pairs.end(), _mm512_setzero_si512());
              context_tile(pairs.data(), per_pair, pp.data(), SUB / 2, acc, rc);
              continue;
            }
#endif
            const int64_t n = (m + 1) / 2;
            int64_t h = 0;
            for (; h + 2 <= H; h += 2) context_heads_bf<2>(pairs.data(), per_pair, n, pp.data() + h * SUB / 2, SUB / 2, acc + h * rc, rc);
            if (h < H) context_heads_bf<1>(pairs.data(), per_pair, n, pp.data() + h * SUB / 2, SUB / 2, acc + h * rc, rc);
            continue;
          }
#endif
          widen_rows<T>(block, lat_t, m, r, rows.data(), rp);
          int64_t h = 0;
          for (; h + 2 <= H; h += 2) context_heads<2>(rows.data(), rp, m, p.data() + h * SUB, SUB, acc + h * rp, rp, rp);
          if (h < H) context_heads<1>(rows.data(), rp, m, p.data() + h * SUB, SUB, acc + h * rp, rp, rp);
        }
      }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (tiles) _tile_release();
#endif
    });

    // the pieces' contexts summed and rounded, then through kv_b's value rows: a task per head and VALUE_SEQS
    // sequences, each value row widened once for them and dotted with each one's context in a chain of its own
    // (dots_of), so a sequence's values do not depend on the sequences beside it
    const int64_t chunks = (B + VALUE_SEQS - 1) / VALUE_SEQS;
    at::parallel_for(0, H * chunks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> cs(VALUE_SEQS * rc), tmp(rc);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t h = t / chunks, b0 = t % chunks * VALUE_SEQS, nb = std::min(VALUE_SEQS, B - b0);
        for (int64_t u = 0; u < nb; ++u) {
          float* c = cs.data() + u * rc;
          for (int64_t i = 0; i < rc; ++i) c[i] = 0.f;
          for (int64_t pi = first[b0 + u]; pi < first[b0 + u + 1]; ++pi) {
            const float* part = ctx + (pi * H + h) * rc;
            for (int64_t i = 0; i < rc; i += W) (Vec::loadu(c + i) + Vec::loadu(part + i)).store(c + i);
          }
#if defined(__AVX512BF16__)
          if (dots) {  // the accumulators' lanes back in the values' order
            for (int64_t i = 0; i < rc; ++i) tmp[natural(i)] = c[i];
            std::copy(tmp.begin(), tmp.end(), c);
          }
#endif
          k3::round_to<T>(c, r);
        }
        const T* w = vb + h * w_vb.stride(0);
        for (int64_t v = 0; v < dv; ++v) {
          float y[VALUE_SEQS];
          widen<T>(w + v * w_vb.stride(1), tmp.data(), r);
          dots_of(tmp.data(), cs.data(), rc, nb, r, y);
          for (int64_t u = 0; u < nb; ++u) op[((b0 + u) * H + h) * dv + v] = static_cast<T>(y[u]);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) {
  m.def("mla_decode(Tensor q, Tensor latent, Tensor lengths, Tensor w_kb, Tensor w_vb, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("mla_decode", &mla_decode); }
