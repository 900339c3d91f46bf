"""The one way to assemble a model: weights from the store, each mixer handed its own cache tensors, collectives and
kernels chosen once. The job, the tests and the benchmarks all build through here."""

import torch

from ..cache import HybridCache
from ..config import ModelConfig
from ..kernels.backend import Kernels
from .decoder import DecoderLayer, K3Model
from .kda import KDA
from .mla import MLA
from .moe import DenseMLP, MoE
from .tp import TPComm


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    comm: TPComm,
    cache: HybridCache,
    kernels: Kernels,
    router_weights: str = "unbiased",
) -> K3Model:
    w = weights.__getitem__
    layers = []
    for spec in cfg.layers:
        p = f"model.layers.{spec.index}."
        attn = p + "self_attn."
        if spec.mixer == "kda":
            mixer = KDA(w, attn, cfg, comm, kernels, cache.layer("conv", spec.index), cache.layer("state", spec.index))
        else:
            mixer = MLA(w, attn, cfg, comm, kernels, cache.layer("latent", spec.index))
        if spec.mlp == "dense":
            mlp = DenseMLP(w, p + "mlp.", comm)
        else:
            mlp = MoE(w, p + "block_sparse_moe.", cfg, comm, biased=router_weights == "biased")
        norms = w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight")
        layers.append(DecoderLayer(spec, mixer, mlp, *norms, cfg.rms_norm_eps))
    return K3Model(
        cfg, w("model.embed_tokens.weight"), layers, w("model.norm.weight"), w("lm_head.weight"), comm, kernels
    )
