"""Soak: a k3dist server under a public endpoint's mix of traffic for a given time, every rank's memory sampled.

    python benchmarks/soak.py                                    # world 2, prefix reuse on, 600 s
    python benchmarks/soak.py --runs 2:on 2:off 2:off:100 1:on   # the table in BENCHMARKS.md (4 x 10 min)
    python benchmarks/soak.py --runs 1:off --seconds 60          # a quick look

A run is `WORLD:PREFIX[:WORDS][,OVERRIDE...]`: dist.nproc, prefix.enabled (on/off), optionally one prompt length
(every chat WORDS words) and more overrides for that server (`2:on,prefix.bytes=256MiB`). Each run starts the server
on the bf16 twin (`generate.batch=4 cache.cap=2048` by default) and has --clients clients send, until --seconds are
up: chats of 3 to 300 words with budgets of 1-64 tokens, greedy and seeded, whole or streamed; streams dropped after
a few chunks; clients that give up after 0.2 s; malformed bodies; streamed completions with n=2. Every answer is
checked (a failure is anything but the expected answer or refusal). Every --sample-s each rank's resident set is
read from /proc, and from /metrics what the server itself reports.

Per run: requests answered, refused (the malformed ones, each with an error envelope), dropped or given up by their
client, failures, the gauges once the clients are done, the server's exit and whether any rank outlived it, and per
rank its worst resident set minus a bare interpreter (python with torch imported) against the plan's `admitted`,
and how much the resident set grew over the last half of the run (also less the prefix pool's bytes: snapshots fill
a pool the plan counts whole, so a pool still filling is growth the plan admitted). A PNG of resident set against
time per run goes beside the table in benchmarks/results/. Exit 1 when a run failed a bar: 0 failures, within
`admitted` at every sample, less than 3% growth over the last half.
"""

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serve import Server  # noqa: E402  (benchmarks/serve.py: a server subprocess, started and stopped cleanly)

MiB = 2**20
GROWTH_BAR = 0.03  # the bar: less than 3% growth over the last half (the last 5 minutes of 10)
MIX = {"chat": 35, "stream": 15, "drop": 15, "give_up": 10, "bad": 10, "n2": 15}  # weights of the request kinds
HI = '{"messages": [{"role": "user", "content": "hi"}]'
BAD = ['"max_tokens": "4"', '"temperature": -1', '"max_tokens": 100000', '"model": "no-such-model"']
BAD_BODIES = [b"{not json", b'{"messages": "hi"}', b"[1, 2, 3]", b'{"messages": [{"role": "user<|im_end|>"}]}']
BAD_BODIES += [f"{HI}, {field}}}".encode() for field in BAD]  # each refused with a 400 naming the field


def corpus_words() -> list[str]:
    text = (common.ROOT / "k3dist" / "twin" / "corpus.txt").read_text()
    return [w for w in text.split() if w.isascii() and w.isalpha()]


