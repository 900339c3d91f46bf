// The routed experts of a MoE block for the CPU, for any number of tokens (decode rows and prefill alike), with the
// expert weights packed as MXFP4 (K3's routed experts, never dequantized whole) or dense in the compute dtype (the
// dequantized twin, Kimi-Linear's experts). Routing and the shared experts stay outside: the router and the shared
// MLP read the block's input x, K3's routed experts read the latent z = W_down x, and each of those bytes is read
// once by whoever needs it.
//
// The (token, choice) pairs are sorted by expert, so each chosen expert's rows are read and widened once per call,
// however many tokens chose it. Phase 1 runs a task per (expert, HALF gate rows and the HALF matching up rows): each
// row is widened whole into a small buffer (mxfp4.h: bf16 pairs or fp32; a dense row in the dot's form is read in
// place), then multiplied with every pair's z, a block of rows by a group of tokens at a time (each loaded line of a
// row serves the group); where an expert has at most one group of tokens, packed rows go into the dots as they are,
// widened a group of 32 at a time in registers (the same sums in the same order); the activation (a value: SiLU or SiTU, chosen once per call) is written per pair. Phase 2
// runs a task per block of ROWS2 output rows: each chosen expert's w2 rows are widened the same way and multiplied
// with its pairs' activations, then every token's outputs are combined in its top-k order.
//
// Roundings follow the torch references (kernels/moe.py): each projection's output, and the activation, round to
// the compute dtype; the weighted combine is fp32. Every output is one dot product summed in a fixed way (mxfp4.h's
// dots_f32: fp32 FMA lanes, then the lanes added; with bf16 compute on CPUs with AVX-512 bf16, dots_pairs: vdpbf16ps
// over input pairs, the instruction oneDNN's bf16 GEMM uses there), so a packed weight gives the same bits as its
// dequantization through this op, and a token the same bits whatever tokens came with it. The sum's order is not
// the references', so the op agrees with them to rounding.
#include "vec.h"  // first: it names the CPU capability ATen's vector functions compile for

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "act.h"
#include "mxfp4.h"

