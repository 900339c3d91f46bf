"""Load benchmark: k3dist vs transformers on the 0.40B twin (bf16), world sizes 1 and 2.

    python benchmarks/load.py                 # warm page cache, 3 repeats, medians
    python benchmarks/load.py --cold          # drop the checkpoint's pages (posix_fadvise) before every run

Per world size it measures
  * `python launch.py run.mode=load dist.nproc=N`: wall seconds of the command and `load_seconds` from result.json;
  * peak RSS of every rank: the ranks are started here (spawn, same env as torchrun) around `k3dist.job.run_rank`,
    and each reports `getrusage(RUSAGE_SELF).ru_maxrss` after it returns, plus its RSS before the job (imports);
  * the per-rank budget `local_bytes + staging_peak + 300 MiB` from the rank's plan.
The peer is `transformers.KimiLinearForCausalLM.from_pretrained(twin, dtype=torch.bfloat16)` in a fresh process
(seconds of the call, wall of the process, peak RSS). The table goes to stdout and to benchmarks/results/load.md.
"""

import argparse
import contextlib
import io
import json
import logging
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import git_rev, md_table, publish  # noqa: E402  (benchmarks/ is on sys.path as the script dir)

CONFIG = ROOT / "k3dist" / "configs" / "Kimi-K3-0.40B-config.json"
RESULTS = ROOT / "benchmarks" / "results"
MiB = 2**20


# ---------------------------------------------------------------- measurements inside a process


def proc_status() -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def compose_job(overrides: list[str]) -> dict:
    """The composed Hydra config as launch.py would hand it to a rank (a plain dict)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def touch(tensors) -> float:
    """Read every byte of the weights once (pages of a lazily mapped checkpoint become resident); seconds."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        for t in tensors:
            t.sum()
    return time.perf_counter() - start


def watch_load() -> dict:
    """Wrap `k3dist.job.load_weights` (in this process only) to read RSS while the weights are alive, then touch them.

    The peak RSS of the load is taken before the touch; the touch shows what the first forward pays on CPU, where
    the loader's tensors can be views of the safetensors mmap. Skipped (empty dict) if the hook point is gone.
    """
    import k3dist.job as job_module

    info: dict = {}
    real = getattr(job_module, "load_weights", None)
    if real is None:
        return info

    def measured(*args, **kwargs):
        store = real(*args, **kwargs)
        status = proc_status()
        info.update(peak_rss=peak_rss(), rss_anon=status["RssAnon"], rss_file=status["RssFile"])
        info["touch_seconds"] = touch(store.tensors.values())
        info["rss_after_touch"] = proc_status()["VmRSS"]
        return store

    job_module.load_weights = measured
    return info


def _rank_child(rank: int, world: int, port: int, job: dict, results) -> None:
    """One rank: torchrun's environment, `run_rank`, then its own peak RSS."""
    try:
        import torch  # noqa: F401  (counted in the baseline, as in any rank)

        from k3dist.dist import torchrun_env
        from k3dist.job import run_rank

        os.environ.update(torchrun_env(rank, world, port))

        quiet = logging.StreamHandler(sys.stderr)  # run_rank keeps a handler it finds: events below WARNING drop
        quiet.setLevel(logging.WARNING)
        logging.getLogger("k3dist").addHandler(quiet)
        logging.getLogger("k3dist").propagate = False
        loaded = watch_load()
        before = proc_status()["VmRSS"]
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0's summary: launch.py already shows it
            result = run_rank(job)
        results.put(
            {
                "rank": rank,
                "ok": True,
                "seconds": time.perf_counter() - start,
                "baseline_rss": before,
                "peak_rss": loaded.get("peak_rss", peak_rss()),
                "load_seconds": result["load_seconds"] if result else None,
            }
            | loaded
        )
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put({"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}"})


def measure_ranks(world: int, out: Path, timeout: float = 240) -> list[dict]:
    """Start `world` ranks of `run.mode=load` here; each reports its own peak RSS."""
    import torch.multiprocessing as mp

    from k3dist.dist import free_port

    job = compose_job(["run.mode=load", f"out={out}"])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_child, args=(r, world, port, job, results)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    try:
        while len(got) < world:
            item = results.get(timeout=timeout)
            got[item["rank"]] = item
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    bad = [got.get(r, {"rank": r, "error": "no report"}) for r in range(world) if not got.get(r, {}).get("ok")]
    if bad:
        raise RuntimeError("; ".join(f"rank {b['rank']}: {b.get('error')}" for b in bad))
    return [got[r] for r in range(world)]


