"""Decode benchmark: k3dist vs transformers `generate` on the 0.40B twin (bf16, greedy), world 1 and 2, batch 1 and 8.

    python benchmarks/decode.py
    python benchmarks/decode.py --worlds 1 --batches 1 --max-new-tokens 8     # a quick look

k3dist: `python launch.py dist.nproc=N generate.batch=B generate.prompt_len=16 generate.max_new_tokens=32` per point;
prefill_seconds, decode_tokens_per_second and step_ms come from result.json (its ranks split the cores: each runs
`cpu_count // nproc` threads). transformers: one fresh process (torch's default threads, all cores) loads the same
checkpoint once and, per batch, on the same prompt ids k3dist used: one forward over the prompt (the prefill time),
then `model.generate(input_ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)`. A logits processor stamps
the time of every step inside generate, so its decode tokens/s is measured like k3dist's: B x steps / time of the
decode forwards (the first token comes from the prefill). The table goes to stdout and benchmarks/results/decode.md.
"""

import argparse
import json
import os
import platform
import shutil
import signal
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


# ---------------------------------------------------------------- the transformers side (a fresh process)


def peer_worker(model_dir: str, spec_path: str, json_out: str) -> None:
    import torch
    import transformers
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per generated token, right after that step's forward: a timestamp per step."""

        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    spec = json.loads(Path(spec_path).read_text())
    model = transformers.KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.eval()
    out = {"threads": torch.get_num_threads(), "transformers": transformers.__version__, "runs": {}}
    for key, prompt in spec["prompts"].items():
        ids = torch.tensor(prompt)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, use_cache=True)
            prefill = time.perf_counter() - start
            clock = StepClock()
            start = time.perf_counter()
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=spec["max_new_tokens"],
                min_new_tokens=spec["max_new_tokens"],
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
            )
            total = time.perf_counter() - start
        steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]
        out["runs"][key] = {
            "prefill_seconds": prefill,
            "generate_seconds": total,
            "generate_prefill_seconds": clock.stamps[0] - start,
            "step_seconds": steps,
            "decode_tokens_per_second": len(prompt) * len(steps) / sum(steps) if steps else 0.0,
            "tokens": gen[:, ids.shape[1] :].tolist(),
        }
        print(f"  transformers batch {len(prompt)}: done in {total:.1f} s", file=sys.stderr, flush=True)
    Path(json_out).write_text(json.dumps(out))


# ---------------------------------------------------------------- the driver


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


