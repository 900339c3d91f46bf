"""The loader across real ranks (gloo, CPU): exact rank-local shards, one verdict everywhere, clean failures."""

import pytest
import torch
from safetensors.torch import load_file

from k3dist.base import dist
from k3dist.config import load_config
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.weights.inventory import scan
from k3dist.weights.loader import load_weights
from k3dist.weights.tp_plan import plan_rank
from tests.support.cli_run import error_lines, run_cli
from tests.support.configs import small_config
from tests.support.ranks import expect_ok, run_ranks

pytestmark = pytest.mark.slow  # the `slow` tier (README: Tests)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    raw = small_config(vocab_size=509, intermediate_size=90)  # uneven vocab and dense splits at 2 and 4 ranks
    return write_checkpoint(raw, tmp_path_factory.mktemp("ckpt"), seed=5, shard_bytes=256 << 10)


def _check_shards(model_dir: str) -> int:
    """Load this rank's shard with the real pipeline, then compare every tensor with an independent full read: in
    float32 (every byte cast through the staging ring) and in the checkpoint's bfloat16 (read straight into the
    weights, row splits picked out of the ring)."""
    rt = dist.init("gloo", "cpu", 60)
    cfg = load_config(model_dir)
    inv = scan(model_dir, cfg)
    full = {}
    for file in inv.files:
        full |= load_file(f"{model_dir}/{file}")
    for dtype in (torch.float32, torch.bfloat16):
        store = load_weights(inv, rt, dtype)
        for p in store.plans:
            mine = store[p.dest] if p.slot is None else store[p.dest][p.slot]
            if p.row is not None:  # a part of a fused destination (schema.placements)
                mine = mine[p.row : p.row + p.local_shape[0]]
            expected = full[p.key].to(p.dtype)
            if p.axis.dim is not None:
                expected = expected.narrow(p.axis.dim, p.start, p.stop - p.start)
            assert mine.dtype == p.dtype and torch.equal(mine, expected), (p.name, dtype)
        assert sum(t.numel() * t.element_size() for t in store.tensors.values()) == store.memory.local_bytes
    dist.shutdown()
    return len(store.plans)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_holds_exactly_its_slice(small_dir, world):
    counts = expect_ok(run_ranks(_check_shards, world, str(small_dir)))
    assert counts == [len(scan(small_dir, load_config(small_dir)).entries)] * world


def test_preflight_refusal_stops_every_rank_before_upload(small_dir, tmp_path):
    rc, text, _ = run_cli(tmp_path, f"model.path={small_dir}", "dist.nproc=2", "memory.reserve=100TiB", "run.mode=load")
    lines = error_lines(text)
    assert rc != 0 and len(lines) == 2 and lines[0] == lines[1], text
    assert "preflight failed on 2 of 2 ranks" in lines[0] and "rank 0" in lines[0] and "rank 1" in lines[0]
    assert "reserve 100.0 TiB" in lines[0]
    assert "k3_weight_shard_loaded" not in text  # refused before any weight was allocated


def test_refusal_on_one_rank_is_reported_by_all(small_dir, tmp_path):
    rc, text, _ = run_cli(
        tmp_path, f"model.path={small_dir}", "dist.nproc=2", "fault.rank=1", "fault.free=100KiB", "run.mode=load"
    )
    lines = error_lines(text)
    assert rc != 0 and len(lines) == 2 and lines[0] == lines[1], text
    assert "1 of 2 ranks: rank 1 needs" in lines[0] and "free 100.0 KiB" in lines[0] and "rank 0" not in lines[0]
    assert "k3_weight_shard_loaded" not in text


@pytest.mark.parametrize("at", [0, 7])
def test_allocation_failure_frees_everything_and_stops_all_ranks(small_dir, tmp_path, at):
    rc, text, _ = run_cli(
        tmp_path,
        f"model.path={small_dir}",
        "dist.nproc=2",
        "fault.rank=1",
        f"fault.alloc_fail_at={at}",
        "run.mode=load",
    )
    lines = error_lines(text)
    assert rc != 0 and len(lines) == 2 and lines[0] == lines[1], text
    assert "upload failed on 1 of 2 ranks: rank 1: allocation failed" in lines[0]
    cfg = load_config(small_dir)
    placed = len({p.dest for p in plan_rank(cfg, scan(small_dir, cfg).entries.values(), 2, 1, torch.bfloat16)[:at]})
    assert at == 0 or placed > 0
    assert f"k3_weight_cleanup rank=1 freed={placed} live=0" in text  # measured through weak references
