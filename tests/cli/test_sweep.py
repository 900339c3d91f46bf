"""Hydra sweeps (`launch.py -m`): a refused point is recorded and the sweep goes on to a summary of every point."""

import csv
import os
import subprocess
import sys

import pytest

from k3dist.twin.checkpoint import write_checkpoint
from tests.support.cli_run import ROOT, error_lines
from tests.support.configs import small_config


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("ckpt"), seed=5)


def sweep(sweep_dir, *overrides: str, timeout: float = 240):
    """Run `launch.py -m` into `sweep_dir`; returns (exit code, output, summary.csv rows, summary.md lines)."""
    proc = subprocess.run(
        [sys.executable, "launch.py", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    text = proc.stderr + proc.stdout
    assert (sweep_dir / "summary.csv").is_file() and (sweep_dir / "summary.md").is_file(), text
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    md = (sweep_dir / "summary.md").read_text().splitlines()
    return proc.returncode, text, rows, md


def test_refused_point_is_recorded_and_the_sweep_goes_on(small_dir, tmp_path):
    # admitted = weights (<1 MiB) + cache (80 B/token) + runtime (~100 MiB + output buffers of 76 B/token) + reserve
    # against a stated 1 GiB: only 900MiB with a 4M-token cache (305 MiB + 290 MiB of outputs) does not fit
    rc, text, rows, md = sweep(
        tmp_path,
        f"model.path={small_dir}",
        "run.mode=load",
        "memory.free=1GiB",
        "memory.reserve=0,900MiB",
        "cache.cap=64,4000000",
    )
    assert rc == 0, text
    assert [(r["num"], r["memory.reserve"], r["cache.cap"], r["verdict"]) for r in rows] == [
        ("0", "0", "64", "admitted"),
        ("1", "0", "4000000", "admitted"),
        ("2", "900MiB", "64", "admitted"),
        ("3", "900MiB", "4000000", "refused"),
    ]
    admitted, refused = rows[:3], rows[3]
    assert all(int(r["free_bytes"]) == 2**30 > int(r["admitted_bytes"]) for r in admitted)
    assert all(float(r["load_seconds"]) > 0 and int(r["peak_bytes"]) > 0 and not r["error"] for r in admitted)
    assert int(refused["free_bytes"]) == 2**30  # as the refusal printed them: 0.1-unit precision
    floor = 900 * 2**20 + 4_000_000 * (80 + 76)  # reserve + cache + outputs; weights, activations, allowance on top
    assert floor < int(refused["admitted_bytes"]) < floor + 256 * 2**20
    assert refused["error"].startswith("preflight failed on 1 of 1 ranks: rank 0 needs admitted 1.5 GiB > free")
    assert not refused["load_seconds"] and not refused["peak_bytes"]
    assert error_lines(text) == ["error: " + refused["error"]]  # printed once, by the refusing rank
    table = [line for line in md if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == 4 and "| refused | 1.5 GiB / 1.0 GiB |" in table[3]
    assert "k3dist sweep: 4 points" in text and table[3] in text


@pytest.mark.slow
def test_sweep_points_with_two_ranks(small_dir, tmp_path):
    rc, text, rows, md = sweep(
        tmp_path,
        f"model.path={small_dir}",
        "dist.nproc=2",
        "generate.max_new_tokens=4",
        "memory.reserve=0,100TiB",
    )
    assert rc == 0, text
    assert [(r["memory.reserve"], r["verdict"]) for r in rows] == [("0", "admitted"), ("100TiB", "refused")]
    assert float(rows[0]["decode_tokens_per_second"]) > 0 and int(rows[0]["peak_bytes"]) > 0
    refusal = rows[1]["error"]
    assert "preflight failed on 2 of 2 ranks" in refusal and "rank 1 needs admitted 100.0 TiB" in refusal
    assert int(rows[1]["admitted_bytes"]) == 100 * 2**40 > int(rows[1]["free_bytes"])
    assert len(error_lines(text)) == 2  # each rank of the refused point printed its own line; the sweep added none
