"""Run a function on N real ranks (spawned processes, gloo on CPU) and collect each rank's result or traceback."""

import os
import queue
import traceback

import torch.multiprocessing as mp

from k3dist.base.dist import free_port, torchrun_env


def _child(fn, rank, world, port, results, args, env):
    os.environ.update(torchrun_env(rank, world, port), **env)
    try:
        results.put((rank, True, fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn, world: int, *args, timeout: float = 240, env: dict | None = None) -> list:
    """fn(*args) on every rank; returns per-rank (ok, value-or-error) after all exit; kills stragglers."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, results, args, env or {})) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[bool, object]] = {}
    try:
        while len(out) < world:
            rank, ok, value = results.get(timeout=timeout)
            out[rank] = (ok, value)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [out.get(r, (False, f"rank {r} returned nothing (exit code {procs[r].exitcode})")) for r in range(world)]


def expect_ok(results: list) -> list:
    errors = [v for ok, v in results if not ok]
    assert not errors, "\n".join(map(str, errors))
    return [v for _, v in results]
