"""Decode benchmark: k3dist vs transformers `generate` on the 0.40B twin (bf16, greedy), with the memory roofline.

    python benchmarks/decode.py                                   # CPU: worlds 1 2, batches 1 8, compile auto on
    python benchmarks/decode.py --worlds 1 --batches 1 --compile auto --max-new-tokens 8     # a quick look
    python benchmarks/decode.py --device cuda --json decode.json  # CUDA: world 1, batches 1 8 64, compile auto off
    python benchmarks/decode.py --worlds 1 --compile auto --quants none int8 --prompt-len 64 --repeats 5 \
        --llama-bench ~/llama-build/bin/llama-bench --gguf twin-bf16.gguf --gguf-q8 twin-q8_0.gguf   # vs llama.cpp

k3dist: one `python launch.py` per (world, compile, batch) on the seeded random prompt of --prompt-len tokens; tok/s,
step p50/p90 and warm-up seconds come from its result.json (ranks split the cores: `cores // world` threads each).
transformers (benchmarks/peer.py, a fresh process, torch's default threads) decodes the same ids with `generate`,
timing each step through a logits processor; on CUDA it runs only where its version has the model. --repeats times
(default 3): the bandwidths, every k3dist point, the peer; figures are medians, ratios paired within a repeat (a
shared machine's speed drifts by tens of percent between minutes).

llama.cpp (benchmarks/llama.py, with --llama-bench and --gguf; skipped and said so without them): right after each
world-1 k3dist point of the first --compile value, `llama-batched-bench` on the same batch, prompt length and new
tokens, the bf16 GGUF beside model.quant=none and the Q8_0 one beside int8; ratios are paired the same way.

Roofline (batch 1): active bytes = what one decode step must read on a rank (roofline.decode_read_bytes: weights
once, the cache up to the mean decode position), checked against the plan's local_bytes. The kernel roofline is
measured here: torch's bf16 GEMV over a matrix the shape of the rank's LM-head slice, with the rank's threads
(median of 7, warm-up excluded, then the median over repeats); roofline tok/s = that GB/s / active bytes.
Achieved GB/s = active bytes x tok/s (gpt-fast's figure). The DRAM roofline uses a large copy_ (read + write
bytes) instead.
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
import llama  # noqa: E402
import roofline  # noqa: E402

CAP = 4096  # cache.cap's default: the latent rows each MLA layer holds per sequence
DEFAULTS = {
    "cpu": {"worlds": [1, 2], "batches": [1, 8], "compile": ["auto", "on"]},
    "cuda": {"worlds": [1], "batches": [1, 8, 64], "compile": ["auto", "off"]},
}


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """Greedy tokens equal before the first divergence, summed over sequences, of the total."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        same, total = same + k, total + max(len(x), len(y))
    return f"{same}/{total}"


