// KDA's recurrent core for the CPU as one op: conv update + SiLU, l2norm, gate, beta, delta rule, output read and
// gated RMSNorm. The torch reference (kernels/kda_fused.py) runs a decode token as ~100 small ops per layer, each a
// dispatch and a parallel region; here every (sequence, head) is one task with its [d, d] state in cache.
// Prefill (kda_prefill) runs the same per-token update over a chunk inside each task: the state stays in cache for
// the whole chunk, which on a CPU is cheaper than the chunked (WY) form's many small matmuls and [C, C, d] decay
// tensors, and a prefill's states are bit-identical to decoding its tokens one by one, whatever the chunking.
// Each token reads and writes the state once: the pass that applies the previous token's rank-1 write k u^T also
// decays the state and takes S^T k and S^T q, and o = S^T q + u (k . q) follows without reading the state again.
// Roundings follow the reference: the conv sum rounds to the compute dtype, SiLU rounds again, all else is fp32;
// exp and log are ATen's vector functions (vec.h).

#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using k3::from_float;
using k3::round_to;
using k3::to_float;
using k3::vmap;
using k3::Vec;
using k3::W;

struct Head {  // one (sequence, head) task: its weights, its state, its scratch
  int64_t d, P, h, K;
  float a, eps, lower, l2eps;  // a = exp(A_log[h]); lower: the gate's form (kda.py's kda_gate), 0 softplus, < 0 K3's;
                              // l2eps: inside q's and k's l2 norm
  const float* wt;         // conv taps [K][3d] fp32, this head's channels
  const float* dt_bias;    // [P]
  const float* o_norm;     // [d]
  float* S;                // [d, d] fp32, key-major
  float* q, *k, *v, *g, *x, *o, *u, *kp, *up;  // d floats each; kp, up: the pending rank-1 write
  bool pending = false;
};

// The token's inputs: conv + SiLU of q, k, v (the window in `conv` shifts by one), l2norm, decay, gate sigmoid.
template <typename T>
float prepare(Head& s, const T* qkv, int64_t qkv_stride, T* conv, int64_t conv_row, const T* g_raw, const T* beta_raw,
              const T* gate) {
  const int64_t d = s.d, K1 = s.K - 1;
  for (int i = 0; i < 3; ++i) {
    float* y = i == 0 ? s.q : (i == 1 ? s.k : s.v);
    const float* w = s.wt + i * d;
    const T* in = qkv + i * qkv_stride + s.h * d;
    T* c = conv + i * s.P + s.h * d;
    to_float<T>(in, s.x, d);
    if (K1) {
      to_float<T>(c, y, d);
      for (int64_t j = 0; j < d; ++j) y[j] *= w[j];
    } else {
      for (int64_t j = 0; j < d; ++j) y[j] = s.x[j] * w[j];
    }
    for (int64_t t = 1; t < K1; ++t) {
      to_float<T>(c + t * conv_row, s.o, d);
      const float* wt = w + t * 3 * d;
      for (int64_t j = 0; j < d; ++j) y[j] += s.o[j] * wt[j];
    }
    if (K1) {
      const float* wl = w + K1 * 3 * d;
      for (int64_t j = 0; j < d; ++j) y[j] += s.x[j] * wl[j];
    }
    for (int64_t t = 0; t + 1 < K1; ++t) std::copy(c + (t + 1) * conv_row, c + (t + 1) * conv_row + d, c + t * conv_row);
    if (K1) std::copy(in, in + d, c + (K1 - 1) * conv_row);
  }
  for (float* y : {s.q, s.k, s.v}) {  // SiLU of the rounded sum, rounded again
    round_to<T>(y, d);
    vmap(y, d, [](Vec r) { return r / (Vec(1.0f) + r.neg().exp()); });
    round_to<T>(y, d);
  }
  float qq = 0.f, kk = 0.f;
  for (int64_t j = 0; j < d; ++j) {
    qq += s.q[j] * s.q[j];
    kk += s.k[j] * s.k[j];
  }
  const float qs = (1.0f / std::sqrt(qq + s.l2eps)) * (1.0f / std::sqrt(static_cast<float>(d)));
  const float ks = 1.0f / std::sqrt(kk + s.l2eps);
  to_float<T>(g_raw + s.h * d, s.g, d);
  to_float<T>(gate + s.h * d, s.x, d);
  for (int64_t j = 0; j < d; ++j) {
    s.q[j] *= qs;
    s.k[j] *= ks;
    s.g[j] += s.dt_bias[s.h * d + j];
  }
  const Vec one(1.0f);
  if (s.lower < 0.0f) {  // K3: decay = exp(lower * sigmoid(a z)), never below exp(lower)
    const Vec a(s.a), lower(s.lower);
    vmap(s.g, d, [&](Vec z) { return (lower * (one / (one + (a * z).neg().exp()))).exp(); });
  } else {  // Kimi-Linear: decay = exp(-a * softplus(z)), softplus as transformers writes it
    const Vec twenty(20.0f), neg_a(-s.a);
    vmap(s.g, d, [&](Vec z) { return (neg_a * Vec::blendv((one + z.exp()).log(), z, z > twenty)).exp(); });
  }
  vmap(s.x, d, [&](Vec z) { return one / (one + z.neg().exp()); });
  return 1.0f / (1.0f + std::exp(-static_cast<float>(beta_raw[s.h])));
}

