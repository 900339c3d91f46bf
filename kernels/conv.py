"""Short causal depthwise conv + SiLU applied to KDA's q, k, v projections.

The conv state holds the previous K-1 PRE-conv inputs, oldest first (vLLM layout), so a prefill followed by
single-token steps reproduces one prefill over the whole sequence. Products are summed in fp32 and rounded once to
the weight's dtype, which is what transformers' bf16 `F.conv1d` yields too, without torch's per-channel bf16 conv
loop on CPUs (30-4000x slower there).
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv_prefill(x: Tensor, weight: Tensor, state: Tensor) -> Tensor:
    """Conv + SiLU over a chunk of tokens that continues the history in `state`.

    x: [B, T, C]; weight: [C, K] (weight[:, K-1] multiplies the current token); state: [B, C, K-1], zeros for a
    fresh sequence, overwritten in place with the last K-1 inputs (older history kept when T < K-1).
    Returns [B, T, C] in x's dtype.
    """
    K, T = weight.shape[-1], x.shape[1]
    window = torch.cat([state.transpose(1, 2), x], dim=1).float()  # [B, K-1+T, C], token-major like x
    state.copy_(window[:, window.shape[1] - state.shape[-1] :].transpose(1, 2))  # K == 1: no history at all
    w = weight.float().T  # [K, C]
    y = window[:, :T] * w[0]
    for tap in range(1, K):  # K multiply-adds over [B, T, C]: torch's grouped conv1d is 5-10x slower at batch > 1
        y += window[:, tap : tap + T] * w[tap]
    return F.silu(y.to(weight.dtype)).to(x.dtype)


def causal_conv_step(x: Tensor, weight: Tensor, state: Tensor) -> Tensor:
    """Conv + SiLU for one token per sequence. x: [B, C]; weight: [C, K]; state: [B, C, K-1] updated in place.

    Returns [B, C] in x's dtype.
    """
    window = torch.cat([state, x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    state.copy_(window[:, :, 1:])
    y = (window.float() * weight.float()).sum(-1).to(weight.dtype)  # [B, C]
    return F.silu(y).to(x.dtype)
