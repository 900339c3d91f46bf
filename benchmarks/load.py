"""Load benchmark: k3dist `run.mode=load` at world 1 and 2 vs transformers `from_pretrained`, on the 0.40B twin (bf16).

    python benchmarks/load.py                        # warm page cache, 3 repeats, medians
    python benchmarks/load.py --cold                 # drop the checkpoint's pages before every run
    python benchmarks/load.py --device cuda --worlds 1 --json load.json

k3dist: `python launch.py run.mode=load dist.nproc=N`; from its result.json: `load_seconds` (preflight, agreement,
upload, agreement), each rank's plan (source_bytes, read_bytes where the plan has it, local_bytes, staging_peak,
runtime_bytes, admitted) and each rank's measured peak (`memory`: peak RSS on CPU; on CUDA peak allocation and
max_memory_reserved). On CPU a rank's peak is also shown less the peak RSS of a bare interpreter that imported torch
(measured once here), since the plan admits model bytes, not the interpreter.
transformers (benchmarks/peer.py, a fresh process per repeat): seconds of `from_pretrained(dtype=bfloat16)`, then
of reading every weight once (its tensors may stay views of the file mmap), and the process's peak RSS.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/ is the script dir; common puts the repo root on sys.path)

MB = 1e6


def drop_pages(files: list[Path]) -> None:
    """Evict the checkpoint from the page cache: the loader's own helper where it has one, else posix_fadvise."""
    try:
        from k3dist.weights.loader import _drop_page_cache as drop
    except ImportError:

        def drop(path: Path) -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    for path in files:
        drop(path)


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    return f"{med(values):.3f} ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else f"{values[0]:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--worlds", type=int, nargs="+", help="rank counts (cpu: 1 2; cuda: 1)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; the tables show medians")
    ap.add_argument("--cold", action="store_true", help="drop the checkpoint's page cache before every run")
    common.add_output_args(ap)
    args = ap.parse_args()
    args.worlds = args.worlds or ([1, 2] if args.device == "cpu" else [1])
    args.out_md = args.out_md or common.RESULTS / ("load.md" if args.device == "cpu" else "load-cuda.md")
    if common.no_device(args):
        return 2

    started = time.perf_counter()
    m = common.machine("k3dist cores // world per rank, transformers torch default", args.device)
    twin = common.twin_dir()
    files = sorted(twin.glob("*.safetensors"))
    ckpt = sum(f.stat().st_size for f in files)
    bare = common.bare_torch_rss()
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-load-"))
    cuda = args.device == "cuda"
    warm = [] if args.cold else ["memory.drop_page_cache=off"]  # CUDA ranks drop each file's pages by default
    skip = common.peer_missing()
    k3: dict[int, list[dict]] = {w: [] for w in args.worlds}
    peers: list[dict] = []
    errors: dict[str, str] = {}
    for rep in range(args.repeats):
        for w in args.worlds:
            if args.cold:
                drop_pages(files)
            overrides = ["run.mode=load", f"dist.nproc={w}", f"dist.device={args.device}", "model.dtype=bfloat16"]
            try:
                k3[w].append(common.k3dist(overrides + warm, tmp / f"w{w}-{rep}.json", args.timeout))
                common.save_partial(args, k3)
                print(f"  rep {rep} world {w}: load {k3[w][-1]['load_seconds']:.3f} s", flush=True)
            except Exception as exc:  # noqa: BLE001  (reported in the table)
                errors[f"k3dist world {w}"] = common.short_error(exc)
        if skip is None and "transformers" not in errors:
            if args.cold:
                drop_pages(files)
            try:
                peers.append(common.peer("load", {"model_dir": str(twin), "device": args.device}, tmp, args.timeout))
                print(f"  rep {rep} transformers: load {peers[-1]['seconds']:.3f} s", flush=True)
            except Exception as exc:  # noqa: BLE001
                errors["transformers"] = common.short_error(exc)

    p_load = med([p["seconds"] for p in peers]) if peers else None
    head = ["system", "world", "load s (median, min-max)", "wall s", "GB/s", "read MB", "checkpoint MB", "load / peer"]
    rows = []
    rank_head = ["system", "world", "rank", "source MB", "read MB", "local MB", "staging MB", "runtime MB"]
    rank_head += ["admitted MB", "peak MB", "peak / admitted"]
    rank_head += (
        ["max reserved MB", "reserved / admitted"] if cuda else ["peak - bare torch MB", "(peak - bare) / admitted"]
    )
    rank_rows = []
    for w in args.worlds:
        runs = k3[w]
        if not runs:
            rows.append(["k3dist", str(w), errors.get(f"k3dist world {w}", "no run"), *[""] * 5])
            continue
        loads = [r["load_seconds"] for r in runs]
        plan = runs[-1]["plan"]
        read = sum(p.get("read_bytes", p["source_bytes"]) for p in plan)
        ratio = common.fmt(med(loads) / p_load if p_load else None, ".2f", "n/a")
        rows.append(
            [
                "k3dist",
                str(w),
                spread(loads),
                f"{med([r['wall'] for r in runs]):.2f}",
                f"{read / med(loads) / 1e9:.2f}",
                f"{read / MB:.0f}",
                f"{ckpt / MB:.0f}",
                ratio,
            ]
        )
        for p in plan:
            rank = p["rank"]
            peak = med([r["memory"][rank]["peak_bytes"] for r in runs])
            row = [
                "k3dist",
                str(w),
                str(rank),
                f"{p['source_bytes'] / MB:.0f}",
                common.fmt(p["read_bytes"] / MB if "read_bytes" in p else None, ".0f", "n/a"),
                f"{p['local_bytes'] / MB:.0f}",
                f"{p['staging_peak'] / MB:.0f}",
                f"{p['runtime_bytes'] / MB:.0f}",
                f"{p['admitted'] / MB:.0f}",
                f"{peak / MB:.0f}",
                f"{peak / p['admitted']:.2f}",
            ]
            if cuda:
                reserved = med([r["memory"][rank].get("max_memory_reserved", 0) for r in runs])
                row += [f"{reserved / MB:.0f}", f"{reserved / p['admitted']:.2f}"]
            else:
                row += [f"{(peak - bare) / MB:.0f}", f"{(peak - bare) / p['admitted']:.2f}"]
            rank_rows.append(row)
    if peers:
        p_loads = [p["seconds"] for p in peers]
        rows.append(
            [
                "transformers",
                "1",
                spread(p_loads),
                f"{med([p['wall'] for p in peers]):.2f}",
                f"{ckpt / p_load / 1e9:.2f}",
                f"{ckpt / MB:.0f}",
                f"{ckpt / MB:.0f}",
                "1.00",
            ]
        )
        peak = med([p["peak_rss"] for p in peers])
        extra = (
            [common.fmt(med([p["max_memory_reserved"] for p in peers]) / MB, ".0f"), ""]
            if cuda
            else [f"{(peak - bare) / MB:.0f}", ""]
        )
        rank_rows.append(
            ["transformers", "1", "0", f"{ckpt / MB:.0f}", "", "", "", "", "", f"{peak / MB:.0f}", "", *extra]
        )
    else:
        rows.append(["transformers", "1", errors.get("transformers") or f"skipped: {skip}", *[""] * 5])

    touch = f"{med([p['touch_seconds'] for p in peers]):.2f} s" if peers else "n/a"
    after = f"{med([p['peak_rss_after_touch'] for p in peers]) / MB:.0f}" if peers else "n/a"
    notes = [
        f"twin `{twin.name}`: {len(files)} files, {ckpt / MB:.0f} MB bf16; page cache "
        + ("dropped before every run (--cold)." if args.cold else "warm (memory.drop_page_cache=off).")
        + f" {args.repeats} repeats, medians.",
        "`load s`: k3dist `load_seconds` / transformers `from_pretrained`; `wall s`: the whole command (interpreter, "
        "imports, Hydra, ranks) or the whole peer process. `GB/s` = bytes read by all ranks (`read_bytes` where the "
        "plan has it, else `source_bytes`) / load s. `load / peer` <= 1 is the target.",
        f"transformers keeps weights as views of the file mmap: reading every byte once afterwards took {touch} "
        f"and brought its peak RSS to {after} MB (the first forward pays that); k3dist's bytes are resident when its "
        "load ends.",
        "`peak MB`: each rank's measured peak from result.json's `memory` (RSS on CPU; allocation on CUDA); "
        f"`admitted`: the plan's total (local + derived + staging + cache + runtime + reserve). A bare interpreter "
        f"with torch imported peaks at {bare / MB:.0f} MB RSS here: `peak - bare torch` is what the model cost.",
    ]
    data = {
        "args": vars(args),
        "bare_torch_rss": bare,
        "checkpoint_bytes": ckpt,
        "errors": errors,
        "k3dist": {str(w): runs for w, runs in k3.items()},
        "peer": peers,
        "peer_skipped": skip,
    }
    tables = [common.md_table(head, rows), "Memory per rank\n\n" + common.md_table(rank_head, rank_rows)]
    common.publish(args, "Load: k3dist vs transformers from_pretrained", tables, notes, m, data, started)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
