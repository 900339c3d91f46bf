"""A failure after the load (prefill or decode) on one rank reaches every rank: the same one line, exit 1, no rank
left waiting in a collective and no process left behind."""

import pytest

from k3dist.twin.checkpoint import write_checkpoint
from tests.ranks.test_faults import run_watched
from tests.support.cli_run import error_lines
from tests.support.configs import small_config
from tests.support.tiers import slow_but


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("after") / "m", seed=2)


@pytest.mark.parametrize(
    "rank, stage",
    slow_but([(r, s) for s in ("prefill", "decode") for r in (0, 1)], keep=[(0, "prefill"), (1, "decode")]),
)
def test_a_failure_after_the_load_is_every_ranks_line(monkeypatch, ckpt, tmp_path, stage, rank):
    rc, text, seen, left = run_watched(
        monkeypatch, tmp_path, f"model.path={ckpt}", "dist.nproc=2", f"fault.rank={rank}", f"fault.raise_in={stage}"
    )
    lines = error_lines(text)
    want = f"error: rank {rank}: {stage} failed: RuntimeError: injected failure in {stage} (fault.raise_in={stage})"
    assert rc == 1 and lines == [want, want], text
    assert "Traceback" not in text and "k3_weight_shard_loaded" in text  # it failed after a complete load
    assert len(seen) >= 3 and not left, (seen, left)
