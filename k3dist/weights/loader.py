"""Rank-aware loading: plan, preflight, agree; then file by file: read the rank-local bytes, place them, check the
free memory, agree; a last agreement after the upload.

Each file ends in an agreement, so a failure on one rank (its own error, a reader thread's, or its free memory
falling under the reserve) stops every rank after the same file with the same line, and no rank waits on a peer
that is gone. Any failure frees every allocation made so far before the error propagates.
"""

import gc
import logging
import os
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..base.dist import Runtime, agree, node_id
from ..base.errors import K3Error
from ..base.fault_injection import Faults
from ..base.units import fmt_bytes
from .inventory import Inventory, layout
from .memory import WEIGHTS_ONLY, MemoryPlan, MemoryTerms, detect_free, memory_plan
from .pagecache import PageCache
from .reads import SLOTS, collector_paused, schedule, staging
from .tp_plan import ShardPlan, plan_rank, store_shapes
from .transfer import Transfer, _indices

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
    terms: MemoryTerms,
    free: int | None,
    faults: Faults,
) -> tuple[list[ShardPlan], MemoryPlan, list[dict]]:
    """Plan this rank, check it fits, and agree with every rank on the verdict and the checkpoint headers.

    Returns every rank's status: its plan, its machine (`node`) and the free memory it measured (`measured`, the
    baseline of the upload's free-memory watch even when `free` is given)."""
    plans = plan_rank(inv.config, inv.entries.values(), rt.world, rt.rank, compute_dtype)
    measured = detect_free(rt.device, rt.local_world)
    if faults.mine(rt.rank) and faults.free is not None:
        free = faults.free
    if free is None:
        free = measured
    mp = memory_plan(rt.rank, plans, free, terms)
    log.info("k3_weight_plan " + " ".join(f"{k}={v}" for k, v in mp.as_dict().items()))
    lower = "memory.reserve, cache.cap or prefix.bytes" if terms.prefix else "memory.reserve or cache.cap"
    statuses = agree(
        "preflight",
        None if mp.fits else f"{mp.refusal()}; lower {lower}, or add ranks",
        rt,
        plan=mp.as_dict(),
        fingerprint=inv.fingerprint,
        headers=inv.file_digests,
        node=node_id(),
        measured=measured,
    )
    if any(st["fingerprint"] != statuses[0]["fingerprint"] for st in statuses):
        raise _disagreement(statuses)
    return plans, mp, statuses


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

    def target(self, plan: ShardPlan, shapes: dict) -> torch.Tensor:
        """Where one rank-local slice goes (allocated here): its own tensor, or its slot/rows of a stacked or fused
        one. Always contiguous, in the plan's local shape."""
        out = self.tensors.get(plan.dest)
        if out is None:
            shape, dtype = (plan.local_shape, plan.dtype) if plan.plain else shapes[plan.dest]
            out = self.tensors[plan.dest] = torch.empty(shape, dtype=dtype, device=self.device)
            self.refs.append(weakref.ref(out))
        target = out if plan.slot is None else out[plan.slot]
        if plan.row is not None:
            target = target[plan.row : plan.row + plan.local_shape[0]]
        return target

    def free_all(self) -> tuple[int, int]:
        """Drop everything; returns (tensors freed, live allocations left), collecting cycles only when something
        is still alive (a full collection takes long enough that a launcher may stop this rank before it speaks)."""
        freed = len(self.tensors)
        self.tensors.clear()
        live = self._live()
        if live:
            gc.collect()
            live = self._live()
        return freed, live

    def _live(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device) - self.baseline
        return sum(1 for r in self.refs if r() is not None)


class Stopped(K3Error):
    """The upload stopped at a file's agreement (a failure on some rank, or a rank lost): every rank that can know
    already does, so no further agreement follows."""


