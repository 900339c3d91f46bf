"""What structured outputs cost a server (`benchmarks/serve.py --structured`): k3dist alone, one server, points of
`--concurrency` streams (8) that are either free or under a `json_schema` grammar, interleaved per repeat.

Every stream produces exactly --max-tokens tokens: free ones with `ignore_eos`, constrained ones under a schema that
cannot close sooner (an array of at least 64 objects, each with an enum, a bounded integer and a short string), so the
two points decode the same number of tokens from the same prompts and differ only in the grammar: rank 0's matchers
and masks, the mask broadcast, and the step's processed mode (masks applied to each rank's logits). The two kinds
of point alternate in order from one repeat to the next. Targets (issue 22):
ITL p50 of the constrained streams within 1.25x of the free ones, output tok/s at least 0.8x, medians of the paired
per-repeat ratios.
"""

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import common
import httpx

ITL_TARGET, TOK_S_TARGET = 1.25, 0.8
DEFAULTS = {"concurrency": [8], "requests": 16, "prompt_len": 64, "max_tokens": 64, "repeats": 5}
ITEM = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue", "amber"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"type": "string", "maxLength": 12},
    },
    "required": ["colour", "count", "label"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": ITEM, "minItems": 64, "maxItems": 64}},
    "required": ["items"],
    "additionalProperties": False,
}


def body(args, model: str | None, prompt: str, constrained: bool) -> dict:
    out = ({"model": model} if model else {}) | {"max_tokens": args.max_tokens, "temperature": 0.0, "stream": True}
    out |= {"stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": prompt}]}
    if constrained:
        return out | {"response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}}}
    return out | {"ignore_eos": True}


async def point(args, server, prompts: list[str], constrained: bool, one_request) -> tuple[list, float]:
    """Every prompt once, at most --concurrency streams in flight."""
    c = args.concurrency[0]
    gate, url = asyncio.Semaphore(c), server.url + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=c + 2, max_keepalive_connections=c + 2)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, trust_env=False) as client:

        async def gated(prompt: str) -> dict:
            async with gate:
                return await one_request(client, url, body(args, server.model, prompt, constrained))

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        return results, time.perf_counter() - start


def run_structured(args, serve) -> int:
    """`serve`: the serve.py module (its Server, k3dist command, prompts, request and summary)."""
    for key, value in DEFAULTS.items():
        setattr(args, key, getattr(args, key) or value)
    args.out_md = args.out_md or common.RESULTS / "serve_structured.md"
    started, cores = time.perf_counter(), len(os.sched_getaffinity(0))
    m = common.machine(f"k3dist {max(1, cores // args.nproc)} per rank x {args.nproc}")
    twin, tmp = common.twin_dir(), Path(tempfile.mkdtemp(prefix="k3bench-structured-"))
    prompts = serve.make_prompts(twin, args.requests + 1, args.prompt_len, args.seed)
    port = common.free_port()
    cmd = None if args.k3dist_url else serve.k3dist_cmd(args, twin, port, tmp / "k3dist")
    url = args.k3dist_url or f"http://127.0.0.1:{port}"
    server = serve.Server(f"k3dist (nproc {args.nproc}, batch {args.batch})", cmd, url, tmp)
    points: dict[str, list[dict]] = {"free": [], "json_schema": []}
    try:
        server.start(args.timeout)
        for constrained in (False, True):  # warm-up: the grammar compiler and both step modes
            asyncio.run(point(args, server, prompts[-1:], constrained, serve.one_request))
        for rep in range(args.repeats):  # the order alternates, so a drift of the host's load pairs out
            for name, constrained in (("free", False), ("json_schema", True))[:: 1 if rep % 2 == 0 else -1]:
                results, seconds = asyncio.run(point(args, server, prompts[:-1], constrained, serve.one_request))
                p = serve.summarize(results, seconds, args.max_tokens) | {"repeat": rep}
                points[name].append(p)
                itl = common.fmt(p["itl_p50"] and p["itl_p50"] * 1e3, ".1f")
                line = f"{p['tok_s']:.1f} tok/s, ITL p50 {itl} ms, failures {p['failures']} {p['errors'] or ''}"
                print(f"  r{rep} {name}: {line}", flush=True)
    finally:
        server.stop()
    itl = serve.paired(points["json_schema"], points["free"], "itl_p50")
    tok = serve.paired(points["json_schema"], points["free"], "tok_s")
    head = ["streams", "out tok/s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "failures", "early", "tok/chunk"]
    rows = []
    for name, ps in points.items():

        def cell(key: str, scale: float = 1.0, spec: str = ".1f", ps=ps) -> str:
            return common.fmt((v := serve.median_of(ps, key)) and v * scale, spec, "-")

        rows.append([
            name, cell("tok_s"), cell("itl_p50", 1e3), cell("itl_p99", 1e3), cell("ttft_p50", 1e3),
            str(sum(p["failures"] for p in ps)), str(sum(p["early"] for p in ps)), cell("tokens_per_chunk", 1, ".2f"),
        ])  # fmt: skip
    rows.append(["json_schema / free", serve._x(tok), serve._x(itl), "", "", "", "", ""])
    ok_itl = bool(itl) and statistics.median(itl) <= ITL_TARGET
    ok_tok = bool(tok) and statistics.median(tok) >= TOK_S_TARGET
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    n = args.concurrency[0]
    targets = [
        [f"ITL p50 of {n} json_schema streams <= {ITL_TARGET}x the free ones'", serve._x(itl), verdict(ok_itl)],
        [f"output tok/s >= {TOK_S_TARGET}x the free streams'", serve._x(tok), verdict(ok_tok)],
    ]
    tables = [
        f"{args.concurrency[0]} concurrent streams\n\n" + common.md_table(head, rows),
        "Targets (issue 22)\n\n" + common.md_table(["target", "json_schema / free", "verdict"], targets),
    ]
    per = " ".join(f"{x:.2f}" for x in itl)
    notes = [
        f"twin `{twin.name}`, bf16, greedy, /v1/chat/completions streamed, {args.requests} requests per point at "
        f"concurrency {args.concurrency[0]}, prompts of {args.prompt_len} tokens, exactly {args.max_tokens} output "
        f"tokens each (free: ignore_eos; json_schema: a schema that cannot close sooner); {args.repeats} repeats, free "
        f"and json_schema in turn (the order alternates); figures are medians over repeats, ratios the median of the "
        f"per-repeat ratios (ITL: {per}; tok/s: {' '.join(f'{x:.2f}' for x in tok)}).",
        f"server: {server.error or 'ok'}, {server.stopped}; logs in {tmp}.",
    ]
    data = {"args": vars(args), "points": points}
    common.publish(args, "Serving: the cost of structured outputs", tables, notes, m, data, started)
    failures = sum(p["failures"] for ps in points.values() for p in ps)
    return 0 if not server.error and failures == 0 else 1
