"""Short causal depthwise conv + SiLU applied to KDA's q, k, v projections.

The conv state holds the previous K-1 PRE-conv inputs, oldest first (vLLM layout), so a prefill followed by
single-token steps reproduces one prefill over the whole sequence. Products are summed in fp32 and rounded once to
the weight's dtype, which is what transformers' bf16 `F.conv1d` yields too, without torch's per-channel bf16 conv
loop on CPUs (orders of magnitude slower there: BENCHMARKS.md, "Measurements behind the code").
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv_prefill(x: Tensor, weight: Tensor, state: Tensor) -> Tensor:
    """Conv + SiLU over a chunk of tokens that continues the history in `state`.

    x: [B, T, C]; weight: [C, K] (weight[:, K-1] multiplies the current token); state: [B, K-1, C], token-major like
    x, zeros for a fresh sequence, overwritten in place with the last K-1 inputs (older history kept when T < K-1).
    Returns [B, T, C] in x's dtype.
    """
    T = x.shape[1]
    window = torch.cat([state, x], dim=1)  # [B, K-1+T, C]
    state.copy_(window[:, window.shape[1] - state.shape[1] :])  # K == 1: no history at all
    return _conv_silu(window, weight, T).to(x.dtype)


def causal_conv_step(x: Tensor, weight: Tensor, state: Tensor) -> Tensor:
    """Conv + SiLU for one token per sequence. x: [B, C]; weight: [C, K]; state: [B, K-1, C] updated in place.

    The same arithmetic as a one-token prefill; the token-major state makes every op here a contiguous [B, C]
    block (a channel-major [B, C, K-1] one makes the decode step's cat, sum and shift strided, and slow on a CPU).
    Returns [B, C] in x's dtype.
    """
    window = torch.cat([state, x.unsqueeze(1)], dim=1)  # [B, K, C]
    state.copy_(window[:, 1:])
    return _conv_silu(window, weight, 1).squeeze(1).to(x.dtype)


def _conv_silu(window: Tensor, weight: Tensor, T: int) -> Tensor:
    """SiLU(sum over taps j of window[:, j : j + T] * weight[:, j]): fp32 products added in tap order, rounded once
    to the weight's dtype. window: [B, K-1+T, C]. Returns [B, T, C] in the weight's dtype. K multiply-adds over
    [B, T, C]: torch's grouped conv1d is slower at batch > 1."""
    window, w = window.float(), weight.T.float().contiguous()  # [K, C]: each tap a contiguous row
    y = window[:, :T] * w[0]
    for tap in range(1, w.shape[0]):
        y += window[:, tap : tap + T] * w[tap]
    return F.silu(y.to(weight.dtype))
