"""KDA token mixer (docs/model.md) over this rank's heads; owns its slots' conv and recurrent state.

One fused projection reads the normed input for q, k, v, the two low-rank gate inputs and beta; decode hands the
rest to the backend's fused kernel, prefill to the backend's prefill kernel where it has one (the CPU ops: the decode
update token by token) or else the chunked reference. o_proj is row-parallel: one all-reduce.
"""

from torch import Tensor

from ..kernels.conv import causal_conv_prefill
from ..kernels.kda import kda_gate, kda_prefill
from ..kernels.kda_fused import KDALayer
from .layers import Binding, gated_rmsnorm


class KDA:
    def __init__(self, b: Binding, prefix: str, conv_state: Tensor, state: Tensor):
        w, lin, cfg = b.weight, b.linear, b.cfg
        self.in_proj = lin(prefix + "in_proj.weight")  # [3P + 2d + H, D]: q, k, v, f_a, g_a, b
        self.conv_w = w(prefix + "conv1d.weight").flatten(2)  # [3, P, K]
        self.f_b, self.g_b = lin(prefix + "fg_b_proj.weight")  # stacked [2, P, d]: one Linear each
        self.o_proj, self.o_norm = lin(prefix + "o_proj.weight"), w(prefix + "o_norm.weight")
        self.A_log, self.dt_bias = w(prefix + "A_log").view(-1), w(prefix + "dt_bias")
        self.heads, self.d = self.A_log.numel(), cfg.kda_head_dim
        P = self.heads * self.d
        self.split = (3 * P, self.d, self.d, self.heads)
        self.eps, self.comm, self.kernels = cfg.rms_norm_eps, b.comm, b.kernels
        self.layer = KDALayer(self.conv_w, self.A_log, self.dt_bias, self.o_norm, self.eps)
        self.conv_state, self.state = conv_state, state  # [B, K-1, 3, P], [B, H, d, d] fp32

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qkv, f_a, g_a, beta_raw = self.in_proj(x).split(self.split, dim=-1)
        return qkv, self.f_b(f_a), beta_raw, self.g_b(g_a)

    def _core(self, op, x: Tensor, conv: Tensor, state: Tensor) -> Tensor:
        """The projections, then the backend's fused core `op` (decode or prefill: one signature) on the given conv
        and recurrent states, then o_proj and its all-reduce."""
        qkv, g_raw, beta_raw, gate = self._project(x)
        o = op(qkv.unflatten(-1, (3, -1)), g_raw, beta_raw, gate, conv, state, self.layer)
        return self.comm.all_reduce(self.o_proj(o).float())

    def decode(self, x: Tensor, positions: Tensor | None = None, rows: int | None = None) -> Tensor:
        """x: [n, D] normed, one token for each of the first n slots. Returns [n, D] fp32, summed over ranks. The
        state holds the positions (`positions` and `rows`: the mixers' one signature, model/kinds.py)."""
        n = x.shape[0]
        return self._core(self.kernels.kda_decode, x, self.conv_state[:n], self.state[:n])

    def prefill(self, x: Tensor, slots: Tensor, start: int) -> Tensor:
        """x: [n, T, D] normed, continuing slots `slots` [n] (their states hold the first `start` tokens).
        Returns [n, T, D] fp32, summed over ranks; the slots' states advance in place."""
        conv, state = self.conv_state.index_select(0, slots), self.state.index_select(0, slots)
        if self.kernels.kda_prefill is not None:
            out = self._core(self.kernels.kda_prefill, x, conv, state)
            self.conv_state.index_copy_(0, slots, conv)
            self.state.index_copy_(0, slots, state)
            return out
        n, T, _ = x.shape
        heads = (n, T, self.heads, self.d)
        qkv, g_raw, beta_raw, gate = self._project(x)
        q, k, v = (  # conv: [n, K-1, 3, P], token-major
            causal_conv_prefill(p, self.conv_w[i], conv[:, :, i]).view(heads)
            for i, p in enumerate(qkv.chunk(3, dim=-1))
        )
        self.conv_state.index_copy_(0, slots, conv)
        g = kda_gate(g_raw.view(heads), self.A_log, self.dt_bias)
        o = kda_prefill(q.float(), k, v, g, beta_raw.float().sigmoid(), state)  # fp32 q: unrounded into the norm
        self.state.index_copy_(0, slots, state)
        o = gated_rmsnorm(o, gate.view(heads), self.o_norm, self.eps).to(x.dtype).reshape(n, T, -1)
        return self.comm.all_reduce(self.o_proj(o).float())
