"""The decode thread governor (k3dist/base/threads.py) on simulated step times: it keeps every thread on a quiet
host, drops to one when two threads' steps slow down under load, and comes back when the load goes."""

import pytest
import torch

from k3dist.base.threads import ThreadGovernor


class Host:
    """A fake clock whose step takes `times[threads]`; the governor's thread count is this host's."""

    def __init__(self, monkeypatch, times: dict[int, float]):
        self.now, self.threads, self.times = 0.0, 2, times
        monkeypatch.setattr(torch, "get_num_threads", lambda: self.threads)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: setattr(self, "threads", n))

    def clock(self) -> float:
        return self.now

    def run(self, gov: ThreadGovernor, steps: int) -> list[int]:
        used = []
        for _ in range(steps):
            gov.tick()
            used.append(self.threads)
            self.now += self.times[self.threads]
        return used


def test_a_quiet_host_keeps_every_thread(monkeypatch):
    host = Host(monkeypatch, {2: 0.012, 1: 0.015})
    gov = ThreadGovernor(2, host.clock)
    used = host.run(gov, 600)
    assert gov.count == 2 and used[-1] == 2
    assert used.count(1) <= 5 * (ThreadGovernor.WINDOW + 1)  # a few looks, ever rarer


def test_a_loaded_host_drops_to_one_thread_and_comes_back(monkeypatch):
    host = Host(monkeypatch, {2: 0.050, 1: 0.019})
    gov = ThreadGovernor(2, host.clock)
    used = host.run(gov, 40)
    assert gov.count == 1 and used[-1] == 1 and used.index(1) < 12  # found within the first steps
    host.times = {2: 0.012, 1: 0.015}  # the load is gone
    used = host.run(gov, 200)
    assert gov.count == 2 and used[-1] == 2


def test_load_arriving_later_is_noticed(monkeypatch):
    host = Host(monkeypatch, {2: 0.012, 1: 0.015})
    gov = ThreadGovernor(2, host.clock)
    host.run(gov, 300)
    host.times = {2: 0.060, 1: 0.020}
    used = host.run(gov, 20)
    assert gov.count == 1 and used[-1] == 1


def test_prefill_runs_on_every_thread_and_is_no_step(monkeypatch):
    host = Host(monkeypatch, {2: 0.050, 1: 0.019})
    gov = ThreadGovernor(2, host.clock)
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
    assert set(host.run(ThreadGovernor(threads, host.clock), 50)) == {1}
