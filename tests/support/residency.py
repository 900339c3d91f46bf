"""Page-cache residency of files, for the tests of what the loader reads and drops (Linux only).

`resident` asks the kernel (mincore on a fresh read-only mapping, which faults nothing in) which pages of a file are
in the page cache; `evict` drops them (clean, unmapped pages only: write test files with `fsync`); `no_readahead`
turns readahead off on a process's existing mappings of a file (madvise MADV_RANDOM), so a fault reads one page.
"""

import ctypes
import mmap
import os
import sys
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
MADV_RANDOM = 1
SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "posix_fadvise")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def resident(path: str | Path) -> set[int]:
    """Indices of the file's pages now in the page cache."""
    size = os.path.getsize(path)
    if size == 0:
        return set()
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(mapping, dtype=np.uint8)
        vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
        if _libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del view
    finally:
        mapping.close()
    return {i for i, v in enumerate(vec) if v & 1}


def evict(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes | None = None) -> None:
    """fsync a file (written now from `data`, or already there) so that its pages can be evicted."""
    with open(path, "r+b" if data is None else "wb") as f:
        if data is not None:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def no_readahead(path: str | Path) -> int:
    """MADV_RANDOM on every mapping of `path` in this process (from /proc/self/maps); returns how many."""
    real, count = os.path.realpath(path), 0
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and line.rstrip().endswith(" " + real):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if _libc.madvise(lo, hi - lo, MADV_RANDOM) != 0:
                raise OSError(ctypes.get_errno(), "madvise")
            count += 1
    return count
