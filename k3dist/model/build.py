"""The one way to assemble a model: weights from the store, each mixer handed its own cache tensors, collectives and
kernels chosen once. The job, the tests and the benchmarks all build through here."""

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..kernels.backend import Kernels
from ..kinds.registry import kinds_of
from ..weights.quant_plan import quantized
from .cache import HybridCache
from .decoder import DecoderLayer, K3Model
from .experts import DenseExperts, experts_dense
from .kinds import BuildOptions, build_kind
from .layers import Binding, activation_of
from .linear import Int8Linear, Linear, widened
from .residuals import BlockResiduals, folded
from .tp import TPComm


@dataclass(frozen=True)
class Choices:
    """build_model's two layout decisions, as keywords for it: `build_model(..., **vars(choices))`."""

    widen: bool
    dense: bool


def choices(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, *, batch: int, pack: bool, cpu_ops: bool
) -> "Choices":
    """`widen` and `dense` for a model of `batch` slots whose kernels are the CPU ops (`cpu_ops`) or not: the rule the
    run plan decides by (run/plan.py), and the one tests and benchmarks that build without a plan take."""
    dense = experts_dense(cfg, batch, pack, moe_block=cpu_ops) and not cfg.latent_size  # K3: stacked or packed
    return Choices(widen=widened(dtype, device), dense=dense)


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    comm: TPComm,
    cache: HybridCache,
    kernels: Kernels,
    *,
    router_weights: str = "unbiased",
    pack: bool = False,
    widen: bool,
    dense: bool,
    quant: str = "none",
) -> K3Model:
    """With `pack`, the projections' weights are reordered for oneDNN one at a time (linear.py) and the plain ones leave
    `weights`, so at most one weight exists twice at any moment (three times for a dense expert layout's w2: plain,
    permuted, packed). With `widen`, prefill GEMMs run in fp32 on widened blocks (linear.py). `dense`: the MoE experts
    held as one dense GEMM pair (experts.py). Both are the run plan's decisions, taken as they are (a model built
    without a plan takes them from `choices`). With `quant="int8"` the projections weights/quant_plan.py names become
    int8 the same way, one at a time."""
    w = weights.__getitem__
    dtype = weights["model.embed_tokens.weight"].dtype

    def dense_experts(prefix: str) -> DenseExperts | None:
        if not dense:
            return None
        return DenseExperts(weights.pop(prefix + "experts.w13"), weights.pop(prefix + "experts.w2"), pack)

    def lin(name: str):
        int8 = quant == "int8" and quantized(name)
        weight = weights.pop(name) if pack or int8 else weights[name]
        make = (
            (lambda part: Int8Linear(part, kernels.int8_mm))
            if int8
            else (lambda part: Linear(part, pack, widen, kernels.linear_rows))
        )
        if weight.dim() == 3:  # stacked projections (KDA's f_b, g_b): one Linear each
            return tuple(make(part) for part in weight.unbind(0))
        return make(weight)

    bind = Binding(w, lin, cfg, comm, kernels, dtype, widen, activation_of(cfg))
    layers, options = [], BuildOptions(router_weights == "biased", dense_experts)
    block = cfg.attn_res_block_size  # K3's block attention residuals (residuals.py); 0: a plain residual stream
    site = lambda name: folded(w(name + "_res_norm.weight"), w(name + "_res_proj.weight"))  # noqa: E731
    for spec in cfg.layers:
        p = f"model.layers.{spec.index}."
        mixer, mlp = (
            build_kind(kind, bind, p, [cache.layer(e.name, spec.index) for e in kind.cache], options)
            for kind in kinds_of(spec)
        )
        norms = w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight")
        sites = (
            BlockResiduals(
                site(p + "self_attention"),
                site(p + "mlp"),
                spec.index % block == 0,
                cfg.rms_norm_eps,
                kernels.res_mix,
            )
            if block
            else None
        )
        layers.append(DecoderLayer(spec, mixer, mlp, *norms, cfg.rms_norm_eps, sites, kernels.rmsnorm))
    embed, norm, head = w("model.embed_tokens.weight"), w("model.norm.weight"), lin("lm_head.weight")
    out_score = site("model.output_attn") if block else None
    return K3Model(
        cfg, embed=embed, layers=layers, norm=norm, head=head, comm=comm, kernels=kernels, out_score=out_score
    )
