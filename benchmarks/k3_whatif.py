"""Kimi K3 2.78T: how many GPUs? The what-if plan of the real config over world sizes, as one Hydra sweep.

    python benchmarks/k3_whatif.py                              # worlds 8, 16, 32 at 141 GiB a rank (an H200's)
    python benchmarks/k3_whatif.py --worlds 8 16 --free 80GiB   # another device

Runs `python launch.py -m model=kimi_k3 run.mode=plan dist.world_size=8,16,32 memory.free=141GiB` (each point a job
of its own, writing its own result.json) and prints one table from those results: per rank the weights it keeps
(`local`, MXFP4 experts as their packed bytes) and what the run needs in all (`admitted`) against `free`, the tightest
rank's headroom or shortfall, and what the pure TP group's collectives move per token (all-reduced and all-gathered
bytes, and the ring traffic each rank sends: k3dist/memory/traffic.py). `plan s` is each job's planning
(result.json's `plan_seconds`); the sweep's wall time, process starts included, is in the notes.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from k3dist.base.units import fmt_bytes  # noqa: E402


def results(sweep: Path) -> list[dict]:
    """Each job's result.json (point.json says where it went), in world order."""
    points = [json.loads(p.read_text()) for p in sweep.glob("*/point.json")]
    failed = [p["error"] for p in points if p["error"]]
    if failed:
        raise RuntimeError(f"{len(failed)} points failed: {failed[0]}")
    return sorted((json.loads(Path(p["out"]).read_text()) for p in points), key=lambda r: r["world_size"])


def row(r: dict) -> list[str]:
    tightest = r["plan"][r["tightest_rank"]]
    room, t = r["headroom"], r["tp_traffic"]
    verdict = f"fits, {fmt_bytes(room)} to spare" if room >= 0 else f"short by {fmt_bytes(-room)}"
    return [
        str(r["world_size"]),
        fmt_bytes(tightest["local_bytes"]),
        fmt_bytes(tightest["admitted"]),
        fmt_bytes(tightest["free"]),
        verdict,
        f"{t['all_reduce_bytes']:,}",
        f"{t['all_gather_bytes']:,}",
        f"{t['ring_bytes']:,}",
        f"{r['plan_seconds']:.1f}",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--free", default="141GiB", help="memory.free: each rank's device memory")
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "k3-whatif.md"
    started = time.perf_counter()
    m = common.machine("one process, the sweep's jobs one after another")
    print(common.header(m), flush=True)
    sweep = Path(tempfile.mkdtemp(prefix="k3bench-whatif-"))
    worlds = ",".join(map(str, args.worlds))
    overrides = ["model=kimi_k3", "run.mode=plan", f"dist.world_size={worlds}", f"memory.free={args.free}"]
    cmd = [sys.executable, "launch.py", "-m", *overrides, f"hydra.sweep.dir={sweep}"]
    common.run_group(cmd, timeout=args.timeout * len(args.worlds))
    wall = time.perf_counter() - started
    found = results(sweep)
    head = ["N", "local", "admitted", "free", "verdict", "all-reduce B/token", "all-gather B/token"]
    head += ["ring B/token a rank", "plan s"]
    notes = [
        f"command: `python launch.py -m {' '.join(overrides)}`; the sweep took {wall:.0f} s in all",
        "local, admitted, free: the tightest rank's (K3's splits are even: every rank keeps and needs the same)",
        "k3dist has no expert parallelism yet: each N is one TP group (across nodes past 8 GPUs), every rank holding "
        "1/N of each of the 896 routed experts; the bytes are those of one decoded token",
    ]
    data = {"results": found, "sweep_dir": str(sweep), "sweep_seconds": wall}
    table = common.md_table(head, [row(r) for r in found])
    common.publish(args, "Kimi K3 2.78T: how many GPUs", [table], notes, m, data, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
