"""How a CPU rank's libraries hold memory, chosen by k3dist rather than left to each user's shell.

Two caches grow with the variety of GEMM shapes a run meets, and neither has a bound that fits a memory plan by
default. oneDNN compiles a kernel for every new (rows, weight shape) pair and keeps it (about 0.7 MiB each) in its
primitive cache, and torch's ideep layer keeps its own LRU of the same primitives; both hold 1,024 by default, so a
server whose prompts have every length grows by up to 0.7 GiB a rank (docs/memory.md). k3dist caps both at
`CACHED_PRIMITIVES`, and the plan counts the cap (memory/runtime.py): a prefill of a new length then builds its
kernels again, which costs nothing measurable next to the prefill itself.

glibc's allocator is set up for a rank too (`limit_heap`): a fixed mmap threshold, so large blocks go back to the
system when freed; few arenas, so the HTTP and tokenizer threads of a server do not each keep a heap of their own;
and `trim`, called with the memory reports, gives back the free pages left inside the heap.

Both caches read their variable once, on first use, so `configure_caches` runs first thing in launch.py (as
threads.configure_openmp does): the rank in that process, the ranks it spawns and torchrun's workers all get it. A
variable the user set is kept, and the plan counts the user's number.
"""

import ctypes
import functools
import os

CACHED_PRIMITIVES = 32  # decode needs ~8 at once and a prefill chunk ~13: both fit, any variety beyond is rebuilt
CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's own, ideep's (torch's oneDNN layer)
PRIMITIVE_BYTES = 3 * 2**20 // 4  # what one cached bf16 GEMM primitive holds: 0.63-0.71 MiB measured, rounded up
ARENAS = 2  # glibc malloc arenas: the main thread's and one for every other thread
MMAP_THRESHOLD = 4 << 20  # blocks from here up are mapped and unmapped, never kept in the heap
TRIM_THRESHOLD = 8 << 20  # free memory at the top of the heap beyond this goes back at once

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt parameters (malloc.h)


def configure_caches(env=os.environ) -> dict[str, str]:
    """Cap the GEMM primitive caches unless the user set a capacity; returns what it set. Effective only before the
    first GEMM in this process (children started later inherit it either way)."""
    wanted = {name: str(CACHED_PRIMITIVES) for name in CACHES if name not in env}
    env.update(wanted)
    return wanted


def cached_primitives(env=os.environ) -> int:
    """How many GEMM primitives a rank may keep: the larger of the two caps (each cache holds its own references to
    the same primitives, so what stays alive is what either one still holds)."""
    caps = []
    for name in CACHES:
        value = env.get(name, "1024")  # both libraries' default
        caps.append(int(value) if value.strip().isdigit() else 1024)
    return max(caps)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def limit_heap() -> None:
    """CPU ranks: make glibc give freed memory back to the system instead of keeping the process at its highest
    transient.

    By default glibc raises its mmap threshold as large blocks are freed (up to 32 MiB) and keeps freed heap memory
    resident, so a process's RSS stays near its highest transient: the memory plan could not mean what it says. A
    fixed 4 MiB threshold sends every larger tensor through mmap/munmap, so prefill activations leave with their
    chunk; two arenas keep a server's threads from growing a heap each. No-op off glibc.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    libc.mallopt(M_ARENA_MAX, ARENAS)


def trim() -> None:
    """Give back the free pages inside every arena (malloc_trim), not only those at the heap's top. No-op off glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