def _forget(exc: BaseException | None) -> None:
    """Clear the locals of every frame an exception (and its causes) holds: a reader's buffers or a view of a weight
    would otherwise keep that weight alive after the cleanup."""
    while exc is not None:
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def readers(rt: Runtime) -> int:
    """Reader threads: up to one per staging slot, the ranks of a machine sharing its cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(SLOTS, cores // max(rt.local_world, 1)))


class _Loading:
    """One upload, file by file; every file ends in an agreement."""

    def __init__(self, inv, plans, rt, *, faults, memory, pages, baseline):
        self.inv, self.plans, self.rt, self.faults = inv, plans, rt, faults
        self.memory, self.pages, self.baseline = memory, pages, baseline
        self.shapes = store_shapes(plans)
        self.chunks = schedule(plans)
        self.total = sum(p.local_bytes for p in plans)
        self.uploaded, self.where = 0, "before the first tensor"
        self.up = _Upload(rt.device)
        slots, slot_bytes = staging(self.chunks)
        self.transfer = Transfer(rt.device, slots, slot_bytes, readers(rt))
        self.bar = tqdm(
            total=self.total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"rank {rt.rank} load",
            disable=not rt.is_main or None,
            leave=False,
        )

    def run(self) -> dict[str, torch.Tensor]:
        files: dict[str, list[int]] = {}
        for i, p in enumerate(self.plans):
            if p.offset is None:
                raise K3Error(f"tensor {p.key}: planned without its file offset (plan from a scanned inventory)")
            files.setdefault(p.file, []).append(i)
        for k, (file, members) in enumerate(files.items()):
            path = Path(self.inv.model_dir) / file
            start, error, free = time.perf_counter(), None, None
            try:
                self.faults.before_file(self.rt.rank, k)
                self._file(path, self.chunks.get(file, []), members)
            except Exception as exc:  # this rank's failure, told to every rank in the file's agreement
                error = self._describe(exc, path)
                _forget(exc)
            finally:
                if self.pages is not None:
                    self.pages.done(path)
            if error is None and self.memory is not None:
                free, error = self._watch(k, path)
            if error is None:
                log.info(
                    "k3_weight_shard_loaded rank=%d file=%s tensors=%d bytes=%d seconds=%.3f%s",
                    self.rt.rank,
                    file,
                    len(members),
                    sum(self.plans[i].local_bytes for i in members),
                    time.perf_counter() - start,
                    "" if free is None else f" free_bytes={free} free_drop={self.baseline - free}",
                )
            try:
                agree("upload", error, self.rt)
            except K3Error as exc:
                raise Stopped(str(exc), agreed=exc.agreed) from None
        if self.uploaded != self.total:
            raise K3Error(f"rank {self.rt.rank}: uploaded {self.uploaded} bytes but the plan holds {self.total}")
        self.transfer.end()
        if self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)
        return self.up.tensors

    def _file(self, path: Path, chunks: list, members: list[int]) -> None:
        """Check the file still holds what was planned, make the weights (hooks first, in plan order), read."""
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):  # no readahead: read exactly the planned pages
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._check(fd, path, members)
            targets = {}
            for i in members:
                p = self.plans[i]
                self.where = f"at tensor {p.name} of {path}"
                self.faults.at_tensor(self.rt.rank, i, p.name)
                targets[i] = self.up.target(p, self.shapes)
            self.where = None  # from here on the transfer knows which chunk failed
            self.transfer.run(fd, chunks, targets, self.plans, self._at_read, self._done)
        finally:
            os.close(fd)

    def _check(self, fd: int, path: Path, members: list[int]) -> None:
        """The dtype, shape and offset of every tensor, read again from the header now, against the plan."""
        self.where = f"reading the header of {path}"
        now = layout(fd)
        for i in members:
            p = self.plans[i]
            planned = (p.src_dtype, p.full_shape, p.offset)
            found = now.get(p.key)
            if found != planned:
                what = "no such tensor" if found is None else f"{found[0]} {list(found[1])} at byte {found[2]}"
                raise K3Error(
                    f"{path}: tensor {p.key} is {what} now, planned {p.src_dtype} {list(p.full_shape)} at byte "
                    f"{p.offset}: the file changed after the inventory"
                )

    def _at_read(self, index: int) -> None:
        self.faults.at_read(self.rt.rank, index, self.plans[index].name)

    def _done(self, nbytes: int) -> None:
        self.uploaded += nbytes
        self.bar.update(nbytes)

    def _describe(self, exc: Exception, path: Path) -> str:
        """This rank's failure as one line naming the rank, the tensor, the file and the numbers."""
        where = self.where
        if where is None:  # in the transfer: a reader names the tensor it hit, else the chunk's first one
            chunk, index = self.transfer.chunk, getattr(exc, "k3_index", None)
            index = _indices(chunk)[0] if index is None and chunk is not None else index
            where = f"reading {path}" if index is None else f"at tensor {self.plans[index].name} of {path}"
        if isinstance(exc, torch.OutOfMemoryError):
            return (
                f"rank {self.rt.rank}: out of device memory {where} after uploading {fmt_bytes(self.uploaded)} of "
                f"{fmt_bytes(self.total)}: the reserve is exhausted (raise memory.reserve)"
            )
        if isinstance(exc, K3Error):
            return str(exc) if str(exc).startswith("rank ") else f"rank {self.rt.rank}: {exc}"
        return f"rank {self.rt.rank}: upload failed {where}: {type(exc).__name__}: {exc}"

    def _watch(self, k: int, path: Path) -> tuple[int, str | None]:
        """Free memory after file `k`; a refusal when what is left to allocate would eat into the reserve."""
        m = self.memory
        free = self.faults.free_seen(self.rt.rank, k, detect_free(self.rt.device, self.rt.local_world))
        still = m.local_bytes - self.uploaded + m.derived_bytes + m.cache_bytes + m.runtime_bytes + m.prefix_bytes
        if free - still >= m.reserve:
            return free, None
        return free, (
            f"rank {self.rt.rank}: reserve exhausted after {path}: free memory is {fmt_bytes(free)}, "
            f"{fmt_bytes(self.baseline - free)} less than at the plan, and {fmt_bytes(still)} is still to allocate "
            f"(weights, cache, runtime), leaving {fmt_bytes(free - still)} < memory.reserve {fmt_bytes(m.reserve)}: "
            "another process is using this rank's memory"
        )

    def close(self) -> None:
        self.bar.close()
        self.transfer.close()


