"""Rank-aware loading: plan, preflight, agree, upload rank-local bytes file by file, agree again.

Any failure frees every allocation made so far before the error propagates, and the second agreement makes
every rank raise with the names of the ranks that failed, so no rank waits on a peer that is gone.
"""

import gc
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..dist import Runtime, agree
from ..dtypes import BY_CODE
from ..errors import K3Error
from ..faults import Faults
from ..units import fmt_bytes
from .inventory import Inventory
from .memory import MemoryPlan, detect_free, memory_plan
from .tp_plan import ShardPlan, copy_shard, plan_rank, store_shapes

log = logging.getLogger("k3dist")


@dataclass
class WeightStore:
    """The rank's weights on its device, by store key (experts stacked), plus the plan that put them there."""

    tensors: dict[str, torch.Tensor]
    plans: list[ShardPlan]
    memory: MemoryPlan
    all_memory: list[dict] = field(default_factory=list)
    load_seconds: float = 0.0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def preflight(
    inv: Inventory,
    rt: Runtime,
    compute_dtype: torch.dtype,
    cache: int,
    runtime: int,
    reserve: int,
    free: int | None,
    faults: Faults,
) -> tuple[list[ShardPlan], MemoryPlan, list[dict]]:
    """Plan this rank, check it fits, and agree with every rank on the verdict and the checkpoint headers."""
    plans = plan_rank(inv.config, inv.entries.values(), rt.world, rt.rank, compute_dtype)
    if faults.mine(rt.rank) and faults.free is not None:
        free = faults.free
    if free is None:
        free = detect_free(rt.device, rt.local_world)
    mp = memory_plan(rt.rank, plans, cache, reserve, free, runtime)
    log.info("k3_weight_plan " + " ".join(f"{k}={v}" for k, v in mp.as_dict().items()))
    statuses = agree(
        "preflight",
        None if mp.fits else mp.refusal() + "; lower memory.reserve or cache.cap, or add ranks",
        rt,
        plan=mp.as_dict(),
        fingerprint=inv.fingerprint,
        headers=inv.file_digests,
    )
    if any(st["fingerprint"] != statuses[0]["fingerprint"] for st in statuses):
        raise _disagreement(statuses)
    return plans, mp, [s["plan"] for s in statuses]


def _disagreement(statuses: list[dict]) -> K3Error:
    """Every rank holds the same statuses, so every rank raises this same error naming the odd ranks and files."""
    fingerprint, head, problems = statuses[0]["fingerprint"], statuses[0]["headers"], []
    for st in statuses:
        if st["fingerprint"] == fingerprint:
            continue
        theirs, why = st["headers"], []
        if set(theirs) != set(head):
            why.append(
                f"files only on rank {st['rank']}: {sorted(set(theirs) - set(head))[:5]}, "
                f"only on rank 0: {sorted(set(head) - set(theirs))[:5]}"
            )
        changed = sorted(f for f in set(theirs) & set(head) if theirs[f] != head[f])
        why += [f"{f} has header {theirs[f][:12]} vs {head[f][:12]}" for f in changed[:5]]
        problems.append(
            f"rank {st['rank']} sees a different checkpoint than rank 0 "
            f"(header fingerprint {st['fingerprint'][:12]} vs {fingerprint[:12]}: {'; '.join(why)})"
        )
    return K3Error(f"preflight: {'; '.join(problems)}; every rank must load the same checkpoint", agreed=True)


