"""Faults across real ranks (gloo, CPU, world 2): ranks that disagree, ranks that die or hang, and no leaks.

Every case is bounded: dist.timeout_s is small, every run has a subprocess or queue timeout, and each CLI run is
watched through /proc (processes carrying a unique marker in their environment) to prove none outlives it.
"""

import gc
import json
import logging
import shutil
import threading
import uuid
from pathlib import Path

import pytest
import torch

from k3dist.base import dist
from k3dist.base.errors import K3Error
from k3dist.base.fault_injection import Faults
from k3dist.config import load_config
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.weights.inventory import INDEX, scan
from k3dist.weights.loader import load_weights
from k3dist.weights.tp_plan import plan_rank
from tests.support.cli_run import error_lines, run_cli
from tests.support.configs import small_config
from tests.support.procs import marked, reap
from tests.support.ranks import expect_ok, run_ranks

pytestmark = pytest.mark.slow  # the `slow` tier (README: Tests)

TIMEOUT_S = 3  # dist.timeout_s of the CLI runs: how long a survivor waits on a lost rank
BOUND = 90  # seconds any one CLI run may take, startup of three Python processes on a busy 2-core box included
MARKER = "K3DIST_FAULT_MARKER"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("ckpt") / "model", seed=5, shard_bytes=256 << 10)


@pytest.fixture(scope="module")
def tensors(ckpt) -> int:
    return len(scan(ckpt, load_config(ckpt)).entries)


class Events(logging.Handler):
    """Collect the loader's structured events on a rank (ranks other than 0 log only warnings by default)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logger = logging.getLogger("k3dist")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


# ---------------------------------------------------------------------------------------- ranks that disagree


def _load_each(dirs_by_variant: dict[str, list[str]]) -> dict[str, dict]:
    """Rank r loads dirs[r] of every variant with the real pipeline; returns each attempt's error and events."""
    rt = dist.init("gloo", "cpu", 30)
    events, out = Events(), {}
    for variant, dirs in dirs_by_variant.items():
        model_dir = dirs[rt.rank]
        cfg = load_config(model_dir)
        try:
            load_weights(scan(model_dir, cfg), rt, torch.float32)
            out[variant] = {"error": None}
        except K3Error as exc:
            out[variant] = {"error": str(exc), "agreed": exc.agreed}
        out[variant]["events"] = events.take()
    dist.shutdown()
    return out


def _altered_metadata(src: Path, dst: Path) -> Path:
    """A copy whose second file has the same tensors and size but other bytes in its header's __metadata__."""
    shutil.copytree(src, dst)
    path = dst / "model-00002-of-00003.safetensors"
    blob = path.read_bytes()
    assert blob.count(b'"__metadata__":{"format":"pt"}') == 1
    path.write_bytes(blob.replace(b'"__metadata__":{"format":"pt"}', b'"__metadata__":{"format":"k3"}'))
    return dst


def _renamed_files(src: Path, dst: Path) -> Path:
    """A copy with the same tensors in a differently named file set (index rewritten to match)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX).read_text())
    for old in sorted(set(index["weight_map"].values())):
        (dst / old).rename(dst / old.replace("model-", "part-"))
    index["weight_map"] = {k: v.replace("model-", "part-") for k, v in index["weight_map"].items()}
    (dst / INDEX).write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="module")
def disagreements(ckpt, tmp_path_factory):
    """One 2-rank run, one load per variant: rank 0 reads the original, rank 1 its own altered copy."""
    tmp = tmp_path_factory.mktemp("disagree")
    variants = {
        "same": [str(ckpt), str(shutil.copytree(ckpt, tmp / "same"))],
        "header": [str(ckpt), str(_altered_metadata(ckpt, tmp / "header"))],
        "files": [str(ckpt), str(_renamed_files(ckpt, tmp / "files"))],
    }
    return expect_ok(run_ranks(_load_each, 2, variants, timeout=BOUND))


def test_identical_copies_agree(disagreements):
    assert [r["same"]["error"] for r in disagreements] == [None, None]


@pytest.mark.parametrize(
    "variant, detail",
    [
        ("header", "model-00002-of-00003.safetensors has header"),
        ("files", "files only on rank 1: ['part-00001-of-00003.safetensors', 'part-00002-of-00003.safetensors'"),
    ],
)
def test_a_rank_with_another_checkpoint_is_named_before_upload(disagreements, variant, detail):
    errors = [r[variant]["error"] for r in disagreements]
    assert errors[0] == errors[1] and all(r[variant]["agreed"] for r in disagreements), errors
    assert errors[0].startswith("preflight: rank 1 sees a different checkpoint than rank 0 (header fingerprint ")
    assert detail in errors[0] and "rank 0 sees" not in errors[0]
    for r in disagreements:
        assert not [e for e in r[variant]["events"] if e.startswith(("k3_weight_shard_loaded", "k3_weight_cleanup"))]


# --------------------------------------------------------------------------------------------------- no leaks


def _weight_objects() -> int:
    """Live floating-point tensors: the loader's allocations, not the byte buffers gloo may release a moment late."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.dtype.is_floating_point)


