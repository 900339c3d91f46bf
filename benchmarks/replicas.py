"""Replicas behind the SGLang Model Gateway: `cache_aware` against `round_robin` on multi-turn chats (issue 42).

    python benchmarks/replicas.py               # 2 replicas, 16 conversations x 4 turns, 3 interleaved repeats
    python benchmarks/replicas.py --quick       # 4 conversations x 2 turns over short documents, 1 repeat

N replicas (world 1 each, the bf16 twin, each pinned to its own core when there are enough) behind `smg launch`
(the test extra's wheel, on 127.0.0.1), and the same workload against one replica alone: its share of prompt tokens
reused is the ceiling a router can reach. Every conversation opens with a shared system prompt and a long document
of its own (the document is most of the first turn's text, so that `cache_aware`'s 30% character match does not
pull every new conversation onto the replica that served the first), then asks --turns short questions, each turn
sent once the answer before it has come back (greedy, --answer-tokens tokens, streamed). All conversations run at
once. Each run starts its replicas afresh, so no run reuses what another cached; the runs interleave (single,
cache_aware, round_robin, rotated every repeat) and the table gives the medians over the repeats.

Per mode: the share of prompt tokens restored from prefix snapshots, from the replicas' own /metrics
(`k3dist_prefix_tokens_reused` over `k3dist_prompt_tokens_total`), TTFT p50 and p90 of turns 2 to the last (the
turns a router can send where their history is), output tokens per second of the run.

Memory: each replica's prefix pool is --prefix-mib (prefix.bytes), sized so that one replica holds the snapshots of
about half the conversations (a snapshot of the twin at 1,700 tokens is 4.5 MiB); the single replica, the ceiling,
gets the fleet's whole pool (--replicas times it). That is where routing matters: with a pool that holds every
conversation on every replica (prefix.bytes=1GiB), `round_robin` finds a history on either replica by turn 3 and
the later turns' TTFT differs by the turn-2 misses alone (BENCHMARKS.md has both). Targets: `cache_aware`'s
share at least 0.9 of one replica's, its TTFT p50 of the later turns at least 2x lower than `round_robin`'s. A PNG of
TTFT p50 by turn per mode goes beside the table.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/ is the script dir; common puts the repo root on sys.path)
from serve import Server, make_prompts, one_request  # noqa: E402

from tests.support.gateway import SMG, Gateway  # noqa: E402

NAME = "k3-twin"  # not "Kimi...": the gateway would give it its Kimi sampling profile (docs/serving.md)
DEFAULTS = dict(conversations=16, turns=4, doc_tokens=1500, system_tokens=150, question_tokens=16, repeats=3)
QUICK = dict(conversations=4, turns=2, doc_tokens=300, system_tokens=40, question_tokens=8, repeats=1)
TARGET_SHARE, TARGET_TTFT = 0.9, 2.0
# the gateway as its users run it, but registering replicas every second (default 30 s) and leaving at once
GATEWAY_FLAGS = ("--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1")


def workload(args, twin: Path) -> list[dict]:
    """Per conversation: its document and its questions (seeded text of the twin's tokenizer), the system prompt
    shared by all."""
    system = make_prompts(twin, 1, args.system_tokens, args.seed)[0]
    docs = make_prompts(twin, args.conversations, args.doc_tokens, args.seed + 1)
    asks = make_prompts(twin, args.conversations * args.turns, args.question_tokens, args.seed + 2)
    return [
        {"system": system, "doc": doc, "asks": asks[i * args.turns : (i + 1) * args.turns]}
        for i, doc in enumerate(docs)
    ]


def replica_cmd(args, twin: Path, port: int, run_dir: Path, core: int | None, pool_mib: int) -> list[str]:
    # an answer's text, sent back as the next turn's history, may tokenize to more tokens than were generated
    cap = args.system_tokens + args.doc_tokens + args.turns * (args.question_tokens + 4 * args.answer_tokens + 32) + 128
    pin = ["taskset", "-c", str(core)] if core is not None else []
    return [
        *pin,
        sys.executable,
        "launch.py",
        "run.mode=serve",
        "model.dtype=bfloat16",
        f"model.path={twin}",
        f"serve.port={port}",
        f"serve.model_name={NAME}",
        f"generate.batch={args.batch}",
        f"cache.cap={cap}",
        f"prefix.bytes={pool_mib}MiB",
        "hydra.output_subdir=null",
        f"hydra.run.dir={run_dir}",
        *args.k3dist_args,
    ]


async def conversation(client: httpx.AsyncClient, url: str, args, conv: dict) -> list[dict]:
    """The conversation's turns in order, each sent once the one before it has been answered."""
    messages, turns = [{"role": "system", "content": conv["system"]}], []
    for t, ask in enumerate(conv["asks"]):
        messages.append({"role": "user", "content": f"{conv['doc']}\n\n{ask}" if t == 0 else ask})
        body = {"model": NAME, "messages": messages, "max_tokens": args.answer_tokens, "temperature": 0.0}
        body |= {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        out = await one_request(client, url, body)
        turns.append(out | {"turn": t + 1})
        messages = messages + [{"role": "assistant", "content": out["text"]}]
    return turns


async def drive(url: str, args, convs: list[dict]) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=len(convs) + 2, max_keepalive_connections=len(convs) + 2)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, trust_env=False) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(conversation(client, url + "/v1/chat/completions", args, c) for c in convs))
        return [t for turns in done for t in turns], time.perf_counter() - start


