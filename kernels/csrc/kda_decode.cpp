// KDA's recurrent decode core for the CPU as one op: conv update + SiLU, l2norm, gate, beta, delta rule, output
// read and gated RMSNorm. The torch reference (kernels/kda_fused.py) runs this as ~100 small ops per layer, each a
// dispatch and a parallel region; here every (sequence, head) is one task with its [d, d] state in cache.
// Roundings follow the reference: the conv sum rounds to the compute dtype, SiLU rounds again, all else is fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "gemv.h"

namespace {

using k3::rnd;

template <typename T>
void kda_head(const T* qkv, int64_t qkv_stride1, T* conv, int64_t conv_row, const T* conv_w, int64_t K,
              const T* g_raw, const T* beta_raw, const T* gate, float a, const float* dt_bias, const float* o_norm,
              float eps, float* S, int64_t d, int64_t P, int64_t h, T* out, float* buf) {
  float* q = buf;
  float* k = buf + d;
  float* v = buf + 2 * d;
  float* g = buf + 3 * d;
  float* u = buf + 4 * d;
  float* o = buf + 5 * d;
  const int64_t K1 = K - 1;
  for (int i = 0; i < 3; ++i) {  // conv + SiLU over this head's q, k, v channels; the window shifts by one
    float* dst = i == 0 ? q : (i == 1 ? k : v);
    for (int64_t j = 0; j < d; ++j) {
      const int64_t c = i * P + h * d + j;
      const T* w = conv_w + c * K;
      const float x = static_cast<float>(qkv[i * qkv_stride1 + h * d + j]);
      float y = K1 ? static_cast<float>(conv[c]) * static_cast<float>(w[0]) : x * static_cast<float>(w[0]);
      for (int64_t t = 1; t < K1; ++t) y += static_cast<float>(conv[t * conv_row + c]) * static_cast<float>(w[t]);
      if (K1) y += x * static_cast<float>(w[K1]);
      for (int64_t t = 0; t + 1 < K1; ++t) conv[t * conv_row + c] = conv[(t + 1) * conv_row + c];
      if (K1) conv[(K1 - 1) * conv_row + c] = static_cast<T>(x);
      const float r = rnd<T>(y);
      dst[j] = rnd<T>(r / (1.0f + std::exp(-r)));
    }
  }
  float qq = 0.f, kk = 0.f;
  for (int64_t j = 0; j < d; ++j) {
    qq += q[j] * q[j];
    kk += k[j] * k[j];
  }
  const float qs = (1.0f / std::sqrt(qq + 1e-6f)) * (1.0f / std::sqrt(static_cast<float>(d)));
  const float ks = 1.0f / std::sqrt(kk + 1e-6f);
  for (int64_t j = 0; j < d; ++j) {
    q[j] *= qs;
    k[j] *= ks;
    const float z = static_cast<float>(g_raw[h * d + j]) + dt_bias[h * d + j];
    const float sp = z > 20.0f ? z : std::log(1.0f + std::exp(z));
    g[j] = std::exp(-a * sp);
  }
  const float beta = 1.0f / (1.0f + std::exp(-static_cast<float>(beta_raw[h])));
  for (int64_t j = 0; j < d; ++j) u[j] = 0.f;
  for (int64_t r = 0; r < d; ++r) {  // decay along the key dim, then S^T k
    float* row = S + r * d;
    const float dec = g[r], kr = k[r];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
      row[j] *= dec;
      u[j] += kr * row[j];
    }
  }
  for (int64_t j = 0; j < d; ++j) {
    u[j] = beta * (v[j] - u[j]);
    o[j] = 0.f;
  }
  for (int64_t r = 0; r < d; ++r) {  // write k u^T, read S^T q from the updated state
    float* row = S + r * d;
    const float kr = k[r], qr = q[r];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
      row[j] += kr * u[j];
      o[j] += qr * row[j];
    }
  }
  float ms = 0.f;
  for (int64_t j = 0; j < d; ++j) ms += o[j] * o[j];
  const float inv = 1.0f / std::sqrt(ms / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) {
    const float y = o[j] * inv * o_norm[j];
    const float s = 1.0f / (1.0f + std::exp(-static_cast<float>(gate[h * d + j])));
    out[h * d + j] = static_cast<T>(y * s);
  }
}

at::Tensor kda_decode(const at::Tensor& qkv, at::Tensor conv_state, const at::Tensor& conv_w, const at::Tensor& g_raw,
                      const at::Tensor& beta_raw, const at::Tensor& gate, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& o_norm, double eps, at::Tensor state) {
  const int64_t B = qkv.size(0), P = qkv.size(2), H = beta_raw.size(-1), d = P / H, K = conv_w.size(-1);
  TORCH_CHECK(qkv.stride(2) == 1 && qkv.stride(1) == P, "kda_decode: qkv rows must be [3, P] contiguous");
  TORCH_CHECK(conv_state.is_contiguous() && state.is_contiguous() && conv_w.is_contiguous(), "kda_decode: layout");
  TORCH_CHECK(g_raw.stride(-1) == 1 && gate.stride(-1) == 1 && beta_raw.stride(-1) == 1, "kda_decode: layout");
  TORCH_CHECK(state.scalar_type() == at::kFloat && A_log.scalar_type() == at::kFloat, "kda_decode: fp32 state");
  auto dt = dt_bias.contiguous().to(at::kFloat);
  auto alog = A_log.contiguous();
  auto onorm = o_norm.contiguous().to(at::kFloat);
  auto out = at::empty({B, P}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "kda_decode", [&] {
    using T = scalar_t;
    const T* qkv_p = qkv.data_ptr<T>();
    T* conv_p = conv_state.data_ptr<T>();
    const T* w_p = conv_w.data_ptr<T>();
    const T* g_p = g_raw.data_ptr<T>();
    const T* b_p = beta_raw.data_ptr<T>();
    const T* gate_p = gate.data_ptr<T>();
    const float* n_p = onorm.data_ptr<float>();
    const float* a_p = alog.data_ptr<float>();
    const float* dt_p = dt.data_ptr<float>();
    float* s_p = state.data_ptr<float>();
    T* out_p = out.data_ptr<T>();
    const int64_t conv_row = 3 * P, conv_b = (K - 1) * conv_row;
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(6 * d);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / H, h = task % H;
        kda_head<T>(qkv_p + b * qkv.stride(0), qkv.stride(1), conv_p + b * conv_b, conv_row, w_p, K,
                    g_p + b * g_raw.stride(0), b_p + b * beta_raw.stride(0), gate_p + b * gate.stride(0),
                    std::exp(a_p[h]), dt_p, n_p, static_cast<float>(eps), s_p + (b * H + h) * d * d, d, P, h,
                    out_p + b * P, buf.data());
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) {
  m.def(
      "kda_decode(Tensor qkv, Tensor(a!) conv_state, Tensor conv_w, Tensor g_raw, Tensor beta_raw, Tensor gate, "
      "Tensor A_log, Tensor dt_bias, Tensor o_norm, float eps, Tensor(b!) state) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("kda_decode", &kda_decode); }
