"""RMSNorms of the model, written as transformers' KimiLinear computes them (fp32 inside, plain weight), on torch's
fused RMSNorm kernel; and K3's block-attention-residual mixing site, which normalises its candidates. These are the
references; the CPU ops (cpu_ops.rmsnorm, cpu_ops.res_mix) compute the same in one op each."""

import torch
import torch.nn.functional as F
from torch import Tensor


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KimiRMSNorm: normalise in fp32, cast back, then multiply by the weight (plain, not 1 + w)."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def gated_rmsnorm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA output norm: fp32 RMSNorm with a weight shared by heads, then times sigmoid(gate) (not SiLU)."""
    y = F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps)
    return (y * gate.float().sigmoid()).to(x.dtype)


def res_mix(p: Tensor, bank: tuple[Tensor, ...], score: Tensor, eps: float) -> Tensor:
    """A mixing site (model/residuals.py): the softmax mixture of the bank's snapshots and p, each candidate scored by
    its weightless RMS norm dotted with the site's vector `score`; p itself while the bank is empty. All fp32."""
    if not bank:
        return p
    candidates = torch.stack((*bank, p))  # [n + 1, ..., D]
    logits = (F.rms_norm(candidates, candidates.shape[-1:], eps=eps) * score).sum(-1)
    return (logits.softmax(0).unsqueeze(-1) * candidates).sum(0)
