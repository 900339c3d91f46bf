// The MLPs' gated activations over rows of gate and up values, shared by the CPU ops that apply them (moe_experts,
// glu): SwiGLU's SiLU and K3's SiTU-GLU, as kernels/activation.py's references compute them.
#pragma once

#include "vec.h"

namespace k3 {

template <typename F>
void zip(float* a, const float* b, int64_t n, F f) {  // a = f(a, b) elementwise, a vector at a time
  for (int64_t j = 0; j < n; j += W) {
    const int64_t m = std::min<int64_t>(W, n - j);
    f(Vec::loadu(a + j, m), Vec::loadu(b + j, m)).store(a + j, m);
  }
}

// The activations, over n gate values g (overwritten with the result) and their up values u, both already rounded
// to the compute dtype; ATen's vector exp and tanh, as torch's own CPU kernels use.
template <typename T>
struct Silu {  // torch's F.silu(gate) * up in the compute dtype
  void operator()(float* g, const float* u, int64_t n) const {
    vmap(g, n, [](Vec x) { return x / (Vec(1.0f) + x.neg().exp()); });
    round_to<T>(g, n);
    zip(g, u, n, [](Vec a, Vec b) { return a * b; });
    round_to<T>(g, n);
  }
};

template <typename T>
struct Situ {  // activation.py's SiTU: fp32, llama.cpp's operations in its order, rounded once
  float beta, inv, linear_beta, linear_inv;
  void operator()(float* g, const float* u, int64_t n) const {
    const Vec b(beta), i(inv), lb(linear_beta), li(linear_inv), one(1.0f);
    zip(g, u, n, [&](Vec x, Vec y) {
      return (x * i).tanh() * b * (one / (one + x.neg().exp())) * ((y * li).tanh() * lb);
    });
    round_to<T>(g, n);
  }
};

}  // namespace k3
