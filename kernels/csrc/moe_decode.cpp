// A decode MoE block for the CPU as one op, from the router's logits on: sigmoid, correction bias for the choice,
// top-k, renormalised weights, the chosen experts' gated MLPs read straight from the stacked weights, and the shared
// expert. The torch path (kernels/moe.py experts_gathered) copies each chosen expert's weights out with index_select
// and runs ~40 small ops per layer; this reads every weight byte once, in two parallel regions (gate/up rows, then
// down rows). The activation is a value (kernels/activation.py: SiLU, or SiTU with its betas), chosen once per call.
// Roundings follow the reference: each GEMV output, SiLU and the SiLU x up product (SiTU: its fp32 result) round to
// the compute dtype; routing and the weighted sum are fp32.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "gemv.h"
#include "route.h"

namespace {

using k3::dot;
using k3::route;
using k3::Route;
using k3::rnd;

template <typename T>
struct Silu {  // torch's F.silu(gate) * up in the compute dtype
  float operator()(float g, float u) const { return rnd<T>(rnd<T>(g / (1.0f + std::exp(-g))) * u); }
};

template <typename T>
struct Situ {  // activation.py's SiTU: fp32, llama.cpp's operations in its order, rounded once
  float beta, inv, linear_beta, linear_inv;
  float operator()(float g, float u) const {
    const float a = std::tanh(g * inv) * beta * (1.0f / (1.0f + std::exp(-g)));
    return rnd<T>(a * (std::tanh(u * linear_inv) * linear_beta));
  }
};

template <typename T, typename Act>
void run(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& bias, const at::Tensor& w13,
         const at::Tensor& w2, const T* s13, const T* s2, int64_t Is, int64_t k, bool renormalize, float scale,
         bool biased, const Act& act_fn, at::Tensor& out) {
  const int64_t N = x.size(0), D = x.size(1), E = w13.size(0), I2 = w13.size(1), I = I2 / 2;
  const int64_t rows_a = k * I2 + 2 * Is, rows_b = k * I + Is;  // per token: gate/up rows; down inputs
  std::vector<Route> routes;
  std::vector<float> xs(N * D), h(N * rows_a), act(N * rows_b);
  auto xf = x.to(at::kFloat).contiguous();
  const float* x_p = xf.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    routes.push_back(route(logits.data_ptr<float>() + n * E, bias.data_ptr<float>(), E, k, renormalize, scale, biased));
    for (int64_t i = 0; i < D; ++i) xs[n * D + i] = rnd<T>(x_p[n * D + i]);
  }
  const T* w13_p = w13.data_ptr<T>();
  const T* w2_p = w2.data_ptr<T>();
  at::parallel_for(0, N * rows_a, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t / rows_a, row = t % rows_a;
      const T* w = row < k * I2 ? w13_p + (routes[n].ids[row / I2] * I2 + row % I2) * D : s13 + (row - k * I2) * D;
      h[t] = rnd<T>(dot(w, xs.data() + n * D, D));
    }
  });
  for (int64_t n = 0; n < N; ++n) {  // the activations: gate rows first, then up rows, per expert
    for (int64_t j = 0; j <= k; ++j) {
      const int64_t width = j < k ? I : Is;
      if (!width) continue;
      const float* gu = h.data() + n * rows_a + j * I2;
      float* a = act.data() + n * rows_b + j * I;
      for (int64_t i = 0; i < width; ++i) a[i] = act_fn(gu[i], gu[width + i]);
    }
  }
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, N * D, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t / D, r = t % D;
      const float* a = act.data() + n * rows_b;
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j)
        acc += rnd<T>(dot(w2_p + (routes[n].ids[j] * D + r) * I, a + j * I, I)) * routes[n].weights[j];
      if (Is) acc += rnd<T>(dot(s2 + r * Is, a + k * I, Is));
      out_p[t] = acc;
    }
  });
}

at::Tensor moe_decode(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& bias, const at::Tensor& w13,
                      const at::Tensor& w2, const std::optional<at::Tensor>& shared13,
                      const std::optional<at::Tensor>& shared2, int64_t top_k, bool renormalize, double scale,
                      bool biased, int64_t act, double beta, double linear_beta) {
  TORCH_CHECK(x.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), "moe_decode: inputs");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && bias.scalar_type() == at::kFloat, "moe_decode: weights");
  TORCH_CHECK(top_k >= 1 && top_k <= w13.size(0), "moe_decode: top_k");
  TORCH_CHECK(act == 0 || (act == 1 && beta > 0 && linear_beta > 0), "moe_decode: act 0 (SiLU) or 1 (SiTU, betas > 0)");
  auto out = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  auto b = bias.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w13.scalar_type(), "moe_decode", [&] {
    const scalar_t* s13 = nullptr;
    const scalar_t* s2 = nullptr;
    int64_t Is = 0;
    if (shared13.has_value() && shared2.has_value()) {
      TORCH_CHECK(shared13->is_contiguous() && shared2->is_contiguous(), "moe_decode: shared expert layout");
      s13 = shared13->data_ptr<scalar_t>();
      s2 = shared2->data_ptr<scalar_t>();
      Is = shared2->size(1);
    }
    const float sc = static_cast<float>(scale), bt = static_cast<float>(beta), lb = static_cast<float>(linear_beta);
    if (act == 0)
      run<scalar_t>(x, logits, b, w13, w2, s13, s2, Is, top_k, renormalize, sc, biased, Silu<scalar_t>{}, out);
    else
      run<scalar_t>(x, logits, b, w13, w2, s13, s2, Is, top_k, renormalize, sc, biased,
                    Situ<scalar_t>{bt, 1.0f / bt, lb, 1.0f / lb}, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) {
  m.def(
      "moe_decode(Tensor x, Tensor logits, Tensor bias, Tensor w13, Tensor w2, Tensor? shared13, Tensor? shared2, "
      "int top_k, bool renormalize, float scale, bool biased, int act, float beta, float linear_beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("moe_decode", &moe_decode); }
