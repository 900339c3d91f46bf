"""Run a function on N real ranks (spawned processes, gloo on CPU) and collect each rank's result or traceback.

A `RankGroup` keeps its spawned ranks between calls, so a test module pays one process start (an interpreter, torch
and k3dist imported: ~2 s of CPU a rank) per world size rather than one per call. Each call still joins a process
group of its own, on a fresh port, and after a call that failed anywhere or ran out of time the ranks are ended and
the next call starts new ones: no call runs in a process a failed call left behind.
"""

import gc
import os
import queue
import traceback

import torch.distributed
import torch.multiprocessing as mp

from k3dist.base import dist
from k3dist.base.dist import free_port, torchrun_env


def _serve(rank: int, world: int, calls, results) -> None:
    """A rank's loop: each call under its own rendezvous environment; None ends it."""
    while (call := calls.get()) is not None:
        number, fn, args, port, env = call
        before = dict(os.environ)
        os.environ.update(torchrun_env(rank, world, port), **env)
        try:
            results.put((number, rank, True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - report everything to the parent
            results.put((number, rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        finally:
            if torch.distributed.is_initialized():  # a call that failed before its own shutdown
                dist.shutdown()
            os.environ.clear()
            os.environ.update(before)
            gc.collect()  # a bound model sits in reference cycles: free it before the next call loads another


class RankGroup:
    """`world` spawned ranks that run one call after another (see the module's docstring)."""

    def __init__(self, world: int):
        self.world = world
        self.procs: list = []
        self.calls = 0
        self.stopping = False

    def run(self, fn, *args, timeout: float = 240, env: dict | None = None) -> list:
        """fn(*args) on every rank; returns per-rank (ok, value-or-error). `timeout`: how long to wait for each
        rank's result."""
        if not self.procs:
            self._start()
        self.calls += 1
        port = free_port()
        for inbox in self.inboxes:
            inbox.put((self.calls, fn, args, port, env or {}))
        out: dict[int, tuple[bool, object]] = {}
        try:
            while len(out) < self.world:
                number, rank, ok, value = self.results.get(timeout=timeout)
                if number == self.calls:  # an earlier, abandoned call's result is dropped
                    out[rank] = (ok, value)
        except queue.Empty:
            pass
        missing = set(range(self.world)) - set(out)
        for r in missing:
            code = self.procs[r].exitcode
            out[r] = (False, f"rank {r} returned nothing ({f'exit code {code}' if code is not None else 'timed out'})")
        if not all(ok for ok, _ in out.values()):
            self.close(wait_s=0 if missing else 30)  # a rank that never answered is stuck: no use waiting for it
        return [out[r] for r in range(self.world)]

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.world, self.inboxes[r], self.results)) for r in range(self.world)
        ]
        for p in self.procs:
            p.start()
        self.stopping = False

    def stop(self) -> None:
        """Ask the ranks to end once their call is done (close waits for them)."""
        if self.procs and not self.stopping:
            for inbox in self.inboxes:
                inbox.put(None)
            self.stopping = True

    def close(self, wait_s: float = 30) -> None:
        """End the ranks: asked first, killed if still alive after `wait_s`."""
        self.stop()
        for p in self.procs:
            p.join(timeout=wait_s)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []


class RankGroups:
    """One RankGroup per world size, for the points of a test module (the `shared_ranks` fixture): called as
    run_ranks is, it runs the call on that world's group."""

    def __init__(self):
        self.groups: dict[int, RankGroup] = {}

    def __call__(self, fn, world: int, *args, timeout: float = 240, env: dict | None = None) -> list:
        return self.groups.setdefault(world, RankGroup(world)).run(fn, *args, timeout=timeout, env=env)

    def close(self) -> None:
        for group in self.groups.values():
            group.stop()  # every group's ranks end at once
        for group in self.groups.values():
            group.close()


def run_ranks(fn, world: int, *args, timeout: float = 240, env: dict | None = None) -> list:
    """fn(*args) on `world` new ranks; returns per-rank (ok, value-or-error) after all exit; kills stragglers."""
    group = RankGroup(world)
    try:
        return group.run(fn, *args, timeout=timeout, env=env)
    finally:
        group.close()


def expect_ok(results: list) -> list:
    errors = [v for ok, v in results if not ok]
    assert not errors, "\n".join(map(str, errors))
    return [v for _, v in results]
