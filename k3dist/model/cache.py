"""HybridCache: each mixer kind's per-slot entries (KDA conv + recurrent state, MLA latent rows) and positions,
allocated once on the device.

`cache_shapes` is the one statement of what the cache holds; the memory plan counts it and the cache allocates it.
Each mixer is handed its own tensors (model/build.py, in its spec's order) and writes them in place: nothing is
reallocated or copied between host and device per step. A slot is reset alone when it takes a new sequence; a host
snapshot keeps a prefix and restores it without recomputing.
"""

from dataclasses import dataclass

import torch

from ..base.errors import K3Error
from ..config import ModelConfig
from ..kinds.registry import MIXERS, cache_entry


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


def _grows(name: str) -> bool:
    entry = cache_entry(name)
    return entry is not None and entry.grows


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
            {n: (t[:, :held] if _grows(n) else t).to("cpu", copy=True) for n, t in self.tensors.items()},
        )

    def load_host(self, snap: HostSnapshot) -> None:
        """Overwrite this cache with a snapshot, in place (host-to-device copies only)."""
        held = int(snap.tensors["positions"].max())
        if held > self.cap or set(snap.tensors) != set(self.tensors):
            raise K3Error(f"snapshot of {held} tokens does not fit this cache (cap {self.cap})")
        for name, t in self.tensors.items():
            (t[:, :held] if _grows(name) else t).copy_(snap.tensors[name])

    @classmethod
    def from_host(
        cls, snap: HostSnapshot, cfg: ModelConfig, world: int, dtype: torch.dtype, device: torch.device
    ) -> "HybridCache":
        cache = cls(cfg, world, snap.tensors["positions"].shape[0], snap.cap, dtype, device)
        cache.load_host(snap)
        return cache
