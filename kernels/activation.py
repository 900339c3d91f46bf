"""The gated activation of an MLP, as a value: SwiGLU's SiLU for Kimi-Linear, SiTU-GLU for Kimi K3.

The model picks one from its config once (`from_config`) and hands it to every MLP path: the torch references call
it (`act(gate, up)`), the C++ and Triton kernels take its `code` and betas and choose their inner loop once per call,
so nothing tests a name per element or per layer.

Roundings. SiLU is torch's `F.silu(gate) * up` in the compute dtype (two roundings), as Kimi-Linear always ran.
SiTU follows llama.cpp's K3 port, the golden reference (`kimi_k3_situ`: ggml scale, tanh, scale, sigmoid, mul, each
rounding to fp32), in fp32 from the compute dtype's gate and up, rounded once back:

    a = tanh(g * (1/beta)) * beta * sigmoid(g);   l = tanh(u * (1/linear_beta)) * linear_beta;   act = a * l

with 1/beta rounded to fp32 first (1/4 is exact; 1/25 is 0.04f, where Moonshot divides by 25: an ulp apart, well
below anything the goldens resolve). The kernels compute exactly these fp32 operations in this order.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

SILU_CODE, SITU_CODE = 0, 1  # the kernels' `act` argument


@dataclass(frozen=True)
class SiLU:
    """SwiGLU: silu(gate) * up."""

    code = SILU_CODE
    beta = linear_beta = 0.0  # unused; the kernels take three numbers whatever the activation

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


@dataclass(frozen=True)
class SiTU:
    """SiTU-GLU: beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta), in fp32, rounded back once."""

    beta: float
    linear_beta: float
    # 1/beta and 1/linear_beta rounded to fp32, as llama.cpp computes them (1.0f / beta): worked out once, when the
    # value is made, not on every call of a decode step
    inverses: tuple[float, float] = field(init=False, repr=False, compare=False)
    code = SITU_CODE

    def __post_init__(self):
        if not (self.beta > 0 and self.linear_beta > 0):
            raise ValueError(f"SiTU needs positive betas, got beta={self.beta}, linear_beta={self.linear_beta}")
        one = torch.ones((), dtype=torch.float32)
        object.__setattr__(self, "inverses", ((one / self.beta).item(), (one / self.linear_beta).item()))

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        inv, inv_linear = self.inverses
        g, u = gate.float(), up.float()
        a = torch.tanh(g * inv) * self.beta * torch.sigmoid(g)
        return (a * (torch.tanh(u * inv_linear) * self.linear_beta)).to(gate.dtype)


Activation = SiLU | SiTU
SILU = SiLU()


def from_config(hidden_act: str, beta: float | None = None, linear_beta: float | None = None) -> Activation:
    """The activation a config names: `silu` (Kimi-Linear) or `situ` with its two betas (K3)."""
    if hidden_act == "silu":
        return SILU
    if hidden_act == "situ":
        if beta is None or linear_beta is None:
            raise ValueError("hidden_act=situ needs activation_situ_beta and activation_situ_linear_beta")
        return SiTU(float(beta), float(linear_beta))
    raise ValueError(f"hidden_act={hidden_act!r} is not supported (silu, situ)")


def glu(gate_up: Tensor, act: Activation) -> Tensor:
    """act(gate, up) of a gate_up projection's output [..., 2I]: the gate rows' outputs, then the up rows'."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate, up)
