"""The whole KDA decode step after the projections, as one function: the signature a fused GPU kernel implements.

conv-state update + SiLU, l2norm of q and k, forget gate, beta, delta rule, output read, gated RMSNorm. This torch
version composes the reference pieces (conv.py, kda.py, norm.py) with exactly the model's roundings, so it is the
oracle for the Triton kernel (kda_triton.py) and the CPU path.
"""

from torch import Tensor

from .conv import causal_conv_step
from .kda import kda_decode_step, kda_gate
from .norm import gated_rmsnorm


def kda_decode_fused(
    qkv: Tensor,
    conv_state: Tensor,
    conv_w: Tensor,
    g_raw: Tensor,
    beta_raw: Tensor,
    gate: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    o_norm: Tensor,
    eps: float,
    state: Tensor,
) -> Tensor:
    """One token per sequence through KDA's recurrent core.

    qkv: [B, 3, P] pre-conv q, k, v projections (compute dtype); conv_state: [B, 3, P, K-1] previous pre-conv
    inputs, oldest first, updated in place; conv_w: [3, P, K]; g_raw: [B, P] = f_b(f_a(x)); beta_raw: [B, H] =
    b_proj(x) before the sigmoid; gate: [B, P] = g_b(g_a(x)) before the sigmoid; A_log: [H] fp32; dt_bias: [P] fp32;
    o_norm: [d]; state: [B, H, d, d] fp32 key-major, updated in place. P = H * d.
    Returns [B, P] in qkv's dtype: the gated, normed output that o_proj reads.
    """
    B, _, P = qkv.shape
    H = beta_raw.shape[-1]
    d = P // H
    q, k, v = (causal_conv_step(qkv[:, i], conv_w[i], conv_state[:, i]).view(B, H, d) for i in range(3))
    g = kda_gate(g_raw.view(B, H, d), A_log, dt_bias)
    beta = beta_raw.float().sigmoid()
    o = kda_decode_step(q.float(), k, v, g, beta, state)  # fp32 q: the output stays unrounded into the norm
    return gated_rmsnorm(o, gate.view(B, H, d), o_norm, eps).to(qkv.dtype).reshape(B, P)