def _fail_each(model_dir: str, cases: list[tuple[str, int, int]]) -> list[dict]:
    """Every case is one load with one fault; every rank reports its cleanup event and a tensor census."""
    rt = dist.init("gloo", "cpu", 30)
    cfg = load_config(model_dir)
    inv = scan(model_dir, cfg)
    plans = plan_rank(cfg, inv.entries.values(), rt.world, rt.rank, torch.float32)
    files = list(dict.fromkeys(p.file for p in plans))
    events, out = Events(), []
    for kind, rank, index in cases:
        census = _weight_objects
        before = census()
        try:
            load_weights(inv, rt, torch.float32, faults=Faults(rank=rank, **{kind: index}))
            error = None
        except K3Error as exc:
            error = str(exc)
        out.append(
            {
                "error": error,
                "events": [e for e in events.take() if e.startswith("k3_weight_cleanup")],
                "placed": len({p.dest for p in plans[:index]}),  # store tensors made before the fault fired
                # ... and on a peer, every store tensor up to the end of that file, whose agreement stops it
                "placed_by_file": len({p.dest for p in plans if files.index(p.file) <= files.index(plans[index].file)}),
                "tensors_before": before,
                "tensors_after": census(),
            }
        )
    dist.shutdown()
    return out


ALLOC_CASES = [(rank, index) for rank in (0, 1) for index in (0, 1, 75, "last")]


@pytest.fixture(scope="module")
def failures(ckpt, tensors):
    """All allocation and out-of-memory cases in one 2-rank run: each failure is agreed, so the group survives."""
    cases = [("alloc_fail_at", r, tensors - 1 if i == "last" else i) for r, i in ALLOC_CASES]
    cases.append(("oom_at", 1, 40))
    results = expect_ok(run_ranks(_fail_each, 2, str(ckpt), cases, timeout=BOUND))
    return {case: [r[i] for r in results] for i, case in enumerate(cases)}


@pytest.mark.parametrize("rank, index", ALLOC_CASES)
def test_allocation_failure_leaves_nothing_allocated(failures, tensors, rank, index):
    index = tensors - 1 if index == "last" else index
    per_rank = failures[("alloc_fail_at", rank, index)]
    errors = {r["error"] for r in per_rank}
    assert len(errors) == 1, errors  # one verdict everywhere
    assert f"upload failed on 1 of 2 ranks: rank {rank}: allocation failed for tensor " in errors.pop()
    faulty, other = per_rank[rank], per_rank[1 - rank]
    assert faulty["events"] == [f"k3_weight_cleanup rank={rank} freed={faulty['placed']} live=0"]
    assert index == 0 or faulty["placed"] > 0
    assert faulty["tensors_after"] == faulty["tensors_before"]  # an independent census: back at the baseline
    # the peer finished that file, then stopped at its agreement and freed what it had made
    assert other["events"] == [f"k3_weight_cleanup rank={1 - rank} freed={other['placed_by_file']} live=0"]
    assert other["tensors_after"] == other["tensors_before"]