class Mix:
    """One client's requests: each kind sent and its answer checked; tallies what happened."""

    def __init__(self, url: str, model: str | None, words: list[str], fixed_words: int | None, seed: int):
        self.url, self.model, self.words, self.fixed = url, model, words, fixed_words
        self.rng = random.Random(seed)
        self.counts = {"answered": 0, "refused": 0, "dropped": 0, "gave_up": 0, "failures": 0}
        self.errors: list[str] = []

    def _text(self) -> str:
        return " ".join(self.rng.choices(self.words, k=self.fixed or self.rng.randint(3, 300)))

    def _chat(self, **extra) -> dict:
        body = {"messages": [{"role": "user", "content": self._text()}], "max_tokens": self.rng.randint(1, 64)}
        if self.rng.random() < 0.5:
            body |= {"temperature": 0.0}
        else:
            body |= {"temperature": 0.8, "seed": self.rng.randrange(2**31)}
        return body | ({"model": self.model} if self.model else {}) | extra

    def fail(self, why: str) -> None:
        self.counts["failures"] += 1
        if len(self.errors) < 5:
            self.errors.append(why[:200])

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        try:
            await getattr(self, kind)(client)
        except httpx.TimeoutException:
            self.fail(f"{kind}: timed out")
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            self.fail(f"{kind}: {type(exc).__name__}: {exc}")

    async def chat(self, client) -> None:
        r = await client.post(self.url + "/v1/chat/completions", json=self._chat())
        body = r.json()
        choice = body["choices"][0] if r.status_code == 200 else None
        if choice and isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length"):
            self.counts["answered"] += 1
        else:
            self.fail(f"chat: {r.status_code} {r.text[:150]}")

    async def _events(self, response):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                yield line[6:]

    async def stream(self, client) -> None:
        body = self._chat(stream=True)
        finished = False
        async with client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return self.fail(f"stream: {r.status_code}")
            async for data in self._events(r):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return self.fail(f"stream: {data[:150]}")
                finished = finished or any(c.get("finish_reason") for c in chunk["choices"])
        self.counts["answered" if finished else "failures"] += 1

    async def drop(self, client) -> None:
        body = self._chat(stream=True, max_tokens=self.rng.randint(16, 64))
        chunks = self.rng.randint(1, 3)
        async with client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return self.fail(f"drop: {r.status_code}")
            async for _ in self._events(r):
                chunks -= 1
                if chunks == 0:
                    break  # leaving the block closes the connection mid-stream
        self.counts["dropped"] += 1

    async def give_up(self, client) -> None:
        try:
            r = await client.post(self.url + "/v1/chat/completions", json=self._chat(max_tokens=64), timeout=0.2)
        except httpx.TimeoutException:
            self.counts["gave_up"] += 1
            return
        self.counts["answered" if r.status_code == 200 else "failures"] += 1

    async def bad(self, client) -> None:
        raw = self.rng.choice(BAD_BODIES)
        r = await client.post(
            self.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
        if 400 <= r.status_code < 500 and isinstance(error, dict) and error.get("message"):
            self.counts["refused"] += 1
        else:
            self.fail(f"bad body {raw[:40]!r}: {r.status_code} {r.text[:100]}")

    async def n2(self, client) -> None:
        body = {"prompt": self._text(), "max_tokens": self.rng.randint(1, 32), "n": 2, "stream": True}
        body |= {"temperature": 0.8, "seed": self.rng.randrange(2**31)} | ({"model": self.model} if self.model else {})
        ended = set()
        async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return self.fail(f"n2: {r.status_code}")
            async for data in self._events(r):
                if data == "[DONE]":
                    break
                for c in json.loads(data)["choices"]:
                    if c.get("finish_reason"):
                        ended.add(c["index"])
        self.counts["answered" if ended == {0, 1} else "failures"] += 1


def resident(pid: int) -> int | None:
    try:
        return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1]) * 1024
    except (OSError, TypeError):
        return None