namespace {

using k3::rnd;
using k3::Silu;
using k3::Situ;
using k3::Vec;

// Geometry: phase 1 widens HALF gate rows and the HALF matching up rows per task, phase 2 ROWS2 output rows per
// expert; the dots run RB rows by up to GB tokens (the accumulators fill the registers). cpu_ops.moe_experts_scratch_
// bytes mirrors these sizes.
constexpr int64_t HALF = 16, ROWS1 = 2 * HALF, ROWS2 = 32, MOST_ROWS = std::max(ROWS1, ROWS2);
#if K3_LANES == 16
constexpr int RB = 4, GB = 6;  // 24 accumulators of AVX-512's 32 registers
#elif defined(K3_LANES)
constexpr int RB = 2, GB = 4;  // 8 of AVX2's 16
#else
constexpr int RB = 2, GB = 2;
#endif

// How a row is dotted: fp32 lines and FMAs (any CPU, any compute dtype), or (PAIRS) bf16 pairs and vdpbf16ps (bf16
// compute on CPUs with AVX-512 bf16, even widths: half the instructions and the lines' bytes). X is the vectors'
// element (z and the activations), Line a widened row's.
template <bool PAIRS>
struct Dots {
  using X = std::conditional_t<PAIRS, c10::BFloat16, float>;
  using Line = std::conditional_t<PAIRS, uint32_t, float>;
  static constexpr int64_t per = PAIRS ? 2 : 1;  // inputs a line element holds
};

struct Packed {  // MXFP4 rows of n elements: n / 2 bytes and n / 32 scales each
  const uint8_t* q;
  const uint8_t* s;
  int64_t n;
  const uint8_t* codes(int64_t r) const { return q + r * (n / 2); }
  const uint8_t* scales(int64_t r) const { return s + r * (n / k3::MX_GROUP); }
  template <bool PAIRS>
  const typename Dots<PAIRS>::Line* row(int64_t r, typename Dots<PAIRS>::Line* buf) const {
    const uint8_t *qr = codes(r), *sr = scales(r);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (PAIRS) {
      k3::widen_mxfp4_pairs(qr, sr, n, buf);
      return buf;
    }
#endif
    if constexpr (!PAIRS) k3::widen_mxfp4(qr, sr, n, buf);
    return buf;
  }
};

template <typename T>
struct Dense {  // rows of n elements in the compute dtype
  const T* w;
  int64_t n;
  template <bool PAIRS>
  const typename Dots<PAIRS>::Line* row(int64_t r, typename Dots<PAIRS>::Line* buf) const {
    if constexpr (PAIRS) {  // bf16 rows are bf16 pairs already
      static_assert(std::is_same_v<T, c10::BFloat16>, "pairs are bf16");
      return reinterpret_cast<const uint32_t*>(w + r * n);
    } else if constexpr (std::is_same_v<T, float>) {
      return w + r * n;
    } else {
      k3::widen_row(w + r * n, n, buf);
      return buf;
    }
  }
};

// out[g * ld + r] = row r . x[g] for nr rows and c vectors: RB rows by GB vectors at a time, the rest in smaller
// blocks (the same sums: mxfp4.h's dots sum each output alone); D::block<R, G>(r0, g0) runs one block
template <typename D>
struct Blocked {
  template <int G>
  void run(int64_t g0, int64_t nr) const {
    const D& d = static_cast<const D&>(*this);
    int64_t r0 = 0;
    for (; r0 + RB <= nr; r0 += RB) d.template block<RB, G>(r0, g0);
    for (; r0 < nr; ++r0) d.template block<1, G>(r0, g0);
  }
  void operator()(int64_t nr, int64_t c) const {
    int64_t g0 = 0;
    for (; g0 + GB <= c; g0 += GB) run<GB>(g0, nr);
    for (; g0 + 2 <= c; g0 += 2) run<2>(g0, nr);
    for (; g0 < c; ++g0) run<1>(g0, nr);
  }
};

// rows widened (or read in place) beforehand, n inputs each
template <bool PAIRS>
struct RowDots : Blocked<RowDots<PAIRS>> {
  const typename Dots<PAIRS>::Line* const* rows;
  const typename Dots<PAIRS>::X* const* x;
  int64_t n;
  float* out;
  int64_t ld;
  template <int R, int G>
  void block(int64_t r0, int64_t g0) const {
    using Line = typename Dots<PAIRS>::Line;
    const Line* const* xs = reinterpret_cast<const Line* const*>(x + g0);
    float* o = out + g0 * ld + r0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (PAIRS) return k3::dots_pairs<R, G>(rows + r0, xs, n / 2, o, ld);
#endif
    if constexpr (!PAIRS) k3::dots_f32<R, G>(rows + r0, xs, n, o, ld);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// MXFP4 rows (codes and scales) of n elements, widened group by group inside the dots (mxfp4.h's
// dots_mxfp4_pairs: the same sums as RowDots over the widened rows). For at most GB vectors, where each widened row
// would serve one block of vectors only: the row's bf16 pairs never go through memory.
struct PackedDots : Blocked<PackedDots> {
  const uint8_t* const* q;
  const uint8_t* const* s;
  const c10::BFloat16* const* x;
  int64_t n;
  float* out;
  int64_t ld;
  template <int R, int G>
  void block(int64_t r0, int64_t g0) const {
    const uint32_t* const* xs = reinterpret_cast<const uint32_t* const*>(x + g0);
    k3::dots_mxfp4_pairs<R, G>(q + r0, s + r0, xs, n, out + g0 * ld + r0, ld);
  }
};
#endif

// Rows `ids` of w (nr of them) by the c vectors x, into out [c][ld]: MXFP4 rows straight into the dots for bf16 pairs
// and at most GB vectors, else each row widened into buf first (or read in place)
template <bool PAIRS, typename Rows, typename X>
void dots_of_rows(const Rows& w, const int64_t* ids, int64_t nr, const X* const* x, int64_t c, int64_t n,
                  typename Dots<PAIRS>::Line* buf, float* out, int64_t ld) {
  using Line = typename Dots<PAIRS>::Line;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<Rows, Packed> && PAIRS) {
    if (c <= GB) {
      const uint8_t *q[MOST_ROWS], *s[MOST_ROWS];
      for (int64_t r = 0; r < nr; ++r) q[r] = w.codes(ids[r]), s[r] = w.scales(ids[r]);
      return PackedDots{{}, q, s, x, n, out, ld}(nr, c);
    }
  }
#endif
  const Line* rows[MOST_ROWS];
  for (int64_t r = 0; r < nr; ++r) rows[r] = w.template row<PAIRS>(ids[r], buf + r * (n / Dots<PAIRS>::per));
  RowDots<PAIRS>{{}, rows, x, n, out, ld}(nr, c);
}

struct Pairs {  // the (token, choice) pairs sorted by expert, stably
  std::vector<int64_t> start;  // [E + 1]: expert e's pairs are sorted slots start[e] .. start[e + 1] - 1
  std::vector<int64_t> pair;   // slot -> pair (token * k + choice)
  std::vector<int64_t> slot;   // pair -> slot
};

Pairs sort_pairs(const int64_t* ids, int64_t P, int64_t E) {
  Pairs s{std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(P), std::vector<int64_t>(P)};
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "moe_experts: expert id ", ids[p], " outside [0, ", E, ")");
    ++s.start[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) s.start[e + 1] += s.start[e];
  std::vector<int64_t> next(s.start.begin(), s.start.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    s.slot[p] = next[ids[p]]++;
    s.pair[s.slot[p]] = p;
  }
  return s;
}

struct Problem {  // one call's routing and sizes
  const int64_t* ids;
  const float* weights;
  int64_t N, k, Z, E, I;
  float* out;
};

template <typename T, bool PAIRS, typename Rows, typename Act>
void run(const Problem& p, const typename Dots<PAIRS>::X* z, const Rows& w13, const Rows& w2, const Act& act_fn) {
  using X = typename Dots<PAIRS>::X;
  using Line = typename Dots<PAIRS>::Line;
  const int64_t N = p.N, k = p.k, Z = p.Z, E = p.E, I = p.I, P = N * k;
  const Pairs pairs = sort_pairs(p.ids, P, E);
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first of HALF gate rows), chosen experts only
  for (int64_t e = 0; e < E; ++e)
    if (pairs.start[e + 1] > pairs.start[e])
      for (int64_t i0 = 0; i0 < I; i0 += HALF) tasks.emplace_back(e, i0);
  std::vector<X> act(P * I);  // by slot
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<Line> buf(ROWS1 * Z / Dots<PAIRS>::per);
    std::vector<float> acc;
    std::vector<const X*> vecs;
    int64_t ids[ROWS1];
    for (int64_t t = begin; t < end; ++t) {
      const auto [e, i0] = tasks[t];
      const int64_t rb = std::min(HALF, I - i0), first = pairs.start[e], c = pairs.start[e + 1] - first;
      for (int64_t r = 0; r < 2 * rb; ++r) ids[r] = e * 2 * I + (r < rb ? i0 + r : I + i0 + r - rb);  // gate, up
      vecs.resize(c);
      for (int64_t v = 0; v < c; ++v) vecs[v] = z + pairs.pair[first + v] / k * Z;
      acc.resize(c * ROWS1);
      dots_of_rows<PAIRS>(w13, ids, 2 * rb, vecs.data(), c, Z, buf.data(), acc.data(), ROWS1);
      for (int64_t v = 0; v < c; ++v) {
        float* gate = acc.data() + v * ROWS1;
        k3::round_to<T>(gate, 2 * rb);  // the gate and up projections' outputs, as torch's GEMM rounds them
        act_fn(gate, gate + rb, rb);
        std::copy(gate, gate + rb, act.data() + (first + v) * I + i0);  // (values of T: exact in X)
      }
    }
  });
  at::parallel_for(0, (Z + ROWS2 - 1) / ROWS2, 1, [&](int64_t begin, int64_t end) {
    std::vector<Line> buf(ROWS2 * I / Dots<PAIRS>::per);
    std::vector<float> y(P * ROWS2);
    std::vector<const X*> vecs;
    int64_t ids[ROWS2];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b * ROWS2, rb = std::min(ROWS2, Z - r0);
      for (int64_t e = 0; e < E; ++e) {
        const int64_t first = pairs.start[e], c = pairs.start[e + 1] - first;
        if (!c) continue;
        for (int64_t r = 0; r < rb; ++r) ids[r] = e * Z + r0 + r;
        vecs.resize(c);
        for (int64_t v = 0; v < c; ++v) vecs[v] = act.data() + (first + v) * I;
        dots_of_rows<PAIRS>(w2, ids, rb, vecs.data(), c, I, buf.data(), y.data() + first * ROWS2, ROWS2);
      }
      for (int64_t n = 0; n < N; ++n) {  // the fp32 combine, in each token's top-k order
        for (int64_t r = 0; r < rb; ++r) {
          float acc = 0.f;
          for (int64_t j = 0; j < k; ++j) acc += rnd<T>(y[pairs.slot[n * k + j] * ROWS2 + r]) * p.weights[n * k + j];
          p.out[n * Z + r0 + r] = acc;
        }
      }
    }
  });
}

