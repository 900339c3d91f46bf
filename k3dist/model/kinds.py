"""How each layer kind of kinds/registry.py is built over one rank's weights: its module, handed its own cache
entries (in the order its spec lists them). Every mixer has one call signature (prefill(x, slots, start),
decode(x, positions, rows)) and every MLP another (prefill(x), decode(x)), so the decoder never asks which kind."""

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from ..kinds.kda import KDA as KDA_KIND
from ..kinds.mla import MLA as MLA_KIND
from ..kinds.mlps import DENSE, MOE
from ..kinds.spec import LayerKind
from .experts import DenseExperts
from .kda import KDA
from .latent_moe import LatentMoE
from .layers import Binding
from .mla import MLA
from .moe import DenseMLP, MoE


@dataclass(frozen=True)
class BuildOptions:
    """What build_model decided for every layer: the router's weights, and the experts held dense (or None)."""

    biased: bool
    dense_experts: Callable[[str], DenseExperts | None]


Builder = Callable[[Binding, str, list[Tensor], BuildOptions], object]  # (bind, layer prefix, cache, options)

BUILDERS: dict[str, Builder] = {
    KDA_KIND.name: lambda b, p, cache, o: KDA(b, p + "self_attn.", *cache),
    MLA_KIND.name: lambda b, p, cache, o: MLA(b, p + "self_attn.", *cache),
    DENSE.name: lambda b, p, cache, o: DenseMLP(b, p + "mlp."),
    MOE.name: lambda b, p, cache, o: (
        LatentMoE(b, p + "block_sparse_moe.", biased=o.biased)
        if b.cfg.latent_size  # K3's experts work in a latent
        else MoE(b, p + "block_sparse_moe.", biased=o.biased, dense=o.dense_experts(p + "block_sparse_moe."))
    ),
}


def build_kind(kind: LayerKind, bind: Binding, layer: str, cache: list[Tensor], options: BuildOptions):
    """The module of `kind` for the layer whose names start with `layer`, over its cache entries `cache`."""
    return BUILDERS[kind.name](bind, layer, cache, options)
