"""What-if planning: every rank's memory plan for a world size, computed in one process without uploading.

Plans from an inventory when there is a checkpoint (real or sparse), or from the config alone.
"""

import torch

from ..config import ModelConfig
from .inventory import Inventory
from .memory import MemoryPlan, memory_plan
from .schema import expected_tensors
from .tp_plan import plan_rank

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def config_inputs(cfg: ModelConfig) -> list[tuple]:
    """Plan inputs from the schema alone: every tensor in the config's dtype, no file."""
    return [(n, n, None, s, SAFETENSORS_DTYPES[cfg.dtype]) for n, s in expected_tensors(cfg).items()]


def plan_world(
    cfg: ModelConfig, inv: Inventory | None, world: int, compute_dtype: torch.dtype, cache: int, reserve: int, free: int
) -> list[MemoryPlan]:
    inputs = inv.plan_inputs() if inv is not None else config_inputs(cfg)
    return [memory_plan(r, plan_rank(inputs, world, r, compute_dtype), cache, reserve, free) for r in range(world)]