// The dots' form for this dtype and these widths (bf16 pairs where they apply), then run
template <typename T, typename Rows, typename Act>
void with_dots(const Problem& p, const at::Tensor& z, const Rows& w13, const Rows& w2, const Act& act_fn) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (p.Z % 2 == 0 && p.I % 2 == 0) {
      auto zc = z.contiguous();
      return run<T, true>(p, zc.data_ptr<c10::BFloat16>(), w13, w2, act_fn);
    }
  }
#endif
  auto zf = z.to(at::kFloat).contiguous();
  run<T, false>(p, zf.data_ptr<float>(), w13, w2, act_fn);
}

template <typename T, typename Rows>
void with_act(const Problem& p, const at::Tensor& z, const Rows& w13, const Rows& w2, int64_t act, double beta,
              double linear_beta) {
  if (act == 0) return with_dots<T>(p, z, w13, w2, Silu<T>{});
  TORCH_CHECK(act == 1 && beta > 0 && linear_beta > 0, "moe_experts: act 0 (SiLU) or 1 (SiTU, positive betas)");
  const float b = static_cast<float>(beta), lb = static_cast<float>(linear_beta);
  with_dots<T>(p, z, w13, w2, Situ<T>{b, 1.0f / b, lb, 1.0f / lb});
}

