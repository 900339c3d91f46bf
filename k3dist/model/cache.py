"""HybridCache: each mixer kind's per-slot entries (KDA conv + recurrent state, MLA latent rows) and positions,
allocated once on the device.

`cache_shapes` is the one statement of what the cache holds; the memory plan counts it and the cache allocates it.
Each mixer is handed its own tensors (model/build.py, in its spec's order) and writes them in place: nothing is
reallocated or copied between host and device per step. A slot is reset alone when it takes a new sequence; a
prefix snapshot of one slot (engine/snapshots.py) restores a prefix without recomputing.
"""

import torch

from ..config import ModelConfig
from ..kinds.registry import MIXERS


def cache_shapes(
    cfg: ModelConfig, world: int, batch: int, cap: int, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every cache tensor on one rank: `{entry}.{i}` for each cache entry of layer i's
    mixer kind (kinds/: KDA's `conv` and `state`, MLA's `latent`), and `positions` (tokens held per slot)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for spec in cfg.layers:
        for entry in MIXERS[spec.mixer].cache:
            out[f"{entry.name}.{spec.index}"] = (entry.shape(cfg, world, batch, cap), entry.dtype or dtype)
    out["positions"] = ((batch,), torch.int64)
    return out


class HybridCache:
    def __init__(self, cfg: ModelConfig, world: int, batch: int, cap: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.cap = batch, cap
        self.tensors = {
            name: torch.zeros(shape, dtype=dt, device=device)
            for name, (shape, dt) in cache_shapes(cfg, world, batch, cap, dtype).items()
        }
        self.positions = self.tensors["positions"]

    def layer(self, kind: str, index: int) -> torch.Tensor:
        return self.tensors[f"{kind}.{index}"]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def reset_slot(self, slot: int) -> None:
        """Empty one slot for a new sequence (outside decode): zero states, latent rows and its position."""
        for t in self.tensors.values():
            t[slot].zero_()

    def reset(self) -> None:
        for t in self.tensors.values():
            t.zero_()
