// MLA's absorbed decode for the CPU as one op, after the projection and the cache write: q_nope folded through
// kv_b's key rows, scores against the cached latent rows, softmax, the weighted latent, and kv_b's value rows. The
// torch path runs this as two bmm's around kernels/mla.py's mla_decode, about fifteen small ops a layer. Roundings
// follow the torch path: q_abs, the scores, the scaled scores, the probabilities, the context and the output each
// round to the compute dtype; sums and the softmax are fp32.
//
// Why it is laid out this way (docs/decode.md has the profile): at depth the op is all arithmetic over the rows,
// 2 x heads x (r + dr) multiply-adds a row, so it must run at the vector units' rate on both threads whatever the
// batch. Each sequence's rows are cut into pieces (up to 64 of 256 rows or more); a piece widens a few rows to fp32
// once and uses them for every head (rows read twice per layer, not twice per head), in register-blocked vector
// kernels (scores: 4 rows x 2 heads of dot products; context: 2 heads x 4 vectors of the latent). The softmax needs
// the whole row of scores before a probability is rounded, as torch's does, so the op runs in four passes: scores
// and each piece's maxima; exp and each piece's sums; the context of each piece; the pieces' contexts summed,
// rounded and taken through kv_b's value rows. Buffers are kept between calls (they only grow).
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>


namespace {

using k3::Vec;
using k3::W;

constexpr int64_t SUB = 32;  // rows widened to fp32 at a time (32 x 160 floats: 20 KiB, in L1); a multiple of 2 W
constexpr int64_t PIECE = 256;  // fewest rows a piece holds (fewer: the split costs more than it gains)
constexpr int64_t AHEAD = 2 * SUB;  // rows ahead of the one widened that are asked of the memory already
constexpr int64_t PIECES = 64;  // most pieces a sequence is cut into (their partial contexts are summed at the end)

inline int64_t pad(int64_t n) { return (n + W - 1) / W * W; }

inline float hsum(const Vec& v) { return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v); }

#if defined(CPU_CAPABILITY_AVX512)
// s[n] = hsum(a[n]) for 8 vectors at once, each summed by hsum's own tree (halves, quarters, pairs, lanes), so the
// values are bit for bit hsum's; about a third of the shuffles of eight separate reductions.
inline void hsum8(const Vec* a, float* s) {
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
    hsum8(&acc[0][0], s);
    return;
  }
#endif
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) s[i * C + c] = hsum(acc[i][c]);
}

template <int R>
inline void scores_rows(const float* rows, int64_t row_s, const float* q, int64_t q_s, int64_t K, int64_t H,
                        float* s, int64_t s_s) {  // s [H][s_s]: R rows' scores at each head's s[h * s_s ..]
  int64_t h = 0;
  float tmp[R * 2];
  for (; h + 2 <= H; h += 2) {
    scores_block<R, 2>(rows, row_s, q + h * q_s, q_s, K, tmp);
    for (int i = 0; i < R; ++i) s[h * s_s + i] = tmp[2 * i], s[(h + 1) * s_s + i] = tmp[2 * i + 1];
  }
  if (h < H) {
    scores_block<R, 1>(rows, row_s, q + h * q_s, q_s, K, tmp);
    for (int i = 0; i < R; ++i) s[h * s_s + i] = tmp[i];
  }
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

template <typename T>
float dot(const T* w, const float* x, int64_t n, float* tmp) {  // w . x in fp32, the weight widened a vector at a time
  widen<T>(w, tmp, n);
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + W <= n; j += W) acc = at::vec::fmadd(Vec::loadu(tmp + j), Vec::loadu(x + j), acc);
  float s = hsum(acc);
  for (; j < n; ++j) s += tmp[j] * x[j];
  return s;
}

struct Piece {
  int64_t b, t0, t1;
};

