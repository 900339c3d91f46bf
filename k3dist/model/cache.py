"""HybridCache: per-slot KDA conv + recurrent state, MLA latent rows and positions, allocated once on the device.

`cache_shapes` is the one statement of what the cache holds; the memory plan counts it and the cache allocates it.
Each mixer is handed its own tensors (model/decoder.py) and writes them in place: nothing is reallocated or copied
between host and device per step. A slot is reset alone when it takes a new sequence; a host snapshot keeps a
prefix and restores it without recomputing.
"""

from dataclasses import dataclass

import torch

from ..base.errors import K3Error
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


@dataclass
class HostSnapshot:
    """A cache's content on the host: every tensor, the latent only up to the longest slot's position."""

    cap: int
    tensors: dict[str, torch.Tensor]


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

    def check_room(self, slot: int, start: int, n: int) -> None:
        if start + n > self.cap:
            raise K3Error(f"cache.cap={self.cap} tokens cannot hold {start} + {n} tokens in slot {slot}")

    def to_host(self) -> HostSnapshot:
        """Copy the content to the host (outside decode): one copy per tensor, never a view, even on the CPU."""
        held = int(self.positions.max())
        return HostSnapshot(
            self.cap,
            {n: (t[:, :held] if n.startswith("latent.") else t).to("cpu", copy=True) for n, t in self.tensors.items()},
        )

    def load_host(self, snap: HostSnapshot) -> None:
        """Overwrite this cache with a snapshot, in place (host-to-device copies only)."""
        held = int(snap.tensors["positions"].max())
        if held > self.cap or set(snap.tensors) != set(self.tensors):
            raise K3Error(f"snapshot of {held} tokens does not fit this cache (cap {self.cap})")
        for name, t in self.tensors.items():
            (t[:, :held] if name.startswith("latent.") else t).copy_(snap.tensors[name])

    @classmethod
    def from_host(
        cls, snap: HostSnapshot, cfg: ModelConfig, world: int, dtype: torch.dtype, device: torch.device
    ) -> "HybridCache":
        cache = cls(cfg, world, snap.tensors["positions"].shape[0], snap.cap, dtype, device)
        cache.load_host(snap)
        return cache
