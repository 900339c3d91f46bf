"""KDA token mixer (docs/kimi-linear.md section 3) over this rank's heads; o_proj is row-parallel."""

import torch.nn.functional as F
from torch import Tensor

from ..kernels.conv import causal_conv_prefill, causal_conv_step
from ..kernels.kda import kda_decode_step, kda_gate, kda_prefill
from .layers import gated_rmsnorm


class KDA:
    def __init__(self, w: dict[str, Tensor], prefix: str, head_dim: int, eps: float, comm):
        get = lambda name: w[prefix + name]  # noqa: E731
        self.wq, self.wk, self.wv = get("q_proj.weight"), get("k_proj.weight"), get("v_proj.weight")
        self.convs = [get(f"{n}_conv1d.weight").squeeze(1) for n in "qkv"]  # [P_local, K] views
        self.f_a, self.f_b = get("f_a_proj.weight"), get("f_b_proj.weight")
        self.g_a, self.g_b = get("g_a_proj.weight"), get("g_b_proj.weight")
        self.b_proj, self.o_proj, self.o_norm = get("b_proj.weight"), get("o_proj.weight"), get("o_norm.weight")
        self.A_log, self.dt_bias = get("A_log").view(-1), get("dt_bias")
        self.d, self.eps, self.comm = head_dim, eps, comm
        self.heads = self.wq.shape[0] // head_dim

    def __call__(self, x: Tensor, conv_state: Tensor, state: Tensor) -> Tensor:
        """x: [B, T, D] normed; conv_state: [B, 3, P_local, K-1]; state: [B, H_local, d, d] fp32 (in place)."""
        B, T, _ = x.shape
        heads = (B, T, self.heads, self.d)
        projected = (F.linear(x, w) for w in (self.wq, self.wk, self.wv))
        if T == 1:
            q, k, v = (
                causal_conv_step(p[:, 0], w, conv_state[:, i]).view(heads)
                for i, (p, w) in enumerate(zip(projected, self.convs, strict=True))
            )
        else:
            q, k, v = (
                causal_conv_prefill(p, w, conv_state[:, i]).view(heads)
                for i, (p, w) in enumerate(zip(projected, self.convs, strict=True))
            )
        g = kda_gate(F.linear(F.linear(x, self.f_a), self.f_b).view(heads), self.A_log, self.dt_bias)
        beta = F.linear(x, self.b_proj).float().sigmoid()
        q = q.float()  # the kernel works in fp32 anyway; an fp32 q keeps its output unrounded for the norm
        if T == 1:
            o = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state).unsqueeze(1)
        else:
            o = kda_prefill(q, k, v, g, beta, state)
        gate = F.linear(F.linear(x, self.g_a), self.g_b).view(heads)
        o = gated_rmsnorm(o, gate, self.o_norm, self.eps).to(x.dtype).reshape(B, T, -1)
        return self.comm.all_reduce(F.linear(o, self.o_proj).float())
