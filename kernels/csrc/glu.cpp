// A gated MLP's activation as one op, between its gate_up and down projections (model/layers.py's gated_mlp): the
// shared experts and dense MLPs of a decode step call it with a few rows, where torch runs two (SiLU) to twelve
// (K3's SiTU) small kernels. The values are act.h's, as kernels/activation.py computes them.
#include "vec.h"  // first: it names the CPU capability ATen's vector functions compile for

#include <torch/library.h>

#include <vector>

#include "act.h"

namespace {

template <typename T, typename Act>
void rows(const T* gu, T* out, int64_t N, int64_t I, const Act& act) {
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> g(I), u(I);
    for (int64_t r = begin; r < end; ++r) {
      k3::to_float(gu + r * 2 * I, g.data(), I);
      k3::to_float(gu + r * 2 * I + I, u.data(), I);
      act(g.data(), u.data(), I);
      for (int64_t i = 0; i < I; ++i) out[r * I + i] = static_cast<T>(g[i]);  // values of T already: exact
    }
  };
  at::parallel_for(0, N, 16, run);  // a decode step's few rows run on the calling thread
}

// gate_up [..., 2I] (the gate rows' outputs, then the up rows') in the compute dtype -> act(gate, up) [..., I]
at::Tensor glu(const at::Tensor& gate_up, int64_t act, double beta, double linear_beta) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "glu: gate_up [..., 2I]");
  auto gu = gate_up.contiguous();
  const int64_t I = gu.size(-1) / 2, N = gu.numel() / std::max<int64_t>(2 * I, 1);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gu.options());
  TORCH_CHECK(act == 0 || (act == 1 && beta > 0 && linear_beta > 0), "glu: act 0 (SiLU) or 1 (SiTU, positive betas)");
  const float b = static_cast<float>(beta), lb = static_cast<float>(linear_beta);
  k3::by_compute_dtype(gu.scalar_type(), "glu", [&](auto t) {
    using T = decltype(t);
    if (act == 0) rows(gu.data_ptr<T>(), out.data_ptr<T>(), N, I, k3::Silu<T>{});
    else rows(gu.data_ptr<T>(), out.data_ptr<T>(), N, I, k3::Situ<T>{b, 1.0f / b, lb, 1.0f / lb});
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) { m.def("glu(Tensor gate_up, int act, float beta, float linear_beta) -> Tensor"); }

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("glu", &glu); }
