"""Fault injection for tests (`fault.*` overrides): a fault fires on one rank, at one tensor or file of the upload
or in prefill or decode after the load."""

import errno
import os
import signal
import time
from dataclasses import dataclass

import torch

from .errors import K3Error


@dataclass(frozen=True)
class Faults:
    rank: int | None = None  # the rank that misbehaves (None: no fault)
    free: int | None = None  # free bytes that rank reports to the preflight
    alloc_fail_at: int | None = None  # the Nth tensor's allocation fails (0-based)
    oom_at: int | None = None  # the device runs out of memory at the Nth tensor (torch.OutOfMemoryError)
    raise_at: int | None = None  # the rank raises a plain exception at the Nth tensor
    kill_at: int | None = None  # the rank SIGKILLs itself at the Nth tensor
    hang_at: int | None = None  # the rank stops responding at the Nth tensor
    delay_s: float | None = None  # the fault waits this long first, so peers already wait on the rank in the agreement
    raise_in: str | None = None  # "prefill", "decode" (after the load), "result" (rank 0 writing result.json) or
    # "route" (rank 0's HTTP front, answering a request whose `user` is "raise": a fault of k3dist's own)
    read_fail_at: int | None = None  # a reader thread fails (EIO) reading the Nth tensor
    hold_at_file: int | None = None  # the rank waits delay_s before reading the Nth file (0-based, in upload order)
    free_drop: int | None = None  # the rank's free memory reads this many bytes lower during the upload ...
    free_drop_at: int | None = None  # ... from the end of the Nth file on (0-based; default 0)

    def mine(self, rank: int) -> bool:
        return self.rank is not None and self.rank == rank

    def at_tensor(self, rank: int, index: int, name: str) -> None:
        """Called by the loader before allocating tensor `index` on `rank`."""
        if not self.mine(rank):
            return
        if self.delay_s and index in (self.alloc_fail_at, self.oom_at, self.raise_at, self.kill_at, self.hang_at):
            time.sleep(self.delay_s)
        if index == self.alloc_fail_at:
            raise K3Error(f"rank {rank}: allocation failed for tensor {name} (injected by fault.alloc_fail_at)")
        if index == self.oom_at:
            raise torch.OutOfMemoryError(f"injected out of memory at tensor {name} (fault.oom_at={index})")
        if index == self.raise_at:
            raise RuntimeError(f"injected failure at tensor {name} (fault.raise_at={index})")
        if index == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if index == self.hang_at:
            while True:
                time.sleep(60)

    def at_read(self, rank: int, index: int, name: str) -> None:
        """Called by a reader thread before reading any part of tensor `index`."""
        if self.mine(rank) and index == self.read_fail_at:
            raise OSError(errno.EIO, f"injected read error at tensor {name} (fault.read_fail_at={index})")

    def before_file(self, rank: int, index: int) -> None:
        """Called by the loader before reading file `index`."""
        if self.mine(rank) and index == self.hold_at_file:
            time.sleep(self.delay_s or 0)

    def free_seen(self, rank: int, index: int, free: int) -> int:
        """The free memory the loader sees after file `index`."""
        if self.mine(rank) and self.free_drop and index >= (self.free_drop_at or 0):
            return max(0, free - self.free_drop)
        return free

    def in_route(self, rank: int, user: str | None) -> None:
        """Called by rank 0's HTTP front as it answers a request (`user`: the request's)."""
        if self.mine(rank) and self.raise_in == "route" and user == "raise":
            raise RuntimeError("injected failure in a route (fault.raise_in=route)")

    def after_load(self, rank: int, stage: str) -> None:
        """Called by the engine in each prefill and decode window, and by rank 0 before it writes result.json."""
        if self.mine(rank) and self.raise_in == stage:
            raise RuntimeError(f"injected failure in {stage} (fault.raise_in={stage})")
