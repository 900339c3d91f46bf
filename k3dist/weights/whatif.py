"""What-if planning: every rank's memory plan for a world size, computed in one process without uploading.

Plans from an inventory when there is a checkpoint (real or sparse), or from the config alone.
"""

import torch

from ..base.dtypes import BY_NAME, BY_TORCH
from ..config import ModelConfig
from .inventory import Inventory, TensorEntry
from .memory import WEIGHTS_ONLY, MemoryPlan, MemoryTerms, family_memory_plan, memory_plan
from .schema import canonical_name, checkpoint_entries, kept_dtype
from .tp_plan import axis_of, plan_rank, plan_tensor


def config_entries(cfg: ModelConfig) -> list[TensorEntry]:
    """The tensors the schema expects, in no file: a Kimi-Linear checkpoint's every one in the config's dtype, a K3
    checkpoint's in K3's own (F32 where it stores F32, its MXFP4 experts as uint8 pairs)."""
    dtype = BY_NAME[cfg.dtype].torch
    return [
        TensorEntry(canonical_name(key), key, None, shape, BY_TORCH[d].code)
        for key, (shape, d) in checkpoint_entries(cfg, dtype).items()
    ]


def shape_families(entries: list[TensorEntry], compute_dtype: torch.dtype) -> list[tuple[TensorEntry, int]]:
    """(one entry, how many) for each set of entries that every rank plans alike: the same split, shape and dtypes.
    A layer's or an expert's number changes none of these, so a model's hundreds of thousands of tensors are a few
    dozen families."""
    families: dict[tuple, list] = {}
    for e in entries:
        key = (axis_of(e.name, len(e.shape)), e.shape, e.dtype, kept_dtype(e.name, compute_dtype))
        families.setdefault(key, [e, 0])[1] += 1
    return [(e, n) for e, n in families.values()]


def plan_all_ranks(
    cfg: ModelConfig,
    inv: Inventory | None,
    world: int,
    compute_dtype: torch.dtype,
    free: int,
    terms: dict[int, MemoryTerms] | None = None,
) -> list[MemoryPlan]:
    """`terms`: each rank's, from the run plan (run/plan.py); None: the weights alone. A checkpoint's tensors are
    planned one by one (their offsets decide which are read together); the config's by shape family, each of which
    is read alone."""
    terms = terms or dict.fromkeys(range(world), WEIGHTS_ONLY)
    if inv is not None:
        entries = list(inv.entries.values())
        return [memory_plan(r, plan_rank(cfg, entries, world, r, compute_dtype), free, terms[r]) for r in range(world)]
    families = shape_families(config_entries(cfg), compute_dtype)
    return [
        family_memory_plan(r, [(plan_tensor(e, world, r, compute_dtype), n) for e, n in families], free, terms[r])
        for r in range(world)
    ]
