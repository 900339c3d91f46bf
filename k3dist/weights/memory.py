"""Per-rank memory plan (docs/memory.md) and free-memory detection (CUDA, or cgroup-aware host RAM)."""

import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..base.units import fmt_bytes
from .reads import SLOTS, read_bytes, schedule, staging
from .tp_plan import ShardPlan


@dataclass(frozen=True, kw_only=True)
class MemoryTerms:
    """A rank's bytes besides its share of the checkpoint and the staging ring, which the tensor plan gives: decided
    once per run (run/plan.py) and added up here."""

    cache: int = 0  # KDA state + MLA rows for generate.batch x cache.cap
    runtime: int = 0  # one prefill chunk, logits, outputs, workspaces (memory/runtime.py)
    derived: int = 0  # copies made while binding: packed or int8 weights, one at a time
    prefix: int = 0  # the snapshot pool and rank 0's remembered ids
    saved: int = 0  # what binding gives back (model.quant=int8)
    reserve: int = 0  # memory.reserve, resolved for the device


WEIGHTS_ONLY = MemoryTerms()  # a load with nothing planned beside its weights (tests, benchmarks)


@dataclass(frozen=True)
class MemoryPlan:
    rank: int
    source_bytes: int  # checkpoint bytes this rank keeps (its share of the checkpoint)
    read_bytes: int  # page-granular checkpoint bytes it really reads (reads.py): row splits read whole pages
    local_bytes: int  # weight bytes it keeps on its device
    replicated_bytes: int  # part of local_bytes every rank holds
    staging_peak: int  # what the staging ring holds at once: a few chunks of at most 64 MiB (reads.py)
    derived_bytes: int  # device copies made at bind time (casts, fused or absorbed weights, int8 copies)
    cache_bytes: int  # KDA state + MLA latent for batch x cap
    runtime_bytes: int  # activations of one prefill chunk, logits and sampling buffers, workspaces (memory/runtime.py)
    prefix_bytes: int  # the pool of prefix snapshots (prefix.bytes; on a CPU also prefix.host_bytes)
    reserve: int  # explicit headroom
    free: int  # memory available to this rank
    tensors: int
    saved_bytes: int = 0  # what binding gives back (model.quant=int8: weights/quant_plan.py)

    @property
    def bound_bytes(self) -> int:
        """Weight bytes held after binding (the load's peak is local_bytes + derived_bytes)."""
        return self.local_bytes - self.saved_bytes

    @property
    def admitted(self) -> int:
        return (
            self.local_bytes
            + self.derived_bytes
            + self.staging_peak
            + self.cache_bytes
            + self.runtime_bytes
            + self.prefix_bytes
            + self.reserve
        )

    @property
    def fits(self) -> bool:
        return self.admitted <= self.free

    def as_dict(self) -> dict:
        return asdict(self) | {"bound_bytes": self.bound_bytes, "admitted": self.admitted, "fits": self.fits}

    def refusal(self) -> str:
        return (
            f"rank {self.rank} needs admitted {fmt_bytes(self.admitted)} > free {fmt_bytes(self.free)} "
            f"(local {fmt_bytes(self.local_bytes)} + derived {fmt_bytes(self.derived_bytes)} + staging "
            f"{fmt_bytes(self.staging_peak)} + cache {fmt_bytes(self.cache_bytes)} + runtime "
            f"{fmt_bytes(self.runtime_bytes)} + prefix {fmt_bytes(self.prefix_bytes)} + reserve "
            f"{fmt_bytes(self.reserve)}; short by {fmt_bytes(self.admitted - self.free)})"
        )


def memory_plan(rank: int, plans: list[ShardPlan], free: int, terms: MemoryTerms = WEIGHTS_ONLY) -> MemoryPlan:
    chunks = schedule(plans)
    slots, slot_bytes = staging(chunks)
    return _with_terms(
        rank,
        free,
        terms,
        source_bytes=sum(p.source_bytes for p in plans),
        read_bytes=read_bytes(plans, chunks),
        local_bytes=sum(p.local_bytes for p in plans),
        replicated_bytes=sum(p.local_bytes for p in plans if p.axis.dim is None),
        staging_peak=slots * slot_bytes,
        tensors=len(plans),
    )


def family_memory_plan(
    rank: int, families: list[tuple[ShardPlan, int]], free: int, terms: MemoryTerms = WEIGHTS_ONLY
) -> MemoryPlan:
    """memory_plan of tensors planned from the config alone, given as (one tensor's plan, how many plan alike).

    With no file offsets every tensor is read on its own (reads.py), so tensors of one shape, split and dtype read,
    stage and keep what one of them does, times their count: the same figures as memory_plan's over every tensor,
    without a plan per tensor (K3: 497,052 tensors a rank, of a few dozen families)."""
    chunks = [(schedule([plan]), count) for plan, count in families]
    every = sum(count * len(c) for sched, count in chunks for c in sched.values())
    widest = max((staging(sched)[1] for sched, _ in chunks), default=0)
    return _with_terms(
        rank,
        free,
        terms,
        source_bytes=sum(p.source_bytes * n for p, n in families),
        read_bytes=sum(read_bytes([p], sched) * n for (p, n), (sched, _) in zip(families, chunks, strict=True)),
        local_bytes=sum(p.local_bytes * n for p, n in families),
        replicated_bytes=sum(p.local_bytes * n for p, n in families if p.axis.dim is None),
        staging_peak=min(SLOTS, every) * widest,
        tensors=sum(n for _, n in families),
    )