def prefix_counts(server: Server) -> tuple[float, float]:
    """(prompt tokens admitted, prompt tokens restored from snapshots) from the server's /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=10, trust_env=False).text
    values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("k3dist_"))
    return float(values["k3dist_prompt_tokens_total"]), float(values["k3dist_prefix_tokens_reused"])


def one_run(args, mode: str, twin: Path, convs: list[dict], tmp: Path) -> dict:
    """Fresh replicas (and the gateway unless `mode` is single), the workload once, everything stopped again."""
    count = 1 if mode == "single" else args.replicas
    cores = sorted(os.sched_getaffinity(0))
    servers = []
    for i in range(count):
        port = common.free_port()
        core = cores[i] if len(cores) >= count and not args.no_pin else None
        pool = args.prefix_mib * (args.replicas if mode == "single" else 1)  # single: the fleet's whole pool in one
        cmd = replica_cmd(args, twin, port, tmp / f"{mode}-{i}", core, pool)
        servers.append(Server(f"{mode}-replica{i}", cmd, f"http://127.0.0.1:{port}", tmp))
    gateway = None
    try:
        for s in servers:
            s.start(args.timeout)
            # its first request loads its kernels; its decode rate (gen_throughput, which the gateway weighs
            # replicas by) is measured over more than a few steps
            warm = {"model": NAME, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 32}
            warm["ignore_eos"] = True
            httpx.post(s.url + "/v1/chat/completions", json=warm, timeout=args.timeout, trust_env=False)
        before = [prefix_counts(s) for s in servers]
        url = servers[0].url
        if mode != "single":
            flags = GATEWAY_FLAGS + tuple(args.gateway_args)
            gateway = Gateway([s.url for s in servers], tmp / f"smg-{mode}-{time.time_ns()}.log", mode, flags)
            gateway.ready(args.timeout)
            gateway.wait_loads(args.timeout)  # as in a gateway that has run a while: it knows every replica's load
            url = gateway.base
        turns, seconds = asyncio.run(drive(url, args, convs))
        after = [prefix_counts(s) for s in servers]
    finally:
        if gateway is not None:
            gateway.stop()
        for s in servers:
            s.stop()
    prompt = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    reused = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ok = [t for t in turns if "error" not in t]
    later = sorted(t["ttft"] for t in ok if t["turn"] > 1)
    by_turn = {
        n: statistics.median([t["ttft"] for t in ok if t["turn"] == n] or [0.0]) for n in range(1, args.turns + 1)
    }
    run = {"mode": mode, "seconds": seconds, "failures": len(turns) - len(ok), "share": reused / prompt}
    run |= {"ttft_p50": _pct(later, 50), "ttft_p90": _pct(later, 90), "tok_s": sum(t["tokens"] for t in ok) / seconds}
    run |= {"by_turn": by_turn, "errors": sorted({t["error"] for t in turns if "error" in t})[:3]}
    run |= {"warnings": gateway.warnings()[:5] if gateway else []}
    return run


def _pct(xs: list[float], q: int) -> float | None:
    return float(statistics.quantiles(xs, n=100, method="inclusive")[q - 1]) if len(xs) > 1 else (xs or [None])[0]


def summary(runs: list[dict], modes: list[str]) -> dict[str, dict]:
    """Per mode, the median over its repeats of each figure."""
    out = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        keys = ("share", "ttft_p50", "ttft_p90", "tok_s")
        out[mode] = {k: statistics.median([r[k] for r in rs if r[k] is not None]) for k in keys}
        out[mode]["by_turn"] = {n: statistics.median([r["by_turn"][n] for r in rs]) for n in rs[0]["by_turn"]}
        out[mode] |= {"failures": sum(r["failures"] for r in rs), "repeats": len(rs)}
    return out


def plot(med: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (mode, m) in enumerate(med.items()):
        turns = sorted(m["by_turn"])
        ax.plot(turns, [m["by_turn"][t] for t in turns], marker="o", color=f"C{i}", label=mode)
    ax.set(xlabel="turn", ylabel="TTFT p50 (s)", title=title, ylim=(0, None), xticks=turns)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def table(med: dict) -> tuple[str, list[str]]:
    single = med["single"]["share"]
    rows = []
    for mode, m in med.items():
        share = f"{m['share']:.2f}" + (f" ({m['share'] / single:.2f} of single)" if mode != "single" and single else "")
        rows.append(
            [mode, share, f"{m['ttft_p50']:.2f}", f"{m['ttft_p90']:.2f}", f"{m['tok_s']:.1f}", str(m["failures"])]
        )
    head = ["mode", "prompt tokens reused", "TTFT p50 turns 2+ (s)", "TTFT p90 turns 2+ (s)", "out tok/s", "failures"]
    checks = []
    if "cache_aware" in med and single:
        ratio = med["cache_aware"]["share"] / single
        checks.append(
            f"cache_aware reuse {ratio:.2f} of one replica's (target >= {TARGET_SHARE}): {_met(ratio >= TARGET_SHARE)}"
        )
    if "cache_aware" in med and "round_robin" in med:
        speed = med["round_robin"]["ttft_p50"] / med["cache_aware"]["ttft_p50"]
        met = _met(speed >= TARGET_TTFT)
        checks.append(f"round_robin / cache_aware TTFT p50 of turns 2+ {speed:.2f}x (target >= {TARGET_TTFT}): {met}")
    return common.md_table(head, rows), checks


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2, help="replicas behind the gateway (world 1 each)")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"], help="smg --policy values")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--doc-tokens", type=int, help="each conversation's document, tokens")
    ap.add_argument("--system-tokens", type=int, help="the shared system prompt, tokens")
    ap.add_argument("--question-tokens", type=int, help="each question, tokens")
    ap.add_argument("--answer-tokens", type=int, default=32, help="max_tokens of every answer (ignore_eos)")
    ap.add_argument("--batch", type=int, default=4, help="generate.batch of each replica")
    ap.add_argument("--repeats", type=int, help="interleaved runs of every mode")
    ap.add_argument("--no-pin", action="store_true", help="do not pin each replica to a core of its own")
    ap.add_argument("--k3dist-args", nargs="*", default=[], help="more overrides for every replica")
    ap.add_argument("--gateway-args", nargs="*", default=[], help="more smg flags (e.g. --cache-threshold 0.5)")
    ap.add_argument(
        "--prefix-mib",
        type=int,
        default=112,
        help="each replica's prefix.bytes (MiB); the single replica, the ceiling, gets --replicas times it",
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: " + json.dumps(QUICK))
    ap.add_argument("--seed", type=int, default=0)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "replicas.md"
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        setattr(args, key, getattr(args, key) or value)
    if not SMG.exists():
        print(f"{SMG} is missing: pip install 'smg>=1.13,<1.14' (the test extra)")
        return 2

    started, cores = time.perf_counter(), len(os.sched_getaffinity(0))
    pinned = not args.no_pin and cores >= args.replicas
    m = common.machine("1 per replica (pinned to a core each)" if pinned else f"{cores} per replica (unpinned)")
    twin, tmp = common.twin_dir(), Path(tempfile.mkdtemp(prefix="k3bench-replicas-"))
    convs = workload(args, twin)
    modes = ["single", *args.policies]
    runs = []
    for rep in range(args.repeats):
        for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            run = one_run(args, mode, twin, convs, tmp) | {"repeat": rep}
            runs.append(run)
            line = f"reused {run['share']:.2f}, TTFT p50 turns 2+ {common.fmt(run['ttft_p50'])} s, "
            line += f"{run['tok_s']:.1f} tok/s, {run['failures']} failures {run['errors'] or ''} {run['seconds']:.0f} s"
            print(f"  r{rep} {mode}: {line}", flush=True)
            common.save_partial(args, {i: r for i, r in enumerate(runs)})
    med = summary(runs, modes)
    text, checks = table(med)
    png = args.out_md.with_suffix(".png")
    plot(med, png, f"{args.replicas} replicas, {args.conversations} conversations x {args.turns} turns")
    notes = checks + [
        f"{args.conversations} conversations x {args.turns} turns at once; each opens with a system prompt of "
        f"{args.system_tokens} tokens shared by all and a document of {args.doc_tokens} of its own, then asks "
        f"{args.question_tokens}-token questions; answers {args.answer_tokens} tokens, greedy, streamed",
        f"each replica: world 1, bf16 twin, generate.batch={args.batch}, prefix reuse on (its default in a server), "
        f"prefix.bytes={args.prefix_mib}MiB each (single: {args.replicas * args.prefix_mib}MiB, the fleet's pool), "
        f"{'its own core' if pinned else 'the cores unpinned'}; single = one replica, no gateway (the reuse ceiling)",
        f"smg {common.version_of('smg')}, default flags but {' '.join(GATEWAY_FLAGS + tuple(args.gateway_args))}; "
        "fresh replicas every run; "
        f"medians of {args.repeats} interleaved repeats; TTFT p50 by turn: {png.name}",
        "gateway warnings: " + ("; ".join(sorted({w for r in runs for w in r["warnings"]})) or "none"),
    ]
    data = {"runs": runs, "medians": med, "args": {k: v for k, v in vars(args).items() if k not in ("json", "out_md")}}
    common.publish(args, f"Replicas behind the SGLang Model Gateway ({args.replicas})", [text], notes, m, data, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
