"""Prefill benchmark: time to first token, k3dist vs transformers, on the 0.40B twin (bf16), and what chunking costs.

    python benchmarks/prefill.py        # 512 and 2048 tokens at batch 1, batch 4 x 2048, chunks 256 512 1024 full
    python benchmarks/prefill.py --lengths 64 128 --batch 2 --chunks 32 full --repeats 1      # a quick look

k3dist: `python launch.py generate.max_new_tokens=1 generate.prompt_len=L generate.batch=B generate.prefill_chunk=C`
on seeded random ids; TTFT = result.json's `prefill_seconds` (every chunk of every sequence through the model up to
the first token), the median of --repeats fresh runs. Rows: batch 1 at each length (chunk --chunk, the config's
default 512), batch --batch at the longest length (its TTFT over batch 1's; target <= 4.5x), and --chunks at the
longest length (`full` = the whole prompt in one forward).
transformers (benchmarks/peer.py, one fresh process): after an untimed warm-up forward, one forward over the same
ids per repeat, last-token logits only; the median.
llama.cpp (benchmarks/llama.py, with --llama-bench and --gguf; skipped and said so without them): right after each
batch-1 k3dist run, `llama-bench -p L -n 0 -r 1` (it warms up first; TTFT = L / its prompt tok/s), so the two
alternate and the ratio is paired per repeat.
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

TARGET_SPEEDUP, TARGET_BATCH_RATIO = 4.0, 4.5


def chunk_value(text: str) -> str:
    if text != "full" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError("a positive number of tokens or 'full'")
    return text


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], help="prompt tokens, batch 1")
    ap.add_argument("--batch", type=int, default=4, help="k3dist batch at the longest length (0: none)")
    ap.add_argument("--chunk", type=int, default=512, help="generate.prefill_chunk of the length and batch rows")
    ap.add_argument("--chunks", type=chunk_value, nargs="*", default=["256", "512", "1024", "full"])
    ap.add_argument("--repeats", type=int, default=3, help="fresh runs per point; medians")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
    llama.add_args(ap)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / ("prefill.md" if args.device == "cpu" else "prefill-cuda.md")
    if common.no_device(args):
        return 2

    from k3dist.config import load_config
    from k3dist.offline.prompts import seeded_ids

    started = time.perf_counter()
    cores = len(os.sched_getaffinity(0))
    m = common.machine(f"k3dist {cores} (one rank), transformers torch default", args.device)
    twin, cfg = common.twin_dir(), load_config(common.CONFIG)
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-prefill-"))
    longest = max(args.lengths)
    points = [(1, n, args.chunk) for n in args.lengths]
    points += [(args.batch, longest, args.chunk)] if args.batch > 1 else []
    points += [(1, longest, longest if c == "full" else int(c)) for c in args.chunks]
    points = list(dict.fromkeys((b, n, min(c, n)) for b, n, c in points))  # a chunk >= the prompt is `full`

    k3: dict[tuple, dict] = {}
    lpre: dict[int, list[float | None]] = {}  # prompt length -> llama.cpp's TTFT after each batch-1 k3dist run
    for b, n, c in points:
        overrides = ["model.dtype=bfloat16", f"dist.device={args.device}", "generate.prompt=null"]
        overrides += [f"generate.prompt_len={n}", f"generate.batch={b}", f"generate.prefill_chunk={c}"]
        overrides += ["generate.max_new_tokens=1", f"cache.cap={max(n + 1, 4096)}"]
        runs = []
        try:
            for i in range(args.repeats):
                runs.append(common.k3dist(overrides, tmp / f"b{b}-n{n}-c{c}-{i}.json", args.timeout))
                if runs[-1].pop("prompt") != seeded_ids(b, n, cfg.vocab_size, 0):
                    raise RuntimeError("k3dist's prompt is not seeded_ids' draw")
                paired = b == 1 and c == min(args.chunk, n) and n in args.lengths
                if paired and not llama.missing(args, args.llama_bench):
                    lpre.setdefault(n, []).append(llama.prefill(args, [n], cores, 1)["ttft"].get(str(n)))
        except Exception as exc:  # noqa: BLE001  (a failed point is reported in its row)
            k3[b, n, c] = {"error": common.short_error(exc)}
            print(f"  k3dist batch {b} x {n} chunk {c}: {k3[b, n, c]['error']}", flush=True)
            continue
        k3[b, n, c] = {"seconds": [r["prefill_seconds"] for r in runs], "memory": runs[-1]["memory"]}
        common.save_partial(args, k3)
        print(f"  k3dist batch {b} x {n} chunk {c}: TTFT {spread(k3[b, n, c]['seconds'])} s", flush=True)

    runs = [{"key": str(n), "ids": seeded_ids(1, n, cfg.vocab_size, 0)} for n in args.lengths]
    spec = {"model_dir": str(twin), "device": args.device, "runs": runs, "repeats": args.repeats}
    if args.no_transformers:
        peer = {"runs": {}, "skipped": "--no-transformers"}
    else:
        peer = common.peer_or_skip("prefill", lambda: spec, tmp, args.timeout * len(args.lengths))

    def median(point) -> float | None:
        return statistics.median(point["seconds"]) if "seconds" in point else None

    base = median(k3.get((1, longest, min(args.chunk, longest)), {}))
    head = ["system", "batch", "prompt tokens", "prefill_chunk", "TTFT s (median, min-max)", "prompt tok/s"]
    head += ["peer TTFT / k3dist", "TTFT / batch 1", "llama.cpp TTFT / k3dist", "per repeat (llama.cpp)"]
    rows, data_rows = [], []
    for (b, n, c), point in k3.items():
        t = median(point)
        p = peer["runs"].get(str(n)) if b == 1 else None
        speedup = statistics.median(p["seconds"]) / t if p and t else None
        ratio = t / base if b > 1 and t and base else None
        chunk = "full" if c >= n else str(c)
        if t is None:
            rows.append(["k3dist", str(b), str(n), chunk, point["error"], "", "", "", "", ""])
            continue
        paired = [x / y for x, y in zip(lpre.get(n, []), point["seconds"], strict=False) if x and y]
        paired = paired if b == 1 and c == min(args.chunk, n) else []
        rows.append(
            [
                "k3dist",
                str(b),
                str(n),
                chunk,
                spread(point["seconds"]),
                f"{b * n / t:.0f}",
                common.fmt(speedup, ".2f", "n/a" if b == 1 else ""),
                common.fmt(ratio, ".2f"),
                f"**{statistics.median(paired):.2f}**" if paired else "",
                " ".join(f"{x:.2f}" for x in paired),
            ]
        )
        data_rows.append(
            {
                "system": "k3dist",
                "batch": b,
                "tokens": n,
                "chunk": c,
                "ttft": t,
                "speedup": speedup,
                "batch_ratio": ratio,
                "llama_speedup": statistics.median(paired) if paired else None,
                "llama_paired": paired,
            }
        )
    for n in args.lengths:
        p = peer["runs"].get(str(n))
        if p is None:
            rows.append(["transformers", "1", str(n), "-", peer.get("error") or "skipped", "", "", "", "", ""])
            continue
        t = statistics.median(p["seconds"])
        rows.append(["transformers", "1", str(n), "-", spread(p["seconds"]), f"{n / t:.0f}", "1.00", "", "", ""])
        data_rows.append({"system": "transformers", "batch": 1, "tokens": n, "ttft": t})
    for n, got in lpre.items():
        if ok := [x for x in got if x]:
            t = statistics.median(ok)
            rows.append(["llama.cpp bf16", "1", str(n), "-", spread(ok), f"{n / t:.0f}", "", "", "1.00", ""])
            data_rows.append({"system": "llama.cpp", "batch": 1, "tokens": n, "ttft": t, "per_repeat": got})

    notes = [
        f"twin `{twin.name}`, bf16, seeded random prompts (k3dist.offline.prompts.seeded_ids: the same ids for both); "
        f"{args.repeats} fresh k3dist runs per point, {args.repeats} transformers forwards per length; medians.",
        f"targets: `peer TTFT / k3dist` >= {TARGET_SPEEDUP:g} at batch 1 (above 1 favours k3dist); batch "
        f"{args.batch} x {longest} `TTFT / batch 1` <= {TARGET_BATCH_RATIO:g}.",
        "k3dist's TTFT is the first prefill of its process (on CPU no warm-up runs before it), so its one-time "
        "first-call costs are in it; transformers' forward is timed after a warm-up forward, and it keeps the "
        "last token's logits only (logits_to_keep=1, as generate's prefill).",
        f"`prefill_chunk`: prompt tokens per sequence per forward (`full` = the whole prompt); rows at {longest} "
        "tokens show what chunking costs. `prompt tok/s` = batch x prompt tokens / TTFT.",
    ]
    if skip := peer.get("skipped"):
        notes.append(f"transformers peer skipped: {skip}.")
    how = (
        f"`llama-bench -m {args.gguf.name} -t {cores} -p L -n 0 -r 1` after each batch-1 k3dist run; "
        "`llama.cpp TTFT / k3dist` the median of the paired ratios."
    )
    notes.append(llama.peer_note(args, bool(lpre), args.llama_bench, how))
    data = {
        "args": vars(args),
        "rows": data_rows,
        "k3dist": [{"batch": b, "tokens": n, "chunk": c} | v for (b, n, c), v in k3.items()],
        "peer": peer,
    }
    title = "Prefill (time to first token): k3dist vs transformers and llama.cpp"
    common.publish(args, title, [common.md_table(head, rows)], notes, m, data, started)
    return 1 if any("error" in v for v in k3.values()) or "error" in peer else 0


if __name__ == "__main__":
    sys.exit(main())
