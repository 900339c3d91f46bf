"""The kernel backend, chosen once when the model is built (`kernels.backend=auto|torch|triton`).

The torch references are the oracle and the CPU path; the Triton kernels implement the same signatures for the GPU.
The model receives a `Kernels` the way it receives its `TPComm`, and never asks again.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from k3dist.kernels import kda_fused, mla

from k3dist.base.errors import K3Error


@dataclass(frozen=True)
class Kernels:
    name: str
    kda_decode: Callable  # kda_fused.kda_decode_fused's signature
    mla_decode: Callable  # mla.mla_decode's signature


TORCH = Kernels("torch", kda_fused.kda_decode_fused, mla.mla_decode)


def _triton() -> Kernels:
    from k3dist.kernels import kda_triton, mla_triton

    return Kernels("triton", kda_triton.kda_decode_fused, mla_triton.mla_decode)


def select(backend: str, device: torch.device) -> Kernels:
    """auto: Triton on CUDA when it imports, else torch. triton: Triton or a clear refusal."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TORCH
    try:
        return _triton()
    except ImportError as exc:
        if backend == "auto":
            return TORCH
        raise K3Error(f"kernels.backend=triton: the Triton kernels do not import here ({exc})") from None
