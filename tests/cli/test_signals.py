"""Ctrl-C and SIGTERM end every process of a run: one `error: interrupted` line, exit 130 / 143, nobody left.

Each run starts in a session of its own, so a signal goes either to the process started (`kill -INT pid`) or to its
whole process group (what a terminal's Ctrl-C does: launcher, agent and ranks at once). Ranks are caught busy: one
hangs in the upload (test-only fault) while its peer waits for it in a gloo agreement that would only give up after
dist.timeout_s, or both are generating. Every run is watched through /proc and must leave no process behind.
"""

import csv
import signal
import time

import pytest

from k3dist.twin.checkpoint import write_checkpoint
from tests.support.cli_run import ROOT, error_lines
from tests.support.configs import small_config
from tests.support.procs import Watched
from tests.support.tiers import slow_but

LINE = "error: interrupted"
TIMEOUT_S = 120  # dist.timeout_s: a rank blocked in an agreement would wait this long on its own
EXIT_S = 15  # how long after the signal every process must be gone (torch elastic's own SIGKILL comes at 30 s)
START_S = 120  # how long a run may take to get busy, startup of three Python processes on a busy 2-core box included
NOISE = ("Traceback", "KeyboardInterrupt", "ChildFailedError", "SignalException", "Error executing job", "leaked")
LAST_SHARD = (
    "k3_weight_shard_loaded rank=0 file=model-00001-of-00003"  # rank 0 then waits for rank 1 in that file's agreement
)
SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("ckpt") / "model", seed=5, shard_bytes=256 << 10)


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """No end-of-sequence id and no tokenizer: generation runs to max_new_tokens, long after the signal."""
    out = tmp_path_factory.mktemp("endless") / "model"
    return write_checkpoint(small_config(eos_token_id=None), out, seed=5, tokenizer=False)


def hanging_load(ckpt, tmp_path, rank: int = 1) -> list[str]:
    return [
        f"model.path={ckpt}",
        "run.mode=load",
        f"dist.timeout_s={TIMEOUT_S}",
        f"fault.rank={rank}",
        "fault.hang_at=5",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"out={tmp_path / 'result.json'}",
    ]


def interrupt(run: Watched, sig: int, group: bool) -> tuple[int, float, set[int]]:
    run.signal(sig, group)
    rc, took, left = run.finish(timeout=EXIT_S * 4)
    print(f"{signal.Signals(sig).name} to {'the group' if group else 'the launcher'}: exit {rc} after {took:.2f} s")
    return rc, took, left


def assert_ended(run: Watched, sig: int, rc: int, took: float, left: set[int], processes: int) -> None:
    text = run.text
    assert rc == 128 + sig, text
    assert error_lines(text) == [LINE], text  # one line for the whole run, whoever saw the signal
    assert not [n for n in NOISE if n in text], text
    assert took < EXIT_S, f"{took:.1f} s to exit\n{text}"
    assert len(run.seen) >= processes, (run.seen, text)  # the launcher and its ranks were running when signalled
    assert not left, f"still running after the launcher exited: {left}"


def _ctrl_c_and_term(ctrl_c_to_group: bool, keep: str) -> list:
    """Ctrl-C (SIGINT) to the group or the launcher, and SIGTERM to the other; `keep` stays in the default run."""
    points = [(signal.SIGINT, ctrl_c_to_group), (signal.SIGTERM, not ctrl_c_to_group)]
    named = lambda p: "ctrl-c" if p[0] == signal.SIGINT else "term"  # noqa: E731
    return slow_but(points, keep=[p for p in points if named(p) == keep], ids=named)


def _named(point: tuple) -> str:
    sig, group = point
    return f"{signal.Signals(sig).name}-{'group' if group else 'launcher'}"


@pytest.mark.parametrize(
    "sig, group",
    slow_but([(s, g) for g in (False, True) for s in SIGNALS], keep=[(signal.SIGINT, True)], ids=_named),
)
def test_two_ranks_busy_in_the_upload_end(ckpt, tmp_path, sig, group):
    run = Watched([*hanging_load(ckpt, tmp_path), "dist.nproc=2"])
    run.wait_for(LAST_SHARD, timeout=START_S)
    time.sleep(1)  # rank 0 blocked in the upload agreement (gloo), rank 1 asleep in the fault
    assert_ended(run, sig, *interrupt(run, sig, group), processes=3)


