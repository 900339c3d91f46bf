// The routed experts of a MoE block for the CPU, for any number of tokens (decode rows and prefill alike), with the
// expert weights packed as MXFP4 (K3's routed experts, never dequantized whole) or dense in the compute dtype (the
// dequantized twin, Kimi-Linear's experts). Routing and the shared experts stay outside: the router and the shared
// MLP read the block's input x, K3's routed experts read the latent z = W_down x, and each of those bytes is read
// once by whoever needs it.
//
// The (token, choice) pairs are sorted by expert, so each chosen expert's rows are read and widened once per call,
// however many tokens chose it. Phase 1 runs a task per (expert, HALF gate rows and the HALF matching up rows): the
// rows are widened to fp32 (mxfp4.h: per 32-group for packed rows) a chunk of inputs at a time, transposed into a
// panel, and multiplied with every pair's z (each loaded panel line serves a group of tokens); the activation (a
// value: SiLU or SiTU, chosen once per call) is written per pair. Phase 2 runs a task per block of ROWS2 output
// rows: each chosen expert's w2 rows are widened the same way and multiplied with its pairs' activations, then every
// token's outputs are combined in its top-k order.
//
// Roundings follow the torch references (kernels/moe.py): each projection's output, and the activation, round to
// the compute dtype; the weighted combine is fp32. Every output is one chain over its inputs in order (mxfp4.h's
// panel_fma: fp32 FMAs; with bf16 compute on CPUs with AVX-512 bf16, panel_dpbf16: vdpbf16ps over input pairs, what
// oneDNN's bf16 GEMM uses there), so a packed weight gives the same bits as its dequantization through this op, and
// a token the same bits whatever tokens came with it.
#include "vec.h"  // first: it names the CPU capability ATen's vector functions compile for

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "mxfp4.h"