def run_cmd(cmd: list[str], timeout: float) -> float:
    start = time.perf_counter()
    proc = run_group(cmd, timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return time.perf_counter() - start


def k3dist_generate(world: int, batch: int, args, out: Path) -> dict:
    cmd = [
        sys.executable,
        "launch.py",
        f"dist.nproc={world}",
        f"generate.batch={batch}",
        f"generate.prompt_len={args.prompt_len}",
        f"generate.max_new_tokens={args.max_new_tokens}",
        "generate.temperature=0",
        f"out={out}",
    ]
    wall = run_cmd(cmd, args.timeout)
    return json.loads(out.read_text()) | {"wall": wall}


def short_error(exc: Exception) -> str:
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"timeout (> {exc.timeout:.0f} s)"
    return "failed: " + str(exc).strip().splitlines()[-1][:80].replace("|", "/")


def seeded_prompts(batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """The ids k3dist draws when generate.prompt is null (k3dist.job.prompts): the same draw, checked against it."""
    import torch

    vocab = json.loads(CONFIG.read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()


def percentile(values: list[float], q: float) -> float:
    ms = sorted(v * 1e3 for v in values)
    return ms[min(int(q * len(ms)), len(ms) - 1)] if ms else 0.0


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """Greedy tokens equal before the first divergence, summed over sequences, of the total."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        same, total = same + k, total + max(len(x), len(y))
    return f"{same}/{total}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=240, help="seconds allowed to each k3dist run (peer: per batch)")
    ap.add_argument("--out-md", type=Path, default=RESULTS / "decode.md")
    ap.add_argument("--worker", choices=["peer"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "peer":
        peer_worker(args.model_dir, args.spec, args.json_out)
        return

    from k3dist.weights.twin import ensure_twin

    twin = ensure_twin(CONFIG)
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-decode-"))
    load_before = os.getloadavg()
    started = time.perf_counter()

    k3: dict[tuple[int, int], dict] = {}  # a point that failed or timed out holds {"error": ...}
    for w in args.worlds:
        for b in args.batches:
            load_avg = os.getloadavg()[0]
            try:
                r = k3dist_generate(w, b, args, tmp / f"k3-w{w}-b{b}.json")
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                k3[w, b] = {"error": short_error(exc), "load_avg": load_avg}
                print(f"  k3dist world {w} batch {b}: FAILED {k3[w, b]['error']}", flush=True)
                continue
            if r["model_dir"] != str(twin):
                raise RuntimeError(f"k3dist ran {r['model_dir']}, expected {twin}")
            k3[w, b] = r | {"load_avg": load_avg}
            print(
                f"  k3dist world {w} batch {b}: prefill {r['prefill_seconds']:.2f} s, "
                f"decode {r['decode_tokens_per_second']:.2f} tok/s, wall {r['wall']:.1f} s",
                flush=True,
            )
    prompts = {}
    for b in args.batches:
        expected = seeded_prompts(b, args.prompt_len)
        for w in args.worlds:
            if "prompt" in k3[w, b] and k3[w, b]["prompt"] != expected:
                raise RuntimeError(f"k3dist world {w} batch {b} used other prompt ids than its seeded draw")
        prompts[str(b)] = expected

    spec = tmp / "peer-spec.json"
    spec.write_text(json.dumps({"prompts": prompts, "max_new_tokens": args.max_new_tokens}))
    peer_out = tmp / "peer.json"
    peer_load_avg = os.getloadavg()[0]
    try:
        peer_wall = run_cmd(
            [
                sys.executable,
                __file__,
                "--worker",
                "peer",
                "--model-dir",
                str(twin),
                "--spec",
                str(spec),
                "--json-out",
                str(peer_out),
            ],
            args.timeout * (1 + len(args.batches)),
        )
        peer = json.loads(peer_out.read_text())
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        peer_wall, peer = float("nan"), {"threads": "?", "transformers": "?", "runs": {}, "error": short_error(exc)}
        print(f"  transformers: FAILED {peer['error']}", flush=True)
    for b in args.batches:
        if str(b) in peer["runs"]:
            p = peer["runs"][str(b)]
            print(
                f"  transformers batch {b}: prefill {p['prefill_seconds']:.2f} s, "
                f"decode {p['decode_tokens_per_second']:.2f} tok/s",
                flush=True,
            )

    cpus = len(os.sched_getaffinity(0))
    header = [
        "system",
        "world",
        "threads/rank",
        "batch",
        "prefill s",
        "decode tok/s",
        "step p50 ms",
        "step p90 ms",
        "prefill / peer",
        "tok/s / peer",
        "greedy = peer",
        "load avg",
    ]
    rows = []
    for b in args.batches:
        p = peer["runs"].get(str(b))
        for w in args.worlds:
            r = k3[w, b]
            if "error" in r:
                rows.append(
                    ["k3dist", str(w), str(max(1, cpus // w)), str(b), r["error"], *[""] * 6, f"{r['load_avg']:.1f}"]
                )
                continue
            rows.append(
                [
                    "k3dist",
                    str(w),
                    str(max(1, cpus // w)),
                    str(b),
                    f"{r['prefill_seconds']:.2f}",
                    f"{r['decode_tokens_per_second']:.2f}",
                    f"{r['step_ms']['p50']:.0f}",
                    f"{r['step_ms']['p90']:.0f}",
                    f"{r['prefill_seconds'] / p['prefill_seconds']:.2f}" if p else "n/a",
                    f"{r['decode_tokens_per_second'] / p['decode_tokens_per_second']:.2f}" if p else "n/a",
                    agreement(r["tokens"], p["tokens"]) if p else "n/a",
                    f"{r['load_avg']:.1f}",
                ]
            )
        if p is None:
            rows.append(["transformers", "1", str(peer["threads"]), str(b), peer.get("error", "missing"), *[""] * 7])
            continue
        rows.append(
            [
                "transformers",
                "1",
                str(peer["threads"]),
                str(b),
                f"{p['prefill_seconds']:.2f}",
                f"{p['decode_tokens_per_second']:.2f}",
                f"{percentile(p['step_seconds'], 0.5):.0f}",
                f"{percentile(p['step_seconds'], 0.9):.0f}",
                "1.00",
                "1.00",
                "",
                f"{peer_load_avg:.1f}",
            ]
        )
    inner = ", ".join(f"b{b} {r['generate_prefill_seconds']:.2f} s" for b, r in peer["runs"].items()) or "n/a"
    walls = ", ".join(f"w{w} b{b} {r['wall']:.1f}" for (w, b), r in k3.items() if "wall" in r)
    notes = [
        f"twin `{twin.name}`, bf16, prompt_len {args.prompt_len} (the seeded random ids k3dist draws, the same ids "
        f"fed to transformers), max_new_tokens {args.max_new_tokens}, greedy; one run per point.",
        f"threads: k3dist ranks split the {cpus} cores (`cpu_count // nproc` each); transformers uses torch's default "
        f"({peer['threads']}) in one process.",
        "`prefill s`: k3dist `prefill_seconds` (the first forward of the job, one-time warm-up included) / "
        "transformers: one forward over the prompt right after from_pretrained, also its first "
        f"(the prefill inside generate then took {inner}).",
        "`decode tok/s` = batch x decode steps / seconds of those steps (k3dist: result.json; transformers: time "
        "between successive logits-processor calls inside generate). Ratios are k3dist / transformers: "
        "prefill below 1 and tok/s above 1 favour k3dist.",
        "`greedy = peer`: tokens equal before the first divergence from transformers, summed over sequences "
        "(bf16 on both sides, so late divergence on near-ties is expected).",
        "`load avg`: the machine's 1-minute load average when the point started; above the core count, threads "
        "of this benchmark wait for other work and times grow (a 2-thread process suffers most).",
        f"wall of each k3dist command, s: {walls}; transformers process (load + all batches): {peer_wall:.1f}.",
        f"machine: {cpus} CPUs, {platform.machine()}, python {platform.python_version()}, transformers "
        f"{peer['transformers']}, commit {git_rev()}; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after (the machine is shared: expect noise).",
    ]
    text = (
        f"## Decode: k3dist vs transformers generate ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
        f"{md_table(header, rows)}\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    )
    publish(text, args.out_md, started)
    shutil.rmtree(tmp, ignore_errors=True)  # kept when the run fails, for its result.json files


if __name__ == "__main__":
    main()
