"""Small building blocks shared by the mixers and MLPs, written as transformers' KimiLinear computes them."""

import torch.nn.functional as F
from torch import Tensor

from ..kernels.norm import gated_rmsnorm, rmsnorm

__all__ = ["gated_rmsnorm", "rmsnorm", "swiglu"]


def swiglu(x: Tensor, gate_up, down) -> Tensor:
    """down(silu(gate x) * up x); `gate_up` holds the gate rows then the up rows ([2I, D], column-parallel).
    The weights are model/linear.py's Linear (or Int8Linear) objects."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)