def _with_terms(rank: int, free: int, terms: MemoryTerms, **weights: int) -> MemoryPlan:
    """A MemoryPlan of the weights' figures and the run's other terms."""
    return MemoryPlan(
        rank=rank,
        derived_bytes=terms.derived,
        cache_bytes=terms.cache,
        runtime_bytes=terms.runtime,
        prefix_bytes=terms.prefix,
        reserve=terms.reserve,
        free=free,
        saved_bytes=terms.saved,
        **weights,
    )


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_available() -> int:
    """MemAvailable, capped by the cgroup (v2 or v1) limit minus its usage."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:
            avail = min(avail, max(limit - usage, 0))
    return avail


def detect_free(device: torch.device, local_world: int = 1) -> int:
    """Free bytes for this rank: CUDA free memory plus what torch's allocator holds unused (it is this process's to
    reuse), or host memory shared by the ranks on this machine."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return host_available() // max(local_world, 1)


_EARLIER_PEAK = 0  # the peak before a measuring window reset the counters (start_peak_window)


def peak_bytes(device: torch.device) -> int:
    """This process's peak: torch's peak allocation on CUDA, the peak resident set on CPU.

    On Linux the resident peak is read from /proc/self/status (VmHWM): getrusage's ru_maxrss survives execve, so a
    rank started from a large parent (a test runner, a notebook) would report the parent's size instead of its own.
    Library code mapped since the bare process is not the run's (code_since_base).
    """
    if device.type == "cuda":
        return max(_EARLIER_PEAK, torch.cuda.max_memory_allocated(device))
    status = proc_status()
    own = status.get("VmHWM", 0) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return max(_EARLIER_PEAK, own - code_since_base(status))


CPU_RESERVE = 64 * 2**20  # the libraries' own state after a load (tokenizer tables, thread pools): ~36 MiB measured


def default_reserve(device: torch.device) -> int:
    """memory.reserve when none is given: 64 MiB on the CPU (CPU_RESERVE); on CUDA 2 GiB plus 3% of the device, for
    the caching allocator's block rounding and fragmentation and for NCCL/cuBLAS growth beyond the plan's workspace
    term (docs/memory.md says how to check it against max_memory_reserved)."""
    if device.type != "cuda":
        return CPU_RESERVE
    return 2 * 2**30 + torch.cuda.get_device_properties(device).total_memory * 3 // 100


def proc_status() -> dict[str, int]:
    """The sizes in /proc/self/status, in bytes, by name (VmRSS, VmHWM, RssFile, ...): one read, so that figures
    combined from several of them are of the same moment. Empty where there is no such file (not Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    sizes = (line.split() for line in lines if line.endswith(" kB"))
    return {words[0].rstrip(":"): int(words[1]) * 1024 for words in sizes}


def start_peak_window(device: torch.device) -> int:
    """Start measuring a phase's own peak; returns the memory in use now (RSS on CPU, allocation on CUDA).

    On Linux the CPU high-water mark is reset through /proc/self/clear_refs, so `window_peak` reads this phase's peak
    only; where that is not allowed the process's lifetime peak stands in (an overestimate). `peak_bytes` still
    reports the lifetime peak.
    """
    global _EARLIER_PEAK
    _EARLIER_PEAK = peak_bytes(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    status = proc_status()
    return status.get("VmRSS", 0) - code_since_base(status)


def window_peak(device: torch.device) -> int:
    """The peak since start_peak_window (allocation on CUDA, resident set less code_since_base on CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = proc_status()
    return status["VmHWM"] - code_since_base(status) if status.get("VmHWM") else peak_bytes(device)


_BASE = 0  # this process's resident set before the run held anything (mark_base)
_BASE_CODE = 0  # of which file-backed pages: the interpreter's and the libraries' code mapped by then


def mark_base() -> None:
    """Note the resident set of the bare process (interpreter, torch and k3dist imported), which the plan's
    `admitted` does not count: what a rank holds for the run is its resident set minus this."""
    global _BASE, _BASE_CODE
    status = proc_status()
    _BASE, _BASE_CODE = status.get("VmRSS", 0), status.get("RssFile", 0)


def code_since_base(status: dict[str, int]) -> int:
    """File-backed pages mapped since mark_base, from a proc_status() reading: library code first run by the run
    (oneDNN's GEMMs, the CPU ops, the tokenizer), which belongs to the bare process's libraries, not to the run, and
    which the plan does not hold.

    The kernel maps a library's code at its page cache's folio size: up to 2 MiB where the file was written recently
    (a fresh install), 4 KiB plus fault-around where it was read back later. The same run's resident set thus varied by
    80 MB with the page cache's history (docs/memory.md); its data did not. Shared, clean and reclaimable, these pages
    are counted with the bare process. A peak read as VmHWM less this understates the data by at most the code first
    mapped after the peak (the few decode steps after a prefill's peak)."""
    return max(status.get("RssFile", 0) - _BASE_CODE, 0) if _BASE_CODE else 0


def resident_bytes(device: torch.device) -> tuple[int, int]:
    """(what this rank holds now, its bare process): on a CPU the resident set and mark_base's figure plus the code
    mapped since (code_since_base), so that their difference is the run's data; on CUDA the caching allocator's
    reserved bytes and 0 (the device holds nothing before the run)."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device), 0
    status = proc_status()
    return status.get("VmRSS", 0), _BASE + code_since_base(status)
