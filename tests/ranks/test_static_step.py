"""The decode step is one static function: no host read inside it (logit processors and grammar masks included), and
one compile that holds for every step, on real ranks. (Compiled tokens equal eager ones and transformers':
tests/ranks/test_parity.py.)"""

import pytest
import torch

from k3dist.base import dist
from k3dist.engine.control import Admit
from k3dist.engine.decode_step import DecodeStep
from k3dist.engine.runner import Runner
from k3dist.engine.sampling import GREEDY, NONE, PENALTIES, SamplingMode, SamplingParams
from k3dist.model.linear import packable
from k3dist.twin.checkpoint import write_checkpoint
from tests.support.configs import small_config
from tests.support.harness import bind, dense_layers
from tests.support.host_reads import HostReads, SyncOps
from tests.support.ranks import expect_ok, run_ranks

pytestmark = pytest.mark.slow  # the `slow` tier (README: Tests)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_checkpoint(small_config(), tmp_path_factory.mktemp("step"), seed=4, dtype="float32"))


PROCESSING = dict(logit_bias=((7, 2.5), (300, -1.0)), presence_penalty=0.3, frequency_penalty=0.2)
PROCESSING |= dict(repetition_penalty=1.3, min_tokens=4, held=(2, 9), grammar=True)


def _count_host_reads(model_dir: str, batch: int, sample: bool, packed: bool = False, backend: str = "auto") -> dict:
    """6 steps as they are, then 6 with logit processors and a grammar mask on every other slot."""
    rt, cfg, model, cache = bind(
        model_dir, "bfloat16" if packed else "float32", batch, 64, backend=backend, pack=packed
    )
    dense = dense_layers(model)
    step = DecodeStep(model, cache)
    runner = Runner(step, prefill_chunk=8)
    reads, ops = HostReads(), SyncOps()
    for process in (NONE, PENALTIES):
        mode = SamplingMode(sample, sample, process)
        admits = tuple(
            Admit(i, tuple(range(3 + i, 9 + 2 * i)), SamplingParams(0.7 * sample, 0.9, **(PROCESSING if i % 2 else {})))
            for i in range(batch)
        )
        masks = tuple(range(1, batch, 2))
        bitmask = torch.full((len(masks), -(-cfg.vocab_size // 32)), 0x0F0F0F0F, dtype=torch.int32)
        runner.admit(admits, mode, masks=masks, mask_words=bitmask.shape[1], bitmask=bitmask)  # outside the step
        with reads, ops:
            for _ in range(6):
                step(mode)
    allowed = all((t % 32) % 8 < 4 for t in step.out_tokens[1::2, :7].flatten().tolist())
    dist.shutdown()
    return {
        "reads": reads.seen,
        "ops": ops.seen,
        "positions": cache.positions.tolist(),
        "dense": dense,
        "allowed": allowed,
    }


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("batch", [1, 8])
def test_no_host_sync_inside_the_step(model_dir, world, batch):
    for sample in (False, True):
        for r in expect_ok(run_ranks(_count_host_reads, world, model_dir, batch, sample)):
            assert r["reads"] == [] and r["ops"] == [], r
            assert r["positions"] == [6 + i + 6 for i in range(batch)]  # each slot at its own position
            assert r["allowed"]  # the masked slots chose only tokens their masks allow


@pytest.mark.skipif(not packable(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 on this CPU")
def test_no_host_sync_with_packed_weights_and_dense_experts(model_dir):
    """bf16 on packed weights at batch 8 with the torch kernels: 8 experts x top-2 are covered, so every MoE layer
    runs dense (with the CPU ops the one-op block runs instead: the other tests here)."""
    for r in expect_ok(run_ranks(_count_host_reads, 1, model_dir, 8, False, True, "torch")):
        assert r["reads"] == [] and r["ops"] == [], r
        assert r["dense"] > 0


def _compiled_holds(model_dir: str, steps: int) -> dict:
    """Compile the step (fullgraph), then run `steps` steps where any recompilation raises."""
    rt, cfg, model, cache = bind(model_dir, "float32", 2, 64)
    step = DecodeStep(model, cache, (GREEDY,), "compile")
    step.warm_up()
    admits = (Admit(0, (5, 9, 2, 7)), Admit(1, (11, 4, 8)))
    Runner(step, prefill_chunk=8).admit(admits)
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(steps):
            step()
    tokens = step.out_tokens[:, : steps + 1].tolist()
    dist.shutdown()
    return {"tokens": tokens, "warmup": step.warmup_seconds}


def test_compiled_step_holds_for_32_steps(model_dir):
    (r,) = expect_ok(run_ranks(_compiled_holds, 1, model_dir, 32, timeout=600))
    assert r["warmup"] > 0 and all(len(t) == 33 for t in r["tokens"])
