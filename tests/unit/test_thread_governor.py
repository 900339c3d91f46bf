"""The decode thread governor (k3dist/base/threads.py) on simulated step times and CPU times: it keeps every thread on
a quiet host (without trying one thread in a short run), drops to one when two threads' steps slow down or hold only
part of their cores under load, and comes back when the load goes."""

import pytest
import torch

from k3dist.base.threads import ThreadGovernor


class Host:
    """A fake clock whose step takes `times[threads]`, while the threads hold `held[threads]` cores (all of theirs on
    a quiet host: the default); the governor's thread count is this host's."""

    def __init__(self, monkeypatch, times: dict[int, float], held: dict[int, float] | None = None):
        self.now, self.cpu, self.threads, self.times, self.held = 0.0, 0.0, 2, times, held or {2: 2.0, 1: 1.0}
        monkeypatch.setattr(torch, "get_num_threads", lambda: self.threads)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: setattr(self, "threads", n))

    def clock(self) -> float:
        return self.now

    def cpu_clock(self) -> float:
        return self.cpu

    def governor(self) -> ThreadGovernor:
        return ThreadGovernor(2, self.clock, self.cpu_clock)

    def run(self, gov: ThreadGovernor, steps: int) -> list[int]:
        used = []
        for _ in range(steps):
            gov.tick()
            used.append(self.threads)
            self.now += self.times[self.threads]
            self.cpu += self.times[self.threads] * self.held[self.threads]
        return used


def test_a_quiet_host_keeps_every_thread(monkeypatch):
    host = Host(monkeypatch, {2: 0.012, 1: 0.015})
    gov = host.governor()
    used = host.run(gov, 600)
    assert gov.count == 2 and used[-1] == 2
    assert used.count(1) <= 5 * (ThreadGovernor.WINDOW + 1)  # a few looks, ever rarer


def test_a_short_run_on_a_quiet_host_never_tries_one_thread(monkeypatch):
    host = Host(monkeypatch, {2: 0.010, 1: 0.016})
    assert set(host.run(host.governor(), ThreadGovernor.EVERY - 1)) == {2}


def test_threads_holding_half_their_cores_try_one_thread_at_once(monkeypatch):
    """No slower than their own first steps (a host loaded from the start), but holding one core of two."""
    host = Host(monkeypatch, {2: 0.030, 1: 0.020}, held={2: 1.0, 1: 1.0})
    gov = host.governor()
    used = host.run(gov, 30)
    assert gov.count == 1 and used.index(1) < 12


def test_a_starved_count_that_stays_faster_is_not_retried_every_window(monkeypatch):
    host = Host(monkeypatch, {2: 0.015, 1: 0.030}, held={2: 1.2, 1: 1.0})  # part-loaded: two threads still win
    gov = host.governor()
    used = host.run(gov, 300)
    assert gov.count == 2 and used.count(1) <= 4 * (ThreadGovernor.WINDOW + 1)


def test_a_loaded_host_drops_to_one_thread_and_comes_back(monkeypatch):
    host = Host(monkeypatch, {2: 0.050, 1: 0.019}, held={2: 1.0, 1: 1.0})
    gov = host.governor()
    used = host.run(gov, 40)
    assert gov.count == 1 and used[-1] == 1 and used.index(1) < 12  # found within the first steps
    host.times, host.held = {2: 0.012, 1: 0.015}, {2: 2.0, 1: 1.0}  # the load is gone
    used = host.run(gov, 200)
    assert gov.count == 2 and used[-1] == 2


def test_load_arriving_later_is_noticed(monkeypatch):
    host = Host(monkeypatch, {2: 0.012, 1: 0.015})
    gov = host.governor()
    host.run(gov, 300)
    host.times, host.held = {2: 0.060, 1: 0.020}, {2: 1.0, 1: 1.0}
    used = host.run(gov, 20)
    assert gov.count == 1 and used[-1] == 1


def test_prefill_runs_on_every_thread_and_is_no_step(monkeypatch):
    host = Host(monkeypatch, {2: 0.050, 1: 0.019}, held={2: 1.0, 1: 1.0})
    gov = host.governor()
    host.run(gov, 40)
    gov.prefill()
    assert host.threads == 2
    host.now += 5.0  # a long prefill: not a step time
    gov.tick()
    assert host.threads == 1 and gov.count == 1


@pytest.mark.parametrize("threads", [1])
def test_one_thread_has_nothing_to_choose(monkeypatch, threads):
    host = Host(monkeypatch, {1: 0.01})
    host.threads = threads
    assert set(host.run(ThreadGovernor(threads, host.clock, host.cpu_clock), 50)) == {1}
