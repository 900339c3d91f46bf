"""KDA token mixer (docs/model.md) over this rank's heads; owns its slots' conv and recurrent state.

One fused projection reads the normed input for q, k, v, the low-rank gate inputs and beta; decode hands the rest
to the backend's fused kernel, prefill to the backend's prefill kernel where it has one (the CPU ops: the decode
update token by token) or else the chunked reference. o_proj is row-parallel: one all-reduce.

Kimi K3's KDA differs in three values, all decided by its config: the forget gate is lower-bounded (`lower` =
gate_lower_bound * sigmoid(...) instead of -exp(A_log) softplus(...): kernels/kda.py), and the output gate is a
full-rank `g_proj` [P, D] (the fused projection's last rows) instead of the low-rank g_b(g_a(x)); and its q and k l2
norms take the config's rms_norm_eps where Kimi-Linear's take fla's 1e-6, as llama.cpp's port (the reference) does:
at 1e-6 the K3 twin's logits move up to 4.6e-4 of their largest from llama.cpp's over a 520-token prompt, at
rms_norm_eps 3e-5. K3 stores A_log padded to 128 entries and replicated; each rank takes its own heads' entries.
"""

from torch import Tensor

from ..kernels.conv import causal_conv_prefill
from ..kernels.kda import L2_EPS, kda_gate, kda_prefill
from ..kernels.kda_fused import KDALayer
from ..weights.tp_plan import shard_range
from .layers import Binding, gated_rmsnorm


class KDA:
    def __init__(self, b: Binding, prefix: str, conv_state: Tensor, state: Tensor):
        w, lin, cfg = b.weight, b.linear, b.cfg
        # [3P + 2d + H, D]: q, k, v, f_a, g_a, b; K3: q, k, v, f_a, b, then its full-rank gate g [P, D]
        self.in_proj = lin(prefix + "in_proj.weight")
        self.conv_w = w(prefix + "conv1d.weight").flatten(2)  # [3, P, K]
        self.full_rank_gate = cfg.gate_lower_bound != 0.0  # K3 (config/k3.py requires both)
        if self.full_rank_gate:
            (self.f_b,) = lin(prefix + "fg_b_proj.weight")  # stacked [1, P, d]
        else:
            self.f_b, self.g_b = lin(prefix + "fg_b_proj.weight")  # stacked [2, P, d]: one Linear each
        self.o_proj, self.o_norm = lin(prefix + "o_proj.weight"), w(prefix + "o_norm.weight")
        self.heads, self.d = cfg.kda_heads // b.comm.world, cfg.kda_head_dim
        A_log = w(prefix + "A_log").view(-1)
        if A_log.numel() != self.heads:  # K3's padded [128], replicated: this rank's heads
            A_log = A_log[slice(*shard_range(cfg.kda_heads, b.comm.world, b.comm.rank))]
        self.A_log, self.dt_bias = A_log, w(prefix + "dt_bias")
        P = self.heads * self.d
        gates = (self.heads, P) if self.full_rank_gate else (self.d, self.heads)  # (b, g) or (g_a, b)
        self.split = (3 * P, self.d, *gates)
        self.eps, self.comm, self.kernels = cfg.rms_norm_eps, b.comm, b.kernels
        self.lower = cfg.gate_lower_bound
        self.l2_eps = self.eps if self.full_rank_gate else L2_EPS  # K3: llama.cpp's port (docs/k3.md, "Epsilons")
        self.layer = KDALayer(self.conv_w, self.A_log, self.dt_bias, self.o_norm, self.eps, self.lower, self.l2_eps)
        self.conv_state, self.state = conv_state, state  # [B, K-1, 3, P], [B, H, d, d] fp32

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(pre-conv q, k, v; the forget gate's input; beta before its sigmoid; the output gate before its sigmoid)"""
        if self.full_rank_gate:
            qkv, f_a, beta_raw, gate = self.in_proj(x).split(self.split, dim=-1)
            return qkv, self.f_b(f_a), beta_raw, gate
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
        g = kda_gate(g_raw.view(heads), self.A_log, self.dt_bias, self.lower)
        beta = beta_raw.float().sigmoid()
        o = kda_prefill(q.float(), k, v, g, beta, state, l2_eps=self.l2_eps)  # fp32 q: unrounded into the norm
        self.state.index_copy_(0, slots, state)
        o = gated_rmsnorm(o, gate.view(heads), self.o_norm, self.eps).to(x.dtype).reshape(n, T, -1)
        return self.comm.all_reduce(self.o_proj(o).float())
