"""The memory terms besides the runtime: the cache, the prefix pool, and what binding makes and gives back.

Each is counted from the same shapes the run allocates (model/cache.py's cache_shapes, weights/tp_plan.py's per-rank
plan), so the plan and the run cannot drift apart.
"""

import torch

from ..config import ModelConfig
from ..engine.prefix import BRANCH_MEMORY
from ..kernels.quant import ROWS, int8_bytes
from ..weights.quant_plan import quantized
from ..weights.tp_plan import plan_rank, store_shapes
from ..weights.whatif import config_entries


def cache_nbytes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of the cache tensors `shapes` (model/cache.py's cache_shapes) describes."""
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes.values())


def prefix_pool_bytes(device_bytes: int, host_bytes: int) -> int:
    """The prefix snapshots' pool (prefix.bytes, and on a CPU prefix.host_bytes) and rank 0's remembered ids."""
    return device_bytes + host_bytes + BRANCH_MEMORY


def int8_terms(cfg: ModelConfig, world: int, rank: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes int8 saves on this rank after bind, the largest transient while binding) for `model.quant=int8`."""
    saved = transient = 0
    for key, (shape, _) in store_shapes(plan_rank(cfg, config_entries(cfg), world, rank, dtype)).items():
        if not quantized(key):
            continue
        parts = shape[0] if len(shape) == 3 else 1  # stacked (fg_b): one Linear per part
        rows, cols = shape[-2], shape[-1]
        one = int8_bytes(rows, cols, dtype)
        saved += parts * (rows * cols * dtype.itemsize - one)
        transient = max(transient, parts * one + 3 * min(rows, ROWS) * cols * 4)  # fp32 block: w, |w|, w / s
    return saved, transient


def bind_bytes(cfg: ModelConfig, world: int, dtype: torch.dtype, pack: bool, dense: bool, int8: bool, transient: int):
    """Bytes made at bind time: packing copies one weight at a time, the largest being the LM head's slice or, for
    dense experts (model/experts.py), a layer's w2 twice over (its permuted copy and the packed one) = its w13 once.
    int8 (weights/quant_plan.py) makes one int8 copy at a time instead (`transient`), and the LM head is then not
    packed."""
    if not pack:
        return transient
    head = 0 if int8 else -(-cfg.vocab_size // world) * cfg.hidden_size
    experts = 2 * cfg.num_experts * cfg.hidden_size * (cfg.expert_size // world) if dense else 0
    return max(max(head, experts) * dtype.itemsize, transient)