def test_out_of_memory_during_upload_says_the_reserve_is_exhausted(failures):
    per_rank = failures[("oom_at", 1, 40)]
    assert per_rank[0]["error"] == per_rank[1]["error"]
    error = per_rank[1]["error"]
    assert error.startswith("upload failed on 1 of 2 ranks: rank 1: out of device memory at tensor "), error
    assert "model-0000" in error and " after uploading " in error and "the reserve is exhausted" in error
    assert per_rank[1]["events"] == [f"k3_weight_cleanup rank=1 freed={per_rank[1]['placed']} live=0"]
    assert per_rank[1]["tensors_after"] == per_rank[1]["tensors_before"]


# ------------------------------------------------------------------------------------ ranks that die or hang


def run_watched(monkeypatch, tmp: Path, *overrides: str, torchrun: list[str] | None = None):
    """run_cli with a unique marker in the environment; returns (exit code, text, pids seen, pids left)."""
    token = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, token)
    marker = f"{MARKER}={token}"
    seen: set[int] = set()
    done = threading.Event()
    box: dict = {}

    def cli():
        try:
            box["run"] = run_cli(tmp, *overrides, torchrun=torchrun, timeout=BOUND)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once no stray is left
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=cli)
    thread.start()
    while not done.wait(0.2):
        seen |= marked(marker)
    thread.join()
    left = reap(marker)  # never leaves a stray behind, even from a failing test; only processes this run started
    if "error" in box:
        raise box["error"]
    rc, text, _ = box["run"]
    return rc, text, seen, left


def _ckpt_args(ckpt: Path) -> list[str]:
    return [f"model.path={ckpt}", "run.mode=load", f"dist.timeout_s={TIMEOUT_S}"]


@pytest.mark.parametrize(
    "fault, rank, expect",
    [
        ("kill_at", 1, ["error: rank 0: upload: lost rank 1 (", "error: ranks [1] died (exit codes {1: -9})"]),
        ("raise_at", 1, ["error: upload failed on 1 of 2 ranks: rank 1: upload failed at tensor model.layers.0"]),
        ("hang_at", 1, ["error: rank 0: upload: lost rank 1 (never reached this agreement"]),
        ("hang_at", 0, ["error: rank 1: upload: lost rank 0 (never reached this agreement"]),
    ],
)
def test_a_lost_rank_is_named_and_nothing_keeps_running(monkeypatch, ckpt, tensors, tmp_path, fault, rank, expect):
    at = tensors - 1 if fault == "kill_at" else 5  # killed late, the survivor is most likely waiting to hear of it
    rc, text, seen, left = run_watched(
        monkeypatch, tmp_path, *_ckpt_args(ckpt), "dist.nproc=2", f"fault.rank={rank}", f"fault.{fault}={at}"
    )
    lines = error_lines(text)
    assert rc != 0 and lines, text
    assert any(line.startswith(tuple(expect)) for line in lines), text
    if fault == "raise_at":  # an agreed failure: both ranks print the same line, naming tensor and file
        assert len(lines) == 2 and lines[0] == lines[1], text
        assert "model-00001-of-00003.safetensors: RuntimeError: injected failure" in lines[0], text
    if fault == "hang_at":  # the survivor gave up at dist.timeout_s, not at some default
        assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in lines[0], text
    assert len(seen) >= 3, seen  # the launcher and both ranks were watched
    assert not left, f"still running after the launcher returned: {left}"


def test_torchrun_rank0_names_a_killed_rank(monkeypatch, ckpt, tensors, tmp_path):
    """Rank 0 already waits in the upload agreement when rank 1 dies, so it names rank 1 before torchrun stops it."""
    rc, text, seen, left = run_watched(
        monkeypatch,
        tmp_path,
        *_ckpt_args(ckpt),
        "fault.rank=1",
        f"fault.kill_at={tensors - 1}",
        "fault.delay_s=1",
        torchrun=["--nproc_per_node=2"],
    )
    assert rc != 0, text
    assert [line for line in error_lines(text) if line.startswith("error: rank 0: upload: lost rank 1 (")], text
    assert "exitcode  : -9" in text and "rank      : 1 (local_rank: 1)" in text  # torchrun's own report
    assert len(seen) >= 3 and not left, (seen, left)


# ---------------------------------------------------------------------- free memory taken mid-upload, readers


