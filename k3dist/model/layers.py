"""Small building blocks shared by the mixers and MLPs, written as transformers' KimiLinear computes them."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import ModelConfig
from ..kernels.backend import Kernels
from ..kernels.norm import gated_rmsnorm, rmsnorm
from .tp import TPComm

__all__ = ["Binding", "gated_rmsnorm", "rmsnorm", "swiglu"]


@dataclass(frozen=True)
class Binding:
    """What every mixer and MLP is built from (model/build.py makes it once): `weight(name)` reads a tensor of the
    rank's store as it is, `linear(name)` makes the projection holder build_model chose for it (model/linear.py:
    plain, packed or int8); the model's config, its collectives, its kernels and the compute dtype."""

    weight: Callable[[str], Tensor]
    linear: Callable[[str], object]
    cfg: ModelConfig
    comm: TPComm
    kernels: Kernels
    dtype: torch.dtype
    widen: bool = False  # prefill GEMMs widened to fp32 (linear.py)


def swiglu(x: Tensor, gate_up, down) -> Tensor:
    """down(silu(gate x) * up x); `gate_up` holds the gate rows then the up rows ([2I, D], column-parallel).
    The weights are model/linear.py's Linear (or Int8Linear) objects."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)