def bandwidths(cfg, worlds: list[int], device: str, cores: int) -> dict[int, dict]:
    """Per world size: the GEMV GB/s over the rank's LM-head slice and the copy GB/s, with the rank's threads."""
    import torch

    out = {}
    for w in worlds:
        threads = max(1, cores // w)
        torch.set_num_threads(threads)
        rows = roofline.local_size(cfg.vocab_size, w, 0)
        out[w] = {
            "threads": threads,
            "gemv_shape": [rows, cfg.hidden_size],
            "gemv_GBps": roofline.gemv_bandwidth(rows, cfg.hidden_size, device),
            "packed_GBps": roofline.packed_gemv_bandwidth(rows, cfg.hidden_size) if device == "cpu" else None,
            "copy_GBps": roofline.copy_bandwidth(device=device),
        }
        print(
            f"  bandwidth, world {w} ({threads} threads): GEMV {out[w]['gemv_GBps']:.1f} GB/s "
            f"(prepacked {out[w]['packed_GBps'] or float('nan'):.1f}), "
            f"copy {out[w]['copy_GBps']:.1f} GB/s",
            flush=True,
        )
    return out


def median_bandwidth(per_repeat: list[dict]) -> dict:
    """One world's bandwidths over the repeats: each figure's median, every repeat's GEMV GB/s beside it."""
    out = dict(per_repeat[0])
    for key in ("gemv_GBps", "packed_GBps", "copy_GBps"):
        if out[key] is not None:
            out[key] = statistics.median(b[key] for b in per_repeat)
    return out | {"gemv_GBps_per_repeat": [b["gemv_GBps"] for b in per_repeat]}


def k3_point(args, w: int, c: str, b: int, q: str, out: Path) -> dict:
    """One `python launch.py` decode run of the twin: its result.json, or {"error": ...}."""
    overrides = [
        f"model.quant={q}",
        f"dist.nproc={w}",
        f"dist.device={args.device}",
        f"decode.compile={c}",
        "model.dtype=bfloat16",
        "generate.prompt=null",
        f"generate.prompt_len={args.prompt_len}",
        f"generate.batch={b}",
        f"generate.max_new_tokens={args.max_new_tokens}",
    ]
    return common.k3dist_point(
        f"world {w} compile {c} quant {q} batch {b}",
        overrides,
        out,
        args.timeout,
        lambda r: (
            f"({r['decode_compile']}) {r['decode_tokens_per_second']:.2f} tok/s, warm-up "
            f"{r['warmup_seconds']:.1f} s, wall {r['wall']:.1f} s"
        ),
    )


def rate(run: dict | None) -> float | None:
    return run.get("decode_tokens_per_second") if run else None


def representative(rs: list[dict]) -> dict:
    """Of one point's repeats: the run with the median tok/s (or the first failure), every repeat's tok/s beside."""
    if bad := [r for r in rs if "error" in r]:
        return bad[0]
    ordered = sorted(rs, key=rate)
    return ordered[len(ordered) // 2] | {"repeat_tok_s": [rate(r) for r in rs]}


def median_peer(peers: list[dict]) -> dict:
    """The peer's repeats folded into one: per batch, the run with the median tok/s, every repeat's tok/s beside."""
    out = next(x for x in peers if x.get("runs")) | {"runs": {}}
    for b in {b for x in peers for b in x.get("runs", {})}:
        out["runs"][b] = representative([x["runs"][b] for x in peers if b in x.get("runs", {})])
    return out


def paired_ratio(mine: list[dict], peers: list[dict], b: int) -> tuple[float, list[float]] | None:
    """k3dist tok/s over the peer's of the same repeat (the two ran back to back): the median, and each one."""
    theirs = [x["runs"].get(str(b)) for x in peers]
    theirs = [t if isinstance(t, (int, float)) else rate(t) for t in theirs]
    ratios = [rate(r) / t for r, t in zip(mine, theirs, strict=False) if rate(r) and t]
    return (statistics.median(ratios), ratios) if ratios else None


def spread(values: list[float]) -> str:
    """min-max and max / min of one point's repeats."""
    values = [v for v in values if v]
    return f"{min(values):.1f}-{max(values):.1f} ({max(values) / min(values):.2f}x)" if values else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--worlds", type=int, nargs="+", help="rank counts (cpu: 1 2; cuda: 1)")
    ap.add_argument("--batches", type=int, nargs="+", help="sequences decoded together (cpu: 1 8; cuda: 1 8 64)")
    ap.add_argument("--compile", nargs="+", choices=["auto", "on", "off"], help="decode.compile values (cpu: auto on)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="k3dist's points then the peer, this many times (medians)")
    ap.add_argument("--quants", nargs="+", choices=["none", "int8"], default=["none"], help="model.quant values")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
    llama.add_args(ap)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / ("decode.md" if args.device == "cpu" else "decode-cuda.md")
    for key, value in DEFAULTS[args.device].items():
        setattr(args, key, getattr(args, key) or value)
    if common.no_device(args):
        return 2

    import torch

    from k3dist.config import load_config
    from k3dist.engine.runner import Timings
    from k3dist.offline.prompts import seeded_ids

    started = time.perf_counter()
    cores = len(os.sched_getaffinity(0))
    m = common.machine(
        f"k3dist cores // world per rank, transformers torch default ({torch.get_num_threads()})", args.device
    )
    twin, cfg = common.twin_dir(), load_config(common.CONFIG)
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-decode-"))
    position = args.prompt_len + max(args.max_new_tokens - 2, 0) / 2  # mean position a decode step reads up to
    mismatches = []

    prompts = {str(b): seeded_ids(b, args.prompt_len, cfg.vocab_size, 0) for b in args.batches}
    spec = {"model_dir": str(twin), "device": args.device, "prompts": prompts, "max_new_tokens": args.max_new_tokens}
    runs: dict[tuple, list[dict]] = {}  # (world, compile, batch) -> one result per repeat
    peers: list[dict] = []
    bws: list[dict[int, dict]] = []
    lruns: dict[tuple, list[dict]] = {}  # (batch, quant) -> llama.cpp's result per repeat
    for rep in range(args.repeats):  # bandwidths, k3dist's points (each with its llama.cpp twin), the peer
        bws.append(bandwidths(cfg, args.worlds, args.device, cores))
        for w in args.worlds:
            if rep == 0:
                mismatches += roofline.plan_mismatches(cfg, w, torch.bfloat16)
            for c in args.compile:
                for q in args.quants:
                    for b in args.batches:
                        r = k3_point(args, w, c, b, q, tmp / f"r{rep}-w{w}-{c}-{q}-b{b}.json")
                        if "error" not in r:
                            if r["model_dir"] != str(twin) or r.pop("prompt") != prompts[str(b)]:
                                raise RuntimeError(
                                    f"k3dist ran {r['model_dir']} on other prompts than {twin} and seeded_ids"
                                )
                            if rep == 0:
                                mismatches += roofline.plan_mismatches(cfg, w, torch.bfloat16, r["plan"])
                        runs.setdefault((w, c, b, q), []).append(r)
                        if w == 1 and c == args.compile[0] and args.device == "cpu":
                            gguf = args.gguf if q == "none" else args.gguf_q8
                            x = llama.decode(args, gguf, [b], cores, args.prompt_len, args.max_new_tokens)
                            lruns.setdefault((b, q), []).append(x)
                            if x["runs"]:
                                print(f"  llama.cpp {gguf.name} batch {b}: {x['runs'][str(b)]:.2f} tok/s", flush=True)
                        common.save_partial(args, runs)
        if args.no_transformers:
            peers.append({"runs": {}, "skipped": "--no-transformers"})
        else:
            peers.append(common.peer_or_skip("decode", lambda: spec, tmp, args.timeout * len(args.batches)))
    k3 = {key: representative(rs) for key, rs in runs.items()}
    bw = {w: median_bandwidth([b[w] for b in bws]) for w in args.worlds}
    peer = median_peer(peers) if any(x.get("runs") for x in peers) else peers[0]

    head = ["system", "world", "threads/rank", "compile", "batch", "tok/s", "step p50 ms", "step p90 ms", "warm-up s"]
    head += ["tok/s / peer", "per repeat", "greedy = peer", "tok/s / llama.cpp", "per repeat (llama.cpp)"]
    rows, roof_rows, data_rows = [], [], []
    roof_head = ["system", "world", "compile", "active MB/step", "achieved GB/s", "GEMV GB/s", "kernel roofline tok/s"]
    roof_head += ["% of kernel roofline", "prepacked GEMV GB/s", "% of prepacked roofline"]
    roof_head += ["copy GB/s", "DRAM roofline tok/s", "% of DRAM roofline"]

    def roof(system: str, w: int, c: str, tok_s: float) -> None:
        active = roofline.decode_read_bytes(cfg, w, 2, position)
        g, cp = bw[w]["gemv_GBps"] * 1e9, bw[w]["copy_GBps"] * 1e9
        row = {"system": system, "world": w, "compile": c, "active_bytes": active, "tok_s": tok_s}
        row["achieved_GBps"] = active["total"] * tok_s / 1e9
        row["kernel_roofline_tok_s"], row["dram_roofline_tok_s"] = g / active["total"], cp / active["total"]
        data_rows.append(row)
        roof_rows.append(
            [
                system,
                str(w),
                c,
                f"{active['total'] / 1e6:.1f}",
                f"{row['achieved_GBps']:.2f}",
                f"{g / 1e9:.1f}",
                f"{row['kernel_roofline_tok_s']:.1f}",
                f"{100 * tok_s / row['kernel_roofline_tok_s']:.0f}%",
                f"{bw[w]['packed_GBps']:.1f}" if bw[w]["packed_GBps"] else "-",
                f"{100 * tok_s * active['total'] / (bw[w]['packed_GBps'] * 1e9):.0f}%" if bw[w]["packed_GBps"] else "-",
                f"{cp / 1e9:.1f}",
                f"{row['dram_roofline_tok_s']:.1f}",
                f"{100 * tok_s / row['dram_roofline_tok_s']:.0f}%",
            ]
        )

    for b in args.batches:
        p = peer["runs"].get(str(b))
        for w in args.worlds:
            for c in args.compile:
                for q in args.quants:
                    r = k3[w, c, b, q]
                    threads = str(max(1, cores // w)) if args.device == "cpu" else "-"
                    system = "k3dist" if q == "none" else f"k3dist {q}"
                    if "error" in r:
                        rows.append([system, str(w), threads, c, str(b), r["error"], *[""] * 8])
                        continue
                    tok_s = r["decode_tokens_per_second"]
                    ratio = paired_ratio(runs[w, c, b, q], peers, b)
                    lratio = paired_ratio(runs[w, c, b, q], lruns.get((b, q), []), b) if w == 1 else None
                    rows.append(
                        [
                            system,
                            str(w),
                            threads,
                            f"{c} ({r['decode_compile']})",
                            str(b),
                            f"{tok_s:.2f}",
                            f"{r['step_ms']['p50']:.1f}",
                            f"{r['step_ms']['p90']:.1f}",
                            f"{r['warmup_seconds']:.1f}",
                            f"{ratio[0]:.2f}" if ratio else "n/a",
                            " ".join(f"{x:.2f}" for x in ratio[1]) if ratio else "",
                            agreement(r["tokens"], p["tokens"]) if p else "n/a",
                            f"**{lratio[0]:.2f}**" if lratio else "n/a",
                            " ".join(f"{x:.2f}" for x in lratio[1]) if lratio else "",
                        ]
                    )
                    if b == 1 and tok_s and q == "none":
                        roof("k3dist", w, c, tok_s)
        for q in args.quants:
            got = [x["runs"].get(str(b)) for x in lruns.get((b, q), [])]
            if any(got):
                name = "llama.cpp bf16" if q == "none" else "llama.cpp Q8_0"
                med = statistics.median(t for t in got if t)
                row = [name, "1", str(cores), "-", str(b), f"{med:.2f}", *[""] * 6, "1.00"]
                rows.append(row + [" ".join(f"{t:.2f}" if t else "-" for t in got) + " tok/s"])
        if p:
            ms = Timings(window_step_seconds=p["step_seconds"]).step_ms()
            rows.append(
                [
                    "transformers",
                    "1",
                    str(peer["threads"]),
                    "-",
                    str(b),
                    f"{p['decode_tokens_per_second']:.2f}",
                    f"{ms['p50']:.1f}",
                    f"{ms['p90']:.1f}",
                    "",
                    "1.00",
                    " ".join(f"{x:.2f}" for x in p["repeat_tok_s"]) + " tok/s",
                    "",
                    "",
                    "",
                ]
            )
            if b == 1:
                roof("transformers", 1, "-", p["decode_tokens_per_second"])
        else:
            rows.append(["transformers", "1", "", "-", str(b), peer.get("error") or "skipped", *[""] * 8])

    w1 = roofline.decode_read_bytes(cfg, 1, 2, position)
    unused = roofline.decode_read_bytes(cfg, 1, 2, CAP - 1)["cache"] - w1["cache"]
    notes = [
        f"twin `{twin.name}`, bf16, greedy; prompt: {args.prompt_len} seeded random ids "
        f"(k3dist.offline.prompts.seeded_ids, "
        f"the same ids for both), {args.max_new_tokens} new tokens; {args.repeats} repeats, each all k3dist points "
        "then the peer: `tok/s` and step times are each point's median-tok/s run, `tok/s / peer` the median of the "
        "repeats' ratios (each k3dist run over the peer run right after it), `per repeat` those ratios (the "
        "peer's row: its tok/s per repeat).",
        "`tok/s` = batch x decode steps / their seconds (the first token comes from the prefill and is not counted); "
        "`step p50/p90`: k3dist per sync window (result.json step_ms), transformers per step; `warm-up s`: k3dist's "
        "one-time compile or graph capture before the first prompt (not in tok/s).",
        f"active bytes per step (world 1: {w1['weights'] / 1e6:.1f} MB of weights + {w1['cache'] / 1e6:.2f} MB of "
        f"cache at mean position {position:.0f}): roofline.decode_read_bytes; its count of every resident weight "
        + ("equals every plan's local_bytes." if not mismatches else "DIFFERS from the plan: " + "; ".join(mismatches)),
        "prepacked roofline: the same GEMV on a oneDNN-prepacked weight, the kernel k3dist's CPU decode really runs "
        "(k3dist/model/linear.py), so the stricter bar. "
        "kernel roofline: torch's bf16 GEMV over the rank's LM-head slice "
        + ", ".join(f"world {w} {v['gemv_shape']} with {v['threads']} threads" for w, v in bw.items())
        + "; DRAM roofline: a 256 MiB copy_ (read + write). Bandwidths are measured at the start of every repeat; "
        "the tables use their medians (GEMV GB/s per repeat: "
        + "; ".join(f"world {w} " + " ".join(f"{x:.1f}" for x in v["gemv_GBps_per_repeat"]) for w, v in bw.items())
        + "). At world > 1 the ranks share the memory bus, so per-rank rooflines measured alone are optimistic.",
        f"the torch MLA decode reference scores all cache.cap ({CAP}) latent rows and masks the rest: at world 1 "
        f"at least {unused / 1e6:.1f} MB more per step than the roofline counts (rows up to the position only).",
        "`tok/s / peer` above 1 favours k3dist; `greedy = peer`: tokens equal before the first divergence, summed "
        "over sequences (bf16 on both sides: near-ties diverge).",
    ]
    if skip := peer.get("skipped"):
        notes.append(f"transformers peer skipped: {skip}.")
    tables = [common.md_table(head, rows), "Roofline, batch 1\n\n" + common.md_table(roof_head, roof_rows)]
    spreads = [
        [f"{q}, batch {b}", spread([rate(r) for r in runs[1, args.compile[0], b, q]]), spread(theirs)]
        for q in args.quants
        for b in args.batches
        if (1, args.compile[0], b, q) in runs and any(theirs := [x["runs"].get(str(b)) for x in lruns.get((b, q), [])])
    ]
    if spreads:
        head_s = ["point (world 1)", "k3dist tok/s over the repeats", "llama.cpp tok/s over the repeats"]
        tables.append("Spread over the repeats\n\n" + common.md_table(head_s, spreads))
    how = (
        f"`llama-batched-bench -t {cores} -c 4096 -npp {args.prompt_len} -ntg {args.max_new_tokens} -npl B` right "
        f"after each world-1 k3dist point ({args.gguf.name if args.gguf else '-'} beside model.quant=none, "
        f"{args.gguf_q8.name if args.gguf_q8 else '-'} beside int8); `tok/s / llama.cpp` the median of the paired "
        "ratios, `per repeat` each one."
    )
    notes.append(llama.peer_note(args, bool(spreads), llama.batched_bench(args), how))
    data = {
        "args": vars(args),
        "bandwidth": bw,
        "bandwidth_per_repeat": bws,
        "roofline": data_rows,
        "plan_mismatches": mismatches,
        "k3dist": [{"world": w, "compile": c, "batch": b, "quant": q} | r for (w, c, b, q), r in k3.items()],
        "peer": peer,
        "llama_cpp": {f"b{b}-{q}": xs for (b, q), xs in lruns.items()},
        "repeats": {
            "k3dist": [
                {"world": w, "compile": c, "batch": b, "quant": q, "tok_s": [rate(r) for r in rs]}
                for (w, c, b, q), rs in runs.items()
            ],
            "peer": [{b: rate(x) for b, x in rr.get("runs", {}).items()} for rr in peers],
        },
    }
    common.publish(args, "Decode: k3dist vs transformers and llama.cpp", tables, notes, m, data, started)
    return 1 if any("error" in r for r in k3.values()) or "error" in peer else 0


if __name__ == "__main__":
    sys.exit(main())
