"""MoE (docs/kimi-linear.md section 5): sigmoid router with a selection-only correction bias, routed SwiGLU
experts split by expert size over ranks, a shared expert, and one all-reduce for the whole block."""

import torch
import torch.nn.functional as F
from torch import Tensor

from .layers import swiglu


class MoE:
    def __init__(self, w: dict[str, Tensor], prefix: str, cfg, comm, biased: bool = False):
        self.gate = w[prefix + "gate.weight"]  # [E, D] fp32
        self.bias = w[prefix + "gate.e_score_correction_bias"]  # [E] fp32
        self.w1, self.w2, self.w3 = (w[prefix + f"experts.{n}"] for n in ("w1", "w2", "w3"))  # stacked [E, ...]
        shared = prefix + "shared_experts."
        self.shared = (
            tuple(w[shared + n] for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
            if shared + "gate_proj.weight" in w
            else None
        )
        self.top_k, self.groups, self.topk_group = cfg.top_k, cfg.num_expert_group, cfg.topk_group
        self.renormalize, self.scale, self.biased = cfg.renormalize, cfg.routed_scaling_factor, biased
        self.comm = comm

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [N, D] -> (expert ids [N, k], combination weights [N, k] fp32)."""
        scores = F.linear(x.float(), self.gate.float()).sigmoid()
        choice = scores + self.bias
        if self.groups > 1:
            grouped = choice.view(len(x), self.groups, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(len(x), -1)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = (choice if self.biased else scores).gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale

    def __call__(self, x: Tensor) -> Tensor:
        """x: [..., D] normed, any float dtype: the router reads it as fp32, the experts in the weights' dtype."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.route(flat)
        x = flat.to(self.w1.dtype)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = swiglu(x[token], self.w1[e], self.w3[e], self.w2[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        if self.shared is not None:
            out += swiglu(x, *self.shared)
        return self.comm.all_reduce(out).view(shape)


class DenseMLP:
    def __init__(self, w: dict[str, Tensor], prefix: str, comm):
        self.weights = tuple(w[prefix + n] for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
        self.comm = comm

    def __call__(self, x: Tensor) -> Tensor:
        return self.comm.all_reduce(swiglu(x.to(self.weights[0].dtype), *self.weights).float())
