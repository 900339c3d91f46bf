// The decode step's reading of the logits for the CPU as one op: each row's k largest logits with their ids, and the
// log-sum-exp of the whole row, in one pass over the row (bf16 or fp32, never widened into a copy). The torch path
// widens the [B, V] logits, takes block maxima, a top-k of the best blocks and a log-sum-exp: about ten passes over
// a vocabulary-sized array a step (2 ms at batch 8 on a 2-core CPU). A row is cut into chunks, one task each: the
// chunk's maximum and sum of exp(x - max) (ATen's vector exp, as torch's), and its top k, kept by insertion against
// the current k-th value (almost every logit fails that one comparison). Ties keep the lower id, as argmax does.
#include "vec.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using k3::to_float;
using k3::Vec;
using k3::W;
constexpr int64_t CHUNK = 8192;  // logits per task

struct Part {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;                 // sum of exp(x - max) over the chunk
  std::vector<float> values;       // best first
  std::vector<int64_t> ids;
};

inline void insert(Part& p, int64_t k, float x, int64_t id) {  // x beats the k-th value (or fewer than k so far)
  int64_t at = static_cast<int64_t>(p.values.size());
  if (at == k) --at;
  else p.values.push_back(x), p.ids.push_back(id);
  while (at > 0 && p.values[at - 1] < x) {  // strictly smaller move down: an equal earlier id stays ahead
    p.values[at] = p.values[at - 1];
    p.ids[at] = p.ids[at - 1];
    --at;
  }
  p.values[at] = x;
  p.ids[at] = id;
}

template <typename T>
void scan(const T* row, int64_t begin, int64_t end, int64_t k, Part& p, float* buf) {
  const int64_t n = end - begin;
  to_float<T>(row + begin, buf, n);
  float kth = -std::numeric_limits<float>::infinity();
  Vec vmax(p.max);
  const int none_beat = (1 << W) - 1;  // zero_mask() sets a lane's bit where the comparison is false
  for (int64_t j = 0; j < n; j += W) {  // maxima and top k
    const int64_t m = std::min<int64_t>(W, n - j);
    const Vec v = m == W ? Vec::loadu(buf + j) : Vec::loadu(buf + j, m);
    if (m == W) vmax = at::vec::maximum(vmax, v);
    const bool full = static_cast<int64_t>(p.values.size()) == k;
    if (!full || m < W || (v > Vec(kth)).zero_mask() != none_beat) {  // some lane beats the k-th value
      for (int64_t i = j; i < j + m; ++i) {
        if (m < W) p.max = std::max(p.max, buf[i]);
        if (static_cast<int64_t>(p.values.size()) < k || buf[i] > kth) {
          insert(p, k, buf[i], begin + i);
          if (static_cast<int64_t>(p.values.size()) == k) kth = p.values[k - 1];
        }
      }
    }
  }
  float lanes[W];
  vmax.store(lanes);
  for (int64_t i = 0; i < W; ++i) p.max = std::max(p.max, lanes[i]);
  if (!std::isfinite(p.max)) {  // all -inf (or a NaN): no mass, or let it propagate as torch's would
    p.sum = std::isnan(p.max) ? p.max : 0.f;
    return;
  }
  const Vec top(p.max);
  Vec acc(0.0f);
  for (int64_t j = 0; j < n; j += W) {
    const int64_t m = std::min<int64_t>(W, n - j);
    const Vec e = ((m == W ? Vec::loadu(buf + j) : Vec::loadu(buf + j, m)) - top).exp();
    acc = acc + (m == W ? e : Vec::set(Vec(0.0f), e, m));
  }
  acc.store(lanes);
  for (int64_t i = 0; i < W; ++i) p.sum += lanes[i];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_lse(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "topk_lse: [B, V] rows, contiguous");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "topk_lse: 1 <= k <= V");
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
  std::vector<Part> parts(B * chunks);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "topk_lse", [&] {
    const scalar_t* p = logits.data_ptr<scalar_t>();
    at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(CHUNK);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / chunks, c = t % chunks;
        scan<scalar_t>(p + b * logits.stride(0), c * CHUNK, std::min(V, (c + 1) * CHUNK), k, parts[t], buf.data());
      }
    });
  });
  auto values = at::empty({B, k}, logits.options().dtype(at::kFloat));
  auto ids = at::empty({B, k}, logits.options().dtype(at::kLong));
  auto lse = at::empty({B}, logits.options().dtype(at::kFloat));
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    Part all;
    for (int64_t c = 0; c < chunks; ++c) {  // chunks in id order: insertion keeps ties to the lower id
      const Part& p = parts[b * chunks + c];
      for (size_t i = 0; i < p.values.size(); ++i)
        if (static_cast<int64_t>(all.values.size()) < k || p.values[i] > all.values[k - 1])
          insert(all, k, p.values[i], p.ids[i]);
      all.max = std::max(all.max, p.max);
    }
    double sum = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      const Part& p = parts[b * chunks + c];
      if (p.sum > 0.f) sum += static_cast<double>(p.sum) * std::exp(static_cast<double>(p.max - all.max));
    }
    lp[b] = std::isfinite(all.max) ? static_cast<float>(all.max + std::log(sum)) : all.max;
    for (int64_t i = 0; i < k; ++i) {
      const bool have = i < static_cast<int64_t>(all.values.size());
      vp[b * k + i] = have ? all.values[i] : -std::numeric_limits<float>::infinity();
      ip[b * k + i] = have ? all.ids[i] : 0;
    }
  }
  return {values, ids, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) { m.def("topk_lse(Tensor logits, int k) -> (Tensor, Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("topk_lse", &topk_lse); }
