"""On a CUDA device: the decode step captured as one CUDA graph (NCCL inside it), replayed without a single host
sync, giving eager's tokens; the grouped-GEMM prefill path equal to the expert loop. Skipped without CUDA."""

import os

import pytest
import torch
import torch.distributed as dist

from k3dist.engine.control import Admit
from k3dist.engine.decode_step import DecodeStep
from k3dist.engine.sampling import GREEDY
from k3dist.engine.sequences import Prompt
from k3dist.model.tp import TPComm
from tests.support.configs import small_config, twin_config
from tests.support.harness import local_engine, run_all
from tests.support.models import random_model

pytestmark = pytest.mark.gpu
PROMPTS = [Prompt(f"r{i}", tuple(range(5 + i, 5 + 7 * (i + 1))), 24) for i in range(6)]


class AlwaysReduce(TPComm):
    """A world of one that still runs every all-reduce, so NCCL is really inside the captured graph."""

    def all_reduce(self, x):
        dist.all_reduce(x)
        return x


@pytest.fixture(scope="module")
def nccl():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("K3_TEST_PORT", "29517"))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _run(kind: str, raw: dict, dtype, backend: str, comm=None, sync_check: bool = False):
    cfg, model, cache = random_model(
        raw, batch=4, cap=256, dtype=dtype, seed=3, backend=backend, device="cuda", comm=comm
    )
    step = DecodeStep(model, cache, (GREEDY,), kind)
    step.warm_up()
    engine = local_engine(step, prefill_chunk=16, sync_every=8, rt=None)
    if sync_check:  # the replays alone, under CUDA's sync debug mode: any host sync raises
        admits = tuple(Admit(i, p.ids) for i, p in enumerate(PROMPTS[:4]))
        engine.runner.admit(admits)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(16):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return None
    return [c.tokens for c in run_all(engine, PROMPTS)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_replay_gives_eager_tokens(nccl, backend):
    raw = small_config()
    comm = AlwaysReduce(1, 0, raw["vocab_size"])
    eager = _run("eager", raw, torch.float32, backend, comm)
    graph = _run("graph", raw, torch.float32, backend, comm)
    assert graph == eager and all(len(t) == 24 for t in graph)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replays_never_sync_the_host(nccl, backend):
    raw = small_config()
    _run("graph", raw, torch.bfloat16, backend, AlwaysReduce(1, 0, raw["vocab_size"]), sync_check=True)


def test_twin_shapes_in_bf16_capture_and_run(nccl):
    raw = twin_config() | {"vocab_size": 32768}
    tokens = _run("graph", raw, torch.bfloat16, "triton")
    assert len(tokens) == len(PROMPTS) and all(0 <= t < 32768 for seq in tokens for t in seq)


def test_grouped_prefill_equals_expert_loop_on_cuda():
    from k3dist.kernels.moe import experts_grouped, experts_loop

    gen = torch.Generator(device="cuda").manual_seed(0)
    E, D, I, N, k = 16, 256, 64, 300, 2
    w13 = torch.randn(E, 2 * I, D, device="cuda", generator=gen).bfloat16() * 0.05
    w2 = torch.randn(E, D, I, device="cuda", generator=gen).bfloat16() * 0.05
    x = torch.randn(N, D, device="cuda", generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(N)])
    weights = torch.rand(N, k, device="cuda", generator=gen)
    got, want = experts_grouped(x, ids, weights, w13, w2), experts_loop(x, ids, weights, w13, w2)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