def upload(
    inv: Inventory,
    plans: list[ShardPlan],
    rt: Runtime,
    faults: Faults,
    memory: MemoryPlan | None = None,
    pages: PageCache | None = None,
    baseline: int = 0,
) -> dict[str, torch.Tensor]:
    """Read rank-local slices file by file into device tensors, agreeing after each file (with `memory`, also on
    the free memory left); on failure free them all, then re-raise."""
    loading = _Loading(inv, plans, rt, faults=faults, memory=memory, pages=pages, baseline=baseline)
    try:
        with collector_paused():
            tensors = loading.run()
    except BaseException as exc:
        _forget(exc)
        loading.close()
        freed, live = loading.up.free_all()
        log.warning("k3_weight_cleanup rank=%d freed=%d live=%d", rt.rank, freed, live)
        if isinstance(exc, Exception) and not isinstance(exc, K3Error):  # outside any file (a bug, the store): say so
            raise K3Error(f"rank {rt.rank}: upload failed: {type(exc).__name__}: {exc}") from None
        raise
    loading.close()
    return tensors


def load_weights(
    inv: Inventory,
    rt: Runtime,
    compute_dtype: torch.dtype,
    terms: MemoryTerms = WEIGHTS_ONLY,
    *,
    free: int | None = None,
    faults: Faults | None = None,
    drop_page_cache: str = "auto",
) -> WeightStore:
    """The whole pipeline after the inventory: preflight + agreement, upload with an agreement per file,
    post-upload agreement. `terms`: this rank's run plan (run/plan.py); `free`: memory.free, or measured if None."""
    faults = faults or Faults()
    start = time.perf_counter()
    plans, memory, statuses = preflight(inv, rt, compute_dtype, terms, free, faults)
    mine = statuses[rt.rank]
    pages = PageCache(drop_page_cache, rt, mine["node"], sum(s["node"] == mine["node"] for s in statuses))
    all_memory = [s["plan"] for s in statuses]
    error, tensors = None, {}
    try:
        tensors = upload(inv, plans, rt, faults, memory, pages, mine["measured"])
    except Stopped:
        raise
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