class _Upload:
    """Allocations of one upload, tracked by weak references so a cleanup can prove nothing is left alive."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tensors: dict[str, torch.Tensor] = {}
        self.refs: list[weakref.ref] = []
        self.baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def place(self, plan: ShardPlan, piece: torch.Tensor, shapes: dict) -> None:
        """Put one rank-local slice where the plan says: its own tensor, or its slot/rows of a stacked or fused one."""
        if plan.plain:
            out = self.tensors[plan.dest] = piece.to(device=self.device, dtype=plan.dtype, non_blocking=False)
            self.refs.append(weakref.ref(out))
            return
        out = self.tensors.get(plan.dest)
        if out is None:
            shape, dtype = shapes[plan.dest]
            out = self.tensors[plan.dest] = torch.empty(shape, dtype=dtype, device=self.device)
            self.refs.append(weakref.ref(out))
        target = out if plan.slot is None else out[plan.slot]
        if plan.row is not None:
            target = target[plan.row : plan.row + plan.local_shape[0]]
        target.copy_(piece.view(target.shape))

    def free_all(self) -> tuple[int, int]:
        """Drop everything; returns (tensors freed, live allocations left) measured after collection."""
        freed = len(self.tensors)
        self.tensors.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return freed, torch.cuda.memory_allocated(self.device) - self.baseline
        return freed, sum(1 for r in self.refs if r() is not None)


def upload(inv: Inventory, plans: list[ShardPlan], rt: Runtime, faults: Faults) -> dict[str, torch.Tensor]:
    """Read rank-local slices file by file into device tensors; on failure free them all, then re-raise."""
    shapes = store_shapes(plans)
    by_file: dict[str, list[tuple[int, ShardPlan]]] = {}
    for i, p in enumerate(plans):
        by_file.setdefault(p.file, []).append((i, p))
    total = sum(p.local_bytes for p in plans)
    up = _Upload(rt.device)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"rank {rt.rank} load",
        disable=not rt.is_main or None,
        leave=False,
    )
    uploaded, current = 0, "before the first tensor"
    try:
        for file, items in by_file.items():
            path = Path(inv.model_dir) / file
            start, nbytes = time.perf_counter(), 0
            with safe_open(path, framework="pt") as handle:
                for i, p in items:
                    current = f"at tensor {p.name} of {path}"
                    faults.at_tensor(rt.rank, i, p.name)
                    piece = copy_shard(handle, p)
                    if piece.dtype != BY_CODE[p.src_dtype].torch or tuple(piece.shape) != p.local_shape:
                        raise K3Error(
                            f"{path}: tensor {p.key} read as {piece.dtype} {list(piece.shape)}, "
                            f"planned {p.src_dtype} {list(p.local_shape)}"
                        )
                    up.place(p, piece, shapes)
                    del piece
                    uploaded += p.local_bytes
                    nbytes += p.local_bytes
                    bar.update(p.local_bytes)
            if rt.device.type == "cuda":
                _drop_page_cache(path)
            log.info(
                "k3_weight_shard_loaded rank=%d file=%s tensors=%d bytes=%d seconds=%.3f",
                rt.rank,
                file,
                len(items),
                nbytes,
                time.perf_counter() - start,
            )
        if uploaded != total:
            raise K3Error(f"rank {rt.rank}: uploaded {uploaded} bytes but the plan holds local_bytes={total}")
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
    except BaseException as exc:
        bar.close()
        freed, live = up.free_all()
        log.warning("k3_weight_cleanup rank=%d freed=%d live=%d", rt.rank, freed, live)
        if isinstance(exc, torch.OutOfMemoryError):
            raise K3Error(
                f"rank {rt.rank}: out of device memory {current} after uploading {fmt_bytes(uploaded)} of "
                f"{fmt_bytes(total)}: the reserve is exhausted (raise memory.reserve)"
            ) from None
        if isinstance(exc, Exception) and not isinstance(exc, K3Error):  # a bug or I/O fault: say where it hit
            raise K3Error(f"rank {rt.rank}: upload failed {current}: {type(exc).__name__}: {exc}") from exc
        raise
    bar.close()
    return up.tensors


def _drop_page_cache(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass


def load_weights(
    inv: Inventory,
    rt: Runtime,
    compute_dtype: torch.dtype,
    cache: int,
    reserve: int,
    free: int | None = None,
    faults: Faults | None = None,
    runtime: int = 0,
) -> WeightStore:
    """The whole pipeline after the inventory: preflight + agreement, upload, post-upload agreement."""
    faults = faults or Faults()
    start = time.perf_counter()
    plans, memory, all_memory = preflight(inv, rt, compute_dtype, cache, runtime, reserve, free, faults)
    error, tensors = None, {}
    try:
        tensors = upload(inv, plans, rt, faults)
    except K3Error as exc:
        error = str(exc)
    except Exception as exc:  # a bug or I/O fault on this rank: peers must still hear of it
        error = f"rank {rt.rank}: upload failed: {type(exc).__name__}: {exc}"
    try:
        agree("upload", error, rt)
    except K3Error:
        tensors.clear()
        raise
    return WeightStore(tensors, plans, memory, all_memory, time.perf_counter() - start)
