"""Serving benchmark: k3dist's OpenAI server vs `transformers serve` on the 0.40B twin (bf16), under load.

    python benchmarks/serve.py                   # concurrency 1 4 16, 32 requests of 128 + 32 tokens, 3 repeats
    python benchmarks/serve.py --quick           # smoke test: concurrency 1 4, 4 requests, 8 tokens, 1 repeat
    python benchmarks/serve.py --skip-peer --nproc 2 --batch 16
    python benchmarks/serve.py --structured       # k3dist alone: 8 json_schema streams vs 8 free ones (issue 22)

Both servers start once on 127.0.0.1 (free ports), are warmed up with one request and stay up; per concurrency the
points interleave, peer then k3dist, --repeats times, each point --requests streaming requests with at most
--concurrency in flight. Metrics as `vllm bench serve` defines them: TTFT = first non-empty text chunk, ITL = gaps
between successive text chunks (pooled), TPOT = (e2e - TTFT) / (output tokens - 1) per request, output tokens from
the stream's `usage` (text chunks counted where a server sends none). Ratios are k3dist / peer of the same repeat.
"""

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/ is the script dir; common puts the repo root on sys.path)

TARGET_TOK_S, TARGET_AT = 4.0, 16  # issue 16: output tok/s at concurrency 16 >= 4x the peer's
DEFAULTS = {"concurrency": [1, 4, 16], "requests": 32, "prompt_len": 128, "max_tokens": 32, "repeats": 3}
QUICK = {"concurrency": [1, 4], "requests": 4, "prompt_len": 32, "max_tokens": 8, "repeats": 1}
GRACE_S = 30  # SIGTERM -> SIGKILL: an idle server should be gone long before


class Server:
    """One OpenAI server: a subprocess in a session of its own (stopping the group ends its ranks too), or a URL."""

    def __init__(self, name: str, cmd: list[str] | None, url: str, log_dir: Path):
        self.name, self.cmd, self.url = name, cmd, url.rstrip("/")
        self.log = log_dir / (name.split()[0] + ".log")
        self.proc: subprocess.Popen | None = None
        self.model, self.error, self.ready_s, self.stopped = None, None, None, None

    def start(self, timeout: float) -> None:
        """Start it and wait for GET /health == 200, then read the model name from GET /v1/models."""
        start = time.perf_counter()
        if self.cmd:
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(
                    self.cmd, cwd=common.ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            common._live.append(self.proc)  # benchmarks/common.py's SIGTERM handler kills these groups
        while True:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode} before ready: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"not ready after {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.25)
        self.ready_s = time.perf_counter() - start
        try:  # the issue saw transformers serve answer 500 here; a request without `model` is served by both
            models = httpx.get(self.url + "/v1/models", timeout=10, trust_env=False)
            self.model = models.raise_for_status().json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            print(f"  {self.name}: GET /v1/models failed ({exc}); requests name no model", flush=True)

    def log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.exists() else []
        return " / ".join(lines[-3:])[-300:]

    def cpu_seconds(self) -> float:
        return common.group_cpu_seconds(self.proc.pid) if self.proc and self.proc.poll() is None else 0.0

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after GRACE_S; then signal again until no process of the group is left."""
        if not self.proc:
            self.stopped = "never started" if self.cmd else "not started here"
            return
        start, pgid = time.perf_counter(), self.proc.pid
        if self.proc.poll() is not None:
            self.stopped = f"had exited {self.proc.returncode} before the end"
        else:
            try:
                os.killpg(pgid, signal.SIGTERM)
                code = self.proc.wait(GRACE_S)
                end = f"exit {code}" if code >= 0 else f"ended by {signal.Signals(-code).name}"  # uvicorn re-raises
                self.stopped = f"SIGTERM: {end} in {time.perf_counter() - start:.1f} s"
            except subprocess.TimeoutExpired:
                self.stopped = f"SIGTERM: no exit in {GRACE_S} s"
            except ProcessLookupError:
                self.stopped = f"had exited {self.proc.wait()} before the end"
        for sig in (signal.SIGTERM, signal.SIGKILL):  # ranks outliving the launcher would keep the group alive
            try:
                os.killpg(pgid, sig)
                self.stopped += f"; {sig.name} to processes left in its group"
            except ProcessLookupError:
                break
            time.sleep(1)
        self.proc.wait()
        common._live.remove(self.proc)


def peer_cmd(twin: Path, port: int) -> list[str]:
    exe = Path(sys.executable).parent / "transformers"  # the CLI of the running venv's transformers
    return [str(exe), "serve", str(twin), *"--device cpu --dtype bfloat16 --host 127.0.0.1 --port".split(), str(port)]


def k3dist_cmd(args, twin: Path, port: int, run_dir: Path) -> list[str]:
    """The server as issue 16 specifies it (`run.mode=serve`, `serve.*`); cache.cap fits prompt + max_tokens."""
    cap = args.prompt_len + args.max_tokens + 64  # + the chat template's tokens and the tokenizers' slack
    cmd = f"run.mode=serve model.dtype=bfloat16 serve.host=127.0.0.1 serve.port={port} dist.nproc={args.nproc}"
    cmd += f" generate.batch={args.batch} cache.cap={cap} hydra.output_subdir=null"
    return [
        sys.executable,
        "launch.py",
        *cmd.split(),
        f"model.path={twin}",
        f"hydra.run.dir={run_dir}",
        *args.k3dist_args,
    ]


def make_prompts(twin: Path, n: int, length: int, seed: int) -> list[str]:
    """Seeded text of `length` tokens, the same for both servers: alphabetic words of the twin's corpus in random
    order (the weights are random, only the length matters). Only those: digits, punctuation and Han text tokenize
    differently in transformers' conversion of tiktoken.model (1% more tokens); these words give equal counts."""
    from k3dist.text.tokenizer import load_tokenizer

    tok = load_tokenizer(twin)
    words = [w for w in (common.ROOT / "k3dist" / "twin" / "corpus.txt").read_text().split() if w.isascii()]
    words, rng = [w for w in words if w.isalpha()], random.Random(seed)
    return [tok.decode(tok.encode(" ".join(rng.choices(words, k=2 * length)))[:length]) for _ in range(n)]


