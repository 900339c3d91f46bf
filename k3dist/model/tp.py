"""The collectives the model needs: sum partial outputs of row-parallel layers, and bring vocab-split logits (or just
their top-k) to every rank. Each is one call with static shapes, so a captured step holds them."""

import torch
import torch.distributed as dist
from torch import Tensor

from ..weights.tp_plan import shard_range

# torch >= 2.12 names it all_gather_single; older releases all_gather_into_tensor (same semantics)
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPComm:
    def __init__(self, world: int, rank: int, vocab_size: int):
        self.world, self.rank, self.vocab_size = world, rank, vocab_size
        self.vocab_start, self.vocab_stop = shard_range(vocab_size, world, rank)
        self.vocab_shard = shard_range(vocab_size, world, 0)[1]  # ceil(V / world): every rank's padded width

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum partial results over ranks (after every row-parallel projection), in place; callers pass fp32."""
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def gather_columns(self, local: Tensor) -> Tensor:
        """[..., n] on every rank -> [..., world * n], rank after rank (a column-parallel output made whole)."""
        if self.world == 1:
            return local
        lead = local.shape[:-1]
        parts = self._gather(local.reshape(-1, local.shape[-1]))  # [world, N, n]
        return parts.permute(1, 0, 2).reshape(*lead, -1)

    def _gather(self, local: Tensor) -> Tensor:
        """[B, n] on every rank -> [world, B, n]: one gather into a single tensor (ranks stacked along dim 0)."""
        out = local.new_empty(self.world * local.shape[0], *local.shape[1:])
        _GATHER(out, local.contiguous())
        return out.view(self.world, *local.shape)

    def gather_logits(self, local: Tensor) -> Tensor:
        """[..., V_local] -> [..., V]: pad each rank's slice to the common width, gather, trim."""
        if self.world == 1:
            return local
        lead = local.shape[:-1]
        local = local.reshape(-1, local.shape[-1])
        pad = self.vocab_shard - local.shape[-1]
        if pad:
            local = torch.nn.functional.pad(local, (0, pad), value=float("-inf"))
        parts = self._gather(local)  # [world, N, V_shard]
        return parts.permute(1, 0, 2).reshape(*lead, -1)[..., : self.vocab_size]

    def gather_topk(self, local: Tensor, k: int, local_topk=None) -> tuple[Tensor, Tensor, Tensor]:
        """The k largest logits over the whole vocab, their token ids and the log-sum-exp of every logit, from each
        rank's own top-k and log-sum-exp only: one gather, whatever the world.

        local: [B, V_local]. Returns (values [B, k] fp32, ids [B, k] int64, lse [B] fp32), best first; values - lse are
        the log-probabilities of a log-softmax over the whole vocabulary. `local_topk(local, k)` computes the rank's
        own three in one op where the backend has one (the CPU ops' topk_lse), else torch does below.
        """
        k_local = min(k, local.shape[-1])
        if local_topk is not None and local.shape[-1]:
            values, ids, lse = local_topk(local, k_local)
        else:
            wide = local.float()  # once, for the top-k and the log-sum-exp both
            values, ids = _topk(wide, k_local)
            lse = torch.logsumexp(wide, dim=-1)
        if self.world == 1:
            return values, ids, lse
        values = torch.nn.functional.pad(values, (0, k - k_local), value=float("-inf"))
        ids = torch.nn.functional.pad(ids + self.vocab_start, (0, k - k_local))
        both = torch.cat([values, lse[:, None]], dim=-1)  # the lse rides along in the values' gather
        gathered = self._gather(both).permute(1, 0, 2)  # [B, world, k + 1]
        all_values = gathered[..., :k].reshape(local.shape[0], -1)
        all_ids = self._gather(ids).permute(1, 0, 2).reshape(local.shape[0], -1)
        best, where = all_values.topk(k, dim=-1)
        return best, all_ids.gather(1, where), torch.logsumexp(gathered[..., k], dim=-1)


BLOCK = 128  # vocab entries per block in the two-stage top-k


def _topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """topk over the last dim of [B, V] in two stages where V splits into blocks: the k blocks with the largest
    maxima hold the k largest values (a block outside them has a maximum no larger than the k-th value), so a top-k
    of their k * BLOCK entries gives the same values. One pass of maxima instead of a top-k over all of V, which a CPU
    does several times slower (BENCHMARKS.md, "Measurements behind the code"). Among equal values the ids may differ
    from a plain topk's (whose order among ties is unspecified too)."""
    B, V = x.shape
    if V % BLOCK or V < 4 * k * BLOCK:
        return x.topk(k, dim=-1)
    dtype, x = x.dtype, x.float()  # exact; torch's CPU bf16 block maxima are slower than widening + fp32 maxima
    blocks = x.view(B, V // BLOCK, BLOCK)
    best = blocks.amax(-1).topk(k, dim=-1).indices  # [B, k]
    candidates = blocks.gather(1, best.unsqueeze(-1).expand(-1, -1, BLOCK)).view(B, k * BLOCK)
    values, where = candidates.topk(k, dim=-1)
    return values.to(dtype), best.gather(1, where // BLOCK) * BLOCK + where % BLOCK