def gauges(base_url: str) -> dict[str, float]:
    """/metrics samples by name, with the rank label kept: `k3dist_rank_resident_bytes{rank="1"}` -> its value."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    return {name: float(value) for name, value in re.findall(r"^(k3dist_[^ ]+) (\S+)$", text, re.M)}


def rank_pids(server: Server) -> list[int]:
    match = re.search(r"rank pids ([\d ]+)\)", server.log.read_text())
    return [int(p) for p in match.group(1).split()] if match else []


async def drive(args, server: Server, pids: list[int], fixed_words: int | None) -> dict:
    """The clients until the deadline, and the sampler beside them; then the gauges once the clients are done."""
    words, start = corpus_words(), time.monotonic()
    deadline = start + args.seconds
    mixes = [Mix(server.url, server.model, words, fixed_words, seed) for seed in range(args.clients)]
    samples: list[dict] = []

    def sample() -> None:
        point = {"t": time.monotonic() - start, "rss": [resident(p) for p in pids]}
        try:
            point["metrics"] = gauges(server.url)
        except httpx.HTTPError:
            point["metrics"] = {}
        samples.append(point)
        ranks = " ".join(f"{(r or 0) / MiB:.0f}" for r in point["rss"])
        print(f"  {point['t']:6.0f} s  rank RSS MiB {ranks}", flush=True)

    async def client(mix: Mix) -> None:
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=0)  # a fresh connection per request
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as c:
            while time.monotonic() < deadline:
                await mix.one(c)

    async def sampler() -> None:
        while time.monotonic() < deadline:
            await asyncio.to_thread(sample)
            await asyncio.sleep(max(0.0, min(args.sample_s, deadline - time.monotonic())))

    await asyncio.gather(sampler(), *(client(m) for m in mixes))
    await asyncio.sleep(2)  # aborted requests leave at the next window
    await asyncio.to_thread(sample)
    counts = {k: sum(m.counts[k] for m in mixes) for k in mixes[0].counts}
    errors = [e for m in mixes for e in m.errors][:5]
    return {"counts": counts, "errors": errors, "samples": samples}


def growth(samples: list[dict], rank: int, less_pool: bool = False) -> float | None:
    """How much the resident set grew over the last half of the traffic: a least-squares line through the samples
    of that half (one sample is noisy: a prefill's activations come and go), its end over its start, minus 1.
    `less_pool`: the samples less the prefix pool's bytes then held (snapshots fill a pool the plan counts whole)."""
    pool = lambda s: s["metrics"].get("k3dist_prefix_bytes_held", 0) if less_pool else 0  # noqa: E731
    points = [(s["t"], s["rss"][rank] - pool(s)) for s in samples[:-1] if s["rss"][rank]]  # the last: clients done
    half = [(t, y) for t, y in points if t >= points[-1][0] / 2] if points else []
    if len(half) < 3:
        return None
    tm, ym = sum(t for t, _ in half) / len(half), sum(y for _, y in half) / len(half)
    slope = sum((t - tm) * (y - ym) for t, y in half) / sum((t - tm) ** 2 for t, _ in half)
    start = ym + slope * (half[0][0] - tm)
    return slope * (half[-1][0] - half[0][0]) / start


def stop(server: Server, pids: list[int]) -> tuple[str, list[int]]:
    """SIGTERM to the server's process group; its exit code, and the ranks still alive 5 s after it (then killed)."""
    start = time.perf_counter()
    os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        end = f"SIGTERM: exit {server.proc.wait(60)} in {time.perf_counter() - start:.1f} s"
    except subprocess.TimeoutExpired:
        end = "SIGTERM: no exit in 60 s"
    deadline = time.monotonic() + 5
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    server.stop()  # whatever is left of the group: killed
    return end, left


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def one_run(args, spec: str, twin: Path, tmp: Path, bare: int) -> dict:
    """`spec`: WORLD:PREFIX[:WORDS][,override ...]."""
    head, *overrides = spec.split(",")
    world, prefix, *fixed = head.split(":")
    fixed_words = int(fixed[0]) if fixed else None
    port, run_dir = common.free_port(), tmp / re.sub(r"[^\w.-]", "-", spec)
    cmd = [sys.executable, "launch.py", "run.mode=serve", "model.dtype=bfloat16", f"model.path={twin}"]
    cmd += ["serve.host=127.0.0.1", f"serve.port={port}", f"dist.nproc={world}", f"generate.batch={args.batch}"]
    cmd += [f"cache.cap={args.cap}", f"prefix.enabled={prefix}", f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"]
    run_dir.mkdir(parents=True)
    server = Server(f"k3dist {spec}", cmd + overrides + args.k3dist_args, f"http://127.0.0.1:{port}", run_dir)
    print(f"run {spec}: {' '.join(server.cmd[1:])}", flush=True)
    pids, stopped = [], None
    try:
        server.start(args.timeout)
        pids = rank_pids(server)
        out = asyncio.run(drive(args, server, pids, fixed_words))
        stopped, left = stop(server, pids)
    finally:
        if stopped is None:
            server.stop()
    return derive(out | {"spec": spec, "pids": pids, "stopped": stopped, "left": left}, bare)


def derive(run: dict, bare: int) -> dict:
    """The run's figures from its samples: admitted, worst held, samples past admitted, growth, gauges after."""
    samples, ranks = run["samples"], range(len(run["pids"]))
    last = samples[-1]["metrics"]
    admitted = [last.get(f'k3dist_rank_admitted_bytes{{rank="{r}"}}') for r in ranks]
    over = [s["t"] for s in samples for r in ranks if admitted[r] and (s["rss"][r] or 0) - bare > admitted[r]]
    return run | {
        "admitted": admitted,
        "worst": [max(s["rss"][r] or 0 for s in samples) - bare for r in ranks],
        "over_at": over,
        "growth": [growth(samples, r) for r in ranks],
        "growth_less_pool": [growth(samples, r, less_pool=True) for r in ranks],
        "pool_held": last.get("k3dist_prefix_bytes_held"),
        "gauges_after": {k: last.get(f"k3dist_{k}") for k in ("requests_running", "requests_waiting", "slots_used")},
    }


def plot(run: dict, bare: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in range(len(run["pids"])):
        points = [(s["t"] / 60, s["rss"][r], s["metrics"].get("k3dist_prefix_bytes_held", 0)) for s in run["samples"]]
        points = [p for p in points if p[1]]
        ax.plot([p[0] for p in points], [p[1] / MiB for p in points], marker=".", color=f"C{r}", label=f"rank {r} RSS")
        if run["pool_held"]:
            ax.plot(
                [p[0] for p in points], [(p[1] - p[2]) / MiB for p in points], ":", color=f"C{r}", label="less pool"
            )
        if run["admitted"][r]:
            ax.axhline(
                (bare + run["admitted"][r]) / MiB, ls="--", color=f"C{r}", lw=1, label=f"rank {r}: bare + admitted"
            )
    ax.set(xlabel="minutes", ylabel="MiB", title=f"soak {run['spec']} (world:prefix[:words])", ylim=(0, None))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def row(run: dict) -> list[str]:
    c, mib = run["counts"], lambda xs: " / ".join("-" if x is None else f"{x / MiB:.0f}" for x in xs)
    pct = lambda xs: " / ".join("-" if x is None else f"{100 * x:+.1f}%" for x in xs)  # noqa: E731
    flat = lambda xs: all(x is not None and x < GROWTH_BAR for x in xs)  # noqa: E731
    ok = c["failures"] == 0 and not run["over_at"] and flat(run["growth"])
    net = c["failures"] == 0 and not run["over_at"] and flat(run["growth_less_pool"])
    return [
        run["spec"],
        str(c["answered"]),
        f"{c['refused']} / {c['dropped']} / {c['gave_up']}",
        str(c["failures"]),
        " ".join(f"{int(v)}" if v is not None else "-" for v in run["gauges_after"].values()),
        mib(run["worst"]) + " vs " + mib(run["admitted"]),
        pct(run["growth"]),
        pct(run["growth_less_pool"]) + f" ({(run['pool_held'] or 0) / MiB:.0f} MiB held)",
        run["stopped"] + (", ranks left: " + " ".join(map(str, run["left"])) if run["left"] else ", no process left"),
        "met" if ok else "NOT met" + (" (met less the prefix pool, filling then)" if net else ""),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=["2:on"], help="WORLD:PREFIX[:WORDS] per run (default 2:on)")
    ap.add_argument("--seconds", type=float, default=600, help="traffic per run (default 600)")
    ap.add_argument("--clients", type=int, default=12, help="concurrent clients (default 12)")
    ap.add_argument("--sample-s", type=float, default=10, help="seconds between memory samples (default 10)")
    ap.add_argument("--batch", type=int, default=4, help="generate.batch (default 4)")
    ap.add_argument("--cap", type=int, default=2048, help="cache.cap (default 2048)")
    ap.add_argument("--k3dist-args", nargs="*", default=[], help="more overrides for the server")
    ap.add_argument("--replot", type=Path, help="only the table and plots again, from an earlier run's --json")
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "soak.md"
    started, cores = time.perf_counter(), len(os.sched_getaffinity(0))
    m = common.machine(f"{cores} // world per rank")
    if args.replot:  # the measurements as they were, on the machine they were made on
        earlier = json.loads(args.replot.read_text())
        m, bare, todo = earlier["machine"] | {"threads": m["threads"]}, earlier["bare"], earlier["runs"]
        vars(args).update({k: earlier["args"][k] for k in ("runs", "seconds", "clients", "sample_s", "batch", "cap")})
    else:
        twin, tmp, bare = common.twin_dir(), Path(tempfile.mkdtemp(prefix="k3bench-soak-")), common.bare_torch_rss()
        todo = args.runs
    runs = []
    for spec in todo:
        try:
            run = derive(spec, bare) if args.replot else one_run(args, spec, twin, tmp, bare)
        except Exception as exc:  # noqa: BLE001 - the other runs still go
            print(f"  {spec}: {common.short_error(exc)}", flush=True)
            continue
        png = common.RESULTS / ("soak-" + re.sub(r"[^\w.]+", "-", run["spec"]) + ".png")
        plot(run, bare, png)
        run["png"] = str(png.relative_to(common.ROOT))
        print("  " + " | ".join(row(run)), flush=True)
        runs.append(run)
    head = ["run", "answered", "refused / dropped / gave up", "failures", "running waiting slots after"]
    head += ["worst RSS - bare vs admitted, MiB per rank", "growth, last half", "less the prefix pool", "server's end"]
    head += ["bars"]
    table = common.md_table(head, [row(r) for r in runs])
    notes = [
        f"{args.seconds:.0f} s per run, {args.clients} clients, bf16 twin, generate.batch={args.batch} "
        f"cache.cap={args.cap}; `run` is world:prefix.enabled[:words of every chat][,overrides]; bare interpreter "
        f"(python with torch imported) {bare / MiB:.0f} MiB; samples every {args.sample_s:.0f} s from /proc.",
        "bars: 0 failures, resident set minus the bare interpreter within `admitted` at every sample, growth over "
        f"the last half under {100 * GROWTH_BAR:.0f}% (a least-squares line through that half's samples under "
        "traffic); plots: " + ", ".join(f"`{r['png']}`" for r in runs),
        "errors: " + ("; ".join(e for r in runs for e in r["errors"]) or "none"),
    ] + (["re-rendered from the run's --json (the load average at end is the re-rendering's)"] if args.replot else [])
    data = {"args": vars(args), "bare": bare, "runs": runs}
    common.publish(args, "Soak: a server's memory under mixed traffic", [table], notes, m, data, started)
    ok = len(runs) == len(args.runs) and all(row(r)[-1] == "met" for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