// One block of `NB` vectors of state columns [j0, j0 + NB W): every row decays after the pending write, and the
// block's S^T k and S^T q accumulate in registers.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;  // raw registers: the accumulators stay in them (ATen's wrapper class made GCC spill them)
inline Reg reg_load(const float* p) { return _mm512_loadu_ps(p); }
inline void reg_store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
inline Reg reg_set(float x) { return _mm512_set1_ps(x); }
inline Reg reg_fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline Reg reg_mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
#else
using Reg = Vec;
inline Reg reg_load(const float* p) { return Vec::loadu(p); }
inline void reg_store(float* p, Reg v) { v.store(p); }
inline Reg reg_set(float x) { return Vec(x); }
inline Reg reg_fma(Reg a, Reg b, Reg c) { return at::vec::fmadd(a, b, c); }
inline Reg reg_mul(Reg a, Reg b) { return a * b; }
#endif

template <int NB, bool PENDING>
inline void delta_block(const Head& s, int64_t j0, float* __restrict acc) {
  const int64_t d = s.d;  // locals: the stores into the state must not make the compiler reload these
  float* __restrict S = s.S + j0;
  const float* __restrict g = s.g;
  const float* __restrict k = s.k;
  const float* __restrict q = s.q;
  const float* __restrict kp = s.kp;
  Reg a[NB], oq[NB], up[NB];
  for (int b = 0; b < NB; ++b) {
    a[b] = oq[b] = reg_set(0.0f);
    up[b] = PENDING ? reg_load(s.up + j0 + b * W) : reg_set(0.0f);
  }
  for (int64_t r = 0; r < d; ++r) {
    float* row = S + r * d;
    const Reg dec = reg_set(g[r]), kr = reg_set(k[r]), qr = reg_set(q[r]), kpr = reg_set(PENDING ? kp[r] : 0.0f);
    for (int b = 0; b < NB; ++b) {
      Reg w = reg_load(row + b * W);
      if (PENDING) w = reg_fma(kpr, up[b], w);
      w = reg_mul(w, dec);
      reg_store(row + b * W, w);
      a[b] = reg_fma(kr, w, a[b]);
      oq[b] = reg_fma(qr, w, oq[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    reg_store(acc + j0 + b * W, a[b]);
    reg_store(s.o + j0 + b * W, oq[b]);
  }
}

template <bool PENDING>
void delta_columns(Head& s, float* acc) {
  constexpr int NB = 4;
  int64_t j0 = 0;
  for (; j0 + NB * W <= s.d; j0 += NB * W) delta_block<NB, PENDING>(s, j0, acc);
  for (; j0 + W <= s.d; j0 += W) delta_block<1, PENDING>(s, j0, acc);
  for (int64_t j = j0; j < s.d; ++j) {  // the last columns, one at a time, with the same fused products
    float aj = 0.f, oj = 0.f;
    for (int64_t r = 0; r < s.d; ++r) {
      float& x = s.S[r * s.d + j];
      const float w = (PENDING ? std::fma(s.kp[r], s.up[j], x) : x) * s.g[r];
      x = w;
      aj = std::fma(s.k[r], w, aj);
      oj = std::fma(s.q[r], w, oj);
    }
    acc[j] = aj;
    s.o[j] = oj;
  }
}

// The delta rule for one token, reading the state once; its own write k u^T is left pending for the next pass.
void delta(Head& s, float beta) {
  const int64_t d = s.d;
  float* acc = s.x + d;  // S^T k
  if (s.pending) {
    delta_columns<true>(s, acc);
  } else {
    delta_columns<false>(s, acc);
  }
  float kq = 0.f;
  for (int64_t j = 0; j < d; ++j) kq += s.k[j] * s.q[j];
  for (int64_t j = 0; j < d; ++j) {
    s.u[j] = beta * (s.v[j] - acc[j]);
    s.o[j] += kq * s.u[j];
  }
  std::swap(s.k, s.kp);  // this token's k and u become the pending write
  std::swap(s.u, s.up);
  s.pending = true;
}

void flush(Head& s) {  // apply the pending write: the state after the last token
  if (!s.pending) return;
  for (int64_t r = 0; r < s.d; ++r) {
    float* row = s.S + r * s.d;
    const float kp = s.kp[r];
    for (int64_t j = 0; j < s.d; ++j) row[j] = std::fma(kp, s.up[j], row[j]);  // as delta's pending write
  }
  s.pending = false;
}

template <typename T>
void finish(Head& s, T* out) {  // gated RMSNorm of o into the output row
  const int64_t d = s.d;
  float ms = 0.f;
  for (int64_t j = 0; j < d; ++j) ms += s.o[j] * s.o[j];
  const float inv = 1.0f / std::sqrt(ms / static_cast<float>(d) + s.eps);
  for (int64_t j = 0; j < d; ++j) s.o[j] = s.o[j] * inv * s.o_norm[j] * s.x[j];
  from_float<T>(s.o, out + s.h * d, d);
}

// qkv [B, T, 3, P] (tokens [3, P] contiguous); g_raw, gate [B, T, P]; beta_raw [B, T, H]; conv_state [B, K-1, 3P];
// state [B, H, d, d] fp32. Returns [B, T, P].
at::Tensor kda_run(const at::Tensor& qkv, at::Tensor& conv_state, const at::Tensor& conv_w, const at::Tensor& g_raw,
                   const at::Tensor& beta_raw, const at::Tensor& gate, const at::Tensor& A_log,
                   const at::Tensor& dt_bias, const at::Tensor& o_norm, double eps, double lower, double l2_eps, at::Tensor& state) {
  const int64_t B = qkv.size(0), T = qkv.size(1), P = qkv.size(3), H = beta_raw.size(-1), d = P / H;
  const int64_t K = conv_w.size(-1);
  TORCH_CHECK(qkv.stride(3) == 1 && qkv.stride(2) == P, "kda: qkv tokens must be [3, P] contiguous");
  TORCH_CHECK(conv_state.is_contiguous() && state.is_contiguous() && conv_w.is_contiguous(), "kda: layout");
  TORCH_CHECK(g_raw.stride(-1) == 1 && gate.stride(-1) == 1 && beta_raw.stride(-1) == 1, "kda: layout");
  TORCH_CHECK(state.scalar_type() == at::kFloat && A_log.scalar_type() == at::kFloat, "kda: fp32 state");
  const auto as_float = [](const at::Tensor& t) {  // (K3 keeps both in fp32: no conversion a call)
    return t.scalar_type() == at::kFloat ? t.contiguous() : t.contiguous().to(at::kFloat);
  };
  auto dt = as_float(dt_bias);
  auto alog = A_log.contiguous();
  auto onorm = as_float(o_norm);
  auto out = at::empty({B, T, P}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "kda", [&] {
    using T_ = scalar_t;
    const T_* qkv_p = qkv.data_ptr<T_>();
    T_* conv_p = conv_state.data_ptr<T_>();
    const T_* w_p = conv_w.data_ptr<T_>();
    const T_* g_p = g_raw.data_ptr<T_>();
    const T_* b_p = beta_raw.data_ptr<T_>();
    const T_* gate_p = gate.data_ptr<T_>();
    T_* out_p = out.data_ptr<T_>();
    const int64_t conv_row = 3 * P, conv_b = (K - 1) * conv_row;
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(10 * d), wt(3 * d * K);
      for (int64_t task = begin; task < end; ++task) {  // heads touch disjoint conv channels: shifted in place
        const int64_t b = task / H, h = task % H;
        for (int i = 0; i < 3; ++i)  // conv_w [3P, K] -> taps [K][3d]: each tap a contiguous row
          for (int64_t j = 0; j < d; ++j)
            for (int64_t t = 0; t < K; ++t)
              wt[t * 3 * d + i * d + j] = static_cast<float>(w_p[(i * P + h * d + j) * K + t]);
        float* f = buf.data();
        Head s{d, P, h, K, std::exp(alog.data_ptr<float>()[h]), static_cast<float>(eps), static_cast<float>(lower), static_cast<float>(l2_eps),
               wt.data(), dt.data_ptr<float>(), onorm.data_ptr<float>(), state.data_ptr<float>() + (b * H + h) * d * d,
               f, f + d, f + 2 * d, f + 3 * d, f + 4 * d, f + 6 * d, f + 7 * d, f + 8 * d, f + 9 * d};
        for (int64_t t = 0; t < T; ++t) {
          const float beta = prepare<T_>(s, qkv_p + b * qkv.stride(0) + t * qkv.stride(1), qkv.stride(2),
                                         conv_p + b * conv_b, conv_row, g_p + b * g_raw.stride(0) + t * g_raw.stride(1),
                                         b_p + b * beta_raw.stride(0) + t * beta_raw.stride(1),
                                         gate_p + b * gate.stride(0) + t * gate.stride(1));
          delta(s, beta);
          finish<T_>(s, out_p + (b * T + t) * P);
        }
        flush(s);
      }
    });
  });
  return out;
}

at::Tensor kda_decode(const at::Tensor& qkv, at::Tensor conv_state, const at::Tensor& conv_w, const at::Tensor& g_raw,
                      const at::Tensor& beta_raw, const at::Tensor& gate, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& o_norm, double eps, double lower, double l2_eps, at::Tensor state) {
  return kda_run(qkv.unsqueeze(1), conv_state, conv_w, g_raw.unsqueeze(1), beta_raw.unsqueeze(1), gate.unsqueeze(1),
                 A_log, dt_bias, o_norm, eps, lower, l2_eps, state)
      .squeeze(1);
}

at::Tensor kda_prefill(const at::Tensor& qkv, at::Tensor conv_state, const at::Tensor& conv_w, const at::Tensor& g_raw,
                       const at::Tensor& beta_raw, const at::Tensor& gate, const at::Tensor& A_log,
                       const at::Tensor& dt_bias, const at::Tensor& o_norm, double eps, double lower, double l2_eps,
                       at::Tensor state) {
  return kda_run(qkv, conv_state, conv_w, g_raw, beta_raw, gate, A_log, dt_bias, o_norm, eps, lower, l2_eps, state);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) {
  m.def(
      "kda_decode(Tensor qkv, Tensor(a!) conv_state, Tensor conv_w, Tensor g_raw, Tensor beta_raw, Tensor gate, "
      "Tensor A_log, Tensor dt_bias, Tensor o_norm, float eps, float lower, float l2_eps, Tensor(b!) state) -> Tensor");
  m.def(
      "kda_prefill(Tensor qkv, Tensor(a!) conv_state, Tensor conv_w, Tensor g_raw, Tensor beta_raw, Tensor gate, "
      "Tensor A_log, Tensor dt_bias, Tensor o_norm, float eps, float lower, float l2_eps, Tensor(b!) state) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3dist, CPU, m) {
  m.impl("kda_decode", &kda_decode);
  m.impl("kda_prefill", &kda_prefill);
}
