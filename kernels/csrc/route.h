// The sigmoid router's choice from its logits, for the CPU MoE ops: sigmoid scores, the correction bias added for the
// choice only, the k largest (ties to the lower id) in descending order, their weights (the unbiased scores, or with
// `biased` the biased ones) renormalised over the k and scaled. model/moe.py's `route` is the reference (one expert
// group); it keeps torch's top-k order, so the two combine a token's experts in different orders (rounding only).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace k3 {

struct Route {
  std::vector<int64_t> ids;
  std::vector<float> weights;
};

inline Route route(const float* logits, const float* bias, int64_t E, int64_t k, bool renormalize, float scale,
                   bool biased) {
  std::vector<float> scores(E), choice(E);
  for (int64_t e = 0; e < E; ++e) {
    scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[e] = scores[e] + bias[e];
  }
  Route r{std::vector<int64_t>(k), std::vector<float>(k)};
  std::vector<bool> taken(E, false);
  for (int64_t j = 0; j < k; ++j) {  // the k largest choices, ties to the lower id
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
    taken[best] = true;
    r.ids[j] = best;
    r.weights[j] = biased ? choice[best] : scores[best];
  }
  if (renormalize) {
    float sum = 0.f;
    for (float w : r.weights) sum += w;
    for (float& w : r.weights) w = w / (sum + 1e-20f);
  }
  for (float& w : r.weights) w *= scale;
  return r;
}

}  // namespace k3