at::Tensor moe_experts(const at::Tensor& z, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
                       const std::optional<at::Tensor>& w13_scale, const at::Tensor& w2,
                       const std::optional<at::Tensor>& w2_scale, int64_t act, double beta, double linear_beta) {
  TORCH_CHECK(z.dim() == 2 && ids.dim() == 2 && ids.size(0) == z.size(0), "moe_experts: z [N, Z], ids [N, k]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat,
              "moe_experts: int64 ids, fp32 weights");
  TORCH_CHECK(weights.sizes() == ids.sizes(), "moe_experts: weights [N, k] as ids");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous(), "moe_experts: weights");
  const bool packed = w13_scale.has_value();
  TORCH_CHECK(packed == w2_scale.has_value(), "moe_experts: both projections packed, or neither");
  const int64_t N = z.size(0), k = ids.size(1), Z = z.size(1), E = w13.size(0), I = w13.size(1) / 2;
  const int64_t per = packed ? 2 : 1;  // stored elements per byte
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) * per == Z, "moe_experts: w13 [E, 2I, Z] (packed: Z / 2)");
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == Z && w2.size(2) * per == I, "moe_experts: w2 [E, Z, I] (packed: I / 2)");
  auto out = at::empty({N, Z}, z.options().dtype(at::kFloat));
  if (N == 0) return out;
  auto id = ids.contiguous();
  auto wt = weights.contiguous();
  const Problem p{id.data_ptr<int64_t>(), wt.data_ptr<float>(), N, k, Z, E, I, out.data_ptr<float>()};
  if (packed) {
    const at::Tensor &s13 = *w13_scale, &s2 = *w2_scale;
    TORCH_CHECK(w13.scalar_type() == at::kByte && w2.scalar_type() == at::kByte, "moe_experts: packed weights uint8");
    TORCH_CHECK(Z % k3::MX_GROUP == 0 && I % k3::MX_GROUP == 0, "moe_experts: MXFP4 rows in whole groups of 32");
    const bool s13_ok = s13.scalar_type() == at::kByte && s13.sizes() == at::IntArrayRef({E, 2 * I, Z / 32});
    const bool s2_ok = s2.scalar_type() == at::kByte && s2.sizes() == at::IntArrayRef({E, Z, I / 32});
    TORCH_CHECK(s13_ok && s13.is_contiguous(), "moe_experts: w13_scale uint8 [E, 2I, Z / 32], contiguous");
    TORCH_CHECK(s2_ok && s2.is_contiguous(), "moe_experts: w2_scale uint8 [E, Z, I / 32], contiguous");
    const Packed r13{w13.data_ptr<uint8_t>(), s13.data_ptr<uint8_t>(), Z};
    const Packed r2{w2.data_ptr<uint8_t>(), s2.data_ptr<uint8_t>(), I};
    k3::by_compute_dtype(z.scalar_type(), "moe_experts: z", [&](auto t) {
      with_act<decltype(t)>(p, z, r13, r2, act, beta, linear_beta);
    });
  } else {
    TORCH_CHECK(w13.scalar_type() == z.scalar_type() && w2.scalar_type() == z.scalar_type(),
                "moe_experts: dense weights in z's dtype");
    k3::by_compute_dtype(z.scalar_type(), "moe_experts: z", [&](auto t) {
      using T = decltype(t);
      const Dense<T> r13{w13.data_ptr<T>(), Z}, r2{w2.data_ptr<T>(), I};
      with_act<T>(p, z, r13, r2, act, beta, linear_beta);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) {
  m.def(
      "moe_experts(Tensor z, Tensor ids, Tensor weights, Tensor w13, Tensor? w13_scale, Tensor w2, Tensor? w2_scale, "
      "int act, float beta, float linear_beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("moe_experts", &moe_experts); }
