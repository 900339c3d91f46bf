"""The kernel backend, chosen once when the model is built (`kernels.backend=auto|torch|cpu|triton`).

The torch references are the oracle; the Triton kernels implement the same signatures for the GPU, and the C++ CPU
ops (kernels/cpu_ops.py) the KDA core (decode and prefill), MLA's absorbed decode, the decode MoE block, the routed
experts for any token count (dense or MXFP4-packed weights) and the router's choice before them, a one-row int8
GEMV, decode rows' GEMV, the logits' top-k with their log-sum-exp, the RMSNorm, K3's mixing site and the MLPs' gated
activation for the CPU.
`auto` is Triton on CUDA and the CPU ops on a CPU, each where it builds or imports (Triton: a version the kernels
ran on, compat.TRITON_MINIMUM), else the references. The model
receives a `Kernels` the way it receives its `TPComm`, and never asks again.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3dist.base import compat
from k3dist.base.errors import K3Error
from k3dist.kernels import activation, kda_fused, mla, norm


@dataclass(frozen=True)
class Kernels:
    name: str
    kda_decode: Callable  # kda_fused.kda_decode_fused's signature
    mla_decode: Callable  # mla.mla_decode's signature
    moe_decode: Callable | None = None  # cpu_ops.moe_decode's signature; None: the torch MoE paths
    kda_prefill: Callable | None = None  # cpu_ops.kda_prefill's signature; None: the chunked reference (kda.py)
    int8_mm: Callable | None = None  # cpu_ops.int8_mm's (one activation row); None: torch's int8 GEMM (quant.py)
    topk_lse: Callable | None = None  # cpu_ops.topk_lse's; None: torch's top-k and log-sum-exp (model/tp.py)
    mla_absorbed: Callable | None = None  # cpu_ops.mla_absorbed's; None: bmm's around mla_decode (model/mla.py)
    linear_rows: Callable | None = None  # cpu_ops.linear_rows' (decode rows); None: F.linear (model/linear.py)
    # cpu_ops.moe_experts' (moe_triton.moe_experts'): routed experts, dense or packed; None: kernels/moe.py's paths
    moe_experts: Callable | None = None
    moe_route: Callable | None = None  # cpu_ops.moe_route's: the router after its GEMV; None: model/moe.py's torch ops
    rmsnorm: Callable = norm.rmsnorm  # KimiRMSNorm (cpu_ops.rmsnorm: one op)
    res_mix: Callable = norm.res_mix  # K3's mixing site (cpu_ops.res_mix: one op)
    glu: Callable = activation.glu  # a gated MLP's activation (cpu_ops.glu: one op)


TORCH = Kernels("torch", kda_fused.kda_decode_fused, mla.mla_decode)


def _cpu() -> Kernels | None:
    from k3dist.kernels import cpu_ops

    if not cpu_ops.available():
        return None
    return Kernels(
        "cpu",
        cpu_ops.kda_decode,
        mla.mla_decode,
        moe_decode=cpu_ops.moe_decode,
        kda_prefill=cpu_ops.kda_prefill,
        int8_mm=cpu_ops.int8_mm,
        topk_lse=cpu_ops.topk_lse,
        mla_absorbed=cpu_ops.mla_absorbed,
        linear_rows=cpu_ops.linear_rows,
        moe_experts=cpu_ops.moe_experts,
        moe_route=cpu_ops.moe_route,
        rmsnorm=cpu_ops.rmsnorm,
        res_mix=cpu_ops.res_mix,
        glu=cpu_ops.glu,
    )


def _triton() -> Kernels:
    from k3dist.kernels import kda_triton, mla_triton, moe_triton

    return Kernels("triton", kda_triton.kda_decode_fused, mla_triton.mla_decode, moe_experts=moe_triton.moe_experts)


def expected(backend: str, device: torch.device) -> str:
    """The name of the backend `select` would choose, without building or importing it (a what-if plan's
    question): the CPU ops where they are built or look buildable, Triton where it is installed."""
    import importlib.util

    from k3dist.kernels import cpu_ops

    if backend in ("torch", "cpu", "triton"):
        return backend
    if device.type == "cuda":
        return "triton" if compat.triton_usable() and importlib.util.find_spec("triton") is not None else "torch"
    return "cpu" if cpu_ops.buildable() else "torch"


def select(backend: str, device: torch.device) -> Kernels:
    """auto: Triton on CUDA when it imports, the CPU ops on a CPU when they build, else torch. triton and cpu: those
    or a clear refusal."""
    if backend == "torch":
        return TORCH
    if backend == "cpu" and device.type != "cpu":
        raise K3Error(f"kernels.backend=cpu runs on the CPU only (dist.device is {device.type})")
    if backend == "cpu" or (backend == "auto" and device.type != "cuda"):
        cpu = _cpu()
        if cpu is None and backend == "cpu":
            from k3dist.kernels import cpu_ops

            raise K3Error(f"kernels.backend=cpu: the CPU kernels do not build here ({cpu_ops.build_error()})")
        return cpu or TORCH
    if not compat.triton_usable():
        if backend == "auto":
            return TORCH
        found = compat.triton_version() or "none"
        raise K3Error(f"kernels.backend=triton needs Triton >= {compat.TRITON_MINIMUM} (installed: {found})")
    try:
        return _triton()
    except ImportError as exc:
        if backend == "auto":
            return TORCH
        raise K3Error(f"kernels.backend=triton: the Triton kernels do not import here ({exc})") from None