@pytest.mark.parametrize("sig, group", _ctrl_c_and_term(True, keep="term"))
def test_two_ranks_generating_end(endless, tmp_path, sig, group):
    run = Watched(
        [
            f"model.path={endless}",
            "generate.prompt=[5,6,7]",
            "generate.max_new_tokens=4000",
            "dist.nproc=2",
            f"hydra.run.dir={tmp_path / 'run'}",
            f"out={tmp_path / 'result.json'}",
        ]
    )
    run.wait_for("k3_weight_shard_loaded rank=0", timeout=START_S)
    time.sleep(3)  # warm-up and decode: prefill/decode collectives between the ranks
    assert_ended(run, sig, *interrupt(run, sig, group), processes=3)
    assert not (tmp_path / "result.json").exists()


def test_ctrl_c_while_the_ranks_start(ckpt, tmp_path):
    """The ranks' interpreters are still importing: the signal waits (blocked) until their handlers are in."""
    run = Watched([*hanging_load(ckpt, tmp_path), "dist.nproc=2"])
    deadline = time.monotonic() + START_S
    while len(run.seen) < 4 and time.monotonic() < deadline:  # launcher, resource tracker, two ranks
        time.sleep(0.05)
    assert_ended(run, signal.SIGINT, *interrupt(run, signal.SIGINT, group=True), processes=4)
    assert LAST_SHARD not in run.text


@pytest.mark.parametrize("sig, group", _ctrl_c_and_term(False, keep="ctrl-c"))
def test_world_of_one_in_process_ends(ckpt, tmp_path, sig, group):
    """`python launch.py` runs the rank itself; here it sleeps in the upload (fault on rank 0)."""
    run = Watched(hanging_load(ckpt, tmp_path, rank=0))
    run.wait_for("k3_weight_plan rank=0", timeout=START_S)
    time.sleep(1)
    assert_ended(run, sig, *interrupt(run, sig, group), processes=1)


@pytest.mark.parametrize("sig, group", _ctrl_c_and_term(False, keep="term"))
def test_torchrun_ends_its_ranks(ckpt, tmp_path, sig, group):
    """torchrun is not ours: it logs the shutdown and raises its SignalException (exit 1). Our ranks print one line,
    rank 0's, and no traceback of their own."""
    run = Watched(hanging_load(ckpt, tmp_path), torchrun=["--nproc_per_node=2"])
    run.wait_for(LAST_SHARD, timeout=START_S)
    time.sleep(1)
    rc, took, left = interrupt(run, sig, group)
    text = run.text
    assert rc != 0, text
    assert error_lines(text) == [LINE], text
    own = tuple(f'"{ROOT / part}/' for part in ("k3dist", "kernels"))  # the project's files, whatever its folder's name
    ours = [line for line in text.splitlines() if line.lstrip().startswith("File ") and any(o in line for o in own)]
    assert "KeyboardInterrupt" not in text and 'launch.py", line' not in text and not ours, text
    assert f"Received {int(sig)} death signal, shutting down workers" in text, text  # the agent forwarded it
    assert took < EXIT_S and len(run.seen) >= 3, (took, run.seen)
    assert not left, f"still running after torchrun exited: {left}"


@pytest.mark.parametrize("sig, group", _ctrl_c_and_term(True, keep="ctrl-c"))
def test_interrupted_sweep_summarizes_the_points_that_finished(ckpt, tmp_path, sig, group):
    """Three points; the second hangs (fault on rank 1) and is interrupted, the third never starts."""
    sweep_dir = tmp_path / "sweep"
    run = Watched(
        [
            "-m",
            f"model.path={ckpt}",
            "run.mode=load",
            "dist.nproc=2",
            f"dist.timeout_s={TIMEOUT_S}",
            "fault.rank=1",
            "fault.hang_at=null,5,100000",  # 100000: past the last tensor, never fires
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    run.wait_for(LAST_SHARD, count=2, timeout=START_S * 2)  # the second point's rank 0 waits for its rank 1
    time.sleep(1)
    assert_ended(run, sig, *interrupt(run, sig, group), processes=3)
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(r["num"], r["fault.hang_at"], r["verdict"]) for r in rows] == [("0", "null", "admitted")], rows
    assert (sweep_dir / "summary.md").is_file() and "k3dist sweep: 1 points" in run.text
    assert not (sweep_dir / "2").exists()
    assert run.text.rstrip().endswith(LINE), run.text  # the summary first, then the line
