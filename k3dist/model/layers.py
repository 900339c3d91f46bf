"""Small building blocks shared by the mixers and MLPs, written as transformers' KimiLinear computes them."""

import torch.nn.functional as F
from torch import Tensor

from ..kernels.norm import gated_rmsnorm, rmsnorm

__all__ = ["gated_rmsnorm", "rmsnorm", "swiglu"]


def swiglu(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """down(silu(gate x) * up x); `w_gate_up` holds the gate rows then the up rows ([2I, D], column-parallel)."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)
