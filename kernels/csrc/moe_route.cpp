// The sigmoid router's choice as one op (route.h), for the MoE blocks whose experts run as their own op (K3's latent
// MoE, the experts op's callers): the router's logits come from torch's own fp32 GEMV, as transformers computes them;
// the ten or so small torch ops after it (sigmoid, bias, top-k, gather, renormalisation) are this one.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "route.h"

namespace {

constexpr int64_t GRAIN = 64;  // tokens per task at least: a decode step's run inline

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, const at::Tensor& bias, int64_t top_k,
                                             bool renormalize, double scale, bool biased) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "moe_route: fp32 logits [N, E]");
  const int64_t N = logits.size(0), E = logits.size(1);
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == E, "moe_route: fp32 bias [E]");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k ", top_k, " outside [1, ", E, "]");
  auto lg = logits.contiguous();
  auto b = bias.contiguous();
  auto ids = at::empty({N, top_k}, logits.options().dtype(at::kLong));
  auto weights = at::empty({N, top_k}, logits.options());
  const float *lp = lg.data_ptr<float>(), *bp = b.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const k3::Route r = k3::route(lp + n * E, bp, E, top_k, renormalize, static_cast<float>(scale), biased);
      std::copy(r.ids.begin(), r.ids.end(), ip + n * top_k);
      std::copy(r.weights.begin(), r.weights.end(), wp + n * top_k);
    }
  });
  return {ids, weights};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) {
  m.def("moe_route(Tensor logits, Tensor bias, int top_k, bool renormalize, float scale, bool biased) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("moe_route", &moe_route); }
