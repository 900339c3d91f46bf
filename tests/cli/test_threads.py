"""k3dist sets its ranks' OpenMP runtime itself (k3dist/base/threads.py): every way of starting ranks gets it, a
user's own value wins, and ranks on one host get disjoint cores."""

import json
import os
import re
import subprocess
import sys

import pytest

from k3dist.base import threads
from tests.support.cli_run import ROOT, run_cli
from tests.support.tiers import slow_but

SPIN = re.compile(r"^\s*GOMP_SPINCOUNT = '(\d+)'", re.M)
POLICY = re.compile(r"^\s*OMP_WAIT_POLICY = '(\w+)'", re.M)


@pytest.mark.parametrize("how", slow_but(["in-process", "spawned", "torchrun"], keep=["spawned"]))
def test_every_rank_reads_k3dists_wait_policy(tmp_path, monkeypatch, how):
    """OMP_DISPLAY_ENV makes each process's libgomp print what it read when torch loaded it."""
    for name in threads.USERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")
    args = ["run.mode=plan", "memory.free=8GiB"]
    from k3dist.base.dist import free_port

    rdzv = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}"]
    torchrun = ["--nproc_per_node=2", *rdzv] if how == "torchrun" else None
    code, text, _ = run_cli(tmp_path, *args, *(["dist.nproc=2"] if how == "spawned" else []), torchrun=torchrun)
    assert code == 0, text
    seen, ours = SPIN.findall(text), threads.OPENMP["GOMP_SPINCOUNT"]
    ranks = 1 if how == "in-process" else 2
    others = 1 if how == "torchrun" else 0  # torchrun's own agent imports torch before any of k3dist runs
    assert seen.count(ours) >= ranks and len(seen) - seen.count(ours) <= others, seen


def test_a_users_wait_policy_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")
    code, text, _ = run_cli(tmp_path, "run.mode=plan", "memory.free=8GiB", "dist.nproc=2")
    assert code == 0, text
    assert set(POLICY.findall(text)) == {"PASSIVE"} and set(SPIN.findall(text)) == {"0"}


def test_configure_sets_nothing_when_the_user_chose():
    for name in threads.USERS:
        env = {name: "x"}
        assert threads.configure_openmp(env) == {} and env == {name: "x"}
    assert threads.configure_openmp({}) == threads.OPENMP


@pytest.mark.parametrize(
    "allowed, world, want",
    [
        ([0, 1], 1, [[0, 1]]),
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1], [2, 3]]),  # the fifth core is left over: every rank runs two threads
        ([4, 5, 6, 7], 2, [[4, 5], [6, 7]]),  # slices of what the process may use, not of all cores
        ([0, 1], 4, [[0], [1], [0], [1]]),  # more ranks than cores: they share, one core each
    ],
)
def test_rank_cores_are_disjoint_slices(allowed, world, want):
    assert [threads.rank_cores(allowed, r, world) for r in range(world)] == want


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="one core")
def test_pin_rank_binds_the_process_to_its_slice():
    code = (
        "import json, os; from k3dist.base.threads import pin_rank; "
        "cores = pin_rank(1, 2); print(json.dumps([cores, sorted(os.sched_getaffinity(0))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    cores, mask = json.loads(out)
    assert cores == mask == threads.rank_cores(sorted(os.sched_getaffinity(0)), 1, 2)
