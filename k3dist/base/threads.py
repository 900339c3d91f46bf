"""The OpenMP runtime of k3dist's CPU ranks, chosen by k3dist rather than left to each user's shell.

A CPU decode step runs a few hundred parallel regions (oneDNN GEMVs, the CPU ops); between two of them libgomp's
worker threads wait, by default spinning for about 300,000 pause loops before they sleep. On a host whose cores are
shared (other jobs, a noisy VM neighbour) the spinning thread takes the core the working one needs, and every
region waits for a descheduled thread: benchmarks/decode.py measured the batch-1 step 4-10x slower that way on a
loaded 2-vCPU host, and no slower with waiting threads that sleep at once (docs/decode.md has the figures).

libgomp reads its settings once, when torch loads it, so `configure_openmp` runs first thing in launch.py: the rank
in that process, the ranks it spawns (they inherit the environment) and torchrun's workers (each runs launch.py)
all get them. A variable the user set is kept. `pin_rank` gives each rank on a host its own slice of the cores it
may use, before its thread pool exists, so ranks never share a core.
"""

import os
import sys

OPENMP = {"OMP_WAIT_POLICY": "PASSIVE"}  # waiting threads sleep at once: no core spent spinning for a peer thread


def configure_openmp(env=os.environ) -> dict[str, str]:
    """Set k3dist's OpenMP variables where the user has not; returns those it set. Effective only before torch is
    imported in this process (children started later inherit them either way)."""
    chosen = {k: v for k, v in OPENMP.items() if k not in env}
    env.update(chosen)
    return chosen


def openmp_settled() -> bool:
    """Whether this process's OpenMP runtime could still read the settings (torch not yet imported)."""
    return "torch" not in sys.modules


def rank_cores(allowed: list[int], local_rank: int, local_world: int) -> list[int]:
    """This rank's share of the cores the host's ranks may use: a contiguous slice, the remainder left unused (every
    rank runs the same number of threads, so the slowest rank is no slower than the rest)."""
    per = max(1, len(allowed) // max(local_world, 1))
    start = (local_rank * per) % len(allowed)
    return allowed[start : start + per]


def pin_rank(local_rank: int, local_world: int) -> list[int]:
    """Bind this process to its slice of the cores (threads it starts later inherit it); returns the slice."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    cores = rank_cores(sorted(os.sched_getaffinity(0)), local_rank, local_world)
    if local_world > 1:
        os.sched_setaffinity(0, cores)
    return cores
