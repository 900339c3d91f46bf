// MLA's absorbed decode for the CPU as one op, after the projection and the cache write: q_nope folded through
// kv_b's key rows, scores against the cached latent rows, softmax, the weighted latent, and kv_b's value rows. The
// torch path runs this as two bmm's around kernels/mla.py's mla_decode, about fifteen small ops a layer (0.35 ms at
// batch 1 on a 2-core CPU, for 0.05 ms of bytes); here each (sequence, head) is one task reading its sequence's rows
// while they are in cache. Roundings follow the torch path: q_abs, the scores, the scaled scores, the
// probabilities, the context and the output each round to the compute dtype; sums and the softmax are fp32.
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "gemv.h"

namespace {

using k3::dot;
using k3::rnd;
using k3::Vec;

template <typename T>
void head(const T* q, int64_t dn, int64_t dr, const T* wkb, int64_t kb_s1, const T* wvb, int64_t vb_s1, int64_t dv,
          const T* rows, int64_t row_s, int64_t r, int64_t len, float scale, T* out, float* buf) {
  float* qc = buf;                   // [r + dr]: q_abs, then q_pe
  float* ctx = buf + r + dr;         // [r]
  float* p = buf + 2 * r + dr;       // [len]
  for (int64_t i = 0; i < r; ++i) qc[i] = 0.f;
  for (int64_t j = 0; j < dn; ++j) {  // q_abs = W_kb^T q_nope, a row of W_kb at a time
    const float qj = static_cast<float>(q[j]);
    const T* w = wkb + j * kb_s1;
    for (int64_t i = 0; i < r; ++i) qc[i] += qj * static_cast<float>(w[i]);
  }
  for (int64_t i = 0; i < r; ++i) qc[i] = rnd<T>(qc[i]);
  for (int64_t i = 0; i < dr; ++i) qc[r + i] = static_cast<float>(q[dn + i]);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) {
    p[t] = rnd<T>(rnd<T>(dot<T>(rows + t * row_s, qc, r + dr)) * scale);
    top = std::max(top, p[t]);
  }
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) p[t] -= top;
  k3::vmap(p, len, [](Vec x) { return x.exp(); });
  for (int64_t t = 0; t < len; ++t) sum += p[t];
  for (int64_t i = 0; i < r; ++i) ctx[i] = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    const float pt = rnd<T>(p[t] / sum);
    const T* row = rows + t * row_s;
    for (int64_t i = 0; i < r; ++i) ctx[i] += pt * static_cast<float>(row[i]);
  }
  for (int64_t i = 0; i < r; ++i) ctx[i] = rnd<T>(ctx[i]);
  for (int64_t v = 0; v < dv; ++v) out[v] = static_cast<T>(dot<T>(wvb + v * vb_s1, ctx, r));
}

// q [B, H, dn + dr]; latent [B, L, r + dr] (rows contiguous); lengths [B]; w_kb [H, dn, r]; w_vb [H, dv, r]
// (views of kv_b, rows contiguous). Returns [B, H * dv].
at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& lengths, const at::Tensor& w_kb,
                      const at::Tensor& w_vb, double scale) {
  const int64_t B = q.size(0), H = q.size(1), dn = w_kb.size(1), r = w_kb.size(2), dv = w_vb.size(1);
  const int64_t dr = q.size(2) - dn, L = latent.size(1);
  TORCH_CHECK(q.is_contiguous() && latent.stride(2) == 1 && latent.size(2) == r + dr, "mla_decode: q, latent layout");
  TORCH_CHECK(w_kb.stride(2) == 1 && w_vb.stride(2) == 1 && w_vb.size(2) == r, "mla_decode: kv_b layout");
  TORCH_CHECK(w_kb.scalar_type() == q.scalar_type() && latent.scalar_type() == q.scalar_type(), "mla_decode: dtypes");
  auto len = lengths.to(at::kLong).contiguous();
  auto out = at::empty({B, H * dv}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mla_decode", [&] {
    using T = scalar_t;
    const T* qp = q.data_ptr<T>();
    const T* lp = latent.data_ptr<T>();
    const T* kb = w_kb.data_ptr<T>();
    const T* vb = w_vb.data_ptr<T>();
    const int64_t* np = len.data_ptr<int64_t>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(2 * r + dr + L);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / H, h = task % H;
        const int64_t n = std::min<int64_t>(std::max<int64_t>(np[b], 0), L);
        head<T>(qp + (b * H + h) * (dn + dr), dn, dr, kb + h * w_kb.stride(0), w_kb.stride(1), vb + h * w_vb.stride(0),
                w_vb.stride(1), dv, lp + b * latent.stride(0), latent.stride(1), r, n, static_cast<float>(scale),
                op + (b * H + h) * dv, buf.data());
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) {
  m.def("mla_decode(Tensor q, Tensor latent, Tensor lengths, Tensor w_kb, Tensor w_vb, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("mla_decode", &mla_decode); }
