"""The prefill path syncs the host a bounded number of times per window, never per layer or per expert (issue 38: a
16-token prefill took 0.34 s on an H200): chunks of two prompts, MoE routing and the grouped experts, MLA, the KDA
chunked form, a snapshot taken and restored, prompt scoring, the first tokens' emit.

CPU: the host reads counted by the tool tests/ranks/test_static_step.py uses (the CUDA path's model code, the torch
kernels). CUDA (`gpu`): CUDA's own sync debug mode, counting every synchronising call."""

import warnings

import pytest
import torch

from k3dist.base import compat
from k3dist.engine.control import Admit
from k3dist.engine.decode_step import DecodeStep
from k3dist.engine.runner import Runner
from k3dist.engine.snapshots import SnapshotStore
from tests.support.configs import small_config
from tests.support.host_reads import HostReads, SyncOps
from tests.support.models import random_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SHAPES = {  # (layers, experts): the small config, then twice the layers, then four times the experts
    "small": {},
    "deeper": {
        "num_hidden_layers": 8,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]},
    },
    "wider": {"num_experts": 32},
}


def _count_syncs(device: str, shape: str) -> list[str]:
    raw = small_config(**SHAPES[shape])
    cuda = device == "cuda"
    dtype, backend = (torch.bfloat16, "triton") if cuda else (torch.float32, "torch")
    _, model, cache = random_model(raw, batch=3, cap=64, dtype=dtype, seed=1, backend=backend, device=device)
    runner = Runner(DecodeStep(model, cache), prefill_chunk=8, snapshots=SnapshotStore(cache))
    prompt = tuple(range(3, 23))  # 20 tokens: three chunks
    first = (Admit(0, prompt, saves=((16, 0),)), Admit(1, prompt[::-1], score=2))
    then = (Admit(2, prompt + (5, 6, 7), restore=0),)  # from the snapshot at 16: its last 7 tokens in one piece
    if not cuda:
        reads, ops = HostReads(), SyncOps()
        with reads, ops:
            runner.admit(first)
            runner.admit(then)
        return reads.seen + ops.seen
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.admit(first)
            runner.admit(then)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.skipif(
    not compat.has("torch._grouped_mm"),
    reason="this torch has no grouped GEMM: its prefill loop reads each MoE layer's group ends (compat.NEWER)",
)
def test_prefill_syncs_do_not_grow_with_layers_or_experts(device):
    small = _count_syncs(device, "small")
    assert _count_syncs(device, "deeper") == small
    assert _count_syncs(device, "wider") == small
    # CUDA: per window, the timing syncs and the host-to-device copies of the pieces' ids and slots, the scored
    # tokens and the emit's rows (a few dozen at most); the CPU path reads nothing at all
    assert len(small) <= (64 if device == "cuda" else 0), small
