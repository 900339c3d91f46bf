"""What a tensor-parallel group's collectives move per token, from the config alone: the what-if's other figure
beside memory. k3dist runs pure TP (no expert parallelism yet): every rank holds its slice of every expert and every
rank takes part in every collective, across nodes where the group is larger than a node.

Per token (model/tp.py's collectives, as the model runs them; none at world 1):
- the embedding: one all-reduce of the hidden state (fp32), each rank adding its vocabulary rows;
- each mixer (KDA, MLA): one all-reduce of the hidden state after its row-split output projection (fp32);
- each MLP (dense, MoE): one all-reduce of the hidden state (fp32); a K3 latent MoE also all-gathers its down
  projection's output z (latent_size, compute dtype) and all-reduces the experts' combine (latent_size, fp32)
  (docs/model.md, "Kimi K3's TP plan");
- the logits: one all-gather of every rank's vocabulary slice, padded to a common width (fp32), as a sampled step
  gathers them (a greedy step gathers only each rank's top-k).

A ring all-reduce of B bytes sends 2 (N-1)/N x B from each rank, an all-gather of B bytes (N-1)/N x B.
"""

import math
from dataclasses import asdict, dataclass

from ..config import ModelConfig
from ..kinds.mlps import MOE

NODE_GPUS = 8  # GPUs one node holds (an HGX H100/H200/B200 board): a larger TP group spans nodes


@dataclass(frozen=True)
class TPTraffic:
    world: int
    nodes: int  # nodes of NODE_GPUS the group spans
    routed_experts: int  # experts each MoE layer routes to, every one split over the whole group (0: no MoE)
    all_reduce_bytes: int  # per token: the sum of the tensors all-reduced
    all_gather_bytes: int  # per token: the sum of the gathered tensors' whole sizes

    @property
    def ring_bytes(self) -> int:
        """What each rank sends per token in ring collectives (and receives)."""
        n = self.world
        return (2 * (n - 1) * self.all_reduce_bytes + (n - 1) * self.all_gather_bytes) // n

    def as_dict(self) -> dict:
        return asdict(self) | {"node_gpus": NODE_GPUS, "ring_bytes": self.ring_bytes}


def tp_traffic(cfg: ModelConfig, world: int, itemsize: int) -> TPTraffic:
    """The bytes a `world`-rank TP group's collectives move per token, in the compute dtype's `itemsize`."""
    moe_layers = cfg.count(mlp=MOE.name)
    all_reduce = all_gather = 0
    if world > 1:
        hidden = cfg.hidden_size * 4
        all_reduce = hidden * (1 + 2 * len(cfg.layers)) + moe_layers * cfg.latent_size * 4
        all_gather = moe_layers * cfg.latent_size * itemsize + world * -(-cfg.vocab_size // world) * 4
    return TPTraffic(
        world=world,
        nodes=math.ceil(world / NODE_GPUS),
        routed_experts=cfg.num_experts if moe_layers else 0,
        all_reduce_bytes=all_reduce,
        all_gather_bytes=all_gather,
    )
