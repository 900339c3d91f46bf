"""Sweeps (`python launch.py -m ...`): every point is recorded, whatever its outcome, and compared at the end.

A point's ranks always run in processes of their own (launch.py), so a refusal or crash, a peak memory figure and a
process group stay that point's. Each job dir gets `point.json` (overrides, where result.json went, each rank's peak
memory or the error); `SweepSummary` (a Hydra callback, conf/config.yaml) reads those and the results into
`summary.csv` and `summary.md` in the sweep dir, and prints the table. Peak memory is the process's peak resident
set on cpu and torch's peak allocation on cuda.
"""

import csv
import io
import json
import re
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from ..base import dist, signals
from ..base.outfiles import atomic_write
from ..base.units import fmt_bytes, parse_bytes
from ..weights.memory import peak_bytes
from .job import run_or_exit

POINT = "point.json"
# How a preflight refusal names each rank that does not fit (weights/memory.py, MemoryPlan.refusal).
REFUSAL = re.compile(r"rank (\d+) needs admitted ([0-9.]+ \w+) > free ([0-9.]+ \w+)")
FIELDS = ["verdict", "admitted_bytes", "free_bytes", "load_seconds", "decode_tokens_per_second", "peak_bytes", "error"]


@record
def point_rank(job: dict) -> int:
    """One rank of a sweep point; returns its peak memory. A user error also lands in torch elastic's error file
    (exit_with_error), where the launcher reads it back for the point's record."""
    signals.as_rank(announce=False)
    run_or_exit(job)
    return peak_bytes(dist.current().device)


def write_point(
    job_dir: Path, num: int, overrides: list[str], out: str, peaks: list[int] | None = None, error: str | None = None
) -> None:
    """The point's record, whole or not at all: an interrupt may end the sweep (and summarize it) mid-write."""
    record = {"num": num, "overrides": overrides, "out": str(Path(out).resolve()), "peak_bytes": peaks, "error": error}
    atomic_write(job_dir / POINT, json.dumps(record, indent=1))


def tightest(pairs: list[tuple[int, int]]) -> tuple[int, int]:
    """(admitted, free) of the rank closest to (or furthest past) its limit: the one that decides the verdict."""
    return max(pairs, key=lambda p: p[0] - p[1])


def summarize(point: dict) -> dict:
    """One row: the verdict, the deciding rank's admitted/free, load and decode speed, the peak over ranks."""
    row = dict.fromkeys(FIELDS, "")
    out = Path(point["out"])
    if point["error"] is None and not out.is_file():
        point = point | {"error": f"no result at {out}"}
    if point["error"] is not None:
        refusals = [(parse_bytes(a), parse_bytes(f)) for _, a, f in REFUSAL.findall(point["error"])]
        row["verdict"] = "refused" if refusals else "failed"
        row["error"] = point["error"]
        if refusals:  # figures as the refusal printed them (0.1-unit precision): only the refusing ranks name them
            row["admitted_bytes"], row["free_bytes"] = tightest(refusals)
        return row
    result = json.loads(out.read_text())
    row["verdict"] = result.get("verdict", "admitted")  # run.mode=plan sweeps carry their own verdict
    row["admitted_bytes"], row["free_bytes"] = tightest([(p["admitted"], p["free"]) for p in result["plan"]])
    row["load_seconds"] = result.get("load_seconds", "")
    row["decode_tokens_per_second"] = result.get("decode_tokens_per_second", "")
    row["peak_bytes"] = max(point["peak_bytes"])
    return row


def swept_keys(points: list[dict]) -> list[str]:
    """Override keys whose values differ between points (all of them if none differ): the sweep's axes."""
    settings = [dict(o.split("=", 1) for o in p["overrides"] if "=" in o) for p in points]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    varying = [k for k in keys if len({s.get(k) for s in settings}) > 1]
    return varying or keys


def markdown(rows: list[dict], keys: list[str]) -> str:
    def human(row: dict) -> list[str]:
        fits = f"{fmt_bytes(row['admitted_bytes'])} / {fmt_bytes(row['free_bytes'])}" if row["free_bytes"] != "" else ""
        load, tps, peak = row["load_seconds"], row["decode_tokens_per_second"], row["peak_bytes"]
        return [
            str(row["num"]),
            *(row[k] for k in keys),
            row["verdict"],
            fits,
            f"{load:.2f}" if load != "" else "",
            f"{tps:.1f}" if tps != "" else "",
            fmt_bytes(peak) if peak != "" else "",
        ]

    head = ["#", *keys, "verdict", "admitted / free", "load s", "decode tok/s", "peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(human(r)) + " |" for r in rows]
    lines += [f"\n#{r['num']} {r['verdict']}: error: {r['error']}" for r in rows if r["error"]]
    return "\n".join(lines) + "\n"


class SweepSummary(Callback):
    """After a multirun: one row per point of this sweep, as CSV and Markdown in the sweep dir, and printed.

    An interrupted sweep never reaches Hydra's on_multirun_end: the launcher runs it on its way out instead, for the
    points that finished.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.started = time.time()  # points left in a reused sweep dir by an earlier sweep are not this sweep's
        self.interrupted = lambda: self.on_multirun_end(config)
        signals.on_interrupt(self.interrupted)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        signals.discard(getattr(self, "interrupted", None))
        sweep_dir = Path(str(config.hydra.sweep.dir))
        files = [p for p in sweep_dir.rglob(POINT) if p.stat().st_mtime >= self.started]
        points = sorted((json.loads(p.read_text()) for p in files), key=lambda p: p["num"])
        if not points:
            return
        keys = swept_keys(points)
        rows = []
        for p in points:
            given = dict(o.split("=", 1) for o in p["overrides"] if "=" in o)
            rows.append({"num": p["num"], **{k: given.get(k, "") for k in keys}, **summarize(p)})
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=["num", *keys, *FIELDS], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(sweep_dir / "summary.csv", text.getvalue())
        table = markdown(rows, keys)
        atomic_write(sweep_dir / "summary.md", table)
        print(f"k3dist sweep: {len(rows)} points ({sweep_dir}/summary.csv, summary.md)\n{table}", end="")
