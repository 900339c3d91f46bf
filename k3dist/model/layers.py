"""Small building blocks shared by the mixers and MLPs, written as transformers' KimiLinear computes them."""

import torch
import torch.nn.functional as F
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


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """down(silu(gate x) * up x) with [out, in] weights: a column-parallel pair and a row-parallel down."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
