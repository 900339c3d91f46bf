"""Dropping a checkpoint file from the page cache once every rank of the machine has read it.

`memory.drop_page_cache`: `auto` drops on CUDA, where the weights live on the device and the cached file only
competes with pinned staging and the other ranks for host memory; `on` drops on any device (hosts short of RAM,
tests); `off` never. The page cache is one per machine, so a file is dropped by the last of the machine's ranks to
finish it (a per-file counter in the rendezvous store), never under a rank still reading it.
"""

import itertools
import logging
import os
from pathlib import Path

import torch

from ..base.dist import Runtime
from ..base.store import count

log = logging.getLogger("k3dist")
MODES = ("auto", "on", "off")
_loads = itertools.count(1)  # every rank runs the same loads in the same order: one counter namespace each


def drops(mode: str, device: torch.device) -> bool:
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def drop(path: Path) -> bool:
    """Ask the kernel to forget the file's cached pages (dirty or mapped pages stay); False where it cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return False
    return True


class PageCache:
    """One load's page-cache policy: `done(path)` after this rank's last read of a file."""

    def __init__(self, mode: str, rt: Runtime, node: str, node_ranks: int):
        self.load = next(_loads)
        self.enabled = drops(mode, rt.device)
        self.rank, self.node, self.node_ranks = rt.rank, node, node_ranks

    def done(self, path: Path) -> None:
        if not self.enabled:
            return
        if self.node_ranks > 1:
            finished = count(f"k3dist/pages/{self.load}/{self.node}/{path.name}")
            if finished < self.node_ranks:
                return
        if drop(path):
            log.info("k3_page_cache_dropped rank=%d file=%s node_ranks=%d", self.rank, path.name, self.node_ranks)