def _fail_with(model_dir: str, cases: list[dict]) -> list[dict]:
    """One load per case (fault fields); every rank reports its error, its load events and a tensor census."""
    rt = dist.init("gloo", "cpu", 30)
    inv = scan(model_dir, load_config(model_dir))
    events, out = Events(), []
    for fault in cases:
        before = _weight_objects()
        try:
            load_weights(inv, rt, torch.float32, faults=Faults(**fault))
            error = None
        except K3Error as exc:
            error = str(exc)
        lines = [e for e in events.take() if e.startswith(("k3_weight_shard_loaded", "k3_weight_cleanup"))]
        out.append({"error": error, "events": lines, "tensors_before": before, "tensors_after": _weight_objects()})
    dist.shutdown()
    return out


@pytest.fixture(scope="module")
def midway(ckpt):
    """Rank 1 loses (nearly) all its free memory after the second file; rank 0's reader fails in the third file."""
    cfg = load_config(ckpt)
    plans = plan_rank(cfg, scan(ckpt, cfg).entries.values(), 2, 0, torch.float32)
    files = list(dict.fromkeys(p.file for p in plans))
    at = next(i for i, p in enumerate(plans) if p.file == files[2])
    cases = [
        {"rank": 1, "free_drop": 2**60, "free_drop_at": 1},
        {"rank": 0, "read_fail_at": at},
    ]
    results = expect_ok(run_ranks(_fail_with, 2, str(ckpt), cases, timeout=BOUND))
    return {"files": files, "read_fail_at": plans[at].name, "runs": [[r[i] for r in results] for i in range(2)]}


def test_free_memory_taken_mid_upload_stops_every_rank(ckpt, midway):
    """After the file where rank 1's free memory fell under the reserve, both ranks stop with one line naming the
    rank, the file and the numbers, and free everything; the files before carry the free-memory figures."""
    per_rank = midway["runs"][0]
    errors = {r["error"] for r in per_rank}
    assert len(errors) == 1, errors
    error = errors.pop()
    second = ckpt / midway["files"][1]
    assert error.startswith(f"upload failed on 1 of 2 ranks: rank 1: reserve exhausted after {second}: "), error
    assert "free memory is 0 B, " in error and "still to allocate" in error and "< memory.reserve 0 B" in error
    for rank, r in enumerate(per_rank):
        loaded = [e for e in r["events"] if e.startswith("k3_weight_shard_loaded")]
        assert len(loaded) == (1 if rank == 1 else 2), r["events"]  # rank 1's second file ended in its refusal
        assert all(" free_bytes=" in e and " free_drop=" in e for e in loaded)
        (cleanup,) = [e for e in r["events"] if e.startswith("k3_weight_cleanup")]
        assert cleanup.startswith(f"k3_weight_cleanup rank={rank} freed=") and cleanup.endswith(" live=0")
        assert r["tensors_after"] == r["tensors_before"]


def test_a_reader_thread_failure_is_agreed_and_freed(ckpt, midway):
    per_rank = midway["runs"][1]
    errors = {r["error"] for r in per_rank}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith(f"upload failed on 1 of 2 ranks: rank 0: upload failed at tensor {midway['read_fail_at']}")
    assert f"{ckpt / midway['files'][2]}: OSError: [Errno 5] injected read error" in error
    for rank, r in enumerate(per_rank):
        (cleanup,) = [e for e in r["events"] if e.startswith("k3_weight_cleanup")]
        assert cleanup.startswith(f"k3_weight_cleanup rank={rank} freed=") and cleanup.endswith(" live=0")
        assert r["tensors_after"] == r["tensors_before"]


def test_reserve_exhausted_mid_upload_on_the_command_line(monkeypatch, ckpt, tmp_path):
    """Through launch.py: both ranks end with the same line, nothing keeps running."""
    rc, text, seen, left = run_watched(
        monkeypatch,
        tmp_path,
        *_ckpt_args(ckpt),
        "dist.nproc=2",
        "fault.rank=1",
        "fault.free_drop=1000TiB",
        "fault.free_drop_at=1",
    )
    lines = error_lines(text)
    assert rc != 0 and len(lines) == 2 and lines[0] == lines[1], text
    assert lines[0].startswith("error: upload failed on 1 of 2 ranks: rank 1: reserve exhausted after "), text
    assert "model-00002-of-00003.safetensors" in lines[0]
    assert len(seen) >= 3 and not left
