"""Tensor-parallel sharding policy (one table, DESIGN.md) and the per-rank plan computed from it.

The plan is the single truth for the loader (what to read), the model (local shapes), the memory verdict and
the what-if report. `copy_shard` reads only the rank-local bytes through safetensors' lazy slices.
"""

import math
import re
from dataclasses import dataclass

import torch

from ..errors import K3Error
from .schema import keeps_fp32


@dataclass(frozen=True)
class Axis:
    """How one tensor family is split: `dim` None = replicated; `vocab` = gathered (or masked) over vocab."""

    name: str
    dim: int | None


REPLICATED = Axis("replicated", None)
VOCAB = Axis("vocab", 0)
COLUMN = Axis("column", 0)
ROW = Axis("row", 1)
HEADS = Axis("heads", 2)  # A_log [1, 1, H, 1]

# First match wins. Names are canonical checkpoint names (schema.expected_tensors).
POLICY: tuple[tuple[str, Axis], ...] = (
    (r"^model\.embed_tokens\.weight$", VOCAB),
    (r"^lm_head\.weight$", VOCAB),
    (r"norm\.weight$", REPLICATED),  # input/post_attention/model norm, kv_a_layernorm, KDA o_norm
    (r"\.self_attn\.A_log$", HEADS),
    (r"\.self_attn\.(f_a_proj|g_a_proj|kv_a_proj_with_mqa)\.weight$", REPLICATED),
    (r"\.self_attn\.[qkv]_proj\.weight$", COLUMN),  # KDA q/k/v and MLA q_proj, by head
    (r"\.self_attn\.[qkv]_conv1d\.weight$", COLUMN),
    (r"\.self_attn\.(f_b_proj|g_b_proj|b_proj|kv_b_proj)\.weight$", COLUMN),
    (r"\.self_attn\.dt_bias$", COLUMN),
    (r"\.self_attn\.o_proj\.weight$", ROW),
    (r"\.gate\.(weight|e_score_correction_bias)$", REPLICATED),  # router
    (r"\.experts\.\d+\.w[13]\.weight$", COLUMN),
    (r"\.experts\.\d+\.w2\.weight$", ROW),
    (r"\.(gate_proj|up_proj)\.weight$", COLUMN),  # dense MLP and shared experts
    (r"\.down_proj\.weight$", ROW),
)
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def axis_of(name: str) -> Axis:
    for pattern, axis in POLICY:
        if re.search(pattern, name):
            return axis
    raise K3Error(f"tensor {name}: no sharding rule in the TP policy")


def shard_range(size: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous ceil-split [start, stop) of `size` rows; even when `world` divides `size`."""
    step = math.ceil(size / world)
    start = min(rank * step, size)
    return start, min(start + step, size)


@dataclass(frozen=True)
class ShardPlan:
    """One tensor on one rank: which bytes to read, what is kept, and where it goes in the weight store."""

    name: str  # canonical checkpoint name
    key: str  # name inside the file (may differ for the dense MLP, see schema.canonical_name)
    file: str | None  # file name inside the model dir; None when planning from the config alone
    axis: Axis
    start: int
    stop: int
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    src_dtype: str  # safetensors dtype string on disk
    dtype: torch.dtype  # dtype kept on the device
    dest: str  # weight-store key (experts are stacked: `...experts.w1` [E, *local])
    slot: int | None  # index in a stacked destination

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def source_bytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.src_dtype]

    @property
    def local_bytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_tensor(name, key, file, shape, src_dtype, world, rank, compute_dtype) -> ShardPlan:
    axis = axis_of(name)
    start, stop, local = 0, None, tuple(shape)
    if axis.dim is not None:
        start, stop = shard_range(shape[axis.dim], world, rank)
        local = tuple(stop - start if i == axis.dim else n for i, n in enumerate(shape))
    dtype = torch.float32 if keeps_fp32(name) else compute_dtype
    m = _EXPERT.match(name)
    dest, slot = (f"{m.group(1)}.{m.group(3)}", int(m.group(2))) if m else (name, None)
    return ShardPlan(
        name, key, file, axis, start, stop if stop is not None else 0, tuple(shape), local, src_dtype, dtype, dest, slot
    )


def plan_rank(tensors, world: int, rank: int, compute_dtype: torch.dtype) -> list[ShardPlan]:
    """`tensors`: iterable of (name, key, file, shape, src_dtype) -> this rank's plan, one entry per tensor."""
    return [plan_tensor(*t, world, rank, compute_dtype) for t in tensors]


def store_shapes(plans: list[ShardPlan]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Weight-store key -> (local shape, dtype); stacked expert buffers get a leading expert dimension."""
    experts: dict[str, int] = {}
    for p in plans:
        if p.slot is not None:
            experts[p.dest] = max(experts.get(p.dest, 0), p.slot + 1)
    return {
        p.dest: ((experts[p.dest], *p.local_shape) if p.slot is not None else p.local_shape, p.dtype) for p in plans
    }


def copy_shard(handle, plan: ShardPlan) -> torch.Tensor:
    """Read only this rank's bytes of one tensor from an open `safe_open` handle (lazy slice, no full read).

    safetensors >= 0.8 returns views into the file's mmap (storage = the whole tensor, row shards strided); the
    clone reads only the rank-local pages into a contiguous tensor that owns exactly `local_bytes` of source data
    and no longer aliases the checkpoint file.
    """
    piece = handle.get_slice(plan.key)
    if plan.axis.dim is None:
        return piece[:].clone(memory_format=torch.contiguous_format)
    index = (slice(None),) * plan.axis.dim + (slice(plan.start, plan.stop),)
    return piece[index].clone(memory_format=torch.contiguous_format)
