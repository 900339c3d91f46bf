"""The CUDA path: the decode step captured as one CUDA graph (NCCL inside it), replayed without a single host sync,
giving eager's tokens; the grouped-GEMM prefill path equal to the expert loop.

Every test runs its code path on the CPU too, in the default suite (the same helpers with device "cpu", gloo for the
collectives, Triton's interpreter for the Triton kernels), so a changed helper or signature fails in CI and not first
on a GPU (issue 38: five of these tests had rotted unseen). Only what needs CUDA (a graph's replay, CUDA's sync
debug mode) runs on the "cuda" points, marked `gpu`."""

import os

import pytest
import torch
import torch.distributed as dist

from k3dist.base.dist import free_port
from k3dist.engine.control import Admit
from k3dist.engine.decode_step import DecodeStep
from k3dist.engine.sampling import GREEDY
from k3dist.engine.sequences import Prompt
from k3dist.model.tp import TPComm
from tests.support.configs import small_config, twin_config
from tests.support.harness import local_engine, run_all
from tests.support.host_reads import HostReads, SyncOps
from tests.support.models import random_model

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = ["cpu", CUDA]
BACKENDS = [  # (device, backend): the interpreter's whole run of six prompts is a minute or two: the slow tier
    ("cpu", "torch"),
    pytest.param("cpu", "triton", marks=pytest.mark.slow),
    pytest.param("cuda", "torch", marks=pytest.mark.gpu),
    pytest.param("cuda", "triton", marks=pytest.mark.gpu),
]
PROMPTS = [Prompt(f"r{i}", tuple(range(5 + i, 5 + 7 * (i + 1))), 24) for i in range(6)]


class AlwaysReduce(TPComm):
    """A world of one that still runs every all-reduce, so the collective is really inside the step (and NCCL
    inside the captured graph)."""

    def all_reduce(self, x):
        dist.all_reduce(x)
        return x


@pytest.fixture(scope="module")
def group():
    """A world of one: gloo for CPU tensors, NCCL for CUDA ones where a GPU is."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _step(device: str, kind: str, raw: dict, dtype, backend: str, comm=None) -> DecodeStep:
    cfg, model, cache = random_model(
        raw, batch=4, cap=256, dtype=dtype, seed=3, backend=backend, device=device, comm=comm
    )
    step = DecodeStep(model, cache, (GREEDY,), kind)
    step.warm_up()
    if kind != "graph":  # a graph's warm-up prefills two tokens first (CUDA); the same code here, then emptied
        step._warm_prefill()
        step.reset()
    return step


def _tokens(device: str, kind: str, raw: dict, dtype, backend: str, comm=None) -> list:
    step = _step(device, kind, raw, dtype, backend, comm)
    return [c.tokens for c in run_all(local_engine(step, prefill_chunk=16, sync_every=8, rt=None), PROMPTS)]


def _admitted(step: DecodeStep) -> None:
    """Four prompts prefilled (outside any step), ready for decode steps."""
    engine = local_engine(step, prefill_chunk=16, sync_every=8, rt=None)
    engine.runner.admit(tuple(Admit(i, p.ids) for i, p in enumerate(PROMPTS[:4])))


@pytest.mark.parametrize("device, backend", BACKENDS)
def test_graph_replay_gives_eager_tokens(group, device, backend):
    """On CUDA the replayed graph gives eager's tokens; on the CPU (no graph) both backends' eager steps give the
    same tokens (Triton's kernels under its interpreter against the torch references)."""
    if backend == "triton":
        pytest.importorskip("triton")
    raw = small_config()
    comm = AlwaysReduce(1, 0, raw["vocab_size"])
    eager = _tokens(device, "eager", raw, torch.float32, backend, comm)
    other = _tokens(device, "graph", raw, torch.float32, backend, comm) if device == "cuda" else None
    if other is None:  # the CPU: the other backend's eager tokens instead of a graph's
        other = _tokens(device, "eager", raw, torch.float32, "torch" if backend == "triton" else backend, comm)
    assert other == eager and all(len(t) == 24 for t in eager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replays_never_sync_the_host(group, device, backend):
    """CUDA: the graph's replays under CUDA's sync debug mode (any sync raises). CPU: the eager steps read no tensor
    value on the host (the tool tests/ranks/test_static_step.py uses)."""
    if backend == "triton":
        pytest.importorskip("triton")
    raw = small_config()
    kind = "graph" if device == "cuda" else "eager"
    step = _step(device, kind, raw, torch.bfloat16, backend, AlwaysReduce(1, 0, raw["vocab_size"]))
    _admitted(step)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(16):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    reads, ops = HostReads(), SyncOps()
    with reads, ops:
        for _ in range(4):
            step()
    assert reads.seen == [] and ops.seen == []
    assert step.cache.positions[:4].tolist() == [len(p.ids) + 4 for p in PROMPTS[:4]]


@pytest.mark.parametrize("device", DEVICES)
def test_twin_shapes_in_bf16_capture_and_run(group, device):
    """The twin's shapes (a smaller vocabulary): captured with the Triton kernels on CUDA, eager with the torch
    kernels on the CPU (the interpreter at these shapes would take minutes)."""
    raw = twin_config() | {"vocab_size": 32768}
    kind, backend = ("graph", "triton") if device == "cuda" else ("eager", "torch")
    tokens = _tokens(device, kind, raw, torch.bfloat16, backend)
    assert len(tokens) == len(PROMPTS) and all(len(t) == 24 and 0 <= min(t) and max(t) < 32768 for t in tokens)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_prefill_equals_expert_loop(device):
    from k3dist.kernels.moe import experts_grouped, experts_loop

    gen = torch.Generator(device=device).manual_seed(0)
    E, D, I, N, k = 16, 256, 64, 300, 2
    w13 = torch.randn(E, 2 * I, D, device=device, generator=gen).bfloat16() * 0.05
    w2 = torch.randn(E, D, I, device=device, generator=gen).bfloat16() * 0.05
    x = torch.randn(N, D, device=device, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, device=device, generator=gen)[:k] for _ in range(N)])
    weights = torch.rand(N, k, device=device, generator=gen)
    got, want = experts_grouped(x, ids, weights, w13, w2), experts_loop(x, ids, weights, w13, w2)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
