"""A mixed load on the server: short streams, with and without one long prompt arriving among them.

    python benchmarks/serve_mixed.py           # 4 streams of 128 + 128 tokens, one 8,192-token prompt, 3 repeats
    python benchmarks/serve_mixed.py --long 32768 --repeats 1

One k3dist server on the 0.40B twin (bf16). Each repeat runs the short streams alone, then the same streams with the
long prompt sent once they are all under way, then the long prompt alone on the idle server. Reported: the short
streams' inter-token latency (p50, p99, max; gaps between text chunks, pooled) with and without the long prompt, and
the long prompt's time to first token beside them and alone. A long prompt is prefilled one chunk per window between
the streams' decode steps, so it should move their p99 by about one chunk's time, not by its whole prefill.
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serve import Server, make_prompts, one_request  # noqa: E402


def body(model: str, prompt, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}


async def mixed(server: Server, shorts: list[str], long_ids: list[int] | None, args) -> dict:
    """The short streams, and the long prompt once every stream has its first token (if `long_ids`)."""
    url = server.url + "/v1/completions"
    async with httpx.AsyncClient(timeout=args.timeout, trust_env=False) as client:
        tasks = [asyncio.create_task(one_request(client, url, body(server.model, p, args.max_tokens))) for p in shorts]
        long_result = None
        if long_ids is not None:
            await asyncio.sleep(args.lead_s)  # every stream under way
            long_result = await one_request(client, url, body(server.model, long_ids, 2))
        results = await asyncio.gather(*tasks)
    gaps = [g for r in results for g in r["itl"]]
    failed = [r["error"] for r in results + [long_result or {}] if r.get("error")]
    pick = lambda q: float(np.percentile(gaps, q)) * 1e3 if gaps else None  # noqa: E731
    return {"p50": pick(50), "p99": pick(99), "max": max(gaps) * 1e3 if gaps else None, "failed": failed,
            "long_ttft": long_result["ttft"] if long_result else None}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long", type=int, default=8192, help="tokens of the long prompt")
    ap.add_argument("--lead-s", type=float, default=1.0, help="seconds the streams run before the long prompt comes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=1)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.ROOT / "benchmarks" / "results" / "serve_mixed.md"
    started, m = time.perf_counter(), common.machine("all cores (one server)")
    twin, tmp = common.twin_dir(), Path(tempfile.mkdtemp(prefix="k3mixed-"))
    port = common.free_port()
    cmd = [sys.executable, "launch.py", "run.mode=serve", f"serve.port={port}", f"model.path={twin}",
           f"dist.nproc={args.nproc}", f"generate.batch={args.streams + 1}", f"cache.cap={args.long + 256}",
           "prefix.enabled=off", f"hydra.run.dir={tmp / 'run'}", "hydra.output_subdir=null"]  # fmt: skip
    server = Server("k3dist mixed", cmd, f"http://127.0.0.1:{port}", tmp)
    runs = []
    try:
        server.start(args.timeout)
        for rep in range(args.repeats):
            shorts = make_prompts(twin, args.streams, args.prompt_len, seed=rep)
            long_ids = [(7919 * i + rep) % 30000 + 300 for i in range(args.long)]  # fresh each repeat
            alone = asyncio.run(mixed(server, shorts, None, args))
            beside = asyncio.run(mixed(server, shorts, long_ids, args))
            idle = asyncio.run(mixed(server, [], long_ids[::-1], args))["long_ttft"]
            runs.append({"alone": alone, "beside": beside, "idle_ttft": idle})
            print(f"repeat {rep}: ITL p99 {alone['p99']:.1f} -> {beside['p99']:.1f} ms, "
                  f"max {alone['max']:.1f} -> {beside['max']:.1f} ms; "
                  f"long TTFT {beside['long_ttft']:.2f} s beside, {idle:.2f} s idle")  # fmt: skip
    finally:
        server.stop()
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    itl = lambda load: [f"{statistics.median(r[load][q] for r in runs):.1f}" for q in ("p50", "p99", "max")]  # noqa: E731
    ttft = f"{med(lambda r: r['beside']['long_ttft']):.2f} s (idle: {med(lambda r: r['idle_ttft']):.2f} s)"
    rows = [[f"{args.streams} streams alone", *itl("alone"), ""],
            [f"{args.streams} streams + one {args.long}-token prompt", *itl("beside"), ttft]]  # fmt: skip
    table = common.md_table(["load", "ITL p50 (ms)", "ITL p99 (ms)", "ITL max (ms)", "long prompt's TTFT"], rows)
    failed = [f for r in runs for f in r["alone"]["failed"] + r["beside"]["failed"]]
    notes = [f"{args.streams} streams of {args.prompt_len} + {args.max_tokens} tokens, greedy; the long prompt comes "
             f"{args.lead_s} s after them; medians of {args.repeats} repeats; failures: {len(failed)}",
             "the long prompt is prefilled one generate.prefill_chunk per window between decode steps"]  # fmt: skip
    common.publish(args, "Mixed load (benchmarks/serve_mixed.py)", [table], notes, m, {"runs": runs}, started)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
