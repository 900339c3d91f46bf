"""Tensor-parallel sharding policy (one table) and the per-rank plan computed from it.

The plan is the single truth for the loader (what to read and where it lands), the model (local shapes), the memory
verdict and the what-if report. `copy_shard` reads only the rank-local bytes through safetensors' lazy slices.
"""

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from ..base.dtypes import BY_CODE
from ..base.errors import K3Error
from ..config import ModelConfig
from ..kinds.registry import KINDS
from ..kinds.spec import COLUMN as COLUMN
from ..kinds.spec import HEADS as HEADS
from ..kinds.spec import REPLICATED, VOCAB, Axis, Placement
from ..kinds.spec import ROW as ROW
from .inventory import TensorEntry
from .schema import kept_dtype, placements

# First match wins. Names are canonical checkpoint names (schema.expected_tensors): the rules every model has, then
# each layer kind's own (kinds/), in registry order, each rule once.
_SHARED: tuple[tuple[str, Axis], ...] = (
    (r"^model\.embed_tokens\.weight$", VOCAB),
    (r"^lm_head\.weight$", VOCAB),
    (r"norm\.weight$", REPLICATED),  # input/post_attention/model norm, kv_a_layernorm, KDA o_norm, K3's res norms
    (r"_res_proj\.weight$", REPLICATED),  # K3's block attention residuals: each site's score vector [1, D]
)
POLICY: tuple[tuple[str, Axis], ...] = tuple(dict.fromkeys((*_SHARED, *(rule for k in KINDS for rule in k.policy))))


_COMPILED = tuple((re.compile(pattern), axis) for pattern, axis in POLICY)


_INDEX = re.compile(r"\.\d+\.")  # a layer's or an expert's number: no rule looks at it


def axis_of(name: str, ndim: int | None = None) -> Axis:
    """The first rule's axis; replicated where the rule's dim is past a tensor of `ndim` dims: K3's A_log [128] is
    padded past its heads, so no split by heads lands on head boundaries, and every rank keeps it whole (512 bytes)
    and takes its own heads (docs/model.md, "Kimi K3's TP plan")."""
    axis = _rule(_INDEX.sub(".0.", name))
    if axis is None:
        raise K3Error(f"tensor {name}: no sharding rule in the TP policy")
    return REPLICATED if axis.dim is not None and ndim is not None and axis.dim >= ndim else axis


@functools.cache  # a few dozen shapes of name, whatever the layer and expert counts (K3: 497,052 tensors)
def _rule(name: str) -> Axis | None:
    for pattern, axis in _COMPILED:
        if pattern.search(name):
            return axis
    return None


def shard_range(size: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous ceil-split [start, stop) of `size` rows; even when `world` divides `size`."""
    step = math.ceil(size / world)
    start = min(rank * step, size)
    return start, min(start + step, size)


@dataclass(frozen=True)
class ShardPlan:
    """One tensor on one rank: which bytes to read, what is kept, and where it lands in the weight store."""

    name: str  # canonical checkpoint name
    key: str  # name inside the file (may differ for the dense MLP, see schema.canonical_name)
    file: str | None  # file name inside the model dir; None when planning from the config alone
    axis: Axis
    start: int
    stop: int
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    src_dtype: str  # safetensors dtype code on disk
    dtype: torch.dtype  # dtype kept on the device
    dest: str  # weight-store key
    slot: int | None  # index along the destination's stacked leading dim (experts, the three convs)
    row: int | None  # first row in a row-fused destination (q/k/v/f_a/g_a/b of a KDA layer, ...); None: not fused
    offset: int | None = None  # file offset of the whole tensor's data (reads.py); None when planned from the config

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def source_bytes(self) -> int:
        return self.numel * BY_CODE[self.src_dtype].itemsize

    @property
    def local_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def plain(self) -> bool:
        """The tensor is its own store entry (neither stacked nor fused)."""
        return self.slot is None and self.row is None


def plan_tensor(
    entry: TensorEntry,
    world: int,
    rank: int,
    compute_dtype: torch.dtype,
    placement: Placement | None = None,
    row: int | None = None,
) -> ShardPlan:
    """One tensor's plan on one rank. `row` is its first row in a fused destination (plan_rank computes it)."""
    axis = axis_of(entry.name, len(entry.shape))
    start, stop, local = 0, 0, tuple(entry.shape)
    if axis.dim is not None:
        start, stop = shard_range(entry.shape[axis.dim], world, rank)
        local = tuple(stop - start if i == axis.dim else n for i, n in enumerate(entry.shape))
    placement = placement or Placement(entry.name)
    return ShardPlan(
        name=entry.name,
        key=entry.key,
        file=entry.file,
        axis=axis,
        start=start,
        stop=stop,
        full_shape=tuple(entry.shape),
        local_shape=local,
        src_dtype=entry.dtype,
        dtype=kept_dtype(entry.name, compute_dtype),
        dest=placement.dest,
        slot=placement.slot,
        row=row,
        offset=entry.offset,
    )


def plan_rank(
    cfg: ModelConfig, entries: Iterable[TensorEntry], world: int, rank: int, compute_dtype: torch.dtype
) -> list[ShardPlan]:
    """This rank's plan, one entry per tensor, with fused tensors' rows laid out part after part."""
    where = placements(cfg)
    entries = list(entries)
    plans = [plan_tensor(e, world, rank, compute_dtype, where.get(e.name)) for e in entries]
    parts: dict[str, list[tuple[int, int]]] = {}  # fused dest -> (part, index in plans)
    for i, e in enumerate(entries):
        placed = where.get(e.name)
        if placed is not None and placed.part is not None:
            parts.setdefault(placed.dest, []).append((placed.part, i))
    for members in parts.values():
        row, seen = 0, {}
        for part, i in sorted(members, key=lambda m: (m[0], plans[m[1]].slot or 0)):
            if part not in seen:  # stacked and fused (experts' w1/w3): every slot starts its parts at the same row
                seen[part], row = row, row + plans[i].local_shape[0]
            plans[i] = replace(plans[i], row=seen[part])
    return plans


def store_shapes(plans: list[ShardPlan]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Weight-store key -> (local shape, dtype): stacked destinations get a leading slot dim, fused ones the sum of
    their parts' rows."""
    slots: dict[str, int] = {}
    rows: dict[str, int] = {}
    first: dict[str, ShardPlan] = {}
    for p in plans:
        first.setdefault(p.dest, p)
        if p.slot is not None:
            slots[p.dest] = max(slots.get(p.dest, 0), p.slot + 1)
        if p.row is not None:
            rows[p.dest] = max(rows.get(p.dest, 0), p.row + p.local_shape[0])
    shapes = {}
    for dest, p in first.items():
        shape = p.local_shape if dest not in rows else (rows[dest], *p.local_shape[1:])
        shapes[dest] = ((slots[dest], *shape) if dest in slots else shape, p.dtype)
    return shapes


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