namespace {

using k3::rnd;
using k3::Vec;

// Panel geometry (mxfp4.h): phase 1 widens HALF gate rows and the HALF matching up rows (RV1 vectors a line), phase 2
// ROWS2 output rows (RV2), a chunk of KB inputs at a time; GMAX* tokens share each loaded panel line (the FMA
// accumulators fill the registers). cpu_ops.moe_experts_scratch_bytes mirrors these sizes.
constexpr int RV1 = 4, RV2 = 2;
constexpr int64_t HALF = RV1 / 2 * k3::PANEL_LANES, ROWS1 = 2 * HALF, ROWS2 = RV2 * k3::PANEL_LANES, KB = 256;
#if K3_LANES == 16
constexpr int GMAX1 = 6, GMAX2 = 12;  // 24 accumulators of AVX-512's 32 registers
#elif defined(K3_LANES)
constexpr int GMAX1 = 2, GMAX2 = 6;  // 8 and 12 of AVX2's 16
#else
constexpr int GMAX1 = 4, GMAX2 = 4;
#endif
static_assert(k3::MX_GROUP % HALF == 0 && k3::MX_GROUP % ROWS2 == 0, "a packed task holds whole groups of rows");

// A task's rows (global row indices, -1 for a zero row) as a panel [kb][nrows] of their inputs k0 .. k0 + kb:
// each row widened into scratch [nrows][KB], then transposed.
template <typename Widen>
void rows_to_panel(const Widen& widen, const int64_t* ids, int64_t nrows, int64_t kb, float* panel, float* scratch) {
  for (int64_t j = 0; j < nrows; ++j) {
    float* dst = scratch + j * KB;
    if (ids[j] < 0)
      std::fill(dst, dst + kb, 0.f);
    else
      widen(ids[j], dst);
  }
  k3::transpose_rows(scratch, nrows, KB, kb, panel);
}

struct Packed {  // MXFP4 rows of n elements: n / 2 bytes and n / 32 scales each
  const uint8_t* q;
  const uint8_t* s;
  int64_t n;
  void panel(const int64_t* ids, int64_t nrows, int64_t k0, int64_t kb, float* out, float* scratch) const {
#if K3_LANES == 16
    fill16<false>(ids, nrows, k0, kb, out);
#else
    auto widen = [&](int64_t r, float* dst) {
      k3::widen_mxfp4(q + r * (n / 2) + k0 / 2, s + (r * n + k0) / k3::MX_GROUP, kb, dst);
    };
    rows_to_panel(widen, ids, nrows, kb, out, scratch);
#endif
  }
#if defined(__AVX512BF16__)
  void pairs(const int64_t* ids, int64_t nrows, int64_t k0, int64_t kb, uint32_t* out, float*) const {
    fill16<true>(ids, nrows, k0, kb, out);
  }
#endif
#if K3_LANES == 16
  template <bool PAIRS>  // straight into the panel, 16 rows at a time (packed tasks hold whole groups of rows: no -1)
  void fill16(const int64_t* ids, int64_t nrows, int64_t k0, int64_t kb, void* out) const {
    for (int64_t v = 0; v < nrows; v += 16) {
      const uint8_t *qr[16], *sr[16];
      for (int r = 0; r < 16; ++r) {
        qr[r] = q + ids[v + r] * (n / 2);
        sr[r] = s + ids[v + r] * (n / k3::MX_GROUP);
      }
      k3::widen_mxfp4_panel16<PAIRS>(qr, sr, k0, kb, static_cast<uint32_t*>(out) + v, nrows);
    }
  }
#endif
};

template <typename T>
struct Dense {
  const T* w;
  int64_t n;
  void panel(const int64_t* ids, int64_t nrows, int64_t k0, int64_t kb, float* out, float* scratch) const {
    rows_to_panel([&](int64_t r, float* dst) { k3::widen_row(w + r * n + k0, kb, dst); }, ids, nrows, kb, out, scratch);
  }
  void pairs(const int64_t* ids, int64_t nrows, int64_t k0, int64_t kb, uint32_t* out, float* scratch) const {
    float* fp32 = scratch + nrows * KB;  // the fp32 panel, then its pairs (kb even)
    panel(ids, nrows, k0, kb, fp32, scratch);
    k3::pack_pairs(fp32, kb, nrows, out);
  }
};

template <typename F>
void zip(float* a, const float* b, int64_t n, F f) {  // a = f(a, b) elementwise, a vector at a time
  for (int64_t j = 0; j < n; j += k3::W) {
    const int64_t m = std::min<int64_t>(k3::W, n - j);
    f(Vec::loadu(a + j, m), Vec::loadu(b + j, m)).store(a + j, m);
  }
}

// The activations, over n gate values g (overwritten with the result) and their up values u, both already rounded
// to the compute dtype; ATen's vector exp and tanh, as torch's own CPU kernels use.
template <typename T>
struct Silu {  // torch's F.silu(gate) * up in the compute dtype
  void operator()(float* g, const float* u, int64_t n) const {
    k3::vmap(g, n, [](Vec x) { return x / (Vec(1.0f) + x.neg().exp()); });
    k3::round_to<T>(g, n);
    zip(g, u, n, [](Vec a, Vec b) { return a * b; });
    k3::round_to<T>(g, n);
  }
};

template <typename T>
struct Situ {  // activation.py's SiTU: fp32, llama.cpp's operations in its order, rounded once
  float beta, inv, linear_beta, linear_inv;
  void operator()(float* g, const float* u, int64_t n) const {
    const Vec b(beta), i(inv), lb(linear_beta), li(linear_inv), one(1.0f);
    zip(g, u, n, [&](Vec x, Vec y) {
      return (x * i).tanh() * b * (one / (one + x.neg().exp())) * ((y * li).tanh() * lb);
    });
    k3::round_to<T>(g, n);
  }
};

// How a task's panel is stored and multiplied: fp32 lines and FMAs (any CPU, any compute dtype), or (PAIRS) bf16
// pairs and vdpbf16ps (bf16 compute on CPUs with AVX-512 bf16, even widths: half the instructions and the panel's
// bytes). X is the vectors' element (z and the activations), Line the panel's.
template <bool PAIRS>
struct Dots {
  using X = std::conditional_t<PAIRS, c10::BFloat16, float>;
  using Line = std::conditional_t<PAIRS, uint32_t, float>;
};

// acc [c][nrows] += the rows' products with c vectors of n inputs, a panel of KB inputs at a time
template <int RV, int GMAX, bool PAIRS, typename Rows>
void panel_products(const Rows& w, const int64_t* ids, int64_t nrows, const typename Dots<PAIRS>::X* const* vecs,
                    int64_t c, int64_t n, float* acc, std::vector<float>& scratch,
                    std::vector<typename Dots<PAIRS>::Line>& panel, std::vector<const void*>& x) {
  x.resize(c);
  for (int64_t k0 = 0; k0 < n; k0 += KB) {
    const int64_t kb = std::min(KB, n - k0);
    if constexpr (PAIRS)
      w.pairs(ids, nrows, k0, kb, panel.data(), scratch.data());
    else
      w.panel(ids, nrows, k0, kb, panel.data(), scratch.data());
    for (int64_t v = 0; v < c; ++v) x[v] = vecs[v] + k0;
    k3::in_groups<GMAX>(k3::PanelProducts<RV, PAIRS>{panel.data(), kb, x.data(), acc}, 0, c);
  }
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
  const int64_t N = p.N, k = p.k, Z = p.Z, E = p.E, I = p.I, P = N * k;
  const Pairs pairs = sort_pairs(p.ids, P, E);
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first of HALF gate rows), chosen experts only
  for (int64_t e = 0; e < E; ++e)
    if (pairs.start[e + 1] > pairs.start[e])
      for (int64_t i0 = 0; i0 < I; i0 += HALF) tasks.emplace_back(e, i0);
  std::vector<X> act(P * I);  // by slot
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * ROWS1 * KB), acc;
    std::vector<typename Dots<PAIRS>::Line> panel(KB * ROWS1);
    std::vector<const X*> vecs;
    std::vector<const void*> x;
    int64_t ids[ROWS1];
    for (int64_t t = begin; t < end; ++t) {
      const auto [e, i0] = tasks[t];
      const int64_t rb = std::min(HALF, I - i0), first = pairs.start[e], c = pairs.start[e + 1] - first;
      for (int64_t r = 0; r < HALF; ++r) {  // gate rows i0.., then the up rows I + i0..
        ids[r] = r < rb ? e * 2 * I + i0 + r : -1;
        ids[HALF + r] = r < rb ? e * 2 * I + I + i0 + r : -1;
      }
      vecs.resize(c);
      for (int64_t v = 0; v < c; ++v) vecs[v] = z + pairs.pair[first + v] / k * Z;
      acc.assign(c * ROWS1, 0.f);
      panel_products<RV1, GMAX1, PAIRS>(w13, ids, ROWS1, vecs.data(), c, Z, acc.data(), scratch, panel, x);
      k3::round_to<T>(acc.data(), c * ROWS1);  // the gate and up projections' outputs, as torch's GEMM rounds them
      for (int64_t v = 0; v < c; ++v) {
        float* gate = acc.data() + v * ROWS1;
        act_fn(gate, gate + HALF, rb);
        std::copy(gate, gate + rb, act.data() + (first + v) * I + i0);  // (values of T: exact in X)
      }
    }
  });
  at::parallel_for(0, (Z + ROWS2 - 1) / ROWS2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * ROWS2 * KB), y(P * ROWS2);
    std::vector<typename Dots<PAIRS>::Line> panel(KB * ROWS2);
    std::vector<const X*> vecs;
    std::vector<const void*> x;
    int64_t ids[ROWS2];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b * ROWS2, rb = std::min(ROWS2, Z - r0);
      std::fill(y.begin(), y.end(), 0.f);
      for (int64_t e = 0; e < E; ++e) {
        const int64_t first = pairs.start[e], c = pairs.start[e + 1] - first;
        if (!c) continue;
        for (int64_t r = 0; r < ROWS2; ++r) ids[r] = r < rb ? e * Z + r0 + r : -1;
        vecs.resize(c);
        for (int64_t v = 0; v < c; ++v) vecs[v] = act.data() + (first + v) * I;
        float* acc = y.data() + first * ROWS2;
        panel_products<RV2, GMAX2, PAIRS>(w2, ids, ROWS2, vecs.data(), c, I, acc, scratch, panel, x);
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

// The panel's form for this dtype and these widths (bf16 pairs where they apply), then run
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

template <typename F>
void dispatch(at::ScalarType dtype, F f) {  // the compute dtypes: f(a value of the type)
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "moe_experts: z in fp32, bf16 or fp16, not ", dtype);
  }
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
    dispatch(z.scalar_type(), [&](auto t) {
      with_act<decltype(t)>(p, z, r13, r2, act, beta, linear_beta);
    });
  } else {
    TORCH_CHECK(w13.scalar_type() == z.scalar_type() && w2.scalar_type() == z.scalar_type(),
                "moe_experts: dense weights in z's dtype");
    dispatch(z.scalar_type(), [&](auto t) {
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
