"""What every benchmark shares: the machine header each table carries, Markdown tables, publishing (stdout,
benchmarks/results/<name>.md, `--json`), running k3dist's CLI or a peer process under a timeout that ends its
whole process group, and for servers a free port and a process group's CPU time.

Figures only compare on one machine: transformers' bf16 decode alone differs 4x between AVX2 and AVX-512/bf16 CPUs,
so the header names the CPU, its vector units, the threads and the load next to every table.
"""

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "k3dist" / "configs" / "Kimi-K3-0.40B-config.json"  # the 0.40B twin every benchmark runs
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
PEER_MIN = (5, 23)  # first transformers release with KimiLinearForCausalLM as k3dist reads it


# ---------------------------------------------------------------- the machine


def cpu_info() -> dict:
    """CPU model name and which of the vector units that decide bf16 speed it has (from /proc/cpuinfo)."""
    name, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name is None:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return {"cpu": name, "flags": {f: f in flags for f in VECTOR_FLAGS}}


def version_of(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
        return (rev.stdout.strip() or "?") + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "?"


def machine(threads: str, device: str = "cpu") -> dict:
    """Everything a reader needs to place the figures: CPU and vector units, cores and threads, versions, load."""
    import torch

    out = cpu_info() | {
        "cores": len(os.sched_getaffinity(0)),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version_of("transformers") or "not installed",
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "commit": git_rev(),
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        out["cuda_device"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    return out


def header(m: dict) -> str:
    flags = ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in m["flags"].items())
    lines = [
        f"CPU: {m['cpu']} ({flags}); {m['cores']} cores, threads: {m['threads']}",
        f"torch {m['torch']}, transformers {m['transformers']}, python {m['python']}, commit {m['commit']}; "
        f"load average {m['load_average'][0]:.2f} at start, {os.getloadavg()[0]:.2f} at end",
    ]
    if "cuda_device" in m:
        lines.append(f"GPU: {m['cuda_device']} (CUDA {m['cuda']})")
    return "\n".join(f"- {line}" for line in lines)


# ---------------------------------------------------------------- tables and publishing


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def fmt(value, spec: str = ".2f", empty: str = "") -> str:
    return empty if value is None else format(value, spec)


def add_output_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", type=Path, help="also write every figure, the table and the machine to this file")
    ap.add_argument("--out-md", type=Path, help="where the Markdown goes (default: benchmarks/results/<name>.md)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds allowed to each k3dist or peer process")


def publish(args, title: str, tables: list[str], notes: list[str], m: dict, data: dict, started: float) -> None:
    """Print the tables with the machine header and notes; write them to --out-md and everything to --json."""
    text = f"## {title} ({time.strftime('%Y-%m-%d %H:%M')})\n\n{header(m)}\n\n" + "\n\n".join(tables) + "\n\n"
    text += "\n".join(f"- {n}" for n in notes) + "\n"
    seconds = time.perf_counter() - started
    print(f"\n{text}\n(benchmark took {seconds:.0f} s)")
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(text)
    print(f"wrote {args.out_md}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"title": title, "machine": m, "seconds": seconds, "table": text} | data
        args.json.write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {args.json}")


def save_partial(args, results: dict) -> None:
    """Write what is measured so far to --json, so a run killed at its time limit still leaves its points."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"partial": True, "results": {str(k): v for k, v in results.items()}}
        args.json.write_text(json.dumps(doc, indent=1, default=str))


def no_device(args) -> bool:
    """--device cuda on a machine without one: say so, leave a --json that says so too; True if so."""
    import torch

    if args.device != "cuda" or torch.cuda.is_available():
        return False
    print(f"{Path(sys.argv[0]).name}: --device cuda but torch sees no CUDA device: nothing measured")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"skipped": "no CUDA device", "machine": machine("-", "cpu")}, indent=1))
    return True


# ---------------------------------------------------------------- processes

_live: list[subprocess.Popen] = []


def _end_children(signum, _frame) -> None:
    """On SIGTERM/SIGINT (gpu_check.sh's `timeout`), end the process groups we started: they run in sessions of
    their own, so the signal sent to our group does not reach them."""
    for proc in _live:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, _end_children)


def run_group(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` from the repo root in its own session; past `timeout` kill the whole group (spawned ranks too)."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=os.environ | (env or {}),
    )
    _live.append(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        _live.remove(proc)
    if proc.returncode != 0:
        tail = "\n".join((out + err).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def short_error(exc: Exception) -> str:
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"timeout (> {exc.timeout:.0f} s)"
    return "failed: " + (str(exc).strip().splitlines() or ["?"])[-1][:100].replace("|", "/")


def k3dist(overrides: list[str], out: Path, timeout: float) -> dict:
    """One `python launch.py` job: its result.json (without top logits and text) plus the command's wall seconds."""
    run_dir = out.with_suffix("")
    cmd = [
        sys.executable,
        "launch.py",
        *overrides,
        f"out={out}",
        f"hydra.run.dir={run_dir}",
        "hydra.output_subdir=null",
    ]
    start = time.perf_counter()
    run_group(cmd, timeout)
    result = json.loads(out.read_text())
    for bulky in ("top_logits", "text"):
        result.pop(bulky, None)
    return result | {"wall": time.perf_counter() - start, "overrides": overrides}


def k3dist_point(label: str, overrides: list[str], out: Path, timeout: float, summary) -> dict:
    """`k3dist` for one point of a table: its result, or {"error": ...} when the run failed (the row says so);
    either way one line `k3dist <label>: ...`, the figures from `summary(result)`."""
    try:
        r = k3dist(overrides, out, timeout)
    except Exception as exc:  # noqa: BLE001  (a failed point is reported in its row)
        print(f"  k3dist {label}: {short_error(exc)}", flush=True)
        return {"error": short_error(exc)}
    print(f"  k3dist {label}: {summary(r)}", flush=True)
    return r


def twin_dir() -> Path:
    """The twin checkpoint the CLI uses by default (written once to $K3DIST_CACHE)."""
    from k3dist.twin.checkpoint import ensure_twin

    return ensure_twin(CONFIG)


def peer_missing() -> str | None:
    """Why transformers cannot be the peer here (None when it can): not installed, or older than PEER_MIN."""
    v = version_of("transformers")
    if v is None:
        return "transformers is not installed"
    parts = tuple(int(p) for p in v.split(".")[:2] if p.isdigit())
    if parts < PEER_MIN:
        return f"transformers {v} < {'.'.join(map(str, PEER_MIN))} has no KimiLinearForCausalLM that reads the twin"
    return None


def peer(mode: str, spec: dict, tmp: Path, timeout: float) -> dict:
    """Run benchmarks/peer.py `mode` on `spec` in a fresh process; its JSON plus the process's wall seconds."""
    spec_path, out = tmp / f"peer-{mode}-spec.json", tmp / f"peer-{mode}.json"
    spec_path.write_text(json.dumps(spec))
    start = time.perf_counter()
    run_group([sys.executable, str(ROOT / "benchmarks" / "peer.py"), mode, str(spec_path), str(out)], timeout)
    return json.loads(out.read_text()) | {"wall": time.perf_counter() - start}


def peer_or_skip(mode: str, make_spec, tmp: Path, timeout: float) -> dict:
    """The peer's results for `mode` ({"runs": {...}}), or why there are none ("skipped" / "error")."""
    skip = peer_missing()
    if skip is not None:
        print(f"  transformers peer skipped: {skip}", flush=True)
        return {"runs": {}, "skipped": skip}
    try:
        return peer(mode, make_spec(), tmp, timeout)
    except Exception as exc:  # noqa: BLE001 - the k3dist side still reports
        return {"runs": {}, "error": short_error(exc)}


def bare_torch_rss() -> int:
    """Peak RSS of a bare interpreter that imported torch: what every process pays before any model byte."""
    code = "import torch; from k3dist.weights.memory import peak_bytes; print(peak_bytes(torch.device('cpu')))"
    return int(run_group([sys.executable, "-c", code], 120).stdout.split()[-1])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a server the benchmark starts."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes of group `pgid` (a server and the ranks it started), from
    /proc: how much an idle server took from the cores while another was measured."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")
