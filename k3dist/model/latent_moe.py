"""Kimi K3's latent MoE (docs/k3.md, "Latent MoE"): the router reads the full hidden state, the routed experts work in
a narrower latent between a down and an up projection, and the shared experts read the full hidden state.

    ids, w = router(x);  z = down x;  y = sum_k w_k W2_k act(W1_k z, W3_k z) (fp32);  out = up(rmsnorm(y)) + shared(x)

The down projection and the shared experts' gate and up projections read the same x: they are one weight
(`in_proj`, the loader's fused parts), one GEMV a step.

Tensor parallel (docs/model.md, "Kimi K3's TP plan"): `down` is split by latent row and its output all-gathered, so
every rank's experts read the whole latent; the experts are split by their own columns as Kimi-Linear's, so each
rank's fp32 combine is a partial sum, all-reduced before the latent norm sees it; `up` is split by latent column, and
its partial output joins the shared experts' in the MLP's one all-reduce. Three collectives a layer: one gather and
one all-reduce of the latent, one of the hidden state.

The routed experts run through the backend's `moe_experts` where it has one (the CPU ops, Triton), else
kernels/moe.py's torch paths; they are stacked in the compute dtype, or MXFP4 (`PackedExperts`), widened a block or
an expert at a time, never whole.
"""

from functools import partial

from torch import Tensor

from ..kernels.moe import experts_gathered, experts_grouped, experts_sorted
from ..kernels.mxfp4 import PackedExperts
from ..weights.tp_plan import shard_range
from .layers import Binding
from .moe import route


class LatentMoE:
    def __init__(self, b: Binding, prefix: str, *, biased: bool = False):
        w, lin, cfg = b.weight, b.linear, b.cfg
        self.gate, self.bias = w(prefix + "gate.weight"), w(prefix + "gate.e_score_correction_bias")
        self.top_k, self.renormalize, self.scale, self.biased = (
            cfg.top_k,
            cfg.renormalize,
            cfg.routed_scaling_factor,
            biased,
        )
        # the routed experts' down projection, then the shared experts' gate and up rows: [Z + 2 Is, D], one GEMV
        self.in_proj, self.up = lin(prefix + "in_proj.weight"), lin(prefix + "routed_expert_up_proj.weight")
        self.norm, self.eps = w(prefix + "routed_expert_norm.weight"), cfg.rms_norm_eps
        self.latent = slice(*shard_range(cfg.latent_size, b.comm.world, b.comm.rank))  # its normed latent's columns
        z_rows = self.latent.stop - self.latent.start
        self.split = (z_rows, self.in_proj.shape[0] - z_rows)  # (this rank's z, its shared gate and up rows)
        x = prefix + "experts."
        if cfg.mxfp4_experts:
            w13 = PackedExperts(w(x + "w13_packed"), w(x + "w13_scale"), b.dtype)
            w2 = PackedExperts(w(x + "w2_packed"), w(x + "w2_scale"), b.dtype)
        else:
            w13, w2 = w(x + "w13"), w(x + "w2")
        self.experts = w13.shape[0]
        if b.kernels.moe_experts is not None:
            self._decode = self._prefill = partial(b.kernels.moe_experts, w13=w13, w2=w2, act=b.act)
        else:
            self._few, self._many, self._prefill = (
                partial(path, w13=w13, w2=w2, act=b.act) for path in (experts_gathered, experts_sorted, experts_grouped)
            )
            self._decode = None
        self.shared_down = lin(prefix + "shared_experts.down_proj.weight")
        self.comm, self.dtype, self.act, self.kernels = b.comm, b.dtype, b.act, b.kernels
        self.choose = b.kernels.moe_route

    def _forward(self, x: Tensor, experts) -> Tensor:
        """x: [..., D] normed (the router reads it as fp32, the projections in the compute dtype)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = route(
            flat, self.gate, self.bias, self.top_k, 1, 1, self.renormalize, self.scale, self.biased, choose=self.choose
        )
        z, gate_up = self.in_proj(flat.to(self.dtype)).split(self.split, dim=-1)
        y = self.comm.all_reduce(experts(self.comm.gather_columns(z), ids, weights))  # [N, Z] fp32: the combine, whole
        y = self.kernels.rmsnorm(y, self.norm, self.eps).to(self.dtype)
        if self.comm.world > 1:  # `up` reads this rank's latent columns
            y = y[:, self.latent].contiguous()
        out = self.up(y).float().add_(self.shared_down(self.kernels.glu(gate_up, self.act)))  # (bf16 into fp32)
        return self.comm.all_reduce(out).view(shape)

    def decode(self, x: Tensor) -> Tensor:
        """The same path for every batch size of a step (a static shape either way): the backend's experts, or the
        torch paths' gathered GEMVs for few (token, expert) pairs and sorted grouped GEMMs for more."""
        if self._decode is not None:
            return self._forward(x, self._decode)
        tokens = x.reshape(-1, x.shape[-1]).shape[0]
        return self._forward(x, self._few if tokens * self.top_k < self.experts else self._many)

    def prefill(self, x: Tensor) -> Tensor:
        return self._forward(x, self._prefill)
