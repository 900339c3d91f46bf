"""The page cache across real ranks (gloo, CPU, world 2, memory.drop_page_cache=on): a file is dropped only once both
ranks of the machine have read it, by the rank that finishes it last."""

import logging
from pathlib import Path

import pytest
import torch

from k3dist.base import dist
from k3dist.base.fault_injection import Faults
from k3dist.config import load_config
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.weights.inventory import scan
from k3dist.weights.loader import load_weights
from k3dist.weights.reads import PAGE, read_bytes
from k3dist.weights.tp_plan import plan_rank
from tests.support.configs import small_config
from tests.support.ranks import expect_ok, run_ranks
from tests.support.residency import SUPPORTED, evict, resident, write_synced

pytestmark = pytest.mark.slow  # the `slow` tier (README: Tests)

HOLD_S = 3.0  # rank 1 waits this long before its second file


def _load(model_dir: str) -> dict:
    """Load with drop=on while rank 1 is held before file 1; when this rank's event for file 1 fires (it has read
    and counted the file), look at the file's pages. Then a load with drop=auto (CPU: kept) for contrast."""
    rt = dist.init("gloo", "cpu", 60)
    cfg = load_config(model_dir)
    inv = scan(model_dir, cfg)
    plans = plan_rank(cfg, inv.entries.values(), rt.world, rt.rank, torch.bfloat16)
    order = list(dict.fromkeys(p.file for p in plans))
    held = order[1]
    seen: dict[str, int] = {}

    class Watch(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith(f"k3_weight_shard_loaded rank={rt.rank} file={held} "):
                seen["at_event"] = len(resident(Path(model_dir) / held))

    logger, watch = logging.getLogger("k3dist"), Watch()
    logger.setLevel(logging.INFO)
    logger.addHandler(watch)
    faults = Faults(rank=1, hold_at_file=1, delay_s=HOLD_S)
    load_weights(inv, rt, torch.bfloat16, faults=faults, drop_page_cache="on")
    logger.removeHandler(watch)
    after_on = {f: len(resident(Path(model_dir) / f)) for f in inv.files}
    load_weights(inv, rt, torch.bfloat16, drop_page_cache="auto")
    after_auto = {f: len(resident(Path(model_dir) / f)) for f in inv.files}
    mine = read_bytes([p for p in plans if p.file == held]) // PAGE
    dist.shutdown()
    return {"at_event": seen["at_event"], "mine": mine, "after_on": after_on, "after_auto": after_auto}


@pytest.mark.skipif(not SUPPORTED, reason="needs mincore and posix_fadvise")
def test_a_file_is_dropped_after_every_rank_of_the_node_read_it(tmp_path):
    ckpt = write_checkpoint(small_config(), tmp_path / "m", seed=6, shard_bytes=256 << 10)
    files = sorted(ckpt.glob("*.safetensors"))
    for f in files:
        write_synced(f)
        evict(f)
    if any(resident(f) for f in files):
        pytest.skip("the page cache cannot be evicted here")
    r0, r1 = expect_ok(run_ranks(_load, 2, str(ckpt), timeout=120))
    # rank 0 finished the file while rank 1 was held: every page it read is still cached
    assert r0["at_event"] >= r0["mine"] > 0
    # rank 1 finished it last: it completed the count and dropped the file before its own event
    assert r1["at_event"] == 0
    assert set(r0["after_on"].values()) == set(r1["after_on"].values()) == {0}  # both done: every file gone
    assert all(n > 0 for n in r0["after_auto"].values())  # auto keeps the page cache on CPU
