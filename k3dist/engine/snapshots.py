"""Every rank's prefix snapshots of its own shard: one sequence's hybrid state after its first L tokens.

A snapshot holds, for one slot, every KDA layer's conv and recurrent state, every MLA layer's latent rows [0, L),
and this rank's logits of position L-1 (so a prompt equal to the prefix gets its first token with no prefill). It
is a copy on the device, or, demoted, in pinned host memory, restored host-to-device into a slot. Rank 0 decides
which snapshots exist (prefix.py); every rank makes, moves and drops its own in the order the window record says.
"""

import torch
from torch import Tensor

from ..kinds.registry import cache_entry
from ..model.cache import HybridCache


def snapshot_bytes(shapes: dict, length: int, vocab_local: int, itemsize: int) -> int:
    """Bytes of one snapshot of `length` tokens from `cache_shapes(..., batch=1, cap=1)`, with its logits."""
    total = vocab_local * itemsize
    for name, (shape, dtype) in shapes.items():
        if (entry := cache_entry(name)) is not None:  # an entry that grows: `length` of its rows (dim 1)
            numel = torch.Size(shape).numel()
            total += (numel // shape[1] * length if entry.grows else numel) * dtype.itemsize
    return total


class SnapshotStore:
    def __init__(self, cache: HybridCache):
        self.cache = cache
        self.snaps: dict[int, tuple[int, dict[str, Tensor], Tensor]] = {}  # id -> (length, tensors, logits)
        self.pin = cache.positions.device.type == "cuda"

    def save(self, snap_id: int, slot: int, length: int, logits: Tensor | None) -> None:
        """Copy slot `slot`'s state after `length` tokens (and its last logits [V_local]) into snapshot `snap_id`;
        logits None: set_logits gives them before any restore."""
        tensors = {}
        for name, t in self.cache.tensors.items():
            if (entry := cache_entry(name)) is not None:
                tensors[name] = (t[slot, :length] if entry.grows else t[slot]).clone()
        self.snaps[snap_id] = (length, tensors, None if logits is None else logits.detach().clone())

    def set_logits(self, snap_id: int, logits: Tensor) -> None:
        length, tensors, _ = self.snaps[snap_id]
        self.snaps[snap_id] = (length, tensors, logits.detach().clone())

    def restore(self, snap_id: int, slot: int) -> tuple[int, Tensor]:
        """Overwrite slot `slot` with snapshot `snap_id` (rows past its length are left as the reset left them);
        returns (its length, its logits on the device)."""
        length, tensors, logits = self.snaps[snap_id]
        for name, saved in tensors.items():
            target = self.cache.tensors[name]
            (target[slot, :length] if cache_entry(name).grows else target[slot]).copy_(saved, non_blocking=True)
        self.cache.positions[slot] = length
        return length, logits.to(self.cache.positions.device, non_blocking=True)

    def demote(self, snap_id: int) -> None:
        """Move a snapshot to host memory (pinned on CUDA, so a restore is one asynchronous copy)."""
        length, tensors, logits = self.snaps[snap_id]
        host = lambda t: t.to("cpu").pin_memory() if self.pin else t  # noqa: E731 - on a CPU the host is the device
        self.snaps[snap_id] = (length, {n: host(t) for n, t in tensors.items()}, host(logits))

    def drop(self, snap_id: int) -> None:
        del self.snaps[snap_id]
