"""The whole KDA decode step after the projections, as one function: the signature a fused GPU kernel implements.

conv-state update + SiLU, l2norm of q and k, forget gate, beta, delta rule, output read, gated RMSNorm. This torch
version does the reference math (conv.py, kda.py, norm.py) with exactly the model's roundings, for q, k and v at
once, so it is both the oracle for the Triton kernel (kda_triton.py) and a CPU path with few ops.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from .conv import causal_conv_step
from .kda import L2_EPS, kda_gate
from .norm import gated_rmsnorm


@dataclass(frozen=True)
class KDALayer:
    """A KDA layer's constants, as the core reads them: conv_w [3, P, K]; A_log [H] fp32; dt_bias [P] fp32;
    o_norm [d]; eps of the gated RMSNorm; lower, the forget gate's form (kda.kda_gate: 0 Kimi-Linear's softplus, < 0
    K3's bound). P = H * d."""

    conv_w: Tensor
    A_log: Tensor
    dt_bias: Tensor
    o_norm: Tensor
    eps: float
    lower: float = 0.0
    l2_eps: float = L2_EPS  # inside q's and k's l2 norm (kda.py)


def kda_decode_fused(qkv: Tensor, g_raw: Tensor, beta_raw: Tensor, gate: Tensor, conv_state, state, layer: KDALayer):
    """One token per sequence through KDA's recurrent core.

    qkv: [B, 3, P] pre-conv q, k, v projections (compute dtype); g_raw: [B, P] = f_b(f_a(x)); beta_raw: [B, H] =
    b_proj(x) before the sigmoid; gate: [B, P] = g_b(g_a(x)) before the sigmoid; conv_state: [B, K-1, 3, P] previous
    pre-conv inputs, oldest first, token-major, contiguous in its last two dims, updated in place; state:
    [B, H, d, d] fp32 key-major, updated in place.
    Returns [B, P] in qkv's dtype: the gated, normed output that o_proj reads.
    """
    conv_w, A_log, dt_bias, o_norm, eps = layer.conv_w, layer.A_log, layer.dt_bias, layer.o_norm, layer.eps
    B, _, P = qkv.shape
    H = beta_raw.shape[-1]
    d = P // H
    # short conv + SiLU over q, k, v as one row of 3P channels (conv.py): fp32 products, rounded once
    K1 = conv_state.shape[1]
    mixed = causal_conv_step(qkv.reshape(B, 3 * P), conv_w.reshape(3 * P, -1), conv_state.view(B, K1, 3 * P))
    q, k, v = mixed.float().view(B, 3, H, d).unbind(1)
    # l2norm (eps inside the sqrt) and the q scale, gate and beta in fp32 (kda.py)
    q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + layer.l2_eps) * d**-0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + layer.l2_eps)
    g = kda_gate(g_raw.view(B, H, d), A_log, dt_bias, layer.lower)
    beta = beta_raw.float().sigmoid().unsqueeze(-1)
    # delta rule on the key-major state: decay, write beta * (v - S^T k) along k, read S^T q
    state.mul_(g.exp().unsqueeze(-1))
    u = beta * (v - (k.unsqueeze(-2) @ state).squeeze(-2))
    state.addcmul_(k.unsqueeze(-1), u.unsqueeze(-2))
    o = (q.unsqueeze(-2) @ state).squeeze(-2)  # [B, H, d], fp32: unrounded into the norm
    return gated_rmsnorm(o, gate.view(B, H, d), o_norm, eps).to(qkv.dtype).reshape(B, P)
