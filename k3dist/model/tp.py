"""The two collectives the model needs: sum partial outputs of row-parallel layers, gather vocab-split logits."""

import torch
import torch.distributed as dist

from ..weights.tp_plan import shard_range


class TPComm:
    def __init__(self, world: int, rank: int, vocab_size: int):
        self.world, self.rank, self.vocab_size = world, rank, vocab_size
        self.vocab_start, self.vocab_stop = shard_range(vocab_size, world, rank)
        self.vocab_shard = shard_range(vocab_size, world, 0)[1]  # ceil(V / world): every rank's padded width

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results over ranks (after every row-parallel projection), in place; callers pass fp32."""
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[..., V_local] -> [..., V]: pad each rank's slice to the common width, all-gather, trim."""
        if self.world == 1:
            return local
        pad = self.vocab_shard - local.shape[-1]
        if pad:
            local = torch.nn.functional.pad(local, (0, pad))
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]
