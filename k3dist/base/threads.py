"""The OpenMP runtime of k3dist's CPU ranks, chosen by k3dist rather than left to each user's shell.

A CPU decode step runs about a hundred parallel regions (oneDNN GEMVs, the CPU ops); between two of them libgomp's
worker threads wait, by default spinning for milliseconds before they sleep. On a host whose cores are shared
(other jobs, a noisy VM neighbour) the spinning thread takes the core the working one needs, and every region waits
for a descheduled thread. Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE) hold up there, but pay a wake-up per
region on a quiet host. So waiting threads spin briefly, and `ThreadGovernor` drops a rank to one thread while its
steps show the host is loaded (docs/decode.md has the figures).

libgomp reads its settings once, when torch loads it, so `configure_openmp` runs first thing in launch.py: the rank
in that process, the ranks it spawns (they inherit the environment) and torchrun's workers (each runs launch.py)
all get them. A variable the user set is kept. `pin_rank` gives each rank on a host its own slice of the cores it
may use, before its thread pool exists, so ranks never share a core.
"""

import os

# waiting threads spin ~0.1 ms (libgomp counts 100,000 spins a millisecond), then sleep: long enough to span the gap
# between two ops of a step, short enough that an idle or descheduled rank gives its cores back
OPENMP = {"GOMP_SPINCOUNT": "10000"}
USERS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # a user who set either one chose the waiting: k3dist sets nothing


def configure_openmp(env=os.environ) -> dict[str, str]:
    """Set k3dist's OpenMP variables unless the user chose a wait policy; returns those it set. Effective only before
    torch is imported in this process (children started later inherit them either way)."""
    if any(k in env for k in USERS):
        return {}
    env.update(OPENMP)
    return dict(OPENMP)


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


class ThreadGovernor:
    """Chooses a CPU rank's OpenMP thread count for decode steps from the steps' own times: all of its cores, or one.

    With its threads spinning briefly between regions (OPENMP) a 2-core step is fastest on a quiet host, and falls
    apart on a loaded one, where every region waits for a descheduled thread; one thread has no such wait and keeps
    most of the speed (docs/decode.md). The process's CPU time per wall second tells the two apart without trying:
    on a quiet 2-core host a step's threads hold about 2.0 cores, while a busy neighbour leaves them about 1.0. So the
    other count is timed for WINDOW steps, and kept if it is faster, when the threads hold under STARVED of their
    cores, when the current count has slowed to SLOWER x its best, or after `every` steps (EVERY, doubled after each
    look that kept the count, up to LONGEST: a steady host pays few looks, a quiet one none in its first EVERY).
    Prefill always runs on every thread (compute-bound). Host-side only: skipped while torch.compile traces.
    """

    WINDOW = 6  # steps timed per count per comparison (their median), after one step to settle
    EVERY, LONGEST = 64, 1024  # steps between looks while nothing changes
    SLOWER = 1.3  # a current count this much slower than its best looks again (after WINDOW more steps)
    STARVED = 0.75  # threads holding less than this share of their cores (the median of WINDOW steps) look again
    MARGIN = 0.95  # the other count must be this much faster to take over

    def __init__(self, threads: int, clock=None, cpu_clock=None):
        import time

        self.clock, self.cpu_clock = clock or time.perf_counter, cpu_clock or time.process_time
        self.full = threads
        self.counts = (threads, 1) if threads > 1 else (threads,)
        self.count, self.active, self.best = threads, threads, {}
        self.recent: list[float] = []
        self.held: list[float] = []  # cores held per step (CPU seconds per wall second) at the current count
        self.trial: list[float] | None = None
        self.steps, self.next_look, self.every, self.last, self.settle = 0, self.EVERY, self.EVERY, None, 1
        self.last_cpu, self.trust_starved = 0.0, 0  # a look that kept the count mutes `starved` until its next look

    def _use(self, count: int) -> None:
        import torch

        if torch.get_num_threads() != count:
            torch.set_num_threads(count)
        self.active, self.settle = count, 1

    def prefill(self) -> None:
        """Before a prefill: every thread, and the gap it makes is not a step time."""
        if len(self.counts) > 1:
            import torch

            torch.set_num_threads(self.full)
            self.last = None

    def pause(self) -> None:
        """Before a window of steps: the time since the last step (the host's look, an idle server) is not a step."""
        self.last = None

    def tick(self) -> None:
        """At the start of each decode step: time the previous one, maybe switch."""
        if len(self.counts) == 1:
            return
        now, cpu = self.clock(), self.cpu_clock()
        took, self.last = (None if self.last is None else now - self.last), now
        held, self.last_cpu = (None if took is None or took <= 0 else (cpu - self.last_cpu) / took), cpu
        if took is None:
            self._use(self.active)  # the first step, or the first after a prefill: the count in use again
        self.steps += 1
        if took is None or self.settle:
            self.settle = max(0, self.settle - (took is not None))
            return
        if self.trial is not None:
            self.trial.append(took)
            if len(self.trial) == self.WINDOW:
                self._decide()
            return
        self.recent = (self.recent + [took])[-self.WINDOW :]
        self.held = (self.held + [held or 0.0])[-self.WINDOW :]
        if len(self.recent) < self.WINDOW:
            return
        now_median = sorted(self.recent)[self.WINDOW // 2]
        best = self.best[self.count] = min(self.best.get(self.count, now_median), now_median)
        starved = self.count > 1 and self.steps >= self.trust_starved and len(self.held) == self.WINDOW
        starved = starved and sorted(self.held)[self.WINDOW // 2] < self.STARVED * self.count
        if self.steps >= self.next_look or now_median > self.SLOWER * best or starved:
            self.trial = []
            self._use(next(c for c in self.counts if c != self.count))

    def _decide(self) -> None:
        other = next(c for c in self.counts if c != self.count)
        theirs, ours = sorted(self.trial)[self.WINDOW // 2], sorted(self.recent)[self.WINDOW // 2]
        self.best[other] = min(self.best.get(other, theirs), theirs)
        if theirs < self.MARGIN * ours:
            self.count, self.recent, self.held, self.every = other, list(self.trial), [], self.EVERY
        else:
            self.every = min(2 * self.every, self.LONGEST)
            self.trust_starved = self.steps + self.every
        self.best[self.count] = sorted(self.recent)[self.WINDOW // 2]  # the current count's best starts afresh
        self.trial, self.next_look, self.held = None, self.steps + self.every, []
        self._use(self.count)
