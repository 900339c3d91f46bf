"""The registry of layer kinds: the only place their names are matched (tests/unit/test_kinds.py checks it).

Registry order is the order every per-kind list comes out in (config checks, TP rules, prefill terms).
"""

from .kda import KDA
from .mla import MLA
from .mlps import DENSE, MOE
from .spec import CacheEntry, LayerKind

MIXERS: dict[str, LayerKind] = {k.name: k for k in (KDA, MLA)}
MLPS: dict[str, LayerKind] = {k.name: k for k in (DENSE, MOE)}
KINDS: tuple[LayerKind, ...] = (*MIXERS.values(), *MLPS.values())
CACHE_ENTRIES: dict[str, CacheEntry] = {e.name: e for k in KINDS for e in k.cache}


def kinds_of(layer) -> tuple[LayerKind, LayerKind]:
    """LayerSpec `layer`'s (mixer kind, MLP kind)."""
    return MIXERS[layer.mixer], MLPS[layer.mlp]


def present(cfg) -> tuple[LayerKind, ...]:
    """The kinds `cfg` has at least one layer of, in registry order."""
    return tuple(k for k in KINDS if k.present(cfg))


def cache_entry(tensor: str) -> CacheEntry | None:
    """The entry a cache tensor `{name}.{layer}` belongs to; None for `positions` (not a layer's)."""
    return CACHE_ENTRIES.get(tensor.split(".", 1)[0]) if "." in tensor else None
