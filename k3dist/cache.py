"""DeviceHybridCache: per-layer KDA conv + recurrent state and MLA latent rows, allocated once on the device.

Decode writes into these tensors in place: no cache tensor is reallocated or copied between host and device per
step. A host snapshot (`to_host`) keeps a prefix; `from_host` rebuilds a device cache from it without recomputing.
"""

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import K3Error


@dataclass
class HostSnapshot:
    """A cache's valid content on the host: per-layer tensors plus the number of tokens it holds."""

    length: int
    cap: int
    conv: dict[int, torch.Tensor]
    state: dict[int, torch.Tensor]
    latent: dict[int, torch.Tensor]  # only the first `length` rows


class DeviceHybridCache:
    def __init__(self, cfg: ModelConfig, world: int, batch: int, cap: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.cap, self.length = batch, cap, 0
        Pl, Hl, d = cfg.kda_dim // world, cfg.kda_heads // world, cfg.kda_head_dim
        kda = [s.index for s in cfg.layers if s.mixer == "kda"]
        mla = [s.index for s in cfg.layers if s.mixer == "mla"]
        self.conv = {i: torch.zeros(batch, 3, Pl, cfg.conv_kernel - 1, dtype=dtype, device=device) for i in kda}
        self.state = {i: torch.zeros(batch, Hl, d, d, dtype=torch.float32, device=device) for i in kda}
        self.latent = {
            i: torch.zeros(batch, cap, cfg.kv_lora_rank + cfg.qk_rope_dim, dtype=dtype, device=device) for i in mla
        }

    def tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.state.values(), *self.latent.values()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reserve(self, n: int) -> int:
        """Claim `n` more token rows; refuses instead of reallocating. Returns the first new position."""
        if self.length + n > self.cap:
            raise K3Error(f"cache.cap={self.cap} tokens cannot hold {self.length} + {n} tokens (raise cache.cap)")
        start, self.length = self.length, self.length + n
        return start

    def reset(self) -> None:
        for t in self.tensors():
            t.zero_()
        self.length = 0

    def to_host(self) -> HostSnapshot:
        """Copy the valid content to the host (one device-to-host copy per tensor, outside decode)."""
        return HostSnapshot(
            self.length,
            self.cap,
            {i: t.cpu() for i, t in self.conv.items()},
            {i: t.cpu() for i, t in self.state.items()},
            {i: t[:, : self.length].cpu() for i, t in self.latent.items()},
        )

    def load_host(self, snap: HostSnapshot) -> None:
        """Overwrite this cache with a snapshot, in place (host-to-device copies only)."""
        if snap.length > self.cap or set(snap.latent) != set(self.latent) or set(snap.conv) != set(self.conv):
            raise K3Error(f"snapshot of {snap.length} tokens does not fit this cache (cap {self.cap})")
        for i, t in self.conv.items():
            t.copy_(snap.conv[i])
        for i, t in self.state.items():
            t.copy_(snap.state[i])
        for i, t in self.latent.items():
            t[:, : snap.length].copy_(snap.latent[i])
        self.length = snap.length

    @classmethod
    def from_host(
        cls, snap: HostSnapshot, cfg: ModelConfig, world: int, dtype: torch.dtype, device: torch.device
    ) -> "DeviceHybridCache":
        batch = next(iter([*snap.conv.values(), *snap.latent.values()])).shape[0]
        cache = cls(cfg, world, batch, snap.cap, dtype, device)
        cache.load_host(snap)
        return cache
