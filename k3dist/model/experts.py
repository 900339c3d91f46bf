"""Where a batch covers the experts on a CPU, every expert as one dense GEMM pair: the holder and the policy that
chooses it. The routed paths' arithmetic is in kernels/moe.py."""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import ModelConfig
from .linear import Linear

DENSE_MAX_RATIO = 8  # dense experts compute E/k times the routed FLOPs; the grouped loop is no faster up to 8
ONE_OP_TOKENS = 16  # decode batches up to this many tokens run the one-op CPU MoE block where it builds
ONE_OP_PREFILL = 48  # prefill pieces up to this many tokens run it too, ONE_OP_TOKENS at a time


def dense_wanted(experts: int, top_k: int, batch: int, pack: bool, one_op: bool = False) -> bool:
    """Whether to hold the experts as `DenseExperts` (one packed dense GEMM pair) instead of stacked.

    On a CPU with packed bf16 weights (linear.py), a decode batch whose (token, expert) pairs cover the experts reads
    nearly all of them anyway, and one packed GEMM streams them faster than the stacked paths' many small products
    (benchmarks/decode.py; BENCHMARKS.md, "Measurements behind the code"). The packed pair replaces the stacked weights,
    so prefill runs dense too: that costs E/k times the routed FLOPs, hence the bound on E/k. Where the one-op CPU block
    serves the batch (`one_op`: it reads the stacked weights, each chosen expert from cache after its first token) the
    stacked weights stay: it is faster than the dense pair there.
    """
    return not one_op and pack and batch * top_k >= experts and experts <= DENSE_MAX_RATIO * top_k


def experts_dense(cfg: ModelConfig, batch: int, pack: bool, moe_block: bool) -> bool:
    """`dense_wanted` for a model whose kernels have the one-op CPU MoE block (`moe_block`) or not: never where it
    serves the batch (one expert group, at most ONE_OP_TOKENS decode tokens). The run plan asks once; build_model
    holds what it decided."""
    one_op = moe_block and cfg.num_expert_group == 1 and batch <= ONE_OP_TOKENS
    return dense_wanted(cfg.num_experts, cfg.top_k, batch, pack, one_op)


class DenseExperts:
    """Every expert for every token as two GEMMs: x [N, D] through w13 as one [E*2I, D] weight, SwiGLU per expert,
    each expert's activations times the token's routing weight for it (0 where not chosen), then w2 as one
    [D, E*I] weight sums over the experts. Built from the stacked weights (the w2 layout is one copy, then packed).

    Rounding: the weighted activations round once to the compute dtype before w2, where the loop rounds each
    expert's output instead: one bf16 rounding of the same terms either way."""

    def __init__(self, w13: Tensor, w2: Tensor, pack: bool):
        self.experts = w13.shape[0]
        self.w13 = Linear(w13.flatten(0, 1), pack)
        self.w2 = Linear(w2.permute(1, 0, 2).flatten(1), pack)

    def __call__(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """x: [N, D]; ids, weights: [N, k]. Returns [N, D] fp32."""
        N = x.shape[0]
        gate, up = self.w13(x).view(N, self.experts, -1).chunk(2, dim=-1)
        routing = torch.zeros(N, self.experts, dtype=torch.float32, device=x.device).scatter_(1, ids, weights.float())
        act = (F.silu(gate) * up).float() * routing.unsqueeze(-1)
        return self.w2(act.to(x.dtype).view(N, -1)).float()
