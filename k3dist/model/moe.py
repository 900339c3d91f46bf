"""MoE (docs/model.md): sigmoid router with a selection-only correction bias, routed SwiGLU experts split by expert
size over ranks, a shared expert, and one all-reduce for the whole block. No path reads anything on the host:
decode gathers the chosen experts' weights, prefill groups tokens by expert with static shapes; or, where the
batch covers the experts on a CPU, every expert runs as one dense GEMM pair (experts.py's `dense_wanted`); or,
with the CPU kernels and up to ONE_OP_TOKENS decode tokens, the whole block after the router's GEMV is one op
(kernels/cpu_ops.py), reading the stacked and shared weights in place."""

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.moe import experts_gathered, experts_grouped, experts_sorted
from .experts import ONE_OP_PREFILL, ONE_OP_TOKENS, DenseExperts
from .layers import Binding, gated_mlp
from .linear import Linear


class MoE:
    def __init__(self, b: Binding, prefix: str, *, biased: bool = False, dense: DenseExperts | None = None):
        """`biased`: the combination weights include the correction bias (model.router_weights); `dense`: the
        experts as one dense GEMM pair, else stacked."""
        w, lin, cfg, kernel = b.weight, b.linear, b.cfg, b.kernels.moe_decode
        self.gate = w(prefix + "gate.weight")  # [E, D] fp32
        self.bias = w(prefix + "gate.e_score_correction_bias")  # [E] fp32
        self.dense, self.dtype, self.experts = dense, b.dtype, cfg.num_experts
        self.top_k, self.groups, self.topk_group = cfg.top_k, cfg.num_expert_group, cfg.topk_group
        self.renormalize, self.scale, self.biased = cfg.renormalize, cfg.routed_scaling_factor, biased
        self.comm = b.comm
        # the one-op CPU block (cpu_ops.moe_decode): one expert group, stacked weights, and plain shared weights
        self.kernel = kernel if dense is None and self.groups == 1 else None
        self.stacked = None
        if dense is None:  # stacked [E, 2I, D], [E, D, I]: each path bound to them once
            self.stacked = {"w13": w(prefix + "experts.w13"), "w2": w(prefix + "experts.w2")}
            self._few, self._many, self._chunk = (
                partial(path, **self.stacked) for path in (experts_gathered, experts_sorted, experts_grouped)
            )
        else:
            self._few = self._many = self._chunk = dense
        shared = prefix + "shared_experts."
        shared_lin = (
            lin if self.kernel is None else (lambda name: Linear(w(name), widen=b.widen, rows=b.kernels.linear_rows))
        )
        self.shared = (
            (shared_lin(shared + "gate_up_proj.weight"), shared_lin(shared + "down_proj.weight"))
            if cfg.num_shared_experts
            else None
        )

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [N, D] -> (expert ids [N, k], combination weights [N, k] fp32)."""
        return route(
            x, self.gate, self.bias, self.top_k, self.groups, self.topk_group, self.renormalize, self.scale, self.biased
        )

    def _forward(self, x: Tensor, experts) -> Tensor:
        """x: [..., D] normed, any float dtype: the router reads it as fp32, the experts in the compute dtype."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.route(flat)
        flat = flat.to(self.dtype)
        out = experts(flat, ids, weights)
        if self.shared is not None:
            out = out + gated_mlp(flat, *self.shared).float()
        return self.comm.all_reduce(out).view(shape)

    def decode(self, x: Tensor) -> Tensor:
        """Up to ONE_OP_TOKENS tokens with the CPU kernel: the one-op block. Otherwise few (token, expert) pairs:
        gather the chosen experts' weights; more pairs than experts: sort them and run grouped GEMMs, reading each
        expert once; dense experts take both. The choice depends on the batch only: a static shape either way."""
        tokens = x.reshape(-1, x.shape[-1]).shape[0]
        if self.kernel is not None and self.dense is None and tokens <= ONE_OP_TOKENS:
            return self._one_op(x)
        few = tokens * self.top_k < self.experts
        return self._forward(x, self._few if few else self._many)

    def _one_op(self, x: Tensor) -> Tensor:
        """The CPU block after the router's GEMV (kept as torch's own fp32 F.linear, as transformers runs it)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = F.linear(flat.float(), self.gate.float())
        shared = (self.shared[0].weight, self.shared[1].weight) if self.shared is not None else (None, None)
        s = self.stacked
        out = self.kernel(
            flat,
            logits,
            bias=self.bias,
            w13=s["w13"],
            w2=s["w2"],
            shared13=shared[0],
            shared2=shared[1],
            top_k=self.top_k,
            renormalize=self.renormalize,
            scale=self.scale,
            biased=self.biased,
        )
        return self.comm.all_reduce(out).view(shape)

    def prefill(self, x: Tensor) -> Tensor:
        """A short piece (a prompt's rest after a restored snapshot, a chat turn) runs the one-op block a few tokens
        at a time: the grouped GEMMs pad every expert's rows and cost about the same from 1 token to 100s."""
        flat = x.reshape(-1, x.shape[-1])
        if self.kernel is not None and len(flat) <= ONE_OP_PREFILL:  # (a kernel only without dense experts)
            parts = [self._one_op(flat[a : a + ONE_OP_TOKENS]) for a in range(0, len(flat), ONE_OP_TOKENS)]
            return torch.cat(parts).view(x.shape)
        return self._forward(x, self._chunk)


def route(
    x: Tensor,
    gate: Tensor,
    bias: Tensor,
    top_k: int,
    groups: int,
    topk_group: int,
    renormalize: bool,
    scale: float,
    biased: bool,
    sort: bool = False,
    choose=None,
) -> tuple[Tensor, Tensor]:
    """The sigmoid router: x [N, D] -> (expert ids [N, k], combination weights [N, k] fp32). The correction bias
    chooses (within the best `topk_group` groups where there are several); the weights are the unbiased scores
    (`biased`: the biased ones), renormalised over the k. `sort`: ids in descending order of the biased score.
    `choose`: the backend's op for all of it after the GEMV (Kernels.moe_route: one group, ids in that order)."""
    logits = F.linear(x.float(), gate.float())
    if choose is not None and groups == 1:
        return choose(logits, bias, top_k, renormalize, scale, biased)
    scores = logits.sigmoid()
    choice = scores + bias
    if groups > 1:
        grouped = choice.view(len(x), groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(len(x), -1)
    ids = choice.topk(top_k, dim=-1, sorted=sort).indices
    weights = (choice if biased else scores).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scale


class DenseMLP:
    """A gated MLP (SwiGLU, or K3's SiTU-GLU: the binding's activation), column- then row-parallel."""

    def __init__(self, b: Binding, prefix: str):
        self.gate_up, self.down = b.linear(prefix + "gate_up_proj.weight"), b.linear(prefix + "down_proj.weight")
        self.comm, self.dtype, self.act, self.glu = b.comm, b.dtype, b.act, b.kernels.glu

    def __call__(self, x: Tensor) -> Tensor:
        return self.comm.all_reduce(gated_mlp(x.to(self.dtype), self.gate_up, self.down, self.act, self.glu).float())

    decode = prefill = __call__
