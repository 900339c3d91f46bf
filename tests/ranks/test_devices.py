"""Devices checked right after init, on real gloo ranks that pretend to see GPUs (torch.cuda's functions replaced):
two ranks on one GPU, a LOCAL_RANK without a GPU, and one GPU each."""

import os
import socket
import types

import pytest
import torch

from k3dist.base import dist
from k3dist.base.errors import K3Error
from tests.support.ranks import expect_ok, run_ranks

pytestmark = pytest.mark.slow  # the `slow` tier (README: Tests)


def _pretend(visible: int, uuid_of) -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: visible
    torch.cuda.set_device = lambda device: None
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(uuid=uuid_of(i), total_memory=80 * 2**30)


def _init(visible: int, shared: bool, local_rank_of_1: int | None) -> dict:
    rank = int(os.environ["RANK"])
    if rank == 1 and local_rank_of_1 is not None:
        os.environ["LOCAL_RANK"] = str(local_rank_of_1)
    _pretend(visible, lambda i: "GPU-0b1e5c3a" if shared else f"GPU-{rank}-{i}")
    try:
        rt = dist.init("gloo", "cuda", 30)
    except K3Error as exc:
        return {"error": str(exc), "agreed": exc.agreed}
    device = str(rt.device)
    dist.shutdown()
    return {"error": None, "device": device}


@pytest.fixture(scope="module")
def cases():
    return {
        "shared": expect_ok(run_ranks(_init, 2, 1, True, None, timeout=90)),  # both see one GPU, the same
        "missing": expect_ok(run_ranks(_init, 2, 2, False, 5, timeout=90)),  # rank 1: LOCAL_RANK=5 of 2 GPUs
        "own": expect_ok(run_ranks(_init, 2, 1, False, None, timeout=90)),  # CUDA_VISIBLE_DEVICES per rank
    }


def test_two_ranks_on_one_gpu_are_refused_on_every_rank(cases):
    r0, r1 = cases["shared"]
    assert r0 == r1 and r0["agreed"], (r0, r1)
    host = socket.gethostname()
    assert r0["error"] == (
        f"devices: ranks 0 ({host} cuda:0), 1 ({host} cuda:0) share GPU GPU-0b1e5c3a; run one rank per GPU (rank i "
        "of a machine uses cuda:LOCAL_RANK, or give each rank its own GPU through CUDA_VISIBLE_DEVICES)"
    )


def test_a_local_rank_without_a_gpu_is_refused_on_every_rank(cases):
    r0, r1 = cases["missing"]
    assert r0 == r1 and r0["agreed"], (r0, r1)
    assert r0["error"].startswith(
        "devices failed on 1 of 2 ranks: rank 1: LOCAL_RANK=5 has no GPU: this process sees 2"
    )


def test_one_gpu_each_is_accepted(cases):
    assert [r["device"] for r in cases["own"]] == ["cuda:0", "cuda:0"]
