"""Small building blocks shared by the mixers and MLPs, written as transformers' KimiLinear computes them, and the
activation a config names."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import KIMI_K3, ModelConfig
from ..kernels.activation import SILU, Activation, from_config
from ..kernels.activation import glu as activation_glu
from ..kernels.backend import Kernels
from ..kernels.norm import gated_rmsnorm, rmsnorm
from .tp import TPComm

__all__ = ["Binding", "activation_of", "gated_mlp", "gated_rmsnorm", "rmsnorm"]


@dataclass(frozen=True)
class Binding:
    """What every mixer and MLP is built from (model/build.py makes it once): `weight(name)` reads a tensor of the
    rank's store as it is, `linear(name)` makes the projection holder build_model chose for it (model/linear.py:
    plain, packed or int8); the model's config, its collectives, its kernels, the compute dtype and the MLPs'
    gated activation (`activation_of`)."""

    weight: Callable[[str], Tensor]
    linear: Callable[[str], object]
    cfg: ModelConfig
    comm: TPComm
    kernels: Kernels
    dtype: torch.dtype
    widen: bool = False  # prefill GEMMs widened to fp32 (linear.py)
    act: Activation = SILU


def activation_of(cfg: ModelConfig) -> Activation:
    """SwiGLU's SiLU for Kimi-Linear, SiTU-GLU with the config's betas for K3 (config/k3.py refuses any other)."""
    return from_config("situ", cfg.situ_beta, cfg.situ_linear_beta) if cfg.variant == KIMI_K3 else SILU


def gated_mlp(x: Tensor, gate_up, down, act: Activation = SILU, glu=activation_glu) -> Tensor:
    """down(act(gate x, up x)); `gate_up` holds the gate rows then the up rows ([2I, D], column-parallel).
    The weights are model/linear.py's Linear (or Int8Linear) objects; `glu` the backend's (Kernels.glu)."""
    return down(glu(gate_up(x), act))