def peer_worker(model_dir: str, json_out: str) -> None:
    """Fresh process: transformers from_pretrained, its seconds and this process's peak RSS."""
    start = time.perf_counter()
    import torch
    import transformers

    imported = time.perf_counter()
    baseline = proc_status()["VmRSS"]
    t0 = time.perf_counter()
    model = transformers.KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    status = proc_status()
    load_peak = peak_rss()
    touch_seconds = touch(model.parameters())
    Path(json_out).write_text(
        json.dumps(
            {
                "seconds": seconds,
                "import_seconds": imported - start,
                "baseline_rss": baseline,
                "peak_rss": load_peak,
                "rss_anon": status["RssAnon"],
                "rss_file": status["RssFile"],
                "touch_seconds": touch_seconds,
                "rss_after_touch": proc_status()["VmRSS"],
                "threads": torch.get_num_threads(),
                "transformers": transformers.__version__,
                "params": sum(p.numel() for p in model.parameters()),
            }
        )
    )


# ---------------------------------------------------------------- the driver


def drop_page_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_group(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; on timeout kill its whole process group (spawned ranks included)."""
    with subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_cmd(cmd: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = run_group(cmd, timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return wall, proc


def k3dist_launch(world: int, out: Path) -> dict:
    wall, _ = run_cmd([sys.executable, "launch.py", "run.mode=load", f"dist.nproc={world}", f"out={out}"], 300)
    result = json.loads(out.read_text())
    return {"wall": wall, "load_seconds": result["load_seconds"], "plan": result["plan"], "dir": result["model_dir"]}


def peer_load(model_dir: Path, out: Path) -> dict:
    wall, _ = run_cmd(
        [sys.executable, __file__, "--worker", "peer", "--model-dir", str(model_dir), "--json-out", str(out)], 300
    )
    return json.loads(out.read_text()) | {"wall": wall}


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; the table shows medians")
    ap.add_argument("--cold", action="store_true", help="drop the checkpoint's page cache before every run")
    ap.add_argument("--budget-mib", type=int, default=300, help="RSS allowance over local_bytes + staging_peak")
    ap.add_argument("--out-md", type=Path, default=RESULTS / "load.md")
    ap.add_argument("--worker", choices=["peer"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "peer":
        peer_worker(args.model_dir, args.json_out)
        return

    from k3dist.weights.twin import ensure_twin

    twin = ensure_twin(CONFIG)
    files = sorted(twin.glob("*.safetensors"))
    ckpt_bytes = sum(f.stat().st_size for f in files)
    load_before = os.getloadavg()
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-load-"))
    launches: dict[int, list[dict]] = {w: [] for w in args.worlds}
    ranks: dict[int, list[list[dict]]] = {w: [] for w in args.worlds}
    peers: list[dict] = []

    def prepare() -> None:
        if args.cold:
            drop_page_cache(files)

    for rep in range(args.repeats):
        for w in args.worlds:
            prepare()
            launches[w].append(k3dist_launch(w, tmp / f"launch-w{w}-{rep}.json"))
            if launches[w][-1]["dir"] != str(twin):
                raise RuntimeError(f"k3dist loaded {launches[w][-1]['dir']}, expected {twin}")
            prepare()
            ranks[w].append(measure_ranks(w, tmp / f"ranks-w{w}-{rep}.json"))
            print(
                f"  rep {rep} world {w}: wall {launches[w][-1]['wall']:.2f} s, load "
                f"{launches[w][-1]['load_seconds']:.3f} s, peak RSS "
                + ", ".join(f"{r['peak_rss'] / MiB:.0f}" for r in ranks[w][-1])
                + " MiB",
                flush=True,
            )
        prepare()
        peers.append(peer_load(twin, tmp / f"peer-{rep}.json"))
        print(
            f"  rep {rep} transformers: wall {peers[-1]['wall']:.2f} s, load {peers[-1]['seconds']:.3f} s", flush=True
        )

    p_load = median([p["seconds"] for p in peers])
    p_wall = median([p["wall"] for p in peers])
    p_rss = median([p["peak_rss"] for p in peers])
    header = [
        "system",
        "world",
        "rank",
        "wall s",
        "load s (min-max)",
        "GB/s",
        "peak RSS MiB",
        "RSS before job MiB",
        "budget MiB",
        "RSS / budget",
        "load / peer",
        "wall / peer",
        "touch s",
        "RSS after touch MiB",
    ]

    def opt(reps: list[dict], key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
        values = [x[key] for x in reps if key in x]
        return fmt.format(median(values) / scale) if values else "n/a"

    rows = []
    for w in args.worlds:
        wall = median([x["wall"] for x in launches[w]])
        loads = [x["load_seconds"] for x in launches[w]]
        plan = launches[w][-1]["plan"]
        for r in range(w):
            reps = [rep[r] for rep in ranks[w]]
            rss = median([x["peak_rss"] for x in reps])
            p = plan[r]
            budget = p["local_bytes"] + p["staging_peak"] + args.budget_mib * MiB
            first = r == 0
            rows.append(
                [
                    "k3dist",
                    str(w),
                    str(r),
                    f"{wall:.2f}" if first else "",
                    f"{median(loads):.3f} ({spread(loads)})" if first else "",
                    f"{ckpt_bytes / median(loads) / 1e9:.2f}" if first else "",
                    f"{rss / MiB:.0f}",
                    opt(reps, "baseline_rss", MiB),
                    f"{budget / MiB:.0f}",
                    f"{rss / budget:.2f}",
                    f"{median(loads) / p_load:.2f}" if first else "",
                    f"{wall / p_wall:.2f}" if first else "",
                    opt(reps, "touch_seconds", fmt="{:.2f}"),
                    opt(reps, "rss_after_touch", MiB),
                ]
            )
    p_loads = [p["seconds"] for p in peers]
    rows.append(
        [
            "transformers",
            "1",
            "0",
            f"{p_wall:.2f}",
            f"{p_load:.3f} ({spread(p_loads)})",
            f"{ckpt_bytes / p_load / 1e9:.2f}",
            f"{p_rss / MiB:.0f}",
            opt(peers, "baseline_rss", MiB),
            "",
            "",
            "1.00",
            "1.00",
            opt(peers, "touch_seconds", fmt="{:.2f}"),
            opt(peers, "rss_after_touch", MiB),
        ]
    )
    plan_rows = [
        [str(w), str(p["rank"]), f"{p['source_bytes'] / MiB:.0f}", f"{p['local_bytes'] / MiB:.0f}",
         f"{p['staging_peak'] / MiB:.0f}", f"{p['replicated_bytes'] / MiB:.1f}"]
        for w in args.worlds for p in launches[w][-1]["plan"]
    ]  # fmt: skip
    peer = peers[-1]
    notes = [
        f"twin: `{twin.name}` ({len(files)} files, {ckpt_bytes / 1e9:.3f} GB bf16); "
        f"page cache: {'dropped (posix_fadvise DONTNEED) before every run' if args.cold else 'warm'}; "
        f"{args.repeats} repeats, medians.",
        f"machine: {os.cpu_count()} CPUs, {platform.machine()}, python {platform.python_version()}, "
        f"transformers {peer['transformers']} ({peer['threads']} threads), commit {git_rev()}; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after "
        f"(the machine is shared: expect noise).",
        "`wall s`: the whole `python launch.py run.mode=load dist.nproc=N` command (interpreter, imports, Hydra, "
        "rank start, load), and for transformers the whole fresh process (imports "
        f"{median([p['import_seconds'] for p in peers]):.1f} s + from_pretrained).",
        "`load s`: k3dist `load_seconds` (preflight + agreement + upload + agreement) / transformers "
        "`from_pretrained` call. `GB/s` = checkpoint bytes / load s.",
        "`peak RSS`: `ru_maxrss` of each rank process (spawned here around `k3dist.job.run_rank`) or of the "
        "transformers process; `RSS before job`: the rank after importing torch + k3dist, before `run_rank`.",
        f"`budget` = local_bytes + staging_peak + {args.budget_mib} MiB of the rank's plan (target RSS / budget <= 1); "
        "`load / peer`, `wall / peer`: k3dist / transformers (target <= 1).",
        "`touch s`: after the load, read every weight byte once (`t.sum()` per tensor), `RSS after touch`: the "
        "process RSS then: the cost a load defers to the first forward (weights left as views of the file mmap "
        "fault their pages in then); near zero when the load already made every byte resident.",
        "RSS at the end of the load (anon / file-backed), MiB: "
        + "; ".join(
            f"k3dist w{w} r{r} {opt([rep[r] for rep in ranks[w]], 'rss_anon', MiB)} / "
            f"{opt([rep[r] for rep in ranks[w]], 'rss_file', MiB)}"
            for w in args.worlds
            for r in range(w)
        )
        + f"; transformers {peer['rss_anon'] / MiB:.0f} / {peer['rss_file'] / MiB:.0f}.",
    ]
    table = md_table(header, rows)
    plan_table = md_table(["world", "rank", "source MiB", "local MiB", "staging_peak MiB", "replicated MiB"], plan_rows)
    text = (
        f"## Load: k3dist vs transformers ({time.strftime('%Y-%m-%d %H:%M')})\n\n{table}\n\n"
        f"Plan figures per rank:\n\n{plan_table}\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    )
    publish(text, args.out_md, started)
    shutil.rmtree(tmp, ignore_errors=True)  # kept when the run fails, for its result.json files


if __name__ == "__main__":
    main()
