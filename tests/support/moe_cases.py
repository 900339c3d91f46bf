"""Routed-expert cases for the MoE kernel tests: MXFP4-packed stacks (quantized from seeded fp32 weights, as the K3
twin's experts are made), their exact dequantization, routing with experts no token chose, and one rank's TP slice
of either."""

from dataclasses import dataclass

import torch

from k3dist.kernels.mxfp4 import PackedExperts
from k3dist.weights import mxfp4


@dataclass(frozen=True)
class Case:
    z: torch.Tensor  # [N, Z] compute dtype
    ids: torch.Tensor  # [N, k] int64, distinct per token
    weights: torch.Tensor  # [N, k] fp32
    w13: PackedExperts  # [E, 2I, Z]
    w2: PackedExperts  # [E, Z, I]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacks dequantized (weights/mxfp4.py, exact) to the compute dtype."""
        d = self.z.dtype
        return (
            mxfp4.dequantize(self.w13.packed, self.w13.scale, d),
            mxfp4.dequantize(self.w2.packed, self.w2.scale, d),
        )


def case(N: int, E: int, k: int, Z: int, I: int, dtype: torch.dtype, seed: int = 0, used: int | None = None) -> Case:
    """N tokens choosing k of E experts (only among the first `used` where given: the rest are chosen by nobody)."""
    gen = torch.Generator().manual_seed(seed)
    p13, s13 = mxfp4.quantize(torch.randn(E, 2 * I, Z, generator=gen) * 0.05)
    p2, s2 = mxfp4.quantize(torch.randn(E, Z, I, generator=gen) * 0.05)
    pool = used or E
    assert k <= pool <= E, (k, pool, E)
    ids = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(N)])
    z = torch.randn(N, Z, generator=gen).to(dtype)
    weights = torch.rand(N, k, generator=gen)
    return Case(z, ids, weights, PackedExperts(p13, s13, dtype), PackedExperts(p2, s2, dtype))


def rank_slice(c: Case, rank: int, world: int) -> Case:
    """Rank `rank`'s share under TP: the column slice of w1 and w3 (expert width I / world), the matching input
    slice of w2, as the plan cuts them: whole MXFP4 groups, contiguous."""
    I = c.w13.shape[1] // 2
    part = I // world
    rows = torch.cat([torch.arange(rank * part, (rank + 1) * part), I + torch.arange(rank * part, (rank + 1) * part)])
    lo, hi = rank * part, (rank + 1) * part
    w13 = PackedExperts(c.w13.packed[:, rows].contiguous(), c.w13.scale[:, rows].contiguous(), c.w13.dtype)
    packed, scale = c.w2.packed[:, :, lo // 2 : hi // 2], c.w2.scale[:, :, lo // 32 : hi // 32]
    w2 = PackedExperts(packed.contiguous(), scale.contiguous(), c.w2.dtype)
    return Case(c.z, c.ids, c.weights, w13, w2)
