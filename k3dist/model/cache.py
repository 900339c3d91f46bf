"""HybridCache: per-slot KDA conv + recurrent state, MLA latent rows and positions, allocated once on the device.

`cache_shapes` is the one statement of what the cache holds; the memory plan counts it and the cache allocates it.
Each mixer is handed its own tensors (model/decoder.py) and writes them in place: nothing is reallocated or copied
between host and device per step. A slot is reset alone when it takes a new sequence; a prefix snapshot of one
slot (engine/snapshots.py) restores a prefix without recomputing.
"""

import torch

from ..config import ModelConfig


def cache_shapes(
    cfg: ModelConfig, world: int, batch: int, cap: int, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every cache tensor on one rank: `conv.{i}`, `state.{i}` per KDA layer,
    `latent.{i}` per MLA layer, and `positions` (tokens held per slot)."""
    Pl, Hl, d = cfg.kda_dim // world, cfg.kda_heads // world, cfg.kda_head_dim
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for spec in cfg.layers:
        if spec.mixer == "kda":
            out[f"conv.{spec.index}"] = ((batch, cfg.conv_kernel - 1, 3, Pl), dtype)  # the last K-1 q, k, v inputs
            out[f"state.{spec.index}"] = ((batch, Hl, d, d), torch.float32)  # key-major S[h, k, v]
        else:
            out[f"latent.{spec.index}"] = ((batch, cap, cfg.kv_lora_rank + cfg.qk_rope_dim), dtype)
    out["positions"] = ((batch,), torch.int64)
    return out


def cache_nbytes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes.values())


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
