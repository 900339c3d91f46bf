// The model's small per-row norms for the CPU, one op each where torch runs five to ten small kernels: KimiRMSNorm
// (kernels/norm.py's rmsnorm) and K3's block-attention-residual mixing site (kernels/norm.py's res_mix). A decode
// step calls them about 130 times with a few rows each, where the ops' dispatch, not their arithmetic, is the cost.
//
// Each row is summed in vector lanes and then one fixed tree (at::vec's reduce), so a row's result never depends on
// the rows beside it or on the threads; the order is not torch's, so the ops meet the references to rounding.
#include "vec.h"  // first: it names the CPU capability ATen's vector functions compile for

#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using k3::Vec;
using k3::W;

constexpr int64_t GRAIN = 16;  // rows a thread takes at least: fewer run on the calling thread (a decode step's)

// sum of x[i] * y[i] over n (vector lanes, then the tree; the tail one by one)
inline float dot(const float* x, const float* y, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = at::vec::fmadd(Vec::loadu(x + i), Vec::loadu(y + i), acc);
  float s = k3::hsum(acc);
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}

inline float inverse_rms(const float* x, int64_t n, float eps) {
  return 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
}

// weight * (x * rsqrt(mean(x^2) + eps)), the normalised row rounded to x's dtype first, the product to the result's;
// x, weight and the result read and written in their own dtypes (a row widened into a buffer), never converted whole
// (fp32 values are read in place; others widened into `buf`)
template <typename T>
const float* as_floats(const T* src, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) return src;
  buf.resize(n);
  k3::to_float<T>(src, buf.data(), n);
  return buf.data();
}

template <typename X, typename Wt, typename Out>
void rmsnorm_rows(const X* x, const Wt* weight, Out* out, int64_t rows, int64_t D, float eps) {
  std::vector<float> wbuf;
  const float* wf = as_floats(weight, D, wbuf);
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> xbuf, o(D);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = as_floats(x + r * D, D, xbuf);
      const float inv = inverse_rms(row, D, eps);
      int64_t i = 0;
      for (; i + W <= D; i += W) (Vec::loadu(row + i) * Vec(inv)).store(o.data() + i);
      for (; i < D; ++i) o[i] = row[i] * inv;
      k3::round_to<X>(o.data(), D);
      i = 0;
      for (; i + W <= D; i += W) (Vec::loadu(o.data() + i) * Vec::loadu(wf + i)).store(o.data() + i);
      for (; i < D; ++i) o[i] *= wf[i];
      k3::from_float<Out>(o.data(), out + r * D, D);
    }
  });
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rmsnorm: x [..., D], weight [D]");
  const auto out_type = c10::promoteTypes(x.scalar_type(), weight.scalar_type());
  const int64_t D = x.size(-1), rows = x.numel() / std::max<int64_t>(D, 1);
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = at::empty(x.sizes(), x.options().dtype(out_type));
  k3::by_compute_dtype(x.scalar_type(), "rmsnorm: x", [&](auto xt) {
    k3::by_compute_dtype(weight.scalar_type(), "rmsnorm: weight", [&](auto wt) {
      k3::by_compute_dtype(out_type, "rmsnorm: result", [&](auto ot) {
        using X = decltype(xt);
        using Wt = decltype(wt);
        using Out = decltype(ot);
        rmsnorm_rows<X, Wt, Out>(xc.data_ptr<X>(), wc.data_ptr<Wt>(), out.data_ptr<Out>(), rows, D,
                                 static_cast<float>(eps));
      });
    });
  });
  return out;
}

// K3's mixing site over the candidates (the bank's snapshots, then the stream; each [..., D] fp32): per row, each
// candidate's weightless RMS norm dotted with `score`, a softmax over the candidates, the mixture of the raw ones
at::Tensor res_mix(at::TensorList candidates, const at::Tensor& score, double eps) {
  const int64_t n = static_cast<int64_t>(candidates.size());
  TORCH_CHECK(n >= 1 && score.dim() == 1 && score.scalar_type() == at::kFloat, "res_mix: candidates, fp32 score [D]");
  const int64_t D = score.size(0);
  std::vector<at::Tensor> held;
  std::vector<const float*> c;
  for (const auto& t : candidates) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.size(-1) == D && t.sizes() == candidates[0].sizes(),
                "res_mix: fp32 candidates of one shape [..., D]");
    held.push_back(t.contiguous());
    c.push_back(held.back().data_ptr<float>());
  }
  auto sc = score.contiguous();
  const float* s = sc.data_ptr<float>();
  auto out = at::empty(candidates[0].sizes(), candidates[0].options());
  float* op = out.data_ptr<float>();
  const int64_t rows = out.numel() / std::max<int64_t>(D, 1);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> p(n);
    for (int64_t r = begin; r < end; ++r) {
      float top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* x = c[j] + r * D;
        p[j] = dot(x, s, D) * inverse_rms(x, D, e);
        top = std::max(top, p[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) total += (p[j] = std::exp(p[j] - top));
      for (int64_t j = 0; j < n; ++j) p[j] /= total;
      float* o = op + r * D;
      for (int64_t i = 0; i < D; i += W) {
        const int64_t m = std::min<int64_t>(W, D - i);
        Vec acc = Vec::loadu(c[0] + r * D + i, m) * Vec(p[0]);
        for (int64_t j = 1; j < n; ++j) acc = at::vec::fmadd(Vec::loadu(c[j] + r * D + i, m), Vec(p[j]), acc);
        acc.store(o + i, m);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("res_mix(Tensor[] candidates, Tensor score, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3dist, CPU, m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("res_mix", &res_mix);
}
