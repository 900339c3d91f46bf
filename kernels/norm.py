"""RMSNorms of the model, written as transformers' KimiLinear computes them (fp32 inside, plain weight)."""

import torch
from torch import Tensor


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KimiRMSNorm: normalise in fp32, cast back, then multiply by the weight (plain, not 1 + w)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rmsnorm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA output norm: fp32 RMSNorm with a weight shared by heads, then times sigmoid(gate) (not SiLU)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)
