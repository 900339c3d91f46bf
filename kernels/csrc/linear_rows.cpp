// A few activation rows (decode: one per live slot) times a compute-dtype weight [N, K], for CPUs whose oneDNN has
// no units for that dtype: torch's low-precision GEMV there streams the weight well under the memory bandwidth. Here
// each weight row is read once and dotted with every activation row while it is in L1 (gemv.h: widened a vector at
// a time, four FMA chains, fp32 sums); each output is rounded once to x's dtype, as torch's GEMM rounds it. A row's
// result does not depend on how many rows came with it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "gemv.h"

namespace {

constexpr int64_t GRAIN = 256;  // weight rows per task at least
constexpr int64_t MAX_ROWS = 16;

template <typename T>
void rows(const T* w, const float* x, float* y, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t m = 0; m < M; ++m) y[m * N + r] = k3::dot(w + r * K, x + m * K, K);
  });
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "linear_rows: x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) <= MAX_ROWS, "linear_rows: at most ", MAX_ROWS, " rows");
  TORCH_CHECK(w.is_contiguous(), "linear_rows: a contiguous weight");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (w.scalar_type() == at::kBFloat16) {
    rows(w.data_ptr<c10::BFloat16>(), xp, yp, M, N, K);
  } else if (w.scalar_type() == at::kHalf) {
    rows(w.data_ptr<c10::Half>(), xp, yp, M, N, K);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "linear_rows: a bf16, fp16 or fp32 weight");
    rows(w.data_ptr<float>(), xp, yp, M, N, K);
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) { m.def("linear_rows(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("linear_rows", &linear_rows); }