def payload(args, model: str | None, prompt: str) -> dict:
    """Only OpenAI fields: transformers serve answers 422 to any other (top_k, ignore_eos, min_tokens)."""
    body = ({"model": model} if model else {}) | {"max_tokens": args.max_tokens, "temperature": 0.0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if args.api == "chat":
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed request: TTFT, the gaps between text chunks, e2e, output tokens, finish reason, or its error."""
    out = {"ttft": None, "itl": [], "chunks": 0, "tokens": None, "prompt_tokens": None, "finish": None, "text": ""}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return out | {"error": f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"}
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return out | {"error": f"stream error: {str(chunk['error'])[:200]}"}
                choice = (chunk.get("choices") or [{}])[0]
                text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                now = time.perf_counter()
                if text:
                    if out["ttft"] is None:
                        out["ttft"] = now - start
                    else:
                        out["itl"].append(now - last)
                    last, out["chunks"], out["text"] = now, out["chunks"] + 1, out["text"] + text
                out["finish"] = choice.get("finish_reason") or out["finish"]
                if usage := chunk.get("usage"):
                    out["tokens"], out["prompt_tokens"] = usage["completion_tokens"], usage["prompt_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        return out | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out["e2e"], out["usage"] = time.perf_counter() - start, out["tokens"] is not None
    out["tokens"] = out["chunks"] if out["tokens"] is None else out["tokens"]  # no usage: count text chunks
    if out["ttft"] is None or out["finish"] is None:  # a stream cut short is a failure, not an early finish
        return out | {"error": "no text streamed" if out["ttft"] is None else "stream ended without finish_reason"}
    return out


async def run_load(args, server: Server, prompts: list[str], concurrency: int, timeout: float) -> tuple[list, float]:
    """Every prompt once, at most `concurrency` in flight (vllm's --max-concurrency, all queued at once)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        url = server.url + ("/v1/chat/completions" if args.api == "chat" else "/v1/completions")

        async def gated(prompt: str) -> dict:
            async with gate:
                return await one_request(client, url, payload(args, server.model, prompt))

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        return results, time.perf_counter() - start


def summarize(results: list[dict], seconds: float, max_tokens: int) -> dict:
    """One point's figures, the way `vllm bench serve` computes them (latencies in seconds)."""
    ok = [r for r in results if "error" not in r]
    ttft, itl = [r["ttft"] for r in ok], [g for r in ok for g in r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    out_tokens = sum(r["tokens"] for r in ok)
    s = {"seconds": seconds, "completed": len(ok), "failures": len(results) - len(ok)}
    s |= {"req_s": len(ok) / seconds, "tok_s": out_tokens / seconds, "output_tokens": out_tokens}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", [r["e2e"] for r in ok])):
        s |= {f"{name}_p{q}": float(np.percentile(xs, q)) if xs else None for q in (50, 99)}
    s["early"] = sum(r["tokens"] < max_tokens for r in ok)
    s["no_usage"] = sum(not r["usage"] for r in ok)
    s["tokens_per_chunk"] = out_tokens / max(1, sum(r["chunks"] for r in ok))
    s["prompt_tokens"] = sorted({r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None})
    s["errors"] = sorted({r["error"] for r in results if "error" in r})[:3]
    return s


COLUMNS = [("req_s", "req/s", 1, ".2f"), ("tok_s", "out tok/s", 1, ".1f")]
COLUMNS += [(f"{m}_{p}", f"{m.upper()} {p} ms", 1e3, ".0f") for m in ("ttft", "tpot", "itl") for p in ("p50", "p99")]


def median_of(points: list[dict], key: str) -> float | None:
    xs = [p[key] for p in points if p.get(key) is not None]
    return statistics.median(xs) if xs else None


def paired(k3: list[dict], peer: list[dict], key: str) -> list[float]:
    """k3dist / peer of the same repeat (the two points ran back to back)."""
    return [a[key] / b[key] for a, b in zip(k3, peer, strict=False) if a.get(key) and b.get(key)]


def _x(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def point_table(c: int, points: dict[str, list[dict]], servers: dict[str, Server]) -> str:
    head = ["system"] + [h for _, h, _, _ in COLUMNS] + ["failures", "early", "prompt tok", "tok/chunk"]
    rows = []
    for side, ps in points.items():
        if not ps or "failures" not in ps[0]:
            rows.append([servers[side].name, ps[0].get("error", "") if ps else "not run", *[""] * (len(head) - 2)])
            continue
        row = [servers[side].name]
        for key, _, scale, spec in COLUMNS:
            row.append(common.fmt(v * scale if (v := median_of(ps, key)) is not None else None, spec, "-"))
        row += [str(sum(p["failures"] for p in ps)), str(sum(p["early"] for p in ps))]
        row += ["/".join(map(str, sorted({t for p in ps for t in p["prompt_tokens"]}))) or "-"]
        row += [f"{median_of(ps, 'tokens_per_chunk'):.2f}" + (" (no usage)" if any(p["no_usage"] for p in ps) else "")]
        rows.append(row)
    k3, peer = points.get("k3dist") or [], points.get("peer") or []
    if k3 and peer and "failures" in k3[0] and "failures" in peer[0]:
        ratio = ["k3dist / peer"] + [_x(paired(k3, peer, key)).rstrip("x") for key, _, _, _ in COLUMNS]
        tok = " ".join(f"{x:.2f}" for x in paired(k3, peer, "tok_s"))
        rows.append(ratio + ["", "", "", f"tok/s per repeat: {tok}"])
    return f"Concurrency {c}\n\n" + common.md_table(head, rows)


def targets(args, runs: dict, skip_peer: bool) -> tuple[str, bool]:
    """The issue's three targets, each met / not met (n/a without a peer)."""

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "NOT met")

    at = TARGET_AT if TARGET_AT in args.concurrency else max(args.concurrency)
    tok = paired(runs[at]["k3dist"], runs[at].get("peer", []), "tok_s")
    tok_ok = None if skip_peer or not tok else statistics.median(tok) >= TARGET_TOK_S
    ttft = {c: paired(runs[c]["k3dist"], runs[c].get("peer", []), "ttft_p50") for c in args.concurrency}
    ttft_ok = None if skip_peer or not all(ttft.values()) else all(statistics.median(r) < 1 for r in ttft.values())
    k3 = [p for c in args.concurrency for p in runs[c]["k3dist"]]
    fail_ok = bool(k3) and all("failures" in p and p["failures"] == 0 for p in k3)
    failures = sum(p.get("failures", args.requests) for p in k3)
    per_c = ", ".join(f"c{c} {_x(r)}" for c, r in ttft.items())
    rows = [
        [f"output tok/s at concurrency {at} >= {TARGET_TOK_S:.0f}x the peer's", _x(tok), verdict(tok_ok)],
        ["TTFT p50 lower than the peer's at every concurrency", per_c, verdict(ttft_ok)],
        ["zero failures (k3dist)", str(failures), verdict(fail_ok)],
    ]
    return "Targets (issue 16)\n\n" + common.md_table(["target", "k3dist / peer", "verdict"], rows), fail_ok


def start_all(args, servers: dict[str, "Server"], warm: str) -> None:
    """Start each server and send it one request; a server that fails is reported in its rows, the other runs."""
    for s in servers.values():
        print(f"starting {s.name}: {' '.join(s.cmd) if s.cmd else s.url}", flush=True)
        try:
            s.start(args.timeout)
            r = asyncio.run(run_load(args, s, [warm], 1, args.timeout))[0][0]
            if "error" in r:
                raise RuntimeError(f"warm-up request failed: {r['error']}")
            print(f"  {s.name} ready in {s.ready_s:.1f} s, model {s.model}; warm-up {r['e2e']:.2f} s", flush=True)
        except Exception as exc:  # noqa: BLE001  (the other server's points still run)
            s.error = common.short_error(exc)
            print(f"  {s.name}: {s.error}", flush=True)


def measure(args, servers: dict[str, "Server"], prompts: list[str]) -> tuple[dict, list[float]]:
    """Per concurrency, --repeats rounds of (peer, k3dist) points; the idle server's CPU share during each."""
    runs = {c: {side: [] for side in servers} for c in args.concurrency}
    idle_cpu = []
    for c in args.concurrency:
        for rep in range(args.repeats):
            for side, s in servers.items():
                if s.error:
                    runs[c][side].append({"error": s.error})
                    continue
                others = [o for o in servers.values() if o is not s]
                cpu0 = [o.cpu_seconds() for o in others]
                results, seconds = asyncio.run(run_load(args, s, prompts, c, args.timeout))
                idle_cpu += [(o.cpu_seconds() - x) / seconds for o, x in zip(others, cpu0, strict=True)]
                p = summarize(results, seconds, args.max_tokens) | {"repeat": rep}
                runs[c][side].append(p)
                ttft, errors = common.fmt(p["ttft_p50"], ".3f"), p["errors"] or ""
                line = f"{p['tok_s']:.1f} tok/s, TTFT p50 {ttft} s, failures {p['failures']} {errors}"
                print(f"  c{c} r{rep} {side}: {line}, early {p['early']}, {seconds:.1f} s", flush=True)
                common.save_partial(args, runs)
    return runs, idle_cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", help="requests in flight (default 1 4 16)")
    ap.add_argument("--requests", type=int, help="requests per point (default 32)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens, k3dist's tokenizer (default 128)")
    ap.add_argument("--max-tokens", type=int, help="max_tokens of every request (default 32)")
    ap.add_argument("--repeats", type=int, help="peer, k3dist points per concurrency, this many times (default 3)")
    ap.add_argument("--nproc", type=int, default=1, help="k3dist dist.nproc")
    ap.add_argument("--batch", type=int, default=16, help="k3dist generate.batch (slots)")
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--skip-peer", action="store_true", help="k3dist only (no ratios, no targets)")
    ap.add_argument("--k3dist-args", nargs="*", default=[], help="more overrides, e.g. decode.sync_every=1")
    ap.add_argument("--k3dist-url", help="use a k3dist server already running there (not started or stopped here)")
    ap.add_argument("--quick", action="store_true", help="smoke test: " + json.dumps(QUICK))
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument(
        "--structured", action="store_true", help="k3dist alone: json_schema vs free streams (serve_structured.py)"
    )
    common.add_output_args(ap)
    args = ap.parse_args()
    if args.structured:
        from serve_structured import run_structured

        return run_structured(args, sys.modules[__name__])
    args.out_md = args.out_md or common.RESULTS / "serve.md"
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        setattr(args, key, getattr(args, key) or value)
    if missing := (None if args.skip_peer else common.peer_missing()):
        print(f"peer skipped: {missing}")
        args.skip_peer = True

    started, cores = time.perf_counter(), len(os.sched_getaffinity(0))
    m = common.machine(f"k3dist {max(1, cores // args.nproc)} per rank x {args.nproc}, transformers torch default")
    twin, tmp = common.twin_dir(), Path(tempfile.mkdtemp(prefix="k3bench-serve-"))
    prompts = make_prompts(twin, args.requests + 1, args.prompt_len, args.seed)  # the last one warms up
    servers: dict[str, Server] = {}
    if not args.skip_peer:
        port = common.free_port()
        servers["peer"] = Server("transformers serve", peer_cmd(twin, port), f"http://127.0.0.1:{port}", tmp)
    port = common.free_port()
    k3_cmd = None if args.k3dist_url else k3dist_cmd(args, twin, port, tmp / "k3dist")
    label = f"k3dist (nproc {args.nproc}, batch {args.batch})"
    servers["k3dist"] = Server(label, k3_cmd, args.k3dist_url or f"http://127.0.0.1:{port}", tmp)
    try:
        start_all(args, servers, prompts.pop())
        runs, idle_cpu = measure(args, servers, prompts)
    finally:
        for s in servers.values():
            s.stop()

    target_table, fail_ok = targets(args, runs, args.skip_peer)
    tables = [point_table(c, runs[c], servers) for c in args.concurrency] + [target_table]
    stops = "; ".join(
        f"{s.name}: ready in {common.fmt(s.ready_s, '.1f', '?')} s, {s.error or 'ok'}, {s.stopped}"
        for s in servers.values()
    )
    notes = [
        f"twin `{twin.name}`, bf16, greedy, /v1/{args.api} streamed; {args.requests} requests per point, prompts of "
        f"{args.prompt_len} tokens (`prompt tok`: as each server's usage counted them), max_tokens {args.max_tokens}; "
        f"{args.repeats} repeats per concurrency, peer then k3dist: figures are medians over repeats, `k3dist / "
        "peer` the median of the repeats' ratios (below 1 favours k3dist for latencies, above 1 for req/s, tok/s).",
        "TTFT: request sent to first text chunk, queueing included (transformers serve runs one generate at a time, "
        "FIFO); ITL: gaps between text chunks, pooled; TPOT: (e2e - TTFT) / (tokens - 1) per request; `early`: "
        "finished before max_tokens (eos); `tok/chunk` > 1: tokens merged into chunks (ITL counts chunks).",
        f"servers: {stops}; the idle server used at most {100 * max(idle_cpu, default=0):.1f}% of a core during "
        f"the other's points; logs in {tmp}.",
    ]
    data = {"args": vars(args), "points": {str(c): v for c, v in runs.items()}, "idle_cpu": idle_cpu}
    data["servers"] = {k: {"ready_s": s.ready_s, "error": s.error, "stopped": s.stopped} for k, s in servers.items()}
    common.publish(args, "Serving: k3dist vs transformers serve", tables, notes, m, data, started)
    return 0 if fail_ok and not any(s.error for s in servers.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
