"""What-if planning: every rank's memory plan for a world size, computed in one process without uploading.

Plans from an inventory when there is a checkpoint (real or sparse), or from the config alone.
"""

import torch

from ..base.dtypes import BY_NAME, BY_TORCH
from ..config import ModelConfig
from .inventory import Inventory, TensorEntry
from .memory import WEIGHTS_ONLY, MemoryPlan, MemoryTerms, memory_plan
from .schema import canonical_name, checkpoint_entries
from .tp_plan import plan_rank


def config_entries(cfg: ModelConfig) -> list[TensorEntry]:
    """The tensors the schema expects, in no file: a Kimi-Linear checkpoint's every one in the config's dtype, a K3
    checkpoint's in K3's own (F32 where it stores F32, its MXFP4 experts as uint8 pairs)."""
    dtype = BY_NAME[cfg.dtype].torch
    return [
        TensorEntry(canonical_name(key), key, None, shape, BY_TORCH[d].code)
        for key, (shape, d) in checkpoint_entries(cfg, dtype).items()
    ]


def plan_all_ranks(
    cfg: ModelConfig,
    inv: Inventory | None,
    world: int,
    compute_dtype: torch.dtype,
    free: int,
    terms: dict[int, MemoryTerms] | None = None,
) -> list[MemoryPlan]:
    """`terms`: each rank's, from the run plan (run/plan.py); None: the weights alone."""
    entries = list(inv.entries.values()) if inv is not None else config_entries(cfg)
    terms = terms or dict.fromkeys(range(world), WEIGHTS_ONLY)
    return [memory_plan(r, plan_rank(cfg, entries, world, r, compute_dtype), free, terms[r]) for r in range(world)]
