"""RMSNorms of the model, written as transformers' KimiLinear computes them (fp32 inside, plain weight), on torch's
fused RMSNorm kernel."""

import torch.nn.functional as F
from torch import Tensor


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KimiRMSNorm: normalise in fp32, cast back, then multiply by the weight (plain, not 1 + w)."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def gated_rmsnorm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA output norm: fp32 RMSNorm with a weight shared by heads, then times sigmoid(gate) (not SiLU)."""
    y = F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps)
    return (y * gate.float().sigmoid()).to(x.dtype)
