"""What a server watches and counts of its ranks' memory: a report when one is due, a rank past its plan logged once,
the GEMM caches' cap in the plan whatever sets it, and file pages mapped after the bare process left out of the run's
figures."""

import logging
import mmap
import os
from pathlib import Path

import pytest
import torch

from k3dist.base import allocator
from k3dist.engine.watch import OVER, MemoryWatch
from k3dist.weights import memory

MiB = 2**20


def test_reports_when_due_and_logs_a_rank_over_its_plan_once(caplog):
    now = [0.0]
    watch = MemoryWatch([100 * MiB, 100 * MiB], every_s=5, clock=lambda: now[0])
    assert watch.due()
    with caplog.at_level(logging.WARNING, logger="k3dist"):
        watch.record([[300 * MiB, 200 * MiB], [300 * MiB, 190 * MiB]])  # rank 1 holds 110 MiB: within the margin
        assert not watch.due() and [r.held for r in watch.ranks] == [100 * MiB, 110 * MiB]
        now[0] = 5.0
        assert watch.due()
        over = int(100 * MiB * (1 + OVER)) + 1
        watch.record([[200 * MiB + over, 200 * MiB], [300 * MiB, 190 * MiB]])
        watch.record([[200 * MiB + 2 * over, 200 * MiB], [300 * MiB, 190 * MiB]])  # still over: no second line
    lines = [r.getMessage() for r in caplog.records if "k3_memory_over" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("k3_memory_over rank=0 held=110.0 MiB admitted=100.0 MiB"), lines


def test_the_caches_are_capped_unless_the_user_chose():
    env = {}
    assert allocator.configure_caches(env) == {name: str(allocator.CACHED_PRIMITIVES) for name in allocator.CACHES}
    assert allocator.cached_primitives(env) == allocator.CACHED_PRIMITIVES
    mine = {"LRU_CACHE_CAPACITY": "200"}
    assert allocator.configure_caches(mine) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(allocator.CACHED_PRIMITIVES)}
    assert allocator.cached_primitives(mine) == 200  # the plan counts what the user set
    assert allocator.cached_primitives({}) == 1024  # the libraries' own default, where nothing is set


def test_file_pages_mapped_after_the_bare_process_count_with_it(tmp_path):
    """A rank's newly run library code is file-backed like this mapping: the base takes it; the data stays the run's."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc on this system")
    cpu = torch.device("cpu")
    path = tmp_path / "pages"
    path.write_bytes(os.urandom(64 * MiB))
    memory.mark_base()
    resident, base = memory.resident_bytes(cpu)
    held = memory.start_peak_window(cpu)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
        assert sum(pages[i] for i in range(0, len(pages), mmap.PAGESIZE)) >= 0  # every page mapped
        data = mmap.mmap(-1, 32 * MiB)  # fresh anonymous pages: freed heap a long test run holds would not grow RSS
        for i in range(0, len(data), mmap.PAGESIZE):
            data[i] = 1
        mapped_resident, mapped_base = memory.resident_bytes(cpu)
        if mapped_base == base and memory.proc_status().get("RssShmem", 0) >= 60 * MiB:
            pytest.skip("the temporary folder is in memory (tmpfs): its pages are shared memory, not file pages")
        assert mapped_resident - resident >= 90 * MiB  # the resident set holds both
        assert mapped_base - base >= 60 * MiB  # the file's pages went to the base
        assert 28 * MiB <= (mapped_resident - mapped_base) - (resident - base) <= 40 * MiB  # the data stayed the run's
        assert 28 * MiB <= memory.window_peak(cpu) - held <= 40 * MiB
        data.close()
