"""The test harness's rank groups (tests/support/ranks.py): a group keeps its spawned ranks from call to call, each call
in a process group of its own; a call that fails or times out ends the ranks, and the next call starts new ones."""

import os
import time

import torch

from k3dist.base import dist
from tests.support.ranks import RankGroup, expect_ok


def _whoami() -> tuple[int, str, int]:
    """This rank's process, the call's rendezvous port, and an all-reduce over the call's group."""
    rt = dist.init("gloo", "cpu", 30)
    total = torch.tensor([rt.rank + 1])
    torch.distributed.all_reduce(total)
    dist.shutdown()
    return os.getpid(), os.environ["MASTER_PORT"], int(total)


def _fail_on(rank: int) -> str:
    if int(os.environ["RANK"]) == rank:
        raise ValueError(f"injected on rank {rank}")
    return "ok"


def _sleep_on(rank: int, seconds: float) -> str:
    if int(os.environ["RANK"]) == rank:
        time.sleep(seconds)
    return "awake"


def test_a_group_reuses_its_ranks_until_a_call_fails_or_times_out():
    group = RankGroup(2)
    try:
        first, second = expect_ok(group.run(_whoami)), expect_ok(group.run(_whoami))
        assert [pid for pid, _, _ in first] == [pid for pid, _, _ in second]  # the same two processes
        assert first[0][1] == first[1][1] != second[0][1]  # a new rendezvous for each call
        assert {total for _, _, total in first + second} == {3}  # a real group of two each time
        failed = group.run(_fail_on, 1)
        assert failed[0] == (True, "ok") and not failed[1][0] and "ValueError: injected on rank 1" in failed[1][1]
        third = expect_ok(group.run(_whoami))
        assert not {pid for pid, _, _ in third} & {pid for pid, _, _ in first}  # new ranks after a failure
        started = time.monotonic()
        slept = group.run(_sleep_on, 0, 600, timeout=2)
        assert slept == [(False, "rank 0 returned nothing (timed out)"), (True, "awake")]
        assert time.monotonic() - started < 20 and not group.procs  # the stuck rank was killed, not waited for
    finally:
        group.close()