struct Buffers {  // kept between calls, grown when a call needs more
  std::vector<float> qc, scores, stat, ctx;
  template <typename V>
  static float* at_least(V& v, size_t n) {
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

  static thread_local Buffers buf;
  float* qc = Buffers::at_least(buf.qc, B * H * Kp);            // q_abs and q_pe per (sequence, head), padded
  float* sc = Buffers::at_least(buf.scores, H * total + SUB);   // [H][total]: scores, then exp (+ a block read past)
  float* stat = Buffers::at_least(buf.stat, 2 * P * H);         // per piece and head: its max, then its sum
  float* ctx = Buffers::at_least(buf.ctx, P * H * rp);          // per piece: [H][rp] partial contexts
  const float fscale = static_cast<float>(scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mla_decode", [&] {
    using T = scalar_t;
    const T* qp = q.data_ptr<T>();
    const T* lp = latent.data_ptr<T>();
    const T* kb = w_kb.data_ptr<T>();
    const T* vb = w_vb.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t lat_b = latent.stride(0), lat_t = latent.stride(1);

    // q_abs = W_kb^T q_nope (rounded), then q_pe: a row of W_kb at a time, vectorised over r
    at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> w(rp);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / H, h = task % H;
        const T* qh = qp + (b * H + h) * (dn + dr);
        float* out_q = qc + task * Kp;
        for (int64_t i = 0; i < Kp; ++i) out_q[i] = 0.f;
        for (int64_t j = 0; j < dn; ++j) {
          widen<T>(kb + h * w_kb.stride(0) + j * w_kb.stride(1), w.data(), r);
          const Vec qj(static_cast<float>(qh[j]));
          for (int64_t i = 0; i < rp; i += W) {
            const int64_t m = std::min<int64_t>(W, r - i);
            at::vec::fmadd(qj, Vec::loadu(w.data() + i, m), Vec::loadu(out_q + i, m)).store(out_q + i, m);
          }
        }
        k3::round_to<T>(out_q, r);
        for (int64_t i = 0; i < dr; ++i) out_q[r + i] = static_cast<float>(qh[dn + i]);
      }
    });

    // pass 1: scores [H][rows] of each piece, rounded as torch's, and the piece's maximum per head
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> rows(SUB * Kp), s(SUB * H);
      const Vec vscale(fscale);
      for (int64_t pi = begin; pi < end; ++pi) {
        const Piece pc = pieces[pi];
        const float* qb = qc + pc.b * H * Kp;
        float* top = stat + pi * H;
        for (int64_t h = 0; h < H; ++h) top[h] = -std::numeric_limits<float>::infinity();
        for (int64_t t = pc.t0; t < pc.t1; t += SUB) {
          const int64_t m = std::min(SUB, pc.t1 - t);
          widen_rows<T>(lp + pc.b * lat_b + t * lat_t, lat_t, m, K, rows.data(), Kp);
          int64_t i = 0;
          for (; i + 4 <= m; i += 4) scores_rows<4>(rows.data() + i * Kp, Kp, qb, Kp, Kp, H, s.data() + i, SUB);
          for (; i < m; ++i) scores_rows<1>(rows.data() + i * Kp, Kp, qb, Kp, Kp, H, s.data() + i, SUB);
          for (int64_t h = 0; h < H; ++h) {  // the score, then the scaled score, each rounded (a vector at a time)
            float* dst = sc + h * total + offset[pc.b] + t;
            float* x = s.data() + h * SUB;
            round_block<T>(x);
            for (int64_t j = 0; j < SUB; j += W) (Vec::loadu(x + j) * vscale).store(x + j);
            round_block<T>(x);
            float best = top[h];  // (a local: top[h] in memory would be stored back at every row)
            for (int64_t j = 0; j < m; ++j) dst[j] = x[j], best = std::max(best, x[j]);
            top[h] = best;
          }
        }
      }
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

    // pass 3: each piece's context [H][rp], with the probabilities rounded as torch's
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> rows(SUB * rp), p(H * SUB), sums(H);
      for (int64_t pi = begin; pi < end; ++pi) {
        const Piece pc = pieces[pi];
        float* acc = ctx + pi * H * rp;
        for (int64_t i = 0; i < H * rp; ++i) acc[i] = 0.f;
        for (int64_t h = 0; h < H; ++h) {
          float sum = 0.f;
          for (int64_t pj = first[pc.b]; pj < first[pc.b + 1]; ++pj) sum += stat[P * H + pj * H + h];
          sums[h] = sum;
        }
        for (int64_t t = pc.t0; t < pc.t1; t += SUB) {
          const int64_t m = std::min(SUB, pc.t1 - t);
          widen_rows<T>(lp + pc.b * lat_b + t * lat_t, lat_t, m, r, rows.data(), rp);
          for (int64_t h = 0; h < H; ++h) {  // p = e / sum, rounded (a vector at a time)
            const float* e = sc + h * total + offset[pc.b] + t;
            const Vec vsum(sums[h]);
            for (int64_t j = 0; j < SUB; j += W) (Vec::loadu(e + j) / vsum).store(p.data() + h * SUB + j);
            round_block<T>(p.data() + h * SUB);  // (whole blocks: the values past m are never used)
          }
          int64_t h = 0;
          for (; h + 2 <= H; h += 2) context_heads<2>(rows.data(), rp, m, p.data() + h * SUB, SUB, acc + h * rp, rp, rp);
          if (h < H) context_heads<1>(rows.data(), rp, m, p.data() + h * SUB, SUB, acc + h * rp, rp, rp);
        }
      }
    });

    // the pieces' contexts summed and rounded, then through kv_b's value rows
    at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> c(rp), tmp(rp);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / H, h = task % H;
        for (int64_t i = 0; i < rp; ++i) c[i] = 0.f;
        for (int64_t pi = first[b]; pi < first[b + 1]; ++pi) {
          const float* part = ctx + (pi * H + h) * rp;
          for (int64_t i = 0; i < rp; i += W) (Vec::loadu(c.data() + i) + Vec::loadu(part + i)).store(c.data() + i);
        }
        k3::round_to<T>(c.data(), r);
        const T* w = vb + h * w_vb.stride(0);
        T* o = op + task * dv;
        for (int64_t v = 0; v < dv; ++v) o[v] = static_cast<T>(dot<T>(w + v * w_vb.stride(1), c.data(), r, tmp.data()));
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
