// Weight-only int8 times one activation row (batch-1 decode) for the CPU: y[r] = (sum_k x[k] q[r, k]) scale[r].
// torch's _weight_int8pack_mm does the same sums but runs one row well under the memory bandwidth on a 2-core CPU
// (the int8 LM head: 37 GB/s); here each weight row is widened 16 int8 at a time to fp32 and summed in four
// independent chains, so the row streams at DRAM speed (50 GB/s). With more rows the widening, not the bytes, is the
// cost, and torch's op is faster: kernels/quant.py sends it those. Sums are fp32; the scaled product is rounded once
// to x's dtype, as torch's op rounds it.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "gemv.h"

namespace {

constexpr int64_t GRAIN = 256;  // weight rows per task at least

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && q.size(1) == x.size(1) && scales.numel() == q.size(0), "int8_mm: shapes");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "int8_mm: a contiguous int8 weight");
  TORCH_CHECK(x.size(0) == 1, "int8_mm: one activation row");
  const int64_t K = x.size(1), N = q.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  auto sf = scales.to(at::kFloat).contiguous();
  auto y = at::empty({1, N}, x.options().dtype(at::kFloat));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* xp = xf.data_ptr<float>();
  const float* sp = sf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) yp[r] = k3::dot(qp + r * K, xp, K) * sp[r];
  });
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) { m.def("int8_mm(Tensor x, Tensor q, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("int8_mm", &int8_mm); }
